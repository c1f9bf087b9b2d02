"""The prefix cache's storage: ShadowRadix over slot pools, and the tensors behind the pools.

A request's working cache row is copied in from the pools on a hit (compressed entries up to the resume
boundary, the window tail into the ring, the C4 compressor states) and copied out once its prompt's
deepest chunk boundary is computed. Pools and their bytes:

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

from dataclasses import dataclass

import torch

from ..model.cache import V4Cache
from ..model.config import V4Config
from .pools import PoolExhausted, PoolSet, SlotPool
from .shadow_radix import ShadowRadix

TAIL_SHARE = 0.25
"""Fraction of the pool budget spent on window tails (plus their state snapshots)."""


@dataclass
class Hit:
    """What a prompt found in the cache: the boundary its cache row resumes at, and the cached tokens
    past it that must be computed again because their window tail was evicted."""

    resume_len: int
    recompute_tokens: int


class PrefixStore:
    """ShadowRadix plus preallocated tensors for every pool, sized to ``budget`` device bytes (the ``c4`` pool,
    when ``host_c4``, sized alike in host memory)."""

    def __init__(self, config: V4Config, chunk: int, budget: int, device: torch.device, host_c4: bool = False) -> None:
        if chunk % 128:
            raise ValueError(f"the prefix-cache chunk must be a multiple of 128 (a C128 block), got {chunk}")
        ratios = config.layer_ratios
        self.config, self.window, self.host_c4 = config, config.window_size, host_c4
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
        self.tree = ShadowRadix(self.pools, chunk, self.window, {"c4": 4, "c4_index": 4, "c128": 128})

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

    # ------------------------------------------------------------------ copy in
    def restore(self, prompt: list[int], cache: V4Cache) -> Hit:
        """Copies the deepest resumable cached prefix of ``prompt`` into row 0 of ``cache`` (freshly reset)."""
        match = self.tree.match(prompt)
        node, end = match.resume_node, match.resume_len
        if end == 0:
            return Hit(0, match.recompute_tokens)
        layers = cache.layers
        slots = {name: self._ids(self.tree.prefix_slots(node, name), name) for name in ("c4", "c4_index", "c128")}
        for j, i in enumerate(self.c4):
            layers[i].compressor.entries[0, : end // 4] = self.c4_entries[j, slots["c4"]].to(self.window_kv.device)
            layers[i].indexer.entries[0, : end // 4] = self.c4_keys[j, slots["c4_index"]]
        for j, i in enumerate(self.c128):
            layers[i].compressor.entries[0, : end // 128] = self.c128_entries[j, slots["c128"]]
        tail, ring = self._ids(node.window_tail), self._ring(end)
        for i, layer in enumerate(layers):
            layer.window[0, ring] = self.window_kv[i, tail]
        for j, i in enumerate(self.c4):
            for prefix, state in (("", layers[i].compressor), ("index_", layers[i].indexer)):
                w = state.kv_state.shape[-1] // 2
                state.kv_state[0, :4, :w] = self.states[prefix + "kv"][j, node.state]
                state.score_state[0, :4, :w] = self.states[prefix + "score"][j, node.state]
        return Hit(end, match.recompute_tokens)

    # ------------------------------------------------------------------ copy out
    def save(self, tokens: list[int], cache: V4Cache) -> bool:
        """Caches the aligned prefix ``tokens`` whose state row 0 of ``cache`` holds right now (its ring holds
        the last ``window`` tokens, its compressors the state at the boundary). Evicts least recently used
        entries when the pools are full; returns False (caching nothing) when even that leaves no room."""
        end = len(tokens)
        match = self.tree.match([*tokens, 0])
        known = match.compressed_len
        self.tree.lock(match.compressed_node, "full")
        try:
            fresh = self._alloc({"c4": (end - known) // 4 if self.c4 else 0,
                                 "c4_index": (end - known) // 4 if self.c4 else 0,
                                 "c128": (end - known) // 128 if self.c128 else 0})
            if fresh is None:
                return False
            needs_tail = known < end or match.compressed_node.window_tail is None
            tail = self._alloc({"window": self.window, "state": 1}) if needs_tail else None
            self._copy_entries(cache, known, end, fresh)
            slots = {name: self.tree.prefix_slots(match.compressed_node, name) + fresh[name] for name in fresh}
            if tail is not None:
                self._copy_tail(cache, end, tail["window"], tail["state"][0])
                self.tree.insert(tokens, slots, tail["window"], tail["state"][0])
            else:
                self.tree.insert(tokens, slots)
            return True
        finally:
            self.tree.unlock(match.compressed_node, "full")

    def _alloc(self, wanted: dict[str, int]) -> dict[str, list[int]] | None:
        taken: dict[str, list[int]] = {}
        for name, n in wanted.items():
            pool = self.pools[name]
            if pool.free_count < n:
                self.tree.evict(name, n - pool.free_count)
            try:
                taken[name] = pool.alloc(n)
            except PoolExhausted:
                for got, slots in taken.items():
                    self.pools[got].free(slots)
                return None
        return taken

    def _copy_entries(self, cache: V4Cache, known: int, end: int, fresh: dict[str, list[int]]) -> None:
        layers = cache.layers
        slots = {name: self._ids(ids, name) for name, ids in fresh.items()}
        for j, i in enumerate(self.c4):
            self.c4_entries[j, slots["c4"]] = layers[i].compressor.entries[0, known // 4 : end // 4].to(
                self.c4_entries.device)
            self.c4_keys[j, slots["c4_index"]] = layers[i].indexer.entries[0, known // 4 : end // 4]
        for j, i in enumerate(self.c128):
            self.c128_entries[j, slots["c128"]] = layers[i].compressor.entries[0, known // 128 : end // 128]

    def _copy_tail(self, cache: V4Cache, end: int, window: list[int], state: int) -> None:
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

    def stats(self) -> dict[str, object]:
        """Tree statistics, per pool capacity, use and bytes, and which pools live in host memory."""
        return {"tree": self.tree.stats(), "pools": self.pools.stats(), "host_pools": ["c4"] if self.host_c4 else []}
