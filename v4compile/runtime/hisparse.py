"""HiSparse: the C4 layers' compressed KV entries in a host tier, with one device hot buffer shared by every
sequence and every C4 layer, filled each decode step with exactly the entries the indexer chose.

Why: at long context the C4 entries are most of a sequence's KV, yet a decode step reads only the indexer's
top-k of them per layer. With every entry in host memory (pinned on a GPU machine) and only a hot set on the
device, one device budget holds several times more sequences.

One decode step, per C4 layer (``HiSparse.lookup``, reached through the layer cache's ``sparse_entries``
hook once the indexer has chosen), all of it device work on fixed-size tensors (no host sync, so a step can
be captured in a CUDA graph):

1. If a token of this step closed a block, the compressor left the new entry in a one-entry device store; it
   is backed up to the host tier (on a side stream on CUDA) and written into the hot buffer.
2. The chosen ids become keys (C4 layer, host row, entry); a device slot map key -> hot slot tells which are
   resident. The wanted keys (a fixed-capacity list of B x (S x K + 1) lanes) are deduplicated by sorting;
   misses take the least recently used hot slots (a device clock stamps every slot a call touches, and
   slots stamped by this call are never victims), evicted keys leave the slot map, and the missing entries
   are copied in from the host tier.
3. Attention reads the chosen entries gathered out of the hot buffer, [B, S x K, d], at indices 0..S x K-1:
   the same values in the same order as from a fully resident store, so outputs are bit for bit those
   without HiSparse.

Lower bound: one call must hold one layer's working set, B x (S x K + 1) entries (the new entry need not be
among the chosen). Layers take turns with the whole buffer because each call gathers its entries out before
the next layer runs, so the bound does not grow with the number of C4 layers.

Each decode row of the cache maps to a host row; moving a sequence to another decode row (the engine's
compaction) swaps the two rows' host rows instead of copying entries, so its hot entries stay valid. On
CUDA the host tier is read and written in place through its unified address by a small Triton kernel that
skips lanes without work, so only missing and new entries cross the bus; on CPU both tiers are host memory
and the same steps run with a torch copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ..model.cache import CompressorCache, LayerCache, V4Cache, compressor_cache
from ..model.config import V4Config
from ..model.pages import EntryPages

COUNTERS = ("lookups", "hits", "fetched", "backed_up", "calls")
"""Device counters: chosen entries looked up, those already on the device (resident, or new this step),
entries copied in from the host tier, new entries backed up to it, and lookup calls (one per C4 layer and
step)."""


def slot_bytes(config: V4Config) -> int:
    """Device bytes of one hot slot: the bf16 entry, its owner key (int64) and its LRU stamp (int32)."""
    return 2 * config.head_dim + 8 + 4


def min_hot_entries(batch: int, topk: int, tokens_per_step: int = 1) -> int:
    """The smallest hot buffer that one lookup call fits: every row's chosen entries plus its new entry."""
    return batch * (tokens_per_step * topk + 1)


