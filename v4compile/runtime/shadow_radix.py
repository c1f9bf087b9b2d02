"""ShadowRadix: a prefix cache over token ids for V4's hybrid attention state.

Every chunk-aligned cached prefix keeps its compressed KV entries (cheap: one per ``ratio`` tokens) in
tree nodes; each node holds its span's slot ids into every compressed pool (its "shadow index"). The
sliding-window KV is expensive per token, so it is kept only as a *window tail* (the last ``window``
tokens) plus a compressor-state snapshot at some node end boundaries. A node whose tail was freed is a
*tombstone*: its compressed entries stay, and a request matching through it resumes at the deepest
live tail above, recomputing the tokens in between.

Ownership: slots handed to ``insert`` belong to the tree from then on (adopted, or freed by the tree
itself when they duplicate entries it already has); the tree frees its slots only in ``evict``.

Locks: ``full`` on a node pins the compressed entries of its whole prefix (the node and every ancestor
count it); ``window`` pins one node's tail and state. Window eviction tombstones any tail without a
window lock, even under full locks: a request only needs the tail at its own resume boundary, and
holds a window lock on that one node.

One file (about 430 lines, 130 of them docstrings and blank lines) because it is one data structure: every public
operation (match, insert, lock, evict) keeps the ownership and lock invariants that ``check`` lists, through private
state (``_held``, ``_clock``, node splits) that a split into modules would have to expose.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .pools import PagePool, PoolSet

WINDOW_POOL = "window"
STATE_POOL = "state"
LOCK_KINDS = ("full", "window")


@dataclass(eq=False)
class RadixNode:
    """One span of a cached prefix: ``tokens`` from absolute offset ``start``, with its slots.

    ``slots[pool]`` holds ``len(tokens) // ratio`` slot ids per compressed pool; ``window_tail`` holds
    ``window`` window-pool slots for tokens [end - window, end) and ``state`` a state-pool slot, both for
    the END boundary and both None on a tombstone. ``full_locks`` counts full locks taken on this node or
    any descendant; ``window_locks`` counts window locks on this node only.
    """

    tokens: tuple[int, ...]
    start: int
    parent: RadixNode | None = field(repr=False)
    slots: dict[str, list[int]] = field(repr=False)
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    window_tail: list[int] | None = None
    state: int | None = None
    full_locks: int = 0
    window_locks: int = 0
    last_used: int = 0

    @property
    def end(self) -> int:
        """Absolute token offset just past this node's span: the boundary its tail and state belong to."""
        return self.start + len(self.tokens)


@dataclass
class Match:
    """What the tree holds for a request's prompt.

    ``compressed_len``: tokens whose compressed entries are cached (ends at ``compressed_node``, which a
    request full-locks). ``resume_len``: the deepest boundary <= compressed_len with a live tail and state
    (at ``resume_node``, which a request window-locks; root and 0 when none). ``path``: the nodes from the
    root (excluded) down to ``compressed_node``, a snapshot that later splits do not update.
    """

    compressed_len: int
    resume_len: int
    compressed_node: RadixNode
    resume_node: RadixNode
    path: list[RadixNode]

    @property
    def recompute_tokens(self) -> int:
        """Tokens the engine recomputes because the tail at ``compressed_len`` is missing (the tombstone cost)."""
        return self.compressed_len - self.resume_len


@dataclass
class InsertResult:
    """What ``insert`` did: ``node`` ends at the inserted length; ``new_tokens`` were not cached before;
    ``tail_adopted`` tells whether the given tail and state were kept; ``released`` lists, per pool, the
    given slots the tree did not keep and has ALREADY returned to their pools (the caller must not free them)."""

    node: RadixNode
    new_tokens: int
    tail_adopted: bool
    released: dict[str, list[int]]


