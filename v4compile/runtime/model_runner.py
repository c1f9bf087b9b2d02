"""The model runner: every call the engine makes into the model, with CUDA graphs for plain decode steps.

``ServedModel`` is the interface a served model implements: ``DeepSeekV4`` does, and ``OptimizedModel`` forwards
each of these entry points to its compiled form. The runner turns the engine's token lists into device tensors,
records routing when asked, and replays a decode bucket's CUDA graph where one applies (``decode_graphs.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..model.cache import V4Cache
from ..model.config import V4Config
from ..model.routing import Routing
from .decode_graphs import DecodeGraphs
from .sequence import Sequence


class ServedModel(Protocol):
    """The model entry points the engine calls (see ``DeepSeekV4`` for each one's contract)."""

    config: V4Config
    embed: torch.nn.Embedding
    mtp: torch.nn.ModuleList

    def new_cache(self, batch_size: int, max_seq_len: int | None = None,
                  device: torch.device | str | None = None) -> V4Cache:
        """An empty cache of ``batch_size`` rows."""

    def extend_hidden(self, input_ids: torch.Tensor, start: int, cache: V4Cache,
                      routing: Routing | None = None) -> torch.Tensor:
        """Final streams of a prefill piece from ``start``, continuing ``cache``."""

    def logits(self, streams: torch.Tensor, last: bool = False) -> torch.Tensor:
        """fp32 logits from final streams."""

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache,
                    routing: Routing | None = None) -> torch.Tensor:
        """Logits of one token per row at ``positions``."""

    def decode_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache,
                      routing: Routing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and final streams of several tokens per row from ``positions``."""

    def mtp_step(self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: V4Cache, *,
                 positions: torch.Tensor | None = None, start: int | None = None, k: int = 0) -> torch.Tensor:
        """Logits of MTP block ``k`` after main-model streams ``hidden`` and the ids that followed them."""


class ModelRunner:
    """Runs ``model`` for the engine. ``cuda_graphs``: capture each decode bucket's plain step in a CUDA graph on
    its first use and replay it after; None means on for a model on a CUDA device, True off CUDA is a
    ValueError."""

    def __init__(self, model: ServedModel, cuda_graphs: bool | None = None) -> None:
        self.model = model
        self.config = model.config
        self.device = model.embed.weight.device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {self.device}")
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self._plain_decode) if use_graphs else None

    @property
    def has_mtp(self) -> bool:
        """Whether the model has an MTP block to draft with."""
        return bool(len(getattr(self.model, "mtp", ())))

    def reset_graphs(self) -> None:
        """Drops every captured graph (after a weight update: they hold the old weights' addresses)."""
        if self.graphs is not None:
            self.graphs.reset()

    def tokens(self, rows: list[list[int]]) -> torch.Tensor:
        """Token ids [rows, tokens] on the model's device."""
        return torch.tensor(rows, device=self.device)

    def prefill(self, tokens: list[int], start: int, cache: V4Cache, record: bool
                ) -> tuple[torch.Tensor, Routing | None]:
        """Final streams [1, S, n, D] of the prompt piece ``tokens`` at positions ``start..`` in row 0 of
        ``cache`` (which it continues and updates), and with ``record`` the routing it chose."""
        routing = self._recorder(record)
        return self.model.extend_hidden(self.tokens([tokens]), start, cache, routing), routing

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, S, vocab] from final streams [B, S, n, D]."""
        return self.model.logits(streams)

    def decode_inputs(self, seqs: list[Sequence], bucket: int, speculative: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's inputs for ``bucket`` rows: each sequence's tokens in its row (current, and its draft
        when ``speculative``; padding rows get token 0 at position 0) and its current token's position."""
        ids = torch.zeros(bucket, 2 if speculative else 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(bucket, dtype=torch.long, device=self.device)
        for seq in seqs:
            ids[seq.row] = torch.tensor([seq.token, seq.draft] if speculative else [seq.token])
            positions[seq.row] = seq.position
        return ids, positions

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache, record: bool
               ) -> tuple[torch.Tensor, Routing | None]:
        """Logits [B, 1, vocab] of one decode step over ``cache``'s rows (a bucket's graph replayed where there
        are graphs, unless ``record``, whose routing comes back too)."""
        routing = self._recorder(record)
        if self.graphs is not None and routing is None:
            return self.graphs.step(ids, positions, cache), None
        return self.model.decode_step(ids, positions, cache, routing), routing

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache, record: bool
               ) -> tuple[torch.Tensor, torch.Tensor, Routing | None]:
        """Logits [B, S, vocab] and final streams of S tokens per row (the current token and its draft), and
        with ``record`` the routing chosen. Launched, never from a graph."""
        routing = self._recorder(record)
        logits, hidden = self.model.decode_tokens(ids, positions, cache, routing)
        return logits, hidden, routing

    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: V4Cache, *,
              positions: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
        """Logits of the first MTP block after main-model streams ``hidden`` and the ids that followed them (at
        ``positions`` per row when decoding, from ``start`` after a prefill)."""
        return self.model.mtp_step(hidden, next_ids, cache, positions=positions, start=start)

    def _plain_decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache) -> torch.Tensor:
        return self.model.decode_step(ids, positions, cache, None)

    def _recorder(self, record: bool) -> Routing | None:
        return Routing.recorder(self.config) if record else None