def device_row_bytes(config: V4Config, max_seq_len: int) -> int:
    """Device bytes of one decode row under HiSparse, entry pages apart: a row on pages without C4 main entries
    (window rings, states, page table) with a one-entry new-entry store per C4 layer, plus its part of the slot
    map (int32 per entry)."""
    n_c4, entries = sum(r == 4 for r in config.layer_ratios), max_seq_len // 4
    row = V4Cache(config, 1, max_seq_len, "meta", EntryPages(config, 2, "meta", c4_main=False)).nbytes()
    return row - n_c4 * (entries - 1) * config.head_dim * 2 + n_c4 * entries * 4


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (2-byte elements) as a tensor on ``device``: itself on CPU; on CUDA a zero-copy view of the
    pinned memory through its unified address (kernels reading it pull the bytes over the bus). Where torch
    refuses the view, ``host`` itself: the row-copy kernel reaches pinned memory through the same address."""
    if device.type != "cuda":
        return host
    if not host.is_pinned():
        raise ValueError("the host tier must be pinned memory to be read from the GPU")

    class Interface:
        __cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i2", "version": 2,
                                    "data": (host.data_ptr(), False), "strides": None}

    try:
        with torch.cuda.device(device):
            return torch.as_tensor(Interface(), device=device).view(host.dtype)
    except (RuntimeError, TypeError, ValueError):
        return host


@triton.jit
def _copy_rows_kernel(dst, dst_rows, src, src_rows, lanes, width, BLOCK_LANES: tl.constexpr,
                      BLOCK_W: tl.constexpr):
    # lanes whose destination row is -1 issue no load or store: their bytes never cross the bus
    lane = tl.program_id(0) * BLOCK_LANES + tl.arange(0, BLOCK_LANES)
    inside = lane < lanes
    to = tl.load(dst_rows + lane, mask=inside, other=-1)
    frm = tl.load(src_rows + lane, mask=inside, other=0)
    live = to >= 0
    for c0 in range(0, width, BLOCK_W):
        col = c0 + tl.arange(0, BLOCK_W)
        mask = live[:, None] & (col < width)[None, :]
        values = tl.load(src + frm[:, None] * width + col[None, :], mask=mask)
        tl.store(dst + to[:, None] * width + col[None, :], values, mask=mask)


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor,
              kernel: bool | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every lane i with ``dst_rows[i] >= 0`` (2-D row-major
    tensors of one 2-byte dtype, int64 row ids). The Triton kernel (default when either side is on CUDA)
    touches no memory for skipped lanes and needs no host sync; the torch form (default elsewhere) is its
    reference."""
    if kernel is None:
        kernel = dst.is_cuda or src.is_cuda
    if not kernel:
        live = dst_rows >= 0
        dst[dst_rows[live]] = src[src_rows[live]]
        return
    lanes, width = dst_rows.numel(), dst.shape[1]
    block_w = triton.next_power_of_2(min(width, 512))
    grid = (triton.cdiv(lanes, 4),)
    _copy_rows_kernel[grid](dst.view(torch.int16), dst_rows, src.view(torch.int16), src_rows, lanes, width,
                            BLOCK_LANES=4, BLOCK_W=block_w)


