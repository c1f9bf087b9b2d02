"""The prefix cache's pools: slot bookkeeping plus the tensors behind it, and the copies between them and a
cache row. This is the only runtime code that reads or writes a ``V4Cache``'s tensors directly.

Pools and their bytes:

- ``window``: one token's window KV in every layer (bf16), kept only as tails of ``window`` tokens;
- ``c4`` / ``c4_index``: one C4 entry / indexer key in every C4 layer; ``c128``: one C128 entry in every
  C128 layer;
- ``state``: one snapshot of every C4 compressor's state (fp32): at a boundary (a multiple of 128) no block
  is open, and the next entry reads only the left half of the previous block's rows, so that is all a
  snapshot keeps; C128 compressors hold nothing there.

With ``host_c4`` (HiSparse) the ``c4`` pool's tensor lives in host memory (pinned on a GPU machine) and the
device budget pays only for the other pools: a hit copies the cached C4 entries back from there.
"""

from __future__ import annotations

import torch

from ..model.cache import V4Cache
from ..model.config import V4Config
from .pools import PoolSet, SlotPool

TAIL_SHARE = 0.25
"""Fraction of the pool budget spent on window tails (plus their state snapshots)."""

RATIOS = {"c4": 4, "c4_index": 4, "c128": 128}
"""Tokens per slot of the compressed pools."""


class PrefixPools:
    """Slot pools (``pools``) and a preallocated tensor per pool, sized to ``budget`` device bytes for
    ``chunk``-token granules (the ``c4`` pool, when ``host_c4``, sized alike in host memory)."""

    def __init__(self, config: V4Config, chunk: int, budget: int, device: torch.device, host_c4: bool = False) -> None:
        ratios = config.layer_ratios
        self.window, self.host_c4 = config.window_size, host_c4
        self.c4 = [i for i, r in enumerate(ratios) if r == 4]
        self.c128 = [i for i, r in enumerate(ratios) if r == 128]
        d, di, n = config.head_dim, config.index_head_dim, len(ratios)
        sizes = {"window": n * d * 2, "c4": len(self.c4) * d * 2, "c4_index": len(self.c4) * di * 2,
                 "c128": len(self.c128) * d * 2, "state": len(self.c4) * 4 * 4 * 2 * (d + di)}
        tail_bytes = self.window * sizes["window"] + sizes["state"]
        tails = max(1, int(budget * TAIL_SHARE) // tail_bytes)
        per_token = (0 if host_c4 else sizes["c4"] / 4) + sizes["c4_index"] / 4 + sizes["c128"] / 128
        tokens = max(0, int((budget - tails * tail_bytes) / per_token)) // chunk * chunk if per_token else 0
        capacity = {"window": tails * self.window, "state": tails, "c4": tokens // 4, "c4_index": tokens // 4,
                    "c128": tokens // 128}
        self.pools = PoolSet(SlotPool(name, capacity[name], sizes[name]) for name in sizes)

        def store(layers: int, cap: int, width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.zeros(layers, cap, width, dtype=dtype, device=device)

        self.window_kv = store(n, capacity["window"], d)
        self.c4_entries = (torch.zeros(len(self.c4), capacity["c4"], d, dtype=torch.bfloat16,
                                       pin_memory=torch.device(device).type == "cuda")
                           if host_c4 else store(len(self.c4), capacity["c4"], d))
        self.c4_keys = store(len(self.c4), capacity["c4_index"], di)
        self.c128_entries = store(len(self.c128), capacity["c128"], d)
        shape = (len(self.c4), capacity["state"], 4)
        self.states = {name: torch.zeros(*shape, w, dtype=torch.float32, device=device)
                       for name, w in (("kv", d), ("score", d), ("index_kv", di), ("index_score", di))}

    def entry_counts(self, known: int, end: int) -> dict[str, int]:
        """Slots per compressed pool that tokens ``known..end-1`` (both multiples of 128) fill."""
        return {name: (end - known) // ratio if (self.c128 if ratio == 128 else self.c4) else 0
                for name, ratio in RATIOS.items()}

    # ------------------------------------------------------------------ copy in
    def load(self, cache: V4Cache, end: int, slots: dict[str, list[int]], tail: list[int], state: int) -> None:
        """Copies a cached prefix of ``end`` tokens into row 0 of ``cache``: its compressed entries from
        ``slots`` (per compressed pool), its window tail from ``tail`` and its compressor states from snapshot
        ``state``."""
        layers = cache.layers
        ids = {name: self._ids(ids, name) for name, ids in slots.items()}
        for j, i in enumerate(self.c4):
            layers[i].compressor.entries[0, : end // 4] = self.c4_entries[j, ids["c4"]].to(self.window_kv.device)
            layers[i].indexer.entries[0, : end // 4] = self.c4_keys[j, ids["c4_index"]]
        for j, i in enumerate(self.c128):
            layers[i].compressor.entries[0, : end // 128] = self.c128_entries[j, ids["c128"]]
        window, ring = self._ids(tail), self._ring(end)
        for i, layer in enumerate(layers):
            layer.window[0, ring] = self.window_kv[i, window]
        for j, i in enumerate(self.c4):
            for prefix, cached in (("", layers[i].compressor), ("index_", layers[i].indexer)):
                w = cached.kv_state.shape[-1] // 2
                cached.kv_state[0, :4, :w] = self.states[prefix + "kv"][j, state]
                cached.score_state[0, :4, :w] = self.states[prefix + "score"][j, state]

    # ------------------------------------------------------------------ copy out
    def store_entries(self, cache: V4Cache, known: int, end: int, slots: dict[str, list[int]]) -> None:
        """Copies row 0's compressed entries of tokens ``known..end-1`` into ``slots`` (per compressed pool)."""
        layers = cache.layers
        ids = {name: self._ids(ids, name) for name, ids in slots.items()}
        for j, i in enumerate(self.c4):
            self.c4_entries[j, ids["c4"]] = layers[i].compressor.entries[0, known // 4 : end // 4].to(
                self.c4_entries.device)
            self.c4_keys[j, ids["c4_index"]] = layers[i].indexer.entries[0, known // 4 : end // 4]
        for j, i in enumerate(self.c128):
            self.c128_entries[j, ids["c128"]] = layers[i].compressor.entries[0, known // 128 : end // 128]

    def store_tail(self, cache: V4Cache, end: int, window: list[int], state: int) -> None:
        """Copies row 0's window tail ending at ``end`` into ``window`` slots and its C4 compressor states into
        snapshot ``state``."""
        layers = cache.layers
        slots, ring = self._ids(window), self._ring(end)
        for i, layer in enumerate(layers):
            self.window_kv[i, slots] = layer.window[0, ring]
        for j, i in enumerate(self.c4):
            for prefix, cached in (("", layers[i].compressor), ("index_", layers[i].indexer)):
                w = cached.kv_state.shape[-1] // 2
                self.states[prefix + "kv"][j, state] = cached.kv_state[0, :4, :w]
                self.states[prefix + "score"][j, state] = cached.score_state[0, :4, :w]

    def _ids(self, slots: list[int], pool: str = "window") -> torch.Tensor:
        device = self.c4_entries.device if pool == "c4" else self.window_kv.device
        return torch.tensor(slots, dtype=torch.long, device=device)

    def _ring(self, end: int) -> torch.Tensor:
        """Ring slots of the window tail ending at ``end`` (tokens end - window .. end - 1)."""
        return torch.arange(end - self.window, end, device=self.window_kv.device) % self.window
