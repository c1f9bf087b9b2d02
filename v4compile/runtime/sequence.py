"""One request as the engine serves it: its tokens so far, where its cache lives, and its routing record."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import logs
from ..model.routing import Routing
from .requests import RequestOutput
from .sampling import sample

_LOG = logs.logger("engine")


@dataclass(frozen=True)
class Mode:
    """How one ``generate`` call's requests run: with MTP speculation (``mtp``) and/or recording every layer's
    routing (``record_routing``). A decode step runs one mode, so the scheduler runs requests of one mode at a
    time; ``submit`` queues requests in the default mode (neither)."""

    mtp: bool = False
    record_routing: bool = False


@dataclass
class Sequence:
    """A request's serving state: ``done`` prompt tokens computed (in staging row ``slot`` while prefilling),
    then decode row ``row``, the current ``token`` (the last one emitted) and, with MTP, its ``draft``;
    ``hidden`` keeps the last window of a prefill's streams for the MTP block's first draft; ``pages`` are the
    entry pages its row's table maps, in token order (one reference each, given back when it retires); ``fork`` the
    boundary where its prompt leaves the cached path it matched (a tail saved there serves the next one);
    ``cacheable`` False once the weights changed under its prefill (its KV must not enter the new prefix cache)."""

    index: int
    prompt: list[int]
    max_new: int
    generator: torch.Generator | None
    out: RequestOutput
    mode: Mode = Mode()
    slot: int = -1
    done: int = 0
    row: int = -1
    token: int = 0
    draft: int = -1
    hidden: torch.Tensor | None = None
    routing: list[Routing] = field(default_factory=list)
    stopped: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: frozenset[int] = frozenset()
    cancelled: bool = False
    pages: list[int] = field(default_factory=list)
    fork: int = 0
    cacheable: bool = True

    @property
    def position(self) -> int:
        """The position of the current token (the next decode step's first input)."""
        return len(self.prompt) + len(self.out.tokens) - 1

    def emit(self, logits: torch.Tensor) -> None:
        """Samples the next token from its ``logits`` [vocab] and appends it (and its log-prob) to the output;
        a stop id stops the sequence."""
        token, logprob = sample(logits, self.temperature, self.top_p, self.generator)
        self.token = token
        self.out.tokens.append(token)
        self.out.logprobs.append(logprob)
        self.stopped = token in self.stop_ids

    def record(self, routing: Routing | None, row: int, tokens: int) -> None:
        """Keeps batch row ``row``'s routing choices for the first ``tokens`` tokens of a step (nothing when the
        step recorded none)."""
        if routing is not None:
            self.routing.append(_row(routing, row, tokens))

    def finish_if_done(self) -> bool:
        """Whether the sequence is done (cancelled, stopped, or at ``max_new`` tokens); when it is, sets the
        output's ``finish_reason`` and its routing record."""
        if self.cancelled:
            self.out.finish_reason = "abort"
        elif self.stopped:
            self.out.finish_reason = "stop"
        elif len(self.out.tokens) < self.max_new:
            return False
        else:
            self.out.finish_reason = "length"
        _LOG.info("request %d finished: %d tokens (%s)", self.out.index, len(self.out.tokens), self.out.finish_reason)
        if self.routing:
            self.out.routing = _concat(self.routing, self.position)
            self.routing = []
        return True


def _row(routing: Routing, row: int, tokens: int) -> Routing:
    """One batch row's choices for its first ``tokens`` tokens."""
    return Routing([None if e is None else e[row : row + 1, :tokens] for e in routing.experts],
                   [None if c is None else c[row : row + 1, :tokens] for c in routing.indexer])


def _concat(parts: list[Routing], tokens: int) -> Routing:
    """One request's record over ``tokens`` fed tokens from per-step pieces; the indexer's choices are
    padded with -1 (masked) to the widest piece, as early pieces see fewer entries than the top-k."""
    width = max((c.shape[-1] for p in parts for c in p.indexer if c is not None), default=0)
    experts = [torch.cat([p.experts[i] for p in parts], dim=1)[:, :tokens] for i in range(len(parts[0].experts))]
    indexer = [None if parts[0].indexer[i] is None else
               torch.cat([torch.nn.functional.pad(p.indexer[i], (0, width - p.indexer[i].shape[-1]), value=-1)
                          for p in parts], dim=1)[:, :tokens] for i in range(len(parts[0].indexer))]
    return Routing(experts, indexer)
