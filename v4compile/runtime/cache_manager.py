"""The cache manager: every cache the engine holds, planned from one memory budget.

``memory_budget`` pays first for the rows (the decode rows, and one staging row per concurrent prefill: window
rings, compressor states and page tables, which do not grow with a sequence; with HiSparse its hot buffer and the
C4 main entries a staging row keeps), then for the prefix cache's window tails, and the rest is the shared entry
pages (``model/pages.py``) that hold every sequence's and every cached prefix's compressed entries. A request
takes the pages its prompt and new tokens need when it is admitted (a prefix hit's pages come from the tree, with a
reference each), so admission is by free pages; it gives them back when it finishes. The engine reaches caches
only through this object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.cache import PAGE_TOKENS, V4Cache
from ..model.config import V4Config
from ..model.pages import EntryPages, page_bytes
from .hisparse import HiSparse, HiSparseCache, device_row_bytes, slot_bytes
from .model_runner import ServedModel
from .pools import PagePool
from .prefix_pools import TAIL_SHARE, tail_bytes
from .prefix_store import Hit, PrefixStore
from .requests import RequestError


@dataclass(frozen=True)
class MemoryPlan:
    """What the budget pays for: staging (prefill) rows, decode rows, the HiSparse hot buffer's bytes, the prefix
    cache's window tails and the entry pages (the null page included)."""

    prefill_rows: int
    decode_rows: int
    hot_bytes: int
    tails: int
    pages: int


def row_bytes(config: V4Config, max_seq_len: int, c4_main: bool = True) -> int:
    """Device bytes of one cache row on entry pages (pages apart): window rings, compressor states, its page table
    and, without ``c4_main`` pages (HiSparse), its own C4 main entries."""
    pages = EntryPages(config, 2, "meta", c4_main)
    return V4Cache(config, 1, max_seq_len, "meta", pages).nbytes()


