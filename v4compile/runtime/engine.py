"""The serving engine: continuous batching over a fixed set of decode rows, chunked prefill in staging
rows, compressed entries on shared pages, and prefix caching through ShadowRadix. Each step reads as
schedule -> run -> postprocess: the ``Scheduler`` decides what runs (``scheduler.py``), the ``ModelRunner``
runs it (``model_runner.py``), the engine samples and hands the results back; the ``CacheManager`` owns every
cache (``cache_manager.py``) and the ``Speculator`` drives MTP speculation (``speculative.py``).

Why the shapes are what they are: every prompt is prefilled in pieces whose boundaries are fixed
multiples of ``piece`` tokens counted from position 0, and every decode step runs a static bucket of rows.
So the computation that produces a token's KV does not depend on what else is running, and a prefix
restored from the cache holds bit for bit what computing it again would give: greedy output with the
prefix cache equals greedy output without it (with one decode bucket; with several, a row's numerics
may follow the bucket size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import batch_invariant, logs
from .cache_manager import CacheManager, plan_memory
from .hisparse import HiSparse
from .model_runner import ModelRunner, ServedModel
from .prefix_store import PrefixStore, default_chunk
from .requests import RequestError, RequestOutput
from .scheduler import DecodeBatch, Scheduler, bucket_sizes, prefill_piece
from .sequence import Mode, Sequence
from .speculative import Speculator

if TYPE_CHECKING:
    from .text import Tokenizer

_LOG = logs.logger("engine")


class Engine:
    """Serves generation requests on ``model`` (a ``DeepSeekV4`` or an ``OptimizedModel`` of one).

    ``memory_budget`` (bytes) pays first for the rows (``max_batch`` decode rows and one staging row per
    concurrent prefill: window rings, compressor states, page tables), then for the prefix cache's window tails,
    and the rest is entry pages that every sequence and cached prefix share: a request takes the pages of its
    prompt and ``max_new_tokens`` when admitted (a prefix hit maps the cached ones, copying no entries), so
    admission is by free pages (``cache_manager.py``). ``max_batch_tokens`` is the largest prefill piece per
    step (rounded down to a divisor of the cache ``chunk``); ``decode_buckets`` are the static decode batch
    sizes (default: powers of two up to ``max_batch``). ``tail_every`` > 0 also caches a window tail every that
    many chunks while a prompt is prefilled (fewer tokens recomputed after a branch, more bytes); 0 keeps one at
    the prompt's end only. ``prefix_tails`` caps the window tails the prefix cache keeps (default: what a quarter
    of the budget the rows leave pays for): fewer tails, fewer bytes per cached token, more recomputation.
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

    def __init__(self, model: ServedModel, *, memory_budget: int | None = None, max_batch_tokens: int = 128,
                 max_batch: int = 4, max_prefills: int = 1, chunk: int | None = None, prefix_cache: bool = True,
                 decode_buckets: tuple[int, ...] | None = None, max_seq_len: int | None = None,
                 tail_every: int = 0, prefix_tails: int | None = None, deterministic: bool = False,
                 hisparse_budget: int | None = None,
                 cuda_graphs: bool | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.max_seq_len = max_seq_len or self.config.max_seq_len
        self.chunk = chunk or default_chunk(self.config)
        if max_batch_tokens < 1 or max_batch < 1 or max_prefills < 1:
            raise ValueError("max_batch_tokens, max_batch and max_prefills must be positive")
        plan = plan_memory(self.config, self.max_seq_len, memory_budget, max_batch, max_prefills, hisparse_budget,
                           prefix_cache, prefix_tails)
        if deterministic:
            torch.use_deterministic_algorithms(True)
            batch_invariant.enable()
            decode_buckets = (plan.decode_rows,)
        buckets = bucket_sizes(decode_buckets, plan.decode_rows)
        self.scheduler = Scheduler(plan.prefill_rows, plan.decode_rows, buckets,
                                   prefill_piece(self.chunk, max_batch_tokens))
        self.caches = CacheManager(model, plan, rows=buckets[-1], max_seq_len=self.max_seq_len, chunk=self.chunk,
                                   prefix_cache=prefix_cache, tail_every=tail_every)
        self.runner = ModelRunner(model, cuda_graphs)
        self.speculator = Speculator(self.runner, self.config.window_size, self._pick_draft)

    @property
    def max_batch(self) -> int:
        """Decode rows the memory budget pays for (at most the ``max_batch`` asked for)."""
        return self.scheduler.max_batch

    @property
    def max_prefills(self) -> int:
        """Concurrent prefills (staging rows) the memory budget pays for."""
        return self.scheduler.max_prefills

    @property
    def store(self) -> PrefixStore | None:
        """The prefix cache (None without one); ``weights_updated`` replaces it."""
        return self.caches.store

    @property
    def hisparse(self) -> HiSparse | None:
        """HiSparse's tiers (None without ``hisparse_budget``)."""
        return self.caches.hisparse

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
        full (their prompts are not served from the prefix cache, which holds no routing). ``mtp`` and
        ``record_routing`` hold for this call's requests only; requests ``submit`` queued in another mode run
        before or after them, never in the same step."""
        _check_sampling(temperature, top_p)
        if mtp and temperature > 0:
            raise ValueError("MTP speculative decoding is greedy only (temperature 0)")
        if mtp and not self.runner.has_mtp:
            raise ValueError("MTP speculative decoding needs a model with an MTP block (n_mtp_layers >= 1)")
        if mtp:
            self.caches.check_tokens_per_step(2)
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: Engine(model, tokenizer=Tokenizer.from_folder(folder)) "
                             "or Tokenizer.builtin()")
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        mode = Mode(mtp=mtp, record_routing=record_routing)
        outputs = [self._enqueue(prompt, limit, temperature, top_p, None if seed is None else seed * 1_000_003 + i,
                                 stop_ids, i, mode)
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
        _check_sampling(temperature, top_p)
        return self._enqueue(prompt, max_new_tokens, temperature, top_p, seed, stop_ids, index, Mode())

    def cancel(self, out: RequestOutput) -> None:
        """Stops a submitted request (a client that went away): the next ``step`` drops it and frees its row,
        its ``finish_reason`` becoming "abort". A request already finished is left as it is."""
        self.scheduler.cancel(out)

    @property
    def busy(self) -> bool:
        """Whether any submitted request is still waiting, prefilling or decoding."""
        return self.scheduler.busy

    def step(self) -> None:
        """One scheduling round: admits waiting requests into free prefill rows, computes one piece of every
        prompt being prefilled (moving finished prompts to decode rows), then one decode step of every decode
        row; cancelled requests are dropped first."""
        with torch.no_grad():
            self._move_rows(self.scheduler.drop_cancelled())
            self._release_retired()
            self.scheduler.admit(self._begin_prefill)
            for seq in list(self.scheduler.prefilling):
                self._prefill_piece(seq)
            batch = self.scheduler.decode_batch()
            if batch is not None:
                self._decode(batch)
                self._move_rows(self.scheduler.compact())
            self._release_retired()

    def _move_rows(self, moves: list[tuple[int, int]]) -> None:
        self.caches.move_rows(moves, live=len(self.scheduler.decoding))

    def _release_retired(self) -> None:
        """Gives back the pages of every sequence that finished, was cancelled or failed since the last call."""
        for seq in self.scheduler.take_retired():
            self.caches.release(seq.pages)
            seq.pages = []

    def weights_updated(self) -> None:
        """Call after changing the model's weights (an RL step): drops every cached prefix, whose KV the old
        weights computed, and any decode CUDA graphs (captured with the old weights' addresses). The engine
        runs the model object it was given, so new weights serve at once. Prompts being prefilled go on with the KV
        they have, but cache none of it."""
        self.caches.drop_prefixes()
        self.runner.reset_graphs()
        for seq in self.scheduler.prefilling:
            seq.cacheable = False

    def stats(self) -> dict[str, object]:
        """Prefix-cache pools and tree statistics (none without a prefix cache) and, with HiSparse, its
        statistics under "hisparse" (hit rate, bytes moved per step; reading them syncs the device)."""
        return self.caches.stats()

    # ------------------------------------------------------------------ requests
    def _enqueue(self, prompt: list[int] | str, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, stop_ids: list[int] | None, index: int, mode: Mode) -> RequestOutput:
        """Validates one request and queues it in ``mode``; a request that cannot be served gets its error."""
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
        self.scheduler.add(Sequence(index, tokens, max_new_tokens, generator, out, mode, temperature=temperature,
                                    top_p=top_p, stop_ids=frozenset(int(i) for i in stop_ids)))
        return out

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
        self.caches.check_fits(len(tokens) + limit)
        return tokens

    # ------------------------------------------------------------------ prefill
    def _begin_prefill(self, seq: Sequence) -> bool:
        """Prepares a sequence's staging row and pages, resuming from the prefix cache unless it records routing
        (the cache holds none); False, changing nothing, when too few pages are free for it."""
        hit = self.caches.begin_prefill(seq.slot, seq.prompt, restore=not seq.mode.record_routing,
                                        tokens=len(seq.prompt) + seq.max_new)
        if hit is None:
            return False
        seq.pages, seq.fork = hit.pages, hit.resume_len + hit.recompute_tokens
        seq.out.cache.prompt_tokens = len(seq.prompt)
        seq.done = seq.out.cache.cached_tokens = hit.resume_len
        seq.out.cache.recomputed_tokens = hit.recompute_tokens
        _LOG.info("request %d admitted: %d prompt tokens, %d from the prefix cache", seq.out.index,
                  len(seq.prompt), seq.out.cache.cached_tokens)
        return True

    def _prefill_piece(self, seq: Sequence) -> None:
        """Computes the next piece of ``seq``'s prompt; after the last one samples its first token (and with MTP
        its first draft) and moves it to a decode row."""
        start, stop = seq.done, self.scheduler.piece_end(seq)
        staging = self.caches.staging[seq.slot]
        hidden, routing = self.runner.prefill(seq.prompt[start:stop], start, staging, seq.mode.record_routing)
        seq.record(routing, 0, stop - start)
        if seq.mode.mtp:
            self.speculator.keep_streams(seq, hidden)
        seq.done = stop
        seq.out.cache.prefill_tokens += stop - start
        if seq.cacheable:
            self.caches.save_prefix(seq.prompt, stop, seq.slot, seq.pages, seq.fork)
        if stop < len(seq.prompt):
            return
        seq.emit(self.runner.logits(hidden[:, -1:])[0, 0])
        if seq.mode.mtp:
            self.speculator.first_draft(seq, staging)
        row = self.scheduler.prefilled(seq)
        if row is not None:
            self.caches.to_decode(row, seq.slot)

    # ------------------------------------------------------------------ decode
    def _decode(self, batch: DecodeBatch) -> None:
        """One decode step of every decode row (a speculative one with MTP): run, then sample each row."""
        cache = self.caches.decode_rows(batch.bucket)
        record = batch.mode.record_routing
        if batch.mode.mtp:
            self.speculator.step(batch.seqs, batch.bucket, cache, record)
            return
        ids, positions = self.runner.decode_inputs(batch.seqs, batch.bucket, speculative=False)
        logits, routing = self.runner.decode(ids, positions, cache, record)
        for seq in batch.seqs:
            seq.emit(logits[seq.row, 0])
            seq.record(routing, seq.row, 1)

    def _pick_draft(self, seq: Sequence, mtp_logits: torch.Tensor) -> int:
        """The draft for the token after ``seq.token``: the MTP block's greedy choice."""
        return int(mtp_logits.argmax())


def _check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