class ShadowRadix:
    """The radix tree over chunk-aligned token prefixes, owning cache slots in ``pools``.

    ``ratios`` maps each compressed pool name to its tokens per entry; ``pools`` must also hold the
    ``"window"`` and ``"state"`` pools. ``chunk`` (the unit of every span) is a multiple of each ratio, so
    entries split cleanly between nodes, and at least ``window``, so a tail never reaches past the root.
    """

    def __init__(self, pools: PoolSet, chunk: int, window: int, ratios: Mapping[str, int]) -> None:
        if window < 1 or chunk < window:
            raise ValueError(f"need 1 <= window <= chunk, got window={window}, chunk={chunk}")
        for name, ratio in ratios.items():
            if ratio < 1 or chunk % ratio:
                raise ValueError(f"chunk {chunk} is not a multiple of ratio {ratio} of pool {name!r}")
        missing = {WINDOW_POOL, STATE_POOL, *ratios} - set(pools)
        if missing:
            raise ValueError(f"pools missing: {', '.join(sorted(missing))}")
        self.pools = pools
        self.chunk = chunk
        self.window = window
        self.ratios = dict(ratios)
        self._root = RadixNode(tokens=(), start=0, parent=None, slots={name: [] for name in ratios})
        self._held: dict[str, set[int]] = {name: set() for name in (WINDOW_POOL, STATE_POOL, *ratios)}
        self._clock = 0

    @property
    def root(self) -> RadixNode:
        """The empty prefix: never evicted, never has a tail (resuming at 0 needs none)."""
        return self._root

    def match(self, tokens: Sequence[int]) -> Match:
        """The cached state for a prompt, over aligned prefixes of at most ``len(tokens) - 1`` tokens (the
        engine must compute at least the last token). Splits a node where the match ends inside it."""
        tokens = tuple(tokens)
        path, matched = self._descend(tokens, max(len(tokens) - 1, 0) // self.chunk * self.chunk)
        self._touch(path)
        resume = next((node for node in reversed(path) if node.window_tail is not None), self._root)
        last = path[-1] if path else self._root
        return Match(compressed_len=matched, resume_len=resume.end, compressed_node=last, resume_node=resume, path=path)

    def insert(
        self,
        tokens: Sequence[int],
        slots: Mapping[str, Sequence[int]],
        window_tail: Sequence[int] | None = None,
        state: int | None = None,
    ) -> InsertResult:
        """Caches the aligned prefix ``tokens``. ``slots[pool]`` lists entry slots for the WHOLE prefix; the
        tree adopts those of the uncached part and frees the others (slot ids identical to the tree's own,
        as when a request reused the matched prefix, are simply kept). ``window_tail``/``state`` belong to
        the end boundary: adopted where that node has none (reviving a tombstone), freed otherwise.
        Raises ``ValueError`` (taking and freeing nothing) on wrong lengths or on slots that are unallocated
        or owned by the tree elsewhere."""
        tokens = tuple(tokens)
        self._check_insert_shapes(tokens, slots, window_tail, state)
        path, matched = self._descend(tokens, len(tokens))
        last = path[-1] if path else self._root
        end_node = last if matched == len(tokens) else None
        released: dict[str, list[int]] = {name: [] for name in self._held}
        adopted: dict[str, list[int]] = {}
        for name, ratio in self.ratios.items():
            given, cut = list(slots[name]), matched // ratio
            released[name] = [s for s, own in zip(given[:cut], self.prefix_slots(last, name), strict=True) if s != own]
            adopted[name] = given[cut:]
            self._require_foreign(name, released[name] + adopted[name])
        tail = None if window_tail is None else list(window_tail)
        tail_adopted = tail is not None and (end_node is None or end_node.window_tail is None)
        if tail is not None and state is not None:
            if tail_adopted:
                self._require_foreign(WINDOW_POOL, tail)
                self._require_foreign(STATE_POOL, [state])
            else:
                assert end_node is not None
                released[WINDOW_POOL] = [] if tail == end_node.window_tail else tail
                released[STATE_POOL] = [] if state == end_node.state else [state]
                self._require_foreign(WINDOW_POOL, released[WINDOW_POOL])
                self._require_foreign(STATE_POOL, released[STATE_POOL])
        for name, freed in released.items():
            self.pools[name].free(freed)
        if end_node is None:
            end_node = RadixNode(tokens=tokens[matched:], start=matched, parent=last, slots=adopted)
            last.children[end_node.tokens[: self.chunk]] = end_node
            for name, new in adopted.items():
                self._held[name].update(new)
            path.append(end_node)
        if tail_adopted and tail is not None and state is not None:
            self._set_tail(end_node, tail, state)
        self._touch(path)
        return InsertResult(end_node, len(tokens) - matched, tail_adopted, released)

    def lock(self, node: RadixNode, kind: str) -> None:
        """Pins ``node``: "full" pins the compressed entries of its whole prefix, "window" its tail and state."""
        if node is not self._root and node.parent is None:
            raise ValueError("cannot lock a node that was evicted")
        if kind == "full":
            for on_path in self._ancestry(node):
                on_path.full_locks += 1
        elif kind == "window":
            node.window_locks += 1
        else:
            raise ValueError(f"unknown lock kind {kind!r}; kinds: {', '.join(LOCK_KINDS)}")

    def unlock(self, node: RadixNode, kind: str) -> None:
        """Releases one ``lock(node, kind)``; raises ``ValueError`` if no such lock is held on ``node``."""
        if kind == "full":
            own = node.full_locks - _child_locks(node)
            if own <= 0:
                raise ValueError(f"no full lock held on the node at [{node.start}, {node.end})")
            for on_path in self._ancestry(node):
                on_path.full_locks -= 1
        elif kind == "window":
            if node.window_locks <= 0:
                raise ValueError(f"no window lock held on the node at [{node.start}, {node.end})")
            node.window_locks -= 1
        else:
            raise ValueError(f"unknown lock kind {kind!r}; kinds: {', '.join(LOCK_KINDS)}")

    def evict(self, pool: str, n_slots: int, above: Sequence[RadixNode] = ()) -> int:
        """Frees at least ``n_slots`` slots of ``pool`` if unlocked state allows, least recently used first,
        and returns how many it freed. "window"/"state": tombstones tails without window locks, those a deeper
        tail supersedes first (``above``: the path a tail is about to be inserted below, whose tails it will
        supersede). Compressed pools: removes unlocked leaves (with all their slots, tail included), then parents
        that become such."""
        if pool in (WINDOW_POOL, STATE_POOL):
            return self._evict_tails(pool, n_slots, above)
        if pool in self.ratios:
            return self._evict_leaves(pool, n_slots)
        raise KeyError(f"no pool named {pool!r} in the tree; pools: {', '.join(self._held)}")

    def prefix_slots(self, node: RadixNode, pool: str) -> list[int]:
        """The slots of compressed ``pool`` for the whole prefix ending at ``node``, in token order."""
        parts = [on_path.slots[pool] for on_path in self._ancestry(node)]
        return [slot for part in reversed(parts) for slot in part]

    def held(self, pool: str) -> set[int]:
        """A copy of the slots the tree owns in ``pool`` (for consistency checks)."""
        return set(self._held[pool])

    def nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self, external: Mapping[str, Iterable[int]] | None = None) -> None:
        """Raises ``AssertionError`` if an invariant fails: tree shape, slot list lengths, tail/state pairing,
        lock counts, and slot ownership (each slot owned once by the tree, all allocated; with ``external``, the
        slots held outside the tree, each pool's used set must be exactly the tree's plus the external ones; on a
        ``PagePool``, where the tree and requests share pages, ``external`` lists a page once per outside holder
        and every page's reference count must equal its holders)."""
        owned: dict[str, list[int]] = {name: [] for name in self._held}
        _expect(self._root.full_locks >= _child_locks(self._root), "root full locks below its children's")
        for node in self.nodes():
            where = f"node [{node.start}, {node.end})"
            parent = node.parent
            _expect(parent is not None and parent.children.get(node.tokens[: self.chunk]) is node, f"{where}: bad link")
            assert parent is not None
            _expect(len(node.tokens) > 0 and len(node.tokens) % self.chunk == 0, f"{where}: span not chunk-aligned")
            _expect(node.start == parent.end, f"{where}: start != parent end {parent.end}")
            for name, ratio in self.ratios.items():
                _expect(len(node.slots[name]) == len(node.tokens) // ratio, f"{where}: wrong {name} slot count")
                owned[name].extend(node.slots[name])
            _expect((node.window_tail is None) == (node.state is None), f"{where}: tail without state or back")
            if node.window_tail is not None:
                _expect(len(node.window_tail) == self.window, f"{where}: tail of {len(node.window_tail)} slots")
                owned[WINDOW_POOL].extend(node.window_tail)
                owned[STATE_POOL].append(node.state)  # type: ignore[arg-type]
            _expect(node.window_locks >= 0, f"{where}: negative window locks")
            _expect(node.full_locks >= _child_locks(node), f"{where}: full locks below its children's")
        for name, slots in owned.items():
            _expect(len(slots) == len(set(slots)), f"pool {name}: a slot is owned twice")
            _expect(set(slots) == self._held[name], f"pool {name}: ownership record out of date")
            pool = self.pools[name]
            used = pool.owned()
            _expect(self._held[name] <= used, f"pool {name}: tree owns unallocated slots")
            if isinstance(pool, PagePool):
                if external is not None:
                    outside = Counter(external.get(name, ()))
                    for page in used | set(outside):
                        want = (page in self._held[name]) + outside[page]
                        _expect(pool.refs(page) == want, f"pool {name}: page {page} has {pool.refs(page)} "
                                                         f"references, its owners {want}")
            elif external is not None:
                outside = set(external.get(name, ()))
                _expect(not (outside & self._held[name]), f"pool {name}: slot owned by tree and caller")
                leaked = used - self._held[name] - outside
                _expect(not leaked and outside <= used, f"pool {name}: leaked slots {leaked} or unallocated outside")

    def stats(self) -> dict[str, Any]:
        """Nodes, tombstones, cached tokens, nodes under a full lock, and slots owned per pool."""
        nodes = list(self.nodes())
        return {
            "nodes": len(nodes),
            "tombstones": sum(node.window_tail is None for node in nodes),
            "cached_tokens": sum(len(node.tokens) for node in nodes),
            "locked_nodes": sum(node.full_locks > 0 for node in nodes),
            "slots": {name: len(held) for name, held in self._held.items()},
        }

    def _descend(self, tokens: tuple[int, ...], limit: int) -> tuple[list[RadixNode], int]:
        """Follows ``tokens[:limit]`` (limit chunk-aligned) chunk by chunk; splits the node where the walk
        stops inside it. Returns the path (root excluded) and the matched length."""
        chunk, node, matched, path = self.chunk, self._root, 0, []
        while matched < limit:
            child = node.children.get(tokens[matched : matched + chunk])
            if child is None:
                break
            stop, n = min(len(child.tokens), limit - matched), chunk
            if child.tokens[:stop] == tokens[matched : matched + stop]:
                n = stop  # the common case, a whole edge in one comparison
            while n < stop and child.tokens[n : n + chunk] == tokens[matched + n : matched + n + chunk]:
                n += chunk
            node = self._split(child, n) if n < len(child.tokens) else child
            path.append(node)
            matched += n
        return path, matched

    def _split(self, node: RadixNode, offset: int) -> RadixNode:
        """Cuts ``node`` at ``offset`` tokens into a new upper node (born a tombstone) and ``node`` itself,
        which keeps its end boundary, tail, window locks and identity, so lock holders stay valid."""
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            tokens=node.tokens[:offset],
            start=node.start,
            parent=parent,
            slots={name: node.slots[name][: offset // ratio] for name, ratio in self.ratios.items()},
            full_locks=node.full_locks,
            last_used=node.last_used,
        )
        for name, ratio in self.ratios.items():
            node.slots[name] = node.slots[name][offset // ratio :]
        node.tokens, node.start, node.parent = node.tokens[offset:], node.start + offset, upper
        upper.children[node.tokens[: self.chunk]] = node
        parent.children[upper.tokens[: self.chunk]] = upper
        return upper

    def _evict_tails(self, pool: str, n_slots: int, above: Sequence[RadixNode]) -> int:
        """Tombstones unpinned tails: first those with a live tail deeper on their path (a continuing conversation
        resumes from the deeper one; the shallower pays only for a branch at exactly its boundary), then the
        rest; each group least recently used first, ties shallowest first."""
        per_tail = self.window if pool == WINDOW_POOL else 1
        candidates = [node for node in self.nodes() if node.window_tail is not None and node.window_locks == 0]
        superseded = {id(node) for node in above}
        for node in self.nodes():
            if node.window_tail is not None and node.parent is not None:
                superseded.update(id(upper) for upper in self._ancestry(node.parent))
        freed = 0
        for node in sorted(candidates, key=lambda node: (id(node) not in superseded, node.last_used, node.end)):
            if freed >= n_slots:
                break
            self._drop_tail(node)
            freed += per_tail
        return freed

    def _evict_leaves(self, pool: str, n_slots: int) -> int:
        """Removes unlocked leaves, least recently used first, walking up as parents become unlocked leaves; returns
        the slots that went back to ``pool``. On a ``PagePool`` a leaf whose pages running requests also hold frees
        nothing and stays (removing it would only lose the cached prefix)."""
        heap = [(node.last_used, node.end, i, node) for i, node in enumerate(self.nodes())
                if self._removable(node) and self._releasable(node, pool)]
        heapq.heapify(heap)
        freed, tiebreak = 0, len(heap)
        while heap and freed < n_slots:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            assert parent is not None
            freed += self._releasable(node, pool)
            self._remove(node)
            if self._removable(parent) and self._releasable(parent, pool):
                heapq.heappush(heap, (parent.last_used, parent.end, tiebreak, parent))
                tiebreak += 1
        return freed

    def _releasable(self, node: RadixNode, pool: str) -> int:
        """The slots of ``pool`` that removing ``node`` returns to it (on a ``PagePool``, the pages only the tree
        holds)."""
        owner = self.pools[pool]
        if isinstance(owner, PagePool):
            return sum(owner.refs(page) == 1 for page in node.slots[pool])
        return len(node.slots[pool])

    def _removable(self, node: RadixNode) -> bool:
        """A leaf nobody pins (the root never is)."""
        return node is not self._root and not node.children and node.full_locks == 0 and node.window_locks == 0

    def _remove(self, node: RadixNode) -> None:
        """Frees every slot of leaf ``node`` and detaches it from the tree."""
        if node.window_tail is not None:
            self._drop_tail(node)
        for name in self.ratios:
            self.pools[name].free(node.slots[name])
            self._held[name].difference_update(node.slots[name])
            node.slots[name] = []
        assert node.parent is not None
        del node.parent.children[node.tokens[: self.chunk]]
        node.parent = None

    def _set_tail(self, node: RadixNode, window_tail: list[int], state: int) -> None:
        """Gives ``node`` a tail and state (the caller checked they are free for the tree to own)."""
        node.window_tail, node.state = window_tail, state
        self._held[WINDOW_POOL].update(window_tail)
        self._held[STATE_POOL].add(state)

    def _drop_tail(self, node: RadixNode) -> None:
        """Frees ``node``'s tail and state, making it a tombstone."""
        assert node.window_tail is not None and node.state is not None
        self.pools[WINDOW_POOL].free(node.window_tail)
        self.pools[STATE_POOL].free([node.state])
        self._held[WINDOW_POOL].difference_update(node.window_tail)
        self._held[STATE_POOL].discard(node.state)
        node.window_tail, node.state = None, None

    def _touch(self, path: list[RadixNode]) -> None:
        """Advances the logical clock and stamps ``path`` with it (LRU order for eviction)."""
        self._clock += 1
        for node in path:
            node.last_used = self._clock

    def _ancestry(self, node: RadixNode) -> Iterator[RadixNode]:
        """``node`` and its ancestors up to and including the root."""
        current: RadixNode | None = node
        while current is not None:
            yield current
            current = current.parent

    def _check_insert_shapes(
        self,
        tokens: tuple[int, ...],
        slots: Mapping[str, Sequence[int]],
        window_tail: Sequence[int] | None,
        state: int | None,
    ) -> None:
        """Rejects a prefix that is empty or unaligned, and slot lists of the wrong length."""
        if not tokens or len(tokens) % self.chunk:
            raise ValueError(f"insert needs a non-empty multiple of {self.chunk} tokens, got {len(tokens)}")
        for name, ratio in self.ratios.items():
            if name not in slots or len(slots[name]) != len(tokens) // ratio:
                raise ValueError(f"insert of {len(tokens)} tokens needs {len(tokens) // ratio} {name} slots")
        if (window_tail is None) != (state is None):
            raise ValueError("window_tail and state come together or not at all")
        if window_tail is not None and len(window_tail) != self.window:
            raise ValueError(f"a window tail has {self.window} slots, got {len(window_tail)}")

    def _require_foreign(self, pool: str, slots: Sequence[int]) -> None:
        """Checks that ``slots`` are distinct, allocated, and not owned by the tree, before it takes or frees them."""
        held, allocated = self._held[pool], self.pools[pool]
        if len(set(slots)) != len(slots):
            raise ValueError(f"pool {pool!r}: a slot is given twice")
        for slot in slots:
            if slot in held:
                raise ValueError(f"pool {pool!r}: slot {slot} is already owned by the tree")
            if slot not in allocated:
                raise ValueError(f"pool {pool!r}: slot {slot} is not allocated")


def _child_locks(node: RadixNode) -> int:
    """The full locks ``node``'s children carry (each also counted on ``node``)."""
    return sum(child.full_locks for child in node.children.values())


def _expect(condition: bool, message: str) -> None:
    """An assertion that survives ``python -O``, for ``ShadowRadix.check``."""
    if not condition:
        raise AssertionError(message)
