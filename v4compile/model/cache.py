"""Decode caches: plain tensors addressed by index tensors, owned by one object the caller passes in.
A cache built on ``EntryPages`` (``pages.py``, the serving engine's pools) keeps its compressed entries on shared
pages addressed through a page table (``CompressorCache``).

Per layer: the sliding-window ring (``window`` slots, slot = position mod window), the compressed
entries of the main compressor, and for C4 layers the indexer keys; per compressor its incremental
state (fp32 kv and score rows of the block in progress, and for the overlapping C4 compressor the
previous block too). Batch row b is one sequence; positions are per row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import V4Config

if TYPE_CHECKING:
    from .pages import EntryPages


PAGE_TOKENS = 128
"""Tokens per page of compressed entries: 32 C4 entries or indexer keys, one C128 entry (a C128 block, and the
prefix cache's default granule, so a cached prefix is whole pages)."""


@dataclass
class CompressorCache:
    """Emitted entries plus the fp32 state of the open block.

    On shared pages (``table`` given): ``pool`` [pages, PAGE_TOKENS // ratio, width] holds the entries of every
    row, of other caches and of cached prefixes, and ``table`` [B, pages per row] lists row b's pages in token
    order, so entry j of row b is ``pool[table[b, j // E], j % E]``; the pages belong to whoever assigns tables
    (the serving engine; page 0 is the null page unassigned slots name), so row copies move table entries, not
    entries. Without a table the cache owns its entries, ``pool`` [B, max_seq_len // ratio, width] indexed by row,
    and copies contents."""

    pool: torch.Tensor
    kv_state: torch.Tensor
    score_state: torch.Tensor
    table: torch.Tensor | None = None

    @property
    def shared(self) -> bool:
        """Whether the entries live on shared pages, addressed through ``table``."""
        return self.table is not None

    @property
    def capacity(self) -> int:
        """Entries a row can hold."""
        return self.pool.shape[1] * (self.table.shape[1] if self.table is not None else 1)

    def read(self, rows: int | None = None) -> torch.Tensor:
        """Every entry slot of the first ``rows`` rows (all when None) in entry order, [rows, capacity, width]: what
        attention and the indexer read (on shared pages a gathered copy, else a view)."""
        if self.table is None:
            return self.pool if rows is None else self.pool[:rows]
        table = self.table if rows is None else self.table[:rows]
        return self.pool[table].flatten(1, 2)

    def locate(self, rows: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where entries ``index`` of batch ``rows`` (broadcast against each other) live: ``pool[first, second]``."""
        if self.table is None:
            return rows, index
        per_page = self.pool.shape[1]
        return self.table[rows, index // per_page], index % per_page

    def write(self, rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
        """Stores ``values`` [..., width] as entries ``index`` of batch ``rows`` (broadcast against each other)."""
        self.pool[self.locate(rows, index)] = values

    def write_range(self, first: int, values: torch.Tensor) -> None:
        """Stores ``values`` [B, n, width] as entries ``first..first+n-1`` of rows ``0..B-1``."""
        bsz, n = values.shape[:2]
        rows = torch.arange(bsz, device=values.device).unsqueeze(1)
        self.write(rows, first + torch.arange(n, device=values.device), values)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Clears the given batch rows (a new sequence starts there): their entries too unless on shared pages."""
        if self.table is None:
            self.pool[rows] = 0
        self.kv_state[rows] = 0
        self.score_state[rows] = float("-inf")

    def rows(self, start: int, stop: int) -> CompressorCache:
        """Batch rows ``start..stop-1``, sharing storage."""
        if self.table is None:
            return CompressorCache(self.pool[start:stop], self.kv_state[start:stop], self.score_state[start:stop])
        return CompressorCache(self.pool, self.kv_state[start:stop], self.score_state[start:stop],
                               self.table[start:stop])

    def copy_row(self, dst_row: int, src: CompressorCache, src_row: int, entries: bool = True) -> None:
        """Copies one sequence's state (and its entries unless ``entries`` is False) from ``src`` row ``src_row``.
        Between caches on the same shared pages the entries stay where they are: the cache's page table, which
        every layer shares, moves once (``V4Cache.copy_row``; the caller moves the pages' ownership)."""
        if entries and not (self.table is not None and src.table is not None and self.pool is src.pool):
            values = src.rows(src_row, src_row + 1).read()[0, : self.capacity]
            index = torch.arange(values.shape[0], device=self.pool.device)
            self.write(torch.tensor(dst_row, device=self.pool.device), index, values)
        self.kv_state[dst_row] = src.kv_state[src_row]
        self.score_state[dst_row] = src.score_state[src_row]


@dataclass
class LayerCache:
    """One attention layer's cache: the window ring and, if the layer compresses, its compressors."""

    window: torch.Tensor
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Clears the given batch rows."""
        self.window[rows] = 0
        for c in (self.compressor, self.indexer):
            if c is not None:
                c.reset_rows(rows)

    def rows(self, start: int, stop: int) -> LayerCache:
        """Batch rows ``start..stop-1``, sharing storage (writes go through)."""
        return LayerCache(self.window[start:stop], *(None if c is None else c.rows(start, stop)
                                                     for c in (self.compressor, self.indexer)))

    def copy_row(self, dst_row: int, src: LayerCache, src_row: int) -> None:
        """Copies one sequence's state of this layer from ``src`` row ``src_row`` into row ``dst_row``."""
        self.window[dst_row] = src.window[src_row]
        for a, b in ((self.compressor, src.compressor), (self.indexer, src.indexer)):
            if a is not None and b is not None:
                a.copy_row(dst_row, b, src_row)

    def sparse_entries(self, chosen: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a C4 layer's decode attention reads for the indexer's ``chosen`` entry ids [B, S, K] (S tokens
        per row from ``positions`` [B]; -1 = none): compressed entries [B, N', d] and the chosen ids as indices
        into them. Every entry is resident in this cache, so that is the entry store with the ids unchanged; a
        cache keeping entries elsewhere (HiSparse's host tier) brings the chosen ones in instead."""
        return self.compressor.read(chosen.shape[0]), chosen


def compressor_cache(
    batch: int, max_seq_len: int, ratio: int, width: int, device: torch.device | None
) -> CompressorCache:
    """A cleared compressor cache owning its entries (``max_seq_len // ratio`` per row) and the fp32 open-block
    state."""
    pool = torch.zeros(batch, max_seq_len // ratio, width, dtype=torch.bfloat16, device=device)
    return CompressorCache(pool, *_open_block(batch, ratio, width, device))


def paged_compressor_cache(pool: torch.Tensor, table: torch.Tensor, ratio: int) -> CompressorCache:
    """A cleared compressor cache on shared pages ``pool`` with the cache's page ``table`` [B, pages]."""
    return CompressorCache(pool, *_open_block(table.shape[0], ratio, pool.shape[-1], pool.device), table=table)


def _open_block(batch: int, ratio: int, width: int, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cleared fp32 open-block state (kv 0, score -inf): the block's rows, and for C4 the previous block's too."""
    c = 2 if ratio == 4 else 1
    return (torch.zeros(batch, c * ratio, c * width, dtype=torch.float32, device=device),
            torch.full((batch, c * ratio, c * width), float("-inf"), dtype=torch.float32, device=device))


class V4Cache:
    """All layer caches of one model for ``batch_size`` sequences of at most ``max_seq_len`` tokens.

    With ``pages`` (shared ``EntryPages``) the compressed entries it has pools for live there, addressed through
    one page ``table`` [batch_size, pages of max_seq_len tokens] for every layer, all null (page 0) until the
    owner of the pages assigns them; without, the cache owns its entries, row by row."""

    def __init__(self, config: V4Config, batch_size: int, max_seq_len: int | None = None,
                 device: torch.device | str | None = None, pages: EntryPages | None = None) -> None:
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len or config.max_seq_len
        device = torch.device(device) if device is not None else None
        self.pages = pages
        self.table: torch.Tensor | None = None
        if pages is not None:
            self.table = torch.zeros(batch_size, -(-self.max_seq_len // PAGE_TOKENS), dtype=torch.long, device=device)
        self.layers = [self.new_layer(config, i, device) for i in range(config.n_layers)]
        self.mtp: list[LayerCache] = [
            LayerCache(torch.zeros(batch_size, config.window_size, config.head_dim, dtype=torch.bfloat16,
                                   device=device)) for _ in range(config.n_mtp_layers)]
        """Window rings of the (window-only) MTP blocks, for drafting in speculative decoding."""

    def new_layer(self, config: V4Config, index: int, device: torch.device | None) -> LayerCache:
        """The cleared cache of main layer ``index`` (a subclass may keep some of it elsewhere)."""
        ratio = config.layer_ratios[index]
        window = torch.zeros(self.batch_size, config.window_size, config.head_dim, dtype=torch.bfloat16, device=device)
        layer = LayerCache(window=window)
        if ratio:
            layer.compressor = self.new_compressor(index, "compressor", ratio, config.head_dim, device)
        if ratio == 4:
            layer.indexer = self.new_compressor(index, "indexer", ratio, config.index_head_dim, device)
        return layer

    def new_compressor(self, index: int, kind: str, ratio: int, width: int,
                       device: torch.device | None) -> CompressorCache:
        """Main layer ``index``'s ``kind`` ("compressor" or "indexer") cache: on the shared pages where they hold
        a pool for it, else owning its entries."""
        pool = self.pages.pools.get((index, kind)) if self.pages is not None else None
        if pool is None:
            return compressor_cache(self.batch_size, self.max_seq_len, ratio, width, device)
        assert self.table is not None
        return paged_compressor_cache(pool, self.table, ratio)

    @property
    def all_layers(self) -> list[LayerCache]:
        """The main layers' caches, then the MTP blocks'."""
        return self.layers + self.mtp

    def reset(self, rows: list[int] | None = None) -> None:
        """Clears the given batch rows (all when None) so new sequences can start there."""
        if rows is None:
            self._clear()
            return
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.all_layers:
            layer.reset_rows(index.to(layer.window.device))

    def _clear(self) -> None:
        """Every row cleared as ``reset_rows`` clears one, in two multi-tensor launches rather than a few per layer
        (a prefix hit clears its staging row first: 43 layers on V4-Flash)."""
        zeros, scores = [], []
        for layer in self.all_layers:
            zeros.append(layer.window)
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    zeros += [c.kv_state] if c.shared else [c.pool, c.kv_state]
                    scores.append(c.score_state)
        torch._foreach_zero_(zeros + scores)
        if scores:
            torch._foreach_add_(scores, float("-inf"))  # a cleared score is -inf

    def rows(self, start: int, stop: int) -> V4Cache:
        """A cache over batch rows ``start..stop-1`` that shares storage with this one (writes go through)."""
        view = copy.copy(self)
        view.batch_size = stop - start
        view.table = None if self.table is None else self.table[start:stop]
        view.layers = [layer.rows(start, stop) for layer in self.layers]
        view.mtp = [layer.rows(start, stop) for layer in self.mtp]
        return view

    def copy_row(self, dst_row: int, src: V4Cache, src_row: int) -> None:
        """Copies one sequence's whole state from ``src`` row ``src_row`` into row ``dst_row`` (on the same shared
        pages: its page table row, not its entries)."""
        if self.table is not None and src.table is not None and self.pages is src.pages:
            self.table[dst_row] = src.table[src_row]
        for mine, theirs in zip(self.all_layers, src.all_layers, strict=True):
            mine.copy_row(dst_row, theirs, src_row)

    def draft_checkpoint(self) -> list[tuple[CompressorCache, torch.Tensor, torch.Tensor]]:
        """What a rejected draft token can leave behind that the next real token does not overwrite: the
        previous-block rows of every overlapping (C4) compressor, which a block-closing draft shifts in.
        (Its ring slot, its open-block row and any entry it emitted are rewritten by the real token.)"""
        return [(c, c.kv_state[:, :4].clone(), c.score_state[:, :4].clone()) for layer in self.layers
                for c in (layer.compressor, layer.indexer) if c is not None and c.kv_state.shape[1] == 8]

    def rollback_draft(self, checkpoint: list[tuple[CompressorCache, torch.Tensor, torch.Tensor]],
                       rows: torch.Tensor, draft_positions: torch.Tensor) -> None:
        """Undoes the drafts at ``draft_positions`` [R] of batch ``rows`` [R] after ``draft_checkpoint``."""
        closing = rows[(draft_positions + 1) % 4 == 0]
        for c, kv_prev, score_prev in checkpoint:
            c.kv_state[closing, :4] = kv_prev[closing]
            c.score_state[closing, :4] = score_prev[closing]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this cache owns, layer by layer (window, then each compressor's pages unless shared, page
        table and state): what its rows cost, shared pages apart."""
        out = [] if self.table is None else [self.table]
        for layer in self.all_layers:
            out.append(layer.window)
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    out += [c.kv_state, c.score_state] if c.shared else [c.pool, c.kv_state, c.score_state]
        return out

    def nbytes(self) -> int:
        """Bytes held by every tensor this cache owns (shared pages not counted)."""
        return sum(t.nbytes for t in self.tensors())
