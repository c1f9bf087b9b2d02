"""The serving engine: continuous batching over a fixed set of decode rows, chunked prefill in staging
rows, and prefix caching through ShadowRadix.

Why the shapes are what they are: every prompt is prefilled in pieces whose boundaries are fixed
multiples of ``piece`` tokens counted from position 0, and every decode step runs a static bucket of rows.
So the computation that produces a token's KV does not depend on what else is running, and a prefix
restored from the cache holds bit for bit what computing it again would give: greedy output with the
prefix cache equals greedy output without it (with one decode bucket; with several, a row's numerics
may follow the bucket size).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import batch_invariant, logs
from ..model.cache import V4Cache
from ..model.config import V4Config
from ..model.routing import Routing
from .decode_graphs import DecodeGraphs
from .hisparse import HiSparse, HiSparseCache, device_row_bytes, slot_bytes
from .prefix_store import PrefixStore
from .requests import RequestError, RequestOutput
from .sampling import sample

if TYPE_CHECKING:
    from .text import Tokenizer

_LOG = logs.logger("engine")


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new: int
    generator: torch.Generator | None
    out: RequestOutput
    staging: V4Cache | None = None
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


class Engine:
    """Serves generation requests on ``model`` (a ``DeepSeekV4`` or an ``OptimizedModel`` of one).

    ``memory_budget`` (bytes) pays first for the working caches (``max_batch`` decode rows and one
    staging row per concurrent prefill, each sized for ``max_seq_len``), and the rest holds the prefix
    cache's pools. ``max_batch_tokens`` is the largest prefill piece per step (rounded down to a divisor
    of the cache ``chunk``); ``decode_buckets`` are the static decode batch sizes (default: powers of two
    up to ``max_batch``). ``tail_every`` > 0 also caches a window tail every that many chunks while a prompt
    is prefilled (fewer tokens recomputed after a branch, more bytes); 0 keeps one at the prompt's end only.
    ``deterministic``: one decode bucket (every step the same shapes), torch's deterministic algorithms and
    batch-invariant matrix products for the process (``v4compile.batch_invariant``), so a sequence's
    log-probs depend neither on what else runs nor on how its tokens were split into chunks and steps.

    ``hisparse_budget`` (bytes, part of ``memory_budget``) turns on HiSparse with a hot buffer of that size:
    decode rows keep their C4 main entries in a host tier (so each costs far less of the budget and more
    of them fit), the prefix cache keeps its C4 main entries in host memory too, and each decode step brings
    the chosen entries into the hot buffer (see ``hisparse.py``). A hot buffer smaller than one step's
    working set is a ValueError here (or in ``generate`` for MTP, whose steps take two tokens per row).

    ``cuda_graphs`` captures each decode bucket's step in a CUDA graph on its first use and replays it after
    (``decode_graphs.py``); steps that record routing or verify drafts run without one. None (the default)
    means on for a model on a CUDA device; True off CUDA is a ValueError.

    ``tokenizer`` (``runtime.text.Tokenizer``) lets prompts be text and gives each output its ``text``; its
    end-of-sequence ids stop a generation unless ``generate`` is given other ``stop_ids``."""

    def __init__(self, model: torch.nn.Module, *, memory_budget: int | None = None, max_batch_tokens: int = 128,
                 max_batch: int = 4, max_prefills: int = 1, chunk: int | None = None, prefix_cache: bool = True,
                 decode_buckets: tuple[int, ...] | None = None, max_seq_len: int | None = None,
                 tail_every: int = 0, deterministic: bool = False, hisparse_budget: int | None = None,
                 cuda_graphs: bool | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.config = config
        self.max_seq_len = max_seq_len or config.max_seq_len
        self.device = model.embed.weight.device
        self.chunk = chunk or default_chunk(config)
        if max_batch_tokens < 1 or max_batch < 1 or max_prefills < 1:
            raise ValueError("max_batch_tokens, max_batch and max_prefills must be positive")
        self.piece = max(d for d in range(1, self.chunk + 1) if self.chunk % d == 0 and d <= max_batch_tokens)
        row_bytes = V4Cache(config, 1, self.max_seq_len, "meta").nbytes()
        budget = memory_budget if memory_budget is not None else (max_batch + max_prefills) * row_bytes * 4
        hot_bytes = hisparse_budget or 0
        decode_row = device_row_bytes(config, self.max_seq_len) if hisparse_budget else row_bytes
        self.max_prefills, self.max_batch = plan_rows(budget - hot_bytes, row_bytes, decode_row, max_prefills,
                                                      max_batch)
        if deterministic:
            torch.use_deterministic_algorithms(True)
            batch_invariant.enable()
            decode_buckets = (self.max_batch,)
        self.buckets = tuple(sorted(decode_buckets)) if decode_buckets else _powers_of_two(self.max_batch)
        if self.buckets[-1] < self.max_batch:
            self.buckets = (*self.buckets, self.max_batch)
        self.hisparse: HiSparse | None = None
        if hisparse_budget:
            self.hisparse = HiSparse(config, self.buckets[-1], self.max_seq_len, hisparse_budget // slot_bytes(config),
                                     self.device)
            self.decode_cache: V4Cache = HiSparseCache(config, self.hisparse, self.device)
        else:
            self.decode_cache = model.new_cache(self.buckets[-1], self.max_seq_len)
        self.staging = [model.new_cache(1, self.max_seq_len) for _ in range(self.max_prefills)]
        self._pool_budget = budget - hot_bytes - self.max_prefills * row_bytes - self.max_batch * decode_row
        self.store = self._new_store() if prefix_cache else None
        self.tail_every = tail_every
        self.speculate = False
        self.recording = False
        self._waiting: deque[_Request] = deque()
        self._prefilling: list[_Request] = []
        self._decoding: list[_Request] = []
        self._requests: dict[int, _Request] = {}
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {self.device}")
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self._plain_decode) if use_graphs else None

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]] | list[str], max_new_tokens: int | list[int] = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, mtp: bool = False,
                 record_routing: bool = False, stop_ids: list[int] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (token ids, or text with a tokenizer) and returns one ``RequestOutput`` per
        prompt, in order. A request stops after ``max_new_tokens`` or at the first of ``stop_ids`` it generates
        (kept as its last token; default: the tokenizer's end-of-sequence ids, none without a tokenizer).
        A bad request gets its ``error`` set and the others still run. With ``seed`` the sampled tokens of a
        request depend only on the seed and its index, not on the rest of the batch. ``mtp`` turns on
        speculative decoding with the model's first MTP block (greedy only): each step verifies the current
        token and one draft, so a step emits two tokens when the draft is right. ``record_routing`` returns,
        per request, the experts and indexer entries every layer chose for every token fed to the model
        (prompt and output but the last), for routing replay in training; such requests are computed in
        full (their prompts are not served from the prefix cache, which holds no routing)."""
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
        if mtp and temperature > 0:
            raise ValueError("MTP speculative decoding is greedy only (temperature 0)")
        if mtp and not len(getattr(self.model, "mtp", ())):
            raise ValueError("MTP speculative decoding needs a model with an MTP block (n_mtp_layers >= 1)")
        if mtp and self.hisparse is not None:
            self.hisparse.check_capacity(self.hisparse.hot_entries, self.buckets[-1], tokens_per_step=2)
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: Engine(model, tokenizer=Tokenizer.from_folder(folder)) "
                             "or Tokenizer.builtin()")
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        self.speculate = mtp
        self.recording = record_routing
        outputs = [self.submit(prompt, limit, temperature, top_p, None if seed is None else seed * 1_000_003 + i,
                               stop_ids, index=i)
                   for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True))]
        while self.busy:
            self.step()
        if self.tokenizer is not None:
            for out in outputs:
                out.text = self.tokenizer.decode(out.tokens)
        return outputs

    def submit(self, prompt: list[int] | str, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop_ids: list[int] | None = None, index: int = 0) -> RequestOutput:
        """Queues one request for ``step`` to serve (a server's entry point; ``generate`` is submit-all, then step
        until done) and returns its ``RequestOutput``, which fills as steps run; ``finish_reason`` is set once it is
        done. A request the engine cannot serve comes back at once with ``error`` set (finish_reason "error").
        ``seed`` makes a sampled request's tokens depend only on it; ``stop_ids`` as in ``generate``."""
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
        out = RequestOutput(index=index)
        try:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestError("a text prompt needs a tokenizer")
                prompt = self.tokenizer.encode(prompt)
            tokens = self._validate(prompt, max_new_tokens)
        except RequestError as exc:
            out.error, out.finish_reason = str(exc), "error"
            _LOG.info("request %d rejected: %s", index, exc)
            return out
        if stop_ids is None:
            stop_ids = self.tokenizer.eos_ids if self.tokenizer is not None else []
        generator = torch.Generator().manual_seed(seed if seed is not None else index) if temperature > 0 else None
        req = _Request(index, tokens, max_new_tokens, generator, out, temperature=temperature, top_p=top_p,
                       stop_ids=frozenset(int(i) for i in stop_ids))
        self._requests[id(out)] = req
        self._waiting.append(req)
        return out

    def cancel(self, out: RequestOutput) -> None:
        """Stops a submitted request (a client that went away): the next ``step`` drops it and frees its row,
        its ``finish_reason`` becoming "abort". A request already finished is left as it is."""
        req = self._requests.get(id(out))
        if req is not None:
            req.cancelled = True

    @property
    def busy(self) -> bool:
        """Whether any submitted request is still waiting, prefilling or decoding."""
        return bool(self._waiting or self._prefilling or self._decoding)

    def step(self) -> None:
        """One scheduling round: admits waiting requests into free prefill rows, computes one piece of every
        prompt being prefilled (moving finished prompts to decode rows), then one decode step of every decode
        row; cancelled requests are dropped first."""
        with torch.no_grad():
            self._drop_cancelled()
            while self._waiting and len(self._prefilling) < self.max_prefills and \
                    len(self._prefilling) + len(self._decoding) < self.max_batch:
                self._prefilling.append(self._admit(self._waiting.popleft(), self._prefilling))
            for req in list(self._prefilling):
                if self._prefill_piece(req):
                    self._prefilling.remove(req)
                    if self._finished(req):
                        continue
                    req.row = len(self._decoding)
                    self.decode_cache.copy_row(req.row, req.staging, 0)
                    req.staging = None
                    self._decoding.append(req)
            if self._decoding and self.speculate:
                self._speculative_step(self._decoding)
            elif self._decoding:
                self._decode_step(self._decoding)

    def _drop_cancelled(self) -> None:
        for queue in (self._waiting, self._prefilling):
            for req in [r for r in queue if r.cancelled]:
                queue.remove(req)
                self._finished(req)
        if any(r.cancelled for r in self._decoding):
            self._compact(self._decoding)

    def weights_updated(self) -> None:
        """Call after changing the model's weights (an RL step): drops every cached prefix, whose KV the old
        weights computed, and any decode CUDA graphs (captured with the old weights' addresses). The engine
        runs the model object it was given, so new weights serve at once."""
        if self.store is not None:
            self.store = self._new_store()
        if self.graphs is not None:
            self.graphs.reset()

    def stats(self) -> dict[str, object]:
        """Prefix-cache pools and tree statistics (none without a prefix cache) and, with HiSparse, its
        statistics under "hisparse" (hit rate, bytes moved per step; reading them syncs the device)."""
        out = self.store.stats() if self.store is not None else {}
        if self.hisparse is not None:
            out["hisparse"] = self.hisparse.stats()
        return out

    def _new_store(self) -> PrefixStore:
        return PrefixStore(self.config, self.chunk, self._pool_budget, self.device, host_c4=self.hisparse is not None)

    # ------------------------------------------------------------------ scheduling
    def _validate(self, prompt: list[int], limit: int) -> list[int]:
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise RequestError("empty prompt")
        bad = next((j for j, t in enumerate(tokens) if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {tokens[bad]} at prompt position {bad} is outside the vocabulary "
                               f"[0, {self.config.vocab_size})")
        if limit < 1:
            raise RequestError(f"max_new_tokens must be at least 1, got {limit}")
        if len(tokens) + limit > self.max_seq_len:
            raise RequestError(f"prompt of {len(tokens)} tokens plus {limit} new tokens exceeds max_seq_len "
                               f"{self.max_seq_len}")
        return tokens

    def _admit(self, req: _Request, prefilling: list[_Request]) -> _Request:
        used = {id(r.staging) for r in prefilling}
        req.staging = next(c for c in self.staging if id(c) not in used)
        req.staging.reset()
        req.out.cache.prompt_tokens = len(req.prompt)
        if self.store is not None and not self.recording:
            hit = self.store.restore(req.prompt, req.staging)
            req.done = hit.resume_len
            req.out.cache.cached_tokens = hit.resume_len
            req.out.cache.recomputed_tokens = hit.recompute_tokens
        _LOG.info("request %d admitted: %d prompt tokens, %d from the prefix cache", req.out.index,
                  len(req.prompt), req.out.cache.cached_tokens)
        return req

    def _prefill_piece(self, req: _Request) -> bool:
        """Computes the next piece of the prompt; True when the prompt is done (first token sampled)."""
        start = req.done
        stop = min(len(req.prompt), (start // self.piece + 1) * self.piece)
        ids = torch.tensor([req.prompt[start:stop]], device=self.device)
        routing = self._recorder()
        hidden = self.model.extend_hidden(ids, start, req.staging, routing)
        if routing is not None:
            req.routing.append(_row(routing, 0, stop - start))
        if self.speculate:  # the MTP block's window needs the last ``window`` positions' streams
            kept = hidden if req.hidden is None else torch.cat((req.hidden, hidden), dim=1)
            req.hidden = kept[:, -self.config.window_size :]
        req.done = stop
        req.out.cache.prefill_tokens += stop - start
        boundary = len(req.prompt) // self.chunk * self.chunk
        checkpoint = self.tail_every and stop % self.chunk == 0 and (stop // self.chunk) % self.tail_every == 0
        if self.store is not None and 0 < stop <= boundary and (stop == boundary or checkpoint):
            self.store.save(req.prompt[:stop], req.staging)
        if stop < len(req.prompt):
            return False
        self._emit(req, self.model.logits(hidden[:, -1:])[0, 0])
        if self.speculate:
            assert req.hidden is not None
            kept = req.hidden.shape[1]
            first = len(req.prompt) - kept
            next_ids = torch.tensor([req.prompt[first + 1 :] + [req.token]], device=self.device)
            draft_logits = self.model.mtp_step(req.hidden, next_ids, req.staging, start=first)
            req.draft, req.hidden = self._pick_draft(req, draft_logits[0, -1]), None
        return True

    def _step_inputs(self, decoding: list[_Request], speculative: bool
                     ) -> tuple[V4Cache, torch.Tensor, torch.Tensor]:
        """The smallest decode bucket holding every row, each row's tokens (current, and its draft when
        ``speculative``; padding rows get token 0 at position 0) and the current token's position."""
        bucket = next(b for b in self.buckets if b >= len(decoding))
        ids = torch.zeros(bucket, 2 if speculative else 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(bucket, dtype=torch.long, device=self.device)
        for req in decoding:
            ids[req.row] = torch.tensor([req.token, req.draft] if speculative else [req.token])
            positions[req.row] = len(req.prompt) + len(req.out.tokens) - 1
        return self.decode_cache.rows(0, bucket), ids, positions

    def _compact(self, decoding: list[_Request]) -> None:
        """Drops finished requests; rows stay dense, later rows moving down over finished ones."""
        keep = [r for r in decoding if not self._finished(r)]
        for row, req in enumerate(keep):
            if req.row != row:
                self.decode_cache.copy_row(row, self.decode_cache, req.row)
                req.row = row
        decoding[:] = keep

    def _decode_step(self, decoding: list[_Request]) -> None:
        cache, ids, positions = self._step_inputs(decoding, speculative=False)
        routing = self._recorder()
        if self.graphs is not None and routing is None:
            logits = self.graphs.step(ids, positions, cache)
        else:
            logits = self.model.decode_step(ids, positions, cache, routing)
        for req in decoding:
            self._emit(req, logits[req.row, 0])
            if routing is not None:
                req.routing.append(_row(routing, req.row, 1))
        self._compact(decoding)

    def _plain_decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache) -> torch.Tensor:
        return self.model.decode_step(ids, positions, cache, None)

    def _speculative_step(self, decoding: list[_Request]) -> None:
        """Verifies every row's current token and draft in one step; a row whose draft the main model
        confirms keeps both tokens plus the token after, others roll their compressor state back; the MTP
        block then drafts again from the new streams."""
        cache, ids, positions = self._step_inputs(decoding, speculative=True)
        checkpoint = cache.draft_checkpoint()
        routing = self._recorder()
        logits, hidden = self.model.decode_tokens(ids, positions, cache, routing)
        next_ids = ids.clone()
        rejected, accepted = [], []
        for req in decoding:
            req.out.mtp_drafted += 1
            confirmed = int(logits[req.row, 0].argmax()) == req.draft
            self._emit(req, logits[req.row, 0])
            kept = 2 if confirmed and not req.stopped and len(req.out.tokens) < req.max_new else 1
            if routing is not None:
                req.routing.append(_row(routing, req.row, kept))
            if kept == 2:
                req.out.mtp_accepted += 1
                self._emit(req, logits[req.row, 1])
                next_ids[req.row] = torch.tensor([req.draft, req.token])
                accepted.append(req)
            else:
                next_ids[req.row, 0] = req.token
                rejected.append(req)
        if rejected:  # the draft's position must not stay in the compressor state
            rows = torch.tensor([r.row for r in rejected], device=self.device)
            cache.rollback_draft(checkpoint, rows, positions[rows] + 1)
        drafts = self.model.mtp_step(hidden, next_ids, cache, positions=positions)
        for req in accepted:
            req.draft = self._pick_draft(req, drafts[req.row, 1])
        for req in rejected:
            req.draft = self._pick_draft(req, drafts[req.row, 0])
        self._compact(decoding)

    def _pick_draft(self, req: _Request, mtp_logits: torch.Tensor) -> int:
        """The draft for the token after ``req.token``: the MTP block's greedy choice."""
        return int(mtp_logits.argmax())

    def _emit(self, req: _Request, logits: torch.Tensor) -> None:
        token, logprob = sample(logits, req.temperature, req.top_p, req.generator)
        req.token = token
        req.out.tokens.append(token)
        req.out.logprobs.append(logprob)
        req.stopped = token in req.stop_ids

    def _finished(self, req: _Request) -> bool:
        if req.cancelled:
            req.out.finish_reason = "abort"
        elif req.stopped:
            req.out.finish_reason = "stop"
        elif len(req.out.tokens) < req.max_new:
            return False
        else:
            req.out.finish_reason = "length"
        _LOG.info("request %d finished: %d tokens (%s)", req.out.index, len(req.out.tokens), req.out.finish_reason)
        if req.routing:
            req.out.routing = _concat(req.routing, len(req.prompt) + len(req.out.tokens) - 1)
            req.routing = []
        self._requests.pop(id(req.out), None)
        return True

    def _recorder(self) -> Routing | None:
        return Routing.recorder(self.config) if self.recording else None


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


def plan_rows(budget: int, prefill_row: int, decode_row: int, max_prefills: int, max_batch: int) -> tuple[int, int]:
    """(prefill rows, decode rows) that ``budget`` bytes of caches pay for: up to ``max_prefills`` prefill rows
    while one decode row still fits, then up to ``max_batch`` decode rows. ValueError when not one of each fits."""
    if budget < prefill_row + decode_row:
        raise ValueError(f"memory_budget leaves {budget} B for sequence caches; one prefill row ({prefill_row} B) "
                         f"and one decode row ({decode_row} B) need {prefill_row + decode_row} B (max_seq_len and "
                         "hisparse_budget set these)")
    prefills = min(max_prefills, (budget - decode_row) // prefill_row)
    return prefills, min(max_batch, (budget - prefills * prefill_row) // decode_row)


def default_chunk(config: V4Config) -> int:
    """The prefix-cache granule: 128 tokens (a C128 block, 32 C4 blocks), or the window if larger, rounded
    up to a multiple of 128."""
    return max(128, -(-config.window_size // 128) * 128)


def _powers_of_two(limit: int) -> tuple[int, ...]:
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return (*sizes, limit)
