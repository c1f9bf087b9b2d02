"""The cache manager: every cache the engine holds, planned from one memory budget.

``memory_budget`` pays first for the working caches (the decode rows, and one staging row per concurrent
prefill, each sized for ``max_seq_len``; with HiSparse its hot buffer, and decode rows without their C4 main
entries), and the rest holds the prefix cache's pools (``prefix_store.py``). The engine reaches caches only
through this object: a prefill's staging row, moves into and between decode rows, a decode bucket's rows, and
the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.cache import V4Cache
from ..model.config import V4Config
from .hisparse import HiSparse, HiSparseCache, device_row_bytes, slot_bytes
from .model_runner import ServedModel
from .prefix_store import Hit, PrefixStore


@dataclass(frozen=True)
class MemoryPlan:
    """What the budget pays for: staging (prefill) rows, decode rows, the HiSparse hot buffer's bytes and the
    bytes left for the prefix cache's pools."""

    prefill_rows: int
    decode_rows: int
    hot_bytes: int
    pool_budget: int


def plan_memory(config: V4Config, max_seq_len: int, memory_budget: int | None, max_batch: int, max_prefills: int,
                hisparse_budget: int | None) -> MemoryPlan:
    """The rows and pool bytes ``memory_budget`` pays for (default: four times ``max_batch + max_prefills`` full
    rows), ``hisparse_budget`` of it going to HiSparse's hot buffer. ValueError when not one row of each fits."""
    row_bytes = V4Cache(config, 1, max_seq_len, "meta").nbytes()
    budget = memory_budget if memory_budget is not None else (max_batch + max_prefills) * row_bytes * 4
    hot_bytes = hisparse_budget or 0
    decode_row = device_row_bytes(config, max_seq_len) if hisparse_budget else row_bytes
    prefills, rows = plan_rows(budget - hot_bytes, row_bytes, decode_row, max_prefills, max_batch)
    return MemoryPlan(prefills, rows, hot_bytes, budget - hot_bytes - prefills * row_bytes - rows * decode_row)


def plan_rows(budget: int, prefill_row: int, decode_row: int, max_prefills: int, max_batch: int) -> tuple[int, int]:
    """(prefill rows, decode rows) that ``budget`` bytes of caches pay for: up to ``max_prefills`` prefill rows
    while one decode row still fits, then up to ``max_batch`` decode rows. ValueError when not one of each fits."""
    if budget < prefill_row + decode_row:
        raise ValueError(f"memory_budget leaves {budget} B for sequence caches; one prefill row ({prefill_row} B) "
                         f"and one decode row ({decode_row} B) need {prefill_row + decode_row} B (max_seq_len and "
                         "hisparse_budget set these)")
    prefills = min(max_prefills, (budget - decode_row) // prefill_row)
    return prefills, min(max_batch, (budget - prefills * prefill_row) // decode_row)


class CacheManager:
    """The caches of ``plan`` for ``model``: ``rows`` decode rows (the largest decode bucket; under HiSparse when
    ``plan.hot_bytes``), one staging row per prefill slot, and with ``prefix_cache`` a ``PrefixStore`` of
    ``chunk``-token granules that also keeps a window tail every ``tail_every`` chunks of a prompt (0: at the
    prompt's deepest chunk boundary only)."""

    def __init__(self, model: ServedModel, plan: MemoryPlan, *, rows: int, max_seq_len: int, chunk: int,
                 prefix_cache: bool, tail_every: int) -> None:
        config, device = model.config, model.embed.weight.device
        self.config, self.device, self.chunk, self.tail_every = config, device, chunk, tail_every
        self.pool_budget = plan.pool_budget
        self.hisparse: HiSparse | None = None
        if plan.hot_bytes:
            self.hisparse = HiSparse(config, rows, max_seq_len, plan.hot_bytes // slot_bytes(config), device)
            self.decode: V4Cache = HiSparseCache(config, self.hisparse, device)
        else:
            self.decode = model.new_cache(rows, max_seq_len)
        self.staging = [model.new_cache(1, max_seq_len) for _ in range(plan.prefill_rows)]
        self.store = self._new_store() if prefix_cache else None

    def _new_store(self) -> PrefixStore:
        return PrefixStore(self.config, self.chunk, self.pool_budget, self.device, host_c4=self.hisparse is not None)

    def drop_prefixes(self) -> None:
        """Forgets every cached prefix (after a weight update: the old weights computed their KV)."""
        if self.store is not None:
            self.store = self._new_store()

    def check_tokens_per_step(self, tokens: int) -> None:
        """Raises ValueError when HiSparse's hot buffer cannot hold a decode step of ``tokens`` tokens per row
        (MTP speculation takes two)."""
        if self.hisparse is not None:
            self.hisparse.check_capacity(self.hisparse.hot_entries, self.decode.batch_size, tokens_per_step=tokens)

    def begin_prefill(self, slot: int, prompt: list[int], restore: bool) -> Hit:
        """Clears staging row ``slot`` for ``prompt`` and, with ``restore`` and a prefix cache, copies in the
        deepest cached prefix it can resume from; what was found (nothing: a zero hit)."""
        staging = self.staging[slot]
        staging.reset()
        if self.store is None or not restore:
            return Hit(0, 0)
        return self.store.restore(prompt, staging)

    def save_prefix(self, prompt: list[int], stop: int, slot: int) -> None:
        """Caches ``prompt[:stop]``, whose state staging row ``slot`` holds after a prefill piece, when ``stop`` is
        the prompt's deepest chunk boundary or a ``tail_every`` checkpoint."""
        boundary = len(prompt) // self.chunk * self.chunk
        checkpoint = self.tail_every and stop % self.chunk == 0 and (stop // self.chunk) % self.tail_every == 0
        if self.store is not None and 0 < stop <= boundary and (stop == boundary or checkpoint):
            self.store.save(prompt[:stop], self.staging[slot])

    def to_decode(self, row: int, slot: int) -> None:
        """Moves a prefilled sequence from staging row ``slot`` into decode row ``row``."""
        self.decode.copy_row(row, self.staging[slot], 0)

    def move_rows(self, moves: list[tuple[int, int]]) -> None:
        """Applies decode row moves (destination, source), in order."""
        for dst, src in moves:
            self.decode.copy_row(dst, self.decode, src)

    def decode_rows(self, bucket: int) -> V4Cache:
        """Decode rows ``0..bucket-1``, sharing storage (a decode step's cache)."""
        return self.decode.rows(0, bucket)

    def stats(self) -> dict[str, object]:
        """Prefix-cache pools and tree statistics (none without a prefix cache) and, with HiSparse, its
        statistics under "hisparse" (reading them syncs the device)."""
        out = self.store.stats() if self.store is not None else {}
        if self.hisparse is not None:
            out["hisparse"] = self.hisparse.stats()
        return out
