"""The prefix cache's own pools: window tails and compressor-state snapshots (plus, under HiSparse, C4 main
entries in host memory), and the copies between them and a cache row. A cached prefix's other compressed entries
are not here: they stay on the engine's shared entry pages (``model/pages.py``), which a hit maps into the
request's page table without copying.

Pools and their bytes:

- ``window``: one token's window KV in every layer (bf16), kept only as tails of ``window`` tokens;
- ``state``: one snapshot of every C4 compressor's state (fp32): at a boundary (a multiple of 128) no block
  is open, and the next entry reads only the left half of the previous block's rows, so that is all a
  snapshot keeps; C128 compressors hold nothing there;
- ``c4`` (with ``host_c4``, HiSparse): one C4 main entry in every C4 layer, in host memory (pinned on a GPU
  machine), copied into the staging row's own C4 store on a hit: HiSparse keeps those entries off the pages.
"""

from __future__ import annotations

import torch

from ..model.cache import LayerCache, V4Cache
from ..model.config import V4Config
from .pools import PoolSet, SlotPool

TAIL_SHARE = 0.25
"""Fraction of the cache budget left after the rows spent on window tails (plus their state snapshots)."""


def _slot_bytes(config: V4Config) -> dict[str, int]:
    """Bytes of one slot of each device pool: a token's window KV in every layer, one state snapshot."""
    n_c4 = sum(r == 4 for r in config.layer_ratios)
    return {"window": len(config.layer_ratios) * config.head_dim * 2,
            "state": n_c4 * 4 * 4 * 2 * (config.head_dim + config.index_head_dim)}


def tail_bytes(config: V4Config) -> int:
    """Bytes of one window tail and its state snapshot."""
    sizes = _slot_bytes(config)
    return config.window_size * sizes["window"] + sizes["state"]


class PrefixPools:
    """Slot pools (``pools``) and a preallocated tensor per pool: ``tails`` window tails and state snapshots on
    ``device`` and, with ``host_c4``, host memory for ``c4_tokens`` tokens of C4 main entries."""

    def __init__(self, config: V4Config, tails: int, device: torch.device, host_c4: bool = False,
                 c4_tokens: int = 0) -> None:
        ratios = config.layer_ratios
        self.window, self.host_c4 = config.window_size, host_c4
        self.c4 = [i for i, r in enumerate(ratios) if r == 4]
        d, di, n = config.head_dim, config.index_head_dim, len(ratios)
        sizes = _slot_bytes(config)
        capacity = {"window": tails * self.window, "state": tails}
        if host_c4:
            sizes["c4"], capacity["c4"] = len(self.c4) * d * 2, c4_tokens // 4
        self.pools = PoolSet(SlotPool(name, capacity[name], sizes[name]) for name in sizes)
        self.window_kv = torch.zeros(n, capacity["window"], d, dtype=torch.bfloat16, device=device)
        self.c4_entries = torch.zeros(len(self.c4), capacity.get("c4", 0), d, dtype=torch.bfloat16,
                                      pin_memory=host_c4 and torch.device(device).type == "cuda")
        shape = (len(self.c4), tails, 4)
        self.states = {name: torch.zeros(*shape, w, dtype=torch.float32, device=device)
                       for name, w in (("kv", d), ("score", d), ("index_kv", di), ("index_score", di))}

    # ------------------------------------------------------------------ copy in
    def load(self, cache: V4Cache, end: int, tail: list[int], state: int, c4: list[int]) -> None:
        """Copies a cached prefix of ``end`` tokens into row 0 of ``cache``: its window tail from ``tail``, its
        compressor states from snapshot ``state`` and (host C4) its C4 main entries from slots ``c4``."""
        layers = cache.layers
        if self.host_c4:
            ids = self._ids(c4, self.c4_entries.device)
            for j, i in enumerate(self.c4):
                entries = self.c4_entries[j, ids].to(self.window_kv.device)
                layers[i].compressor.rows(0, 1).write_range(0, entries.unsqueeze(0))
        # one gather per pool for every layer, then one multi-tensor copy into the rings and states
        tails = self.window_kv[:, self._ids(tail)]
        into, values = [], []
        for i, layer in enumerate(layers):
            for ring, part in self._ring_runs(end):
                into.append(layer.window[0, ring])
                values.append(tails[i, part])
        for name, views in self._state_views(layers).items():
            into += views
            values += list(self.states[name][:, state].unbind(0))
        torch._foreach_copy_(into, values)

    # ------------------------------------------------------------------ copy out
    def store_c4(self, cache: V4Cache, known: int, end: int, c4: list[int]) -> None:
        """Copies row 0's C4 main entries of tokens ``known..end-1`` into host slots ``c4``."""
        ids = self._ids(c4, self.c4_entries.device)
        for j, i in enumerate(self.c4):
            entries = cache.layers[i].compressor.rows(0, 1).read()[0, known // 4 : end // 4]
            self.c4_entries[j, ids] = entries.to(self.c4_entries.device)

    def store_tail(self, cache: V4Cache, end: int, window: list[int], state: int) -> None:
        """Copies row 0's window tail ending at ``end`` into ``window`` slots and its C4 compressor states into
        snapshot ``state``."""
        layers = cache.layers
        rings = torch.stack([layer.window[0] for layer in layers])
        self.window_kv[:, self._ids(window)] = torch.cat([rings[:, ring] for ring, _ in self._ring_runs(end)], 1)
        for name, views in self._state_views(layers).items():
            if views:
                self.states[name][:, state] = torch.stack(views)

    def _ids(self, slots: list[int], device: torch.device | None = None) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long, device=device or self.window_kv.device)

    def _state_views(self, layers: list[LayerCache]) -> dict[str, list[torch.Tensor]]:
        """Per snapshot pool, row 0's previous-block rows of every C4 layer's compressor (or indexer) state: what a
        snapshot keeps (a block boundary leaves the open block empty)."""
        views: dict[str, list[torch.Tensor]] = {name: [] for name in self.states}
        for i in self.c4:
            for prefix, cached in (("", layers[i].compressor), ("index_", layers[i].indexer)):
                w = cached.kv_state.shape[-1] // 2
                views[prefix + "kv"].append(cached.kv_state[0, :4, :w])
                views[prefix + "score"].append(cached.score_state[0, :4, :w])
        return views

    def _ring_runs(self, end: int) -> list[tuple[slice, slice]]:
        """(ring slots, tail positions) of the tail ending at ``end`` (tokens end - window .. end - 1, token t in
        slot t mod window) as at most two contiguous runs, since the ring wraps once: copies are plain views."""
        start = end % self.window  # the slot of token end - window
        runs = [(slice(start, self.window), slice(0, self.window - start)),
                (slice(0, start), slice(self.window - start, self.window))]
        return [(ring, part) for ring, part in runs if ring.stop > ring.start]