def pages_for(tokens: int) -> int:
    """Pages holding the compressed entries of ``tokens`` tokens."""
    return -(-tokens // PAGE_TOKENS)


def plan_memory(config: V4Config, max_seq_len: int, memory_budget: int | None, max_batch: int, max_prefills: int,
                hisparse_budget: int | None, prefix_cache: bool = True, tails: int | None = None) -> MemoryPlan:
    """The rows, tails and pages ``memory_budget`` pays for (default: four times ``max_batch + max_prefills``
    full-length sequences). ``hisparse_budget`` of it goes to HiSparse's hot buffer; the rows (up to ``max_batch``
    and ``max_prefills``) take what leaves the pages of one ``max_seq_len`` sequence (and one window tail with a
    prefix cache); a ``TAIL_SHARE`` of what the rows leave beyond that sequence's pages goes to window tails (at
    most ``tails``), and the rest to pages, so one full-length sequence always fits. ValueError when not one row of
    each fits beside those."""
    c4_main = not hisparse_budget
    staging = row_bytes(config, max_seq_len, c4_main)
    page = page_bytes(config, c4_main)
    full = staging + pages_for(max_seq_len) * page_bytes(config)
    budget = memory_budget if memory_budget is not None else (max_batch + max_prefills) * full * 4
    hot_bytes = hisparse_budget or 0
    decode_row = device_row_bytes(config, max_seq_len) if hisparse_budget else staging
    one_sequence = pages_for(max_seq_len) * page
    reserve = one_sequence + (tail_bytes(config) if prefix_cache else 0)
    prefills, rows = plan_rows(budget - hot_bytes - reserve, staging, decode_row, max_prefills, max_batch)
    rest = budget - hot_bytes - prefills * staging - rows * decode_row
    if tails is not None and tails < 1:
        raise ValueError(f"the prefix cache needs at least one window tail, got prefix_tails={tails}")
    share = max(1, int((rest - one_sequence) * TAIL_SHARE) // tail_bytes(config))
    tails = (min(tails, share) if tails is not None else share) if prefix_cache else 0
    if not page:  # no compressing layer: pages hold nothing and cost nothing
        return MemoryPlan(prefills, rows, hot_bytes, tails, (rows + prefills) * pages_for(max_seq_len) + 1)
    pages = (rest - tails * tail_bytes(config)) // page + 1
    if pages < 2:
        raise ValueError(f"memory_budget leaves {rest} B after the rows: not one {page} B page of entries and "
                         f"{tails} window tails of {tail_bytes(config)} B")
    return MemoryPlan(prefills, rows, hot_bytes, tails, pages)


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
    ``plan.hot_bytes``), one staging row per prefill slot, the entry pages they share and with ``prefix_cache``
    a ``PrefixStore`` of ``chunk``-token granules that also keeps a window tail every ``tail_every`` chunks of a
    prompt (0: at the prompt's deepest chunk boundary only)."""

    def __init__(self, model: ServedModel, plan: MemoryPlan, *, rows: int, max_seq_len: int, chunk: int,
                 prefix_cache: bool, tail_every: int) -> None:
        config, device = model.config, model.embed.weight.device
        self.config, self.device, self.chunk, self.tail_every = config, device, chunk, tail_every
        self.plan = plan
        self.hisparse: HiSparse | None = None
        self.entry_pages = EntryPages(config, plan.pages, device, c4_main=not plan.hot_bytes)
        self.pages = PagePool("pages", plan.pages, self.entry_pages.page_bytes)
        if plan.hot_bytes:
            self.hisparse = HiSparse(config, rows, max_seq_len, plan.hot_bytes // slot_bytes(config), device)
            self.decode: V4Cache = HiSparseCache(config, self.hisparse, device, self.entry_pages)
        else:
            self.decode = V4Cache(config, rows, max_seq_len, device, self.entry_pages)
        self.staging = [V4Cache(config, 1, max_seq_len, device, self.entry_pages) for _ in range(plan.prefill_rows)]
        self.store = self._new_store() if prefix_cache else None

    def _new_store(self) -> PrefixStore:
        return PrefixStore(self.config, self.chunk, self.pages, self.plan.tails, self.device,
                           host_c4=self.hisparse is not None, c4_tokens=(self.plan.pages - 1) * PAGE_TOKENS)

    def drop_prefixes(self) -> None:
        """Forgets every cached prefix (after a weight update: the old weights computed their KV); pages that
        running requests hold stay theirs."""
        if self.store is not None:
            self.pages.free(sorted(self.store.tree.held(self.pages.name)))
            self.store = self._new_store()

    def check_fits(self, tokens: int) -> None:
        """Raises RequestError when a sequence of ``tokens`` tokens needs more entry pages than the engine has."""
        need = pages_for(tokens)
        if need > self.pages.capacity:
            raise RequestError(f"a sequence of {tokens} tokens needs {need} entry pages of {PAGE_TOKENS} tokens; "
                               f"the memory budget pays for {self.pages.capacity}")

    def check_tokens_per_step(self, tokens: int) -> None:
        """Raises ValueError when HiSparse's hot buffer cannot hold a decode step of ``tokens`` tokens per row
        (MTP speculation takes two)."""
        if self.hisparse is not None:
            self.hisparse.check_capacity(self.hisparse.hot_entries, self.decode.batch_size, tokens_per_step=tokens)

    def begin_prefill(self, slot: int, prompt: list[int], restore: bool, tokens: int) -> Hit | None:
        """Prepares staging row ``slot`` for ``prompt`` (a sequence of at most ``tokens`` tokens): with ``restore``
        and a prefix cache, the deepest cached prefix it can resume from (its pages mapped, its tail copied in), and
        fresh pages for the rest. What was found, its ``pages`` now every page of the sequence (the caller's to
        ``release``); None, holding nothing, when the free pages (after evicting cached prefixes) are too few."""
        staging = self.staging[slot]
        staging.reset()
        hit = self.store.restore(prompt, staging) if self.store is not None and restore else Hit(0, 0)
        need = pages_for(tokens) - len(hit.pages)
        fresh = self.store.take_pages(need) if self.store is not None else \
            self.pages.alloc(need) if self.pages.free_count >= need else None
        if fresh is None:
            self.release(hit.pages)
            return None
        self.entry_pages.zero(fresh)
        hit.pages += fresh
        self._assign(staging, 0, hit.pages)
        return hit

    def save_prefix(self, prompt: list[int], stop: int, slot: int, pages: list[int], fork: int = 0) -> None:
        """Caches ``prompt[:stop]``, whose state staging row ``slot`` (on ``pages``) holds after a prefill piece,
        when ``stop`` is the prompt's deepest chunk boundary, a ``tail_every`` checkpoint or ``fork``: where the
        prompt left a cached path without a tail there (the next prompt taking that path resumes there too)."""
        boundary = len(prompt) // self.chunk * self.chunk
        checkpoint = self.tail_every and stop % self.chunk == 0 and (stop // self.chunk) % self.tail_every == 0
        if self.store is not None and 0 < stop <= boundary and (stop in (boundary, fork) or checkpoint):
            self.store.save(prompt[:stop], self.staging[slot], pages)

    def to_decode(self, row: int, slot: int) -> None:
        """Moves a prefilled sequence from staging row ``slot`` into decode row ``row`` (its page table, not its
        entries; window rings and states are copied)."""
        self.decode.copy_row(row, self.staging[slot], 0)
        self._assign(self.staging[slot], 0, [])

    def move_rows(self, moves: list[tuple[int, int]], live: int) -> None:
        """Applies decode row moves (destination, source), in order, then points rows ``live..`` at the null page
        (a padding row must not write into pages a live row now owns)."""
        for dst, src in moves:
            self.decode.copy_row(dst, self.decode, src)
        assert self.decode.table is not None
        self.decode.table[live:] = 0

    def release(self, pages: list[int]) -> None:
        """Drops a finished sequence's references to its pages."""
        self.pages.free(pages)

    def decode_rows(self, bucket: int) -> V4Cache:
        """Decode rows ``0..bucket-1``, sharing storage (a decode step's cache)."""
        return self.decode.rows(0, bucket)

    def stats(self) -> dict[str, object]:
        """Entry pages (capacity, used, free, bytes), prefix-cache pools and tree statistics (none without a prefix
        cache) and, with HiSparse, its statistics under "hisparse" (reading them syncs the device)."""
        out: dict[str, object] = {"pages": self.pages_stats()}
        if self.store is not None:
            out.update(self.store.stats())
        if self.hisparse is not None:
            out["hisparse"] = self.hisparse.stats()
        return out

    def pages_stats(self) -> dict[str, int]:
        """Capacity, used and free entry pages, and bytes of one page."""
        return {"capacity": self.pages.capacity, "used": self.pages.used_count, "free": self.pages.free_count,
                "page_bytes": self.pages.bytes_per_slot, "page_tokens": PAGE_TOKENS}

    @staticmethod
    def _assign(cache: V4Cache, row: int, pages: list[int]) -> None:
        """Row ``row`` of ``cache``'s page table: ``pages`` in token order, then the null page."""
        assert cache.table is not None
        table = torch.zeros(cache.table.shape[1], dtype=torch.long)
        table[: len(pages)] = torch.tensor(pages, dtype=torch.long)
        cache.table[row] = table.to(cache.table.device)
