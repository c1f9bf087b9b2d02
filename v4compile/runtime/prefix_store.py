"""The prefix cache: ShadowRadix deciding which pages, tails and snapshots hold which cached prefix.

A cached prefix's compressed entries are pages of the engine's shared entry pages: saving one adds the tree's
reference to the pages the request computed, and a hit hands the request references to the tree's pages for its
page table, copying no entries. What is copied on a hit is fixed-size: the window tail into the ring and the C4
compressor states (``PrefixPools``, ``prefix_pools.py``), plus, under HiSparse, the C4 main entries kept in host
memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.cache import PAGE_TOKENS, V4Cache
from ..model.config import V4Config
from .pools import PagePool, PoolExhausted, PoolSet
from .prefix_pools import PrefixPools
from .shadow_radix import RadixNode, ShadowRadix


@dataclass
class Hit:
    """What a prompt found in the cache: the boundary its cache row resumes at, the cached tokens past it that
    must be computed again because their window tail was evicted, and the pages (one reference each, now the
    caller's) holding the entries up to the boundary."""

    resume_len: int
    recompute_tokens: int
    pages: list[int] = field(default_factory=list)


def default_chunk(config: V4Config) -> int:
    """The prefix-cache granule: 128 tokens (a page: a C128 block, 32 C4 blocks), or the window if larger,
    rounded up to a multiple of 128."""
    return max(PAGE_TOKENS, -(-config.window_size // PAGE_TOKENS) * PAGE_TOKENS)


class PrefixStore:
    """ShadowRadix over the shared entry pages ``pages`` and ``tails`` window tails with their state snapshots
    (on ``device``; with ``host_c4``, also host memory for ``c4_tokens`` tokens of C4 main entries), caching
    prefixes in ``chunk``-token granules."""

    def __init__(self, config: V4Config, chunk: int, pages: PagePool, tails: int, device: torch.device,
                 host_c4: bool = False, c4_tokens: int = 0) -> None:
        if chunk % PAGE_TOKENS:
            raise ValueError(f"the prefix-cache chunk must be a multiple of {PAGE_TOKENS} (a page), got {chunk}")
        self.tensors = PrefixPools(config, tails, device, host_c4, c4_tokens)
        self.pages = pages
        self.pools = PoolSet([*self.tensors.pools.values(), pages])
        ratios = {pages.name: PAGE_TOKENS, **({"c4": 4} if host_c4 else {})}
        self.tree = ShadowRadix(self.pools, chunk, config.window_size, ratios)

    def restore(self, prompt: list[int], cache: V4Cache) -> Hit:
        """The deepest resumable cached prefix of ``prompt``: its tail and states (and host C4 entries) copied
        into row 0 of ``cache`` (freshly reset), its pages returned with a reference each for the row's table."""
        match = self.tree.match(prompt)
        node, end = match.resume_node, match.resume_len
        if end == 0:
            return Hit(0, match.recompute_tokens)
        assert node.window_tail is not None and node.state is not None  # a resume node has its tail
        c4 = self.tree.prefix_slots(node, "c4") if self.tensors.host_c4 else []
        self.tensors.load(cache, end, node.window_tail, node.state, c4)
        pages = self.tree.prefix_slots(node, self.pages.name)
        self.pages.retain(pages)
        return Hit(end, match.recompute_tokens, pages)

    def save(self, tokens: list[int], cache: V4Cache, pages: list[int]) -> bool:
        """Caches the aligned prefix ``tokens`` whose state row 0 of ``cache`` holds right now (its ring holds
        the last ``window`` tokens, its compressors the state at the boundary, its entries on ``pages``, the
        row's pages in token order): the tree takes a reference to the pages it did not hold. Evicts least
        recently used tails (and host entries) when those pools are full; returns False (caching nothing) when
        even that leaves no room."""
        end = len(tokens)
        match = self.tree.match([*tokens, 0])
        known = match.compressed_len
        self.tree.lock(match.compressed_node, "full")
        try:
            host = {"c4": (end - known) // 4} if self.tensors.host_c4 else {}
            needs_tail = known < end or match.compressed_node.window_tail is None
            fresh = self._alloc({**host, **({"window": self.tensors.window, "state": 1} if needs_tail else {})},
                                match.path)
            if fresh is None:
                return False
            if host:
                self.tensors.store_c4(cache, known, end, fresh["c4"])
            name = self.pages.name
            new_pages = pages[known // PAGE_TOKENS : end // PAGE_TOKENS]
            self.pages.retain(new_pages)
            slots = {name: self.tree.prefix_slots(match.compressed_node, name) + new_pages}
            if host:
                slots["c4"] = self.tree.prefix_slots(match.compressed_node, "c4") + fresh["c4"]
            if needs_tail:
                self.tensors.store_tail(cache, end, fresh["window"], fresh["state"][0])
                self.tree.insert(tokens, slots, fresh["window"], fresh["state"][0])
            else:
                self.tree.insert(tokens, slots)
            return True
        finally:
            self.tree.unlock(match.compressed_node, "full")

    def take_pages(self, n: int) -> list[int] | None:
        """``n`` fresh pages (one reference each, the caller's), evicting unlocked cached prefixes, least recently
        used first, while too few are free; None (taking nothing) when even that leaves too few."""
        while self.pages.free_count < n:
            if not self.tree.evict(self.pages.name, n - self.pages.free_count):
                return None
        return self.pages.alloc(n)

    def _alloc(self, wanted: dict[str, int], above: list[RadixNode]) -> dict[str, list[int]] | None:
        """Takes ``wanted`` slots per pool, evicting from the tree where a pool is short (tails on ``above``, the
        path the new tail goes below, first); None (taking nothing) when a pool cannot free enough."""
        taken: dict[str, list[int]] = {}
        for name, n in wanted.items():
            pool = self.pools[name]
            if pool.free_count < n:
                self.tree.evict(name, n - pool.free_count, above)
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