class HiSparse:
    """Host tier, hot buffer and their device-side maps for ``rows`` decode rows of ``config``'s C4 layers at
    up to ``max_seq_len`` tokens, with ``hot_entries`` hot slots. ``tokens_per_step``: tokens per row in one
    decode call (2 with MTP speculation), for the lower-bound check. ``timing`` (CUDA, eager calls only)
    records events to split lookup time into exposed (main stream) and hidden (side stream)."""

    def __init__(self, config: V4Config, rows: int, max_seq_len: int, hot_entries: int,
                 device: torch.device | str, *, tokens_per_step: int = 1, timing: bool = False) -> None:
        device = torch.device(device)
        self.layers = [i for i, r in enumerate(config.layer_ratios) if r == 4]
        if not self.layers:
            raise ValueError("HiSparse needs a model with C4 layers (compress ratio 4)")
        self.rows, self.entries, self.width = rows, max_seq_len // 4, config.head_dim
        self.max_seq_len = max_seq_len
        self.topk = min(config.index_topk, self.entries)
        self.check_capacity(hot_entries, rows, tokens_per_step)
        self.hot_entries = hot_entries
        self.trash_key = len(self.layers) * rows * self.entries
        self.host = torch.zeros(self.trash_key, self.width, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
        self.host_view = device_view(self.host, device)
        self.hot = torch.zeros(hot_entries + 1, self.width, dtype=torch.bfloat16, device=device)
        self.slot_map = torch.full((self.trash_key + 1,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((hot_entries + 1,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.zeros(hot_entries + 1, dtype=torch.int32, device=device)
        self.clock = torch.zeros((), dtype=torch.int32, device=device)
        self.row_of = torch.arange(rows, device=device)
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        self.lanes = torch.arange(rows, device=device)
        self._host_rows = list(range(rows))
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.timing = timing and device.type == "cuda"
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def check_capacity(self, hot_entries: int, batch: int, tokens_per_step: int) -> None:
        """Raises ValueError when ``hot_entries`` cannot hold one call's working set (a configuration error:
        no step could run)."""
        need = min_hot_entries(batch, self.topk, tokens_per_step)
        if hot_entries < need:
            raise ValueError(f"HiSparse hot buffer of {hot_entries} entries is smaller than one decode step's "
                             f"working set: {batch} rows x ({tokens_per_step} token(s) x index_topk {self.topk} "
                             f"+ 1 new entry) = {need} entries; give it at least {need} entries or fewer rows")

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tier."""
        return self.host.nbytes

    @property
    def device_bytes(self) -> int:
        """Device bytes HiSparse holds beyond the cache rows: hot buffer, slot map, owners and stamps."""
        return sum(t.nbytes for t in (self.hot, self.slot_map, self.owner, self.stamp))

    # ------------------------------------------------------------------ the decode step
    def lookup(self, layer: int, first_row: int, chosen: torch.Tensor, positions: torch.Tensor,
               new_entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For C4 layer ``layer`` (0-based among C4 layers) and decode rows ``first_row..``: makes the
        ``chosen`` entries [B, S, K] resident, stores this step's new entries (``new_entries`` [B, 1, d], the
        compressor's one-entry store), and returns the chosen entries gathered [B, S*K, d] with their
        indices [B, S, K] (-1 kept), for ``sparse_entries``."""
        bsz, steps, k = chosen.shape
        if steps > 4:
            raise ValueError(f"HiSparse takes at most 4 tokens per row and step, got {steps}")
        # guard_or_false: a compiled decode's batch is unbacked (no guard can be made on it; a graph break there
        # would lose it), so there the check is the engine's, made once for its largest bucket
        if guard_or_false(bsz * (steps * k + 1) > self.hot_entries):
            self.check_capacity(self.hot_entries, bsz, steps)
        timed = self.timing and not torch.cuda.is_current_stream_capturing()
        start = self._event() if timed else None
        self._backup(layer, first_row, positions, steps, new_entries, timed)
        base, new_id, emitted = self._new_entry(layer, first_row, positions, steps)
        new_key = torch.where(emitted, base + new_id, self.trash_key)
        valid = chosen >= 0
        keys = torch.where(valid, base.view(-1, 1, 1) + chosen, self.trash_key)
        fresh = emitted.view(-1, 1, 1) & (chosen == new_id.view(-1, 1, 1))
        hits = valid & ((self.slot_map[keys] >= 0) | fresh)
        fetched = self._admit(keys.flatten(), new_key, emitted)
        slots = torch.where(emitted, self.slot_map[new_key].long(), self.hot_entries)
        self.hot[slots] = new_entries[:, 0]
        slots = torch.where(valid, self.slot_map[keys].long(), self.hot_entries)
        gathered = self.hot[slots.view(bsz, steps * k)]
        ids = torch.where(valid, torch.arange(steps * k, device=chosen.device).view(1, steps, k), -1)
        self.counters += torch.stack((valid.sum(), hits.sum(), fetched, emitted.sum(), self.counters.new_ones(())))
        if start is not None:
            self._events.append(("exposed", start, self._event()))
        if self.side is not None and layer == len(self.layers) - 1:
            torch.cuda.current_stream().wait_stream(self.side)
        return gathered, ids

    def _new_entry(self, layer: int, first_row: int, positions: torch.Tensor,
                   steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the first key of its host row in ``layer``, the id of the entry its ``steps`` tokens from
        ``positions`` closed, and whether they closed one (token t closes entry t // 4 when t % 4 == 3)."""
        base = (layer * self.rows + self.row_of[first_row : first_row + positions.shape[0]]) * self.entries
        closing = positions + torch.remainder(3 - positions, 4)
        return base, closing // 4, closing < positions + steps

    def _backup(self, layer: int, first_row: int, positions: torch.Tensor, steps: int, new_entries: torch.Tensor,
                timed: bool) -> None:
        """Writes this step's new entries to the host tier. On CUDA on the side stream, from tensors that outlive
        the step (so nothing the main stream frees is read there late), joined after the last C4 layer's call."""
        if self.side is None:
            base, new_id, emitted = self._new_entry(layer, first_row, positions, steps)
            copy_rows(self.host_view, torch.where(emitted, base + new_id, -1), new_entries[:, 0],
                      self.lanes[: positions.shape[0]])
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            start = self._event() if timed else None
            base, new_id, emitted = self._new_entry(layer, first_row, positions, steps)
            copy_rows(self.host_view, torch.where(emitted, base + new_id, -1), new_entries[:, 0],
                      self.lanes[: positions.shape[0]])
            if start is not None:
                self._events.append(("hidden", start, self._event()))

    def _admit(self, keys: torch.Tensor, new_key: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
        """Makes every wanted key resident (the chosen ``keys`` and this step's ``new_key`` per row; trash
        keys stand for none): LRU victims, slot-map updates, copies from the host tier for misses other than
        new entries. Returns the number of entries copied in (a device scalar)."""
        hot, trash = self.hot_entries, self.trash_key
        is_new = torch.cat((torch.zeros_like(keys, dtype=torch.bool), emitted))
        ordered = (torch.cat((keys, new_key)) * 2 + (~is_new).long()).sort().values  # new entries first per key
        key = ordered // 2
        fresh = ordered % 2 == 0
        first = torch.cat((key.new_ones(1, dtype=torch.bool), key[1:] != key[:-1]))
        live = first & (key != trash)
        slot = self.slot_map[key].long()
        hit, miss = live & (slot >= 0), live & (slot < 0)
        self.clock += 1
        self.stamp[torch.where(hit, slot, hot)] = self.clock
        lru = self.stamp[:hot].argsort(stable=True)
        victim = torch.where(miss, lru[(miss.cumsum(0) - 1).clamp(min=0)], hot)
        evicted = self.owner[victim]
        self.slot_map.index_fill_(0, torch.where(miss & (evicted >= 0), evicted, trash), -1)  # no host copy
        self.owner[victim] = torch.where(miss, key, -1)
        self.slot_map[torch.where(miss, key, trash)] = victim.int()
        self.stamp[victim] = self.clock
        fetch = miss & ~fresh
        copy_rows(self.hot, torch.where(fetch, victim, -1), self.host_view, key)
        return fetch.sum()

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # ------------------------------------------------------------------ rows (admission time, not the hot path)
    def store_row(self, row: int, layer: int, entries: torch.Tensor) -> None:
        """Copies a prefilled sequence's entries [N, d] of C4 layer ``layer`` into decode row ``row``'s host
        row (call ``invalidate`` for the row first)."""
        start = (layer * self.rows + self._host_rows[row]) * self.entries
        self.host[start : start + entries.shape[0]].copy_(entries)

    def invalidate(self, rows: list[int]) -> None:
        """Forgets the hot entries of decode ``rows`` (a new sequence starts there); their slots go first."""
        for row in rows:
            host_row = self._host_rows[row]
            for layer in range(len(self.layers)):
                start = (layer * self.rows + host_row) * self.entries
                self.slot_map[start : start + self.entries] = -1
            mine = (self.owner >= 0) & (self.owner // self.entries % self.rows == host_row)
            self.owner.masked_fill_(mine, -1)
            self.stamp.masked_fill_(mine, 0)

    def swap_rows(self, a: int, b: int) -> None:
        """Exchanges the host rows of decode rows ``a`` and ``b`` (a sequence moving between rows keeps its
        entries and hot slots)."""
        self._host_rows[a], self._host_rows[b] = self._host_rows[b], self._host_rows[a]
        self.row_of.copy_(torch.tensor(self._host_rows))

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, float]:
        """Hot-buffer hit rate, entries and bytes moved (per step too), tier sizes, and with ``timing`` the
        lookup milliseconds on the main stream (exposed) and on the side stream (hidden). Syncs the device."""
        counts = dict(zip(COUNTERS, self.counters.tolist(), strict=True))
        steps = counts["calls"] // len(self.layers)
        moved = (counts["fetched"] + counts["backed_up"]) * self.width * 2
        out: dict[str, float] = {**counts, "steps": steps,
                                 "hit_rate": counts["hits"] / counts["lookups"] if counts["lookups"] else 1.0,
                                 "bytes_in": counts["fetched"] * self.width * 2,
                                 "bytes_out": counts["backed_up"] * self.width * 2,
                                 "bytes_per_step": moved / steps if steps else 0.0,
                                 "hot_entries": self.hot_entries, "host_bytes": self.host_bytes,
                                 "device_bytes": self.device_bytes, "zero_copy_view": self.host_view.is_cuda}
        if self._events:
            torch.cuda.synchronize()
            for kind in ("exposed", "hidden"):
                out[f"{kind}_ms"] = sum(a.elapsed_time(b) for k, a, b in self._events if k == kind)
        return out

    def reset_stats(self) -> None:
        """Zeroes the counters and drops recorded timings."""
        self.counters.zero_()
        self._events.clear()


class HotLayerCache(LayerCache):
    """A C4 layer's cache under HiSparse: window ring, indexer keys and compressor states on the device as
    usual, the compressor's entries a one-entry store per row (the compressor writes entry j at index
    min(j, N-1) = 0), and the entries themselves in ``hisparse``'s tiers as its C4 layer ``c4_layer``."""

    def __init__(self, window: torch.Tensor, compressor: CompressorCache, indexer: CompressorCache,
                 hisparse: HiSparse, c4_layer: int, first_row: int = 0) -> None:
        super().__init__(window, compressor, indexer)
        self.hisparse, self.c4_layer, self.first_row = hisparse, c4_layer, first_row

    def rows(self, start: int, stop: int) -> HotLayerCache:
        """Batch rows ``start..stop-1``, sharing storage and tiers."""
        assert self.compressor is not None and self.indexer is not None
        return HotLayerCache(self.window[start:stop], self.compressor.rows(start, stop), self.indexer.rows(start, stop),
                             self.hisparse, self.c4_layer, self.first_row + start)

    def copy_row(self, dst_row: int, src: LayerCache, src_row: int) -> None:
        """Copies a sequence's layer state; its entries go to the host tier unless ``src`` is under HiSparse
        too (a row move, whose host rows the cache swaps)."""
        if isinstance(src, HotLayerCache):
            super().copy_row(dst_row, src, src_row)
            return
        assert self.compressor is not None and self.indexer is not None
        assert src.compressor is not None and src.indexer is not None
        self.window[dst_row] = src.window[src_row]
        self.indexer.copy_row(dst_row, src.indexer, src_row)
        self.compressor.copy_row(dst_row, src.compressor, src_row, entries=False)
        self.hisparse.store_row(self.first_row + dst_row, self.c4_layer,
                                src.compressor.rows(src_row, src_row + 1).read()[0])

    def sparse_entries(self, chosen: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen entries brought into the hot buffer and gathered (see ``HiSparse.lookup``)."""
        assert self.compressor is not None
        return self.hisparse.lookup(self.c4_layer, self.first_row, chosen, positions,
                                    self.compressor.read(chosen.shape[0]))


class HiSparseCache(V4Cache):
    """The engine's decode cache with HiSparse: ``hisparse.rows`` rows whose C4 main entries live in
    ``hisparse``'s host tier and hot buffer; everything else as in ``V4Cache``. ``copy_row`` and ``reset``
    act on the whole cache (not on a ``rows`` view)."""

    def __init__(self, config: V4Config, hisparse: HiSparse, device: torch.device | str | None = None,
                 pages: EntryPages | None = None) -> None:
        self.hisparse = hisparse
        super().__init__(config, hisparse.rows, hisparse.max_seq_len, device, pages)

    def new_layer(self, config: V4Config, index: int, device: torch.device | None) -> LayerCache:
        """C4 layers get a ``HotLayerCache``; the others are as in ``V4Cache``."""
        if config.layer_ratios[index] != 4:
            return super().new_layer(config, index, device)
        window = torch.zeros(self.batch_size, config.window_size, config.head_dim, dtype=torch.bfloat16, device=device)
        return HotLayerCache(window, compressor_cache(self.batch_size, 4, 4, config.head_dim, device),
                             self.new_compressor(index, "indexer", 4, config.index_head_dim, device),
                             self.hisparse, self.hisparse.layers.index(index))

    def copy_row(self, dst_row: int, src: V4Cache, src_row: int) -> None:
        """A row move inside this cache swaps host rows; a row from another cache (a prefilled staging row)
        replaces the destination's sequence, its entries going to the host tier."""
        if src is self:
            self.hisparse.swap_rows(dst_row, src_row)
        else:
            self.hisparse.invalidate([dst_row])
        super().copy_row(dst_row, src, src_row)

    def reset(self, rows: list[int] | None = None) -> None:
        """Clears rows (all when None) and forgets their hot entries."""
        self.hisparse.invalidate(list(range(self.batch_size)) if rows is None else rows)
        super().reset(rows)
