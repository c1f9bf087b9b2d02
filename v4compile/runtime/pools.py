"""Slot pools: bookkeeping of which fixed-size cache slots are in use.

The engine keeps one preallocated tensor per cache kind (window KV, C4 entries, C4 indexer keys, C128
entries, compressor states), indexed by slot id; a ``SlotPool`` only decides which ids are free. Keeping
tensors out of the pool keeps it pure Python, fast and testable on any device.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping


class PoolExhausted(RuntimeError):
    """Raised when a pool has fewer free slots than requested; the caller may evict and retry."""

    def __init__(self, pool: str, requested: int, free: int) -> None:
        super().__init__(f"pool {pool!r} exhausted: requested {requested} slots, {free} free")
        self.pool = pool
        self.requested = requested
        self.free = free


class SlotPool:
    """A named pool of ``capacity`` integer slots (0..capacity-1), each standing for ``bytes_per_slot`` bytes.

    Allocation hands out the lowest free slots first, so runs are deterministic. Every call either fully
    succeeds or changes nothing, so a failed call never leaves half-allocated or half-freed state.
    """

    def __init__(self, name: str, capacity: int, bytes_per_slot: int = 0) -> None:
        if capacity < 0 or bytes_per_slot < 0:
            raise ValueError(f"pool {name!r}: capacity and bytes_per_slot must be >= 0")
        self.name = name
        self.capacity = capacity
        self.bytes_per_slot = bytes_per_slot
        self._free: list[int] = list(range(capacity))  # a heap; range() order is already one
        self._used: set[int] = set()

    def alloc(self, n: int) -> list[int]:
        """Takes ``n`` free slots, lowest first; raises ``PoolExhausted`` (allocating nothing) if too few are free."""
        if n < 0:
            raise ValueError(f"pool {self.name!r}: cannot allocate {n} slots")
        if n > len(self._free):
            raise PoolExhausted(self.name, n, len(self._free))
        slots = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Returns ``slots`` to the pool; raises ``ValueError`` (freeing nothing) on a slot that is not in use."""
        slots = list(slots)
        seen: set[int] = set()
        for slot in slots:
            if slot not in self._used or slot in seen:
                raise ValueError(f"pool {self.name!r}: slot {slot} is not in use (double free or unknown slot)")
            seen.add(slot)
        self._used.difference_update(slots)
        for slot in slots:
            heapq.heappush(self._free, slot)

    def __contains__(self, slot: object) -> bool:
        """Whether ``slot`` is currently allocated (lets owners validate slot ids cheaply)."""
        return slot in self._used

    @property
    def free_count(self) -> int:
        """Slots available to ``alloc``."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        """Slots currently allocated."""
        return len(self._used)

    @property
    def used_bytes(self) -> int:
        """Bytes the allocated slots stand for."""
        return len(self._used) * self.bytes_per_slot

    @property
    def capacity_bytes(self) -> int:
        """Bytes the whole pool stands for."""
        return self.capacity * self.bytes_per_slot

    def owned(self) -> set[int]:
        """A copy of the allocated slot set, for consistency checks (O(used), not for the hot path)."""
        return set(self._used)


class PoolSet(Mapping[str, SlotPool]):
    """The engine's pools by name ("window", "c4", "c4_index", "c128", "state"), with one place to report usage."""

    def __init__(self, pools: Iterable[SlotPool]) -> None:
        self._pools: dict[str, SlotPool] = {}
        for pool in pools:
            if pool.name in self._pools:
                raise ValueError(f"duplicate pool name {pool.name!r}")
            self._pools[pool.name] = pool

    @classmethod
    def from_capacities(cls, capacities: Mapping[str, int], bytes_per_slot: Mapping[str, int] | None = None) -> PoolSet:
        """Builds one pool per name in ``capacities``; ``bytes_per_slot`` defaults to 0 for names it lacks."""
        sizes = bytes_per_slot or {}
        return cls(SlotPool(name, capacity, sizes.get(name, 0)) for name, capacity in capacities.items())

    def __getitem__(self, name: str) -> SlotPool:
        """The pool called ``name``; the ``KeyError`` lists the names that exist."""
        if name not in self._pools:
            raise KeyError(f"no pool named {name!r}; pools: {', '.join(self._pools)}")
        return self._pools[name]

    def __iter__(self) -> Iterator[str]:
        """Pool names, in creation order."""
        return iter(self._pools)

    def __len__(self) -> int:
        """The number of pools."""
        return len(self._pools)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: capacity, used, free, used_bytes and capacity_bytes, for reporting."""
        return {
            name: {
                "capacity": pool.capacity,
                "used": pool.used_count,
                "free": pool.free_count,
                "used_bytes": pool.used_bytes,
                "capacity_bytes": pool.capacity_bytes,
            }
            for name, pool in self._pools.items()
        }


class PagePool(SlotPool):
    """The engine's entry pages (``model/pages.py``): ids ``1..n_pages-1`` (page 0 is the null page, never handed
    out), each with a reference count, since a cached prefix and every request resuming from it hold the same
    pages. ``alloc`` hands out pages with one reference, ``retain`` adds one, ``free`` drops one and returns a
    page to the pool when its last goes. Bookkeeping only, like ``SlotPool``."""

    def __init__(self, name: str, n_pages: int, bytes_per_page: int = 0) -> None:
        super().__init__(name, max(n_pages - 1, 0), bytes_per_page)
        self._free = list(range(1, n_pages))
        self._refs: dict[int, int] = {}

    def alloc(self, n: int) -> list[int]:
        """Takes ``n`` free pages, lowest first, each with one reference; ``PoolExhausted`` (taking nothing) if too
        few are free."""
        pages = super().alloc(n)
        self._refs.update((page, 1) for page in pages)
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Adds a reference to each of ``pages``; ``ValueError`` (changing nothing) on a page not in use."""
        pages = list(pages)
        unknown = [page for page in pages if page not in self._refs]
        if unknown:
            raise ValueError(f"pool {self.name!r}: cannot retain page {unknown[0]}, which is not in use")
        for page in pages:
            self._refs[page] += 1

    def free(self, slots: Iterable[int]) -> None:
        """Drops one reference from each page (a page listed twice loses two); pages left without one return to
        the pool. ``ValueError`` (changing nothing) when a page would drop below zero references."""
        pages = list(slots)
        drops: dict[int, int] = {}
        for page in pages:
            drops[page] = drops.get(page, 0) + 1
            if drops[page] > self._refs.get(page, 0):
                raise ValueError(f"pool {self.name!r}: page {page} is not in use (double free or unknown page)")
        released = []
        for page, n in drops.items():
            self._refs[page] -= n
            if not self._refs[page]:
                del self._refs[page]
                released.append(page)
        super().free(released)

    def refs(self, page: int) -> int:
        """References held on ``page`` (0 when free)."""
        return self._refs.get(page, 0)
