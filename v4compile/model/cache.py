"""Decode caches: plain tensors addressed by index tensors, owned by one object the caller passes in.

Per layer: the sliding-window ring (``window`` slots, slot = position mod window), the compressed
entries of the main compressor, and for C4 layers the indexer keys; per compressor its incremental
state (fp32 kv and score rows of the block in progress, and for the overlapping C4 compressor the
previous block too). Batch row b is one sequence; positions are per row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .config import V4Config


@dataclass
class CompressorCache:
    """Emitted entries ``[B, max_seq_len // ratio, width]`` plus the fp32 state of the open block."""

    entries: torch.Tensor
    kv_state: torch.Tensor
    score_state: torch.Tensor

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Clears the given batch rows (a new sequence starts there)."""
        self.entries[rows] = 0
        self.kv_state[rows] = 0
        self.score_state[rows] = float("-inf")

    def rows(self, start: int, stop: int) -> CompressorCache:
        """Batch rows ``start..stop-1``, sharing storage."""
        return CompressorCache(self.entries[start:stop], self.kv_state[start:stop], self.score_state[start:stop])

    def copy_row(self, dst_row: int, src: CompressorCache, src_row: int, entries: bool = True) -> None:
        """Copies one sequence's state (and its entries unless ``entries`` is False) from ``src`` row ``src_row``."""
        if entries:
            self.entries[dst_row] = src.entries[src_row]
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
        return self.compressor.entries[: chosen.shape[0]], chosen


def compressor_cache(
    batch: int, max_seq_len: int, ratio: int, width: int, device: torch.device | None
) -> CompressorCache:
    """A cleared compressor cache: ``max_seq_len // ratio`` entries per row and the fp32 open-block state."""
    c = 2 if ratio == 4 else 1
    return CompressorCache(
        entries=torch.zeros(batch, max_seq_len // ratio, width, dtype=torch.bfloat16, device=device),
        kv_state=torch.zeros(batch, c * ratio, c * width, dtype=torch.float32, device=device),
        score_state=torch.full((batch, c * ratio, c * width), float("-inf"), dtype=torch.float32, device=device),
    )


class V4Cache:
    """All layer caches of one model for ``batch_size`` sequences of at most ``max_seq_len`` tokens."""

    def __init__(self, config: V4Config, batch_size: int, max_seq_len: int | None = None,
                 device: torch.device | str | None = None) -> None:
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len or config.max_seq_len
        device = torch.device(device) if device is not None else None
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
            layer.compressor = compressor_cache(self.batch_size, self.max_seq_len, ratio, config.head_dim, device)
        if ratio == 4:
            layer.indexer = compressor_cache(self.batch_size, self.max_seq_len, ratio, config.index_head_dim, device)
        return layer

    @property
    def all_layers(self) -> list[LayerCache]:
        """The main layers' caches, then the MTP blocks'."""
        return self.layers + self.mtp

    def reset(self, rows: list[int] | None = None) -> None:
        """Clears the given batch rows (all when None) so new sequences can start there."""
        index = torch.arange(self.batch_size) if rows is None else torch.tensor(rows, dtype=torch.long)
        for layer in self.all_layers:
            layer.reset_rows(index.to(layer.window.device))

    def rows(self, start: int, stop: int) -> V4Cache:
        """A cache over batch rows ``start..stop-1`` that shares storage with this one (writes go through)."""
        view = copy.copy(self)
        view.batch_size = stop - start
        view.layers = [layer.rows(start, stop) for layer in self.layers]
        view.mtp = [layer.rows(start, stop) for layer in self.mtp]
        return view

    def copy_row(self, dst_row: int, src: V4Cache, src_row: int) -> None:
        """Copies one sequence's whole state from ``src`` row ``src_row`` into row ``dst_row``."""
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
        """Every cache tensor, layer by layer (window, then each compressor's entries and state): what two
        caches must agree on to hold the same sequences."""
        out = []
        for layer in self.all_layers:
            out.append(layer.window)
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    out += [c.entries, c.kv_state, c.score_state]
        return out

    def nbytes(self) -> int:
        """Bytes held by every cache tensor."""
        return sum(t.nbytes for t in self.tensors())
