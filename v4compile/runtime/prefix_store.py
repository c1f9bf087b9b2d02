"""The prefix cache: ShadowRadix deciding which slots hold which cached prefix, over ``PrefixPools`` holding them.

A request's staging row is copied in from the pools on a hit (compressed entries up to the resume boundary, the
window tail into the ring, the C4 compressor states) and copied out once its prompt's deepest chunk boundary is
computed. The tree and slot decisions are made here; the copies are ``PrefixPools``' (``prefix_pools.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.cache import V4Cache
from ..model.config import V4Config
from .pools import PoolExhausted
from .prefix_pools import RATIOS, PrefixPools
from .shadow_radix import ShadowRadix


@dataclass
class Hit:
    """What a prompt found in the cache: the boundary its cache row resumes at, and the cached tokens
    past it that must be computed again because their window tail was evicted."""

    resume_len: int
    recompute_tokens: int


def default_chunk(config: V4Config) -> int:
    """The prefix-cache granule: 128 tokens (a C128 block, 32 C4 blocks), or the window if larger, rounded
    up to a multiple of 128."""
    return max(128, -(-config.window_size // 128) * 128)


class PrefixStore:
    """ShadowRadix over ``PrefixPools`` sized to ``budget`` device bytes (the ``c4`` pool, when ``host_c4``, sized
    alike in host memory), caching prefixes in ``chunk``-token granules."""

    def __init__(self, config: V4Config, chunk: int, budget: int, device: torch.device, host_c4: bool = False) -> None:
        if chunk % 128:
            raise ValueError(f"the prefix-cache chunk must be a multiple of 128 (a C128 block), got {chunk}")
        self.tensors = PrefixPools(config, chunk, budget, device, host_c4)
        self.pools = self.tensors.pools
        self.tree = ShadowRadix(self.pools, chunk, config.window_size, RATIOS)

    def restore(self, prompt: list[int], cache: V4Cache) -> Hit:
        """Copies the deepest resumable cached prefix of ``prompt`` into row 0 of ``cache`` (freshly reset)."""
        match = self.tree.match(prompt)
        node, end = match.resume_node, match.resume_len
        if end == 0:
            return Hit(0, match.recompute_tokens)
        assert node.window_tail is not None and node.state is not None  # a resume node has its tail
        slots = {name: self.tree.prefix_slots(node, name) for name in RATIOS}
        self.tensors.load(cache, end, slots, node.window_tail, node.state)
        return Hit(end, match.recompute_tokens)

    def save(self, tokens: list[int], cache: V4Cache) -> bool:
        """Caches the aligned prefix ``tokens`` whose state row 0 of ``cache`` holds right now (its ring holds
        the last ``window`` tokens, its compressors the state at the boundary). Evicts least recently used
        entries when the pools are full; returns False (caching nothing) when even that leaves no room."""
        end = len(tokens)
        match = self.tree.match([*tokens, 0])
        known = match.compressed_len
        self.tree.lock(match.compressed_node, "full")
        try:
            fresh = self._alloc(self.tensors.entry_counts(known, end))
            if fresh is None:
                return False
            needs_tail = known < end or match.compressed_node.window_tail is None
            tail = self._alloc({"window": self.tensors.window, "state": 1}) if needs_tail else None
            self.tensors.store_entries(cache, known, end, fresh)
            slots = {name: self.tree.prefix_slots(match.compressed_node, name) + fresh[name] for name in fresh}
            if tail is not None:
                self.tensors.store_tail(cache, end, tail["window"], tail["state"][0])
                self.tree.insert(tokens, slots, tail["window"], tail["state"][0])
            else:
                self.tree.insert(tokens, slots)
            return True
        finally:
            self.tree.unlock(match.compressed_node, "full")

    def _alloc(self, wanted: dict[str, int]) -> dict[str, list[int]] | None:
        """Takes ``wanted`` slots per pool, evicting from the tree where a pool is short; None (taking nothing)
        when a pool cannot free enough."""
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

    def stats(self) -> dict[str, object]:
        """Tree statistics, per pool capacity, use and bytes, and which pools live in host memory."""
        return {"tree": self.tree.stats(), "pools": self.pools.stats(),
                "host_pools": ["c4"] if self.tensors.host_c4 else []}
