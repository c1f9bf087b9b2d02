"""ShadowRadix: unit tests of insert/match/split/evict/locks, and a stateful test against a reference model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from v4compile.runtime.pools import PoolSet
from v4compile.runtime.shadow_radix import InsertResult, Match, RadixNode, ShadowRadix

CHUNK, WINDOW = 4, 2
RATIOS = {"c4": 2, "c4_index": 2, "c128": 4}
POOLS = ("window", "state", *RATIOS)
A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
B = [7, 7, 7, 7, 8, 8, 8, 8]


def make_tree(capacities: dict[str, int] | None = None) -> ShadowRadix:
    """A tree over roomy pools unless ``capacities`` says otherwise."""
    pools = PoolSet.from_capacities({name: 64 for name in POOLS} | (capacities or {}))
    return ShadowRadix(pools, CHUNK, WINDOW, RATIOS)


def put(tree: ShadowRadix, tokens: list[int], tail: bool = True) -> InsertResult:
    """Inserts ``tokens`` with freshly allocated entry slots (and a fresh tail and state)."""
    slots = {name: tree.pools[name].alloc(len(tokens) // ratio) for name, ratio in RATIOS.items()}
    window = tree.pools["window"].alloc(WINDOW) if tail else None
    state = tree.pools["state"].alloc(1)[0] if tail else None
    return tree.insert(tokens, slots, window, state)


def lens(match: Match) -> tuple[int, int, int]:
    return match.compressed_len, match.resume_len, match.recompute_tokens


def test_insert_then_match_resumes_at_tail() -> None:
    tree = make_tree()
    result = put(tree, A)
    assert result.new_tokens == 12 and result.tail_adopted and not any(result.released.values())
    match = tree.match([*A, 0, 0])
    assert lens(match) == (12, 12, 0) and match.resume_node is result.node is match.compressed_node
    assert tree.prefix_slots(result.node, "c4") == result.node.slots["c4"] and len(match.path) == 1
    assert lens(tree.match(B)) == (0, 0, 0) and lens(tree.match([])) == (0, 0, 0)
    tree.check(external={})


def test_match_never_covers_the_last_token_and_splits_into_a_tombstone() -> None:
    tree = make_tree()
    lower = put(tree, A).node
    match = tree.match(A)  # 12 tokens: at most 8 may be reused
    assert lens(match) == (8, 0, 8) and tree.stats()["nodes"] == 2 and tree.stats()["tombstones"] == 1
    upper = match.compressed_node
    assert upper.window_tail is None and upper.end == 8 and lower.parent is upper and lower.start == 8
    assert tree.prefix_slots(lower, "c4_index") == upper.slots["c4_index"] + lower.slots["c4_index"]
    assert lens(tree.match([*A, 5])) == (12, 12, 0)
    tree.check(external={})


def test_full_lock_survives_a_split_and_pins_the_path() -> None:
    tree = make_tree()
    lower = put(tree, A).node
    tree.lock(lower, "full")
    upper = tree.match(A[:9]).compressed_node
    assert upper.full_locks == 1 and tree.root.full_locks == 1
    with pytest.raises(ValueError, match="no full lock"):
        tree.unlock(upper, "full")  # its count is only the descendant's lock
    assert tree.evict("c4", 100) == 0
    tree.unlock(lower, "full")
    assert upper.full_locks == 0 and tree.root.full_locks == 0
    tree.check(external={})


def test_insert_revives_a_tombstone() -> None:
    tree = make_tree()
    node = put(tree, B).node
    assert tree.evict("window", 1) == WINDOW and node.window_tail is None and node.state is None
    assert lens(tree.match([*B, 0])) == (8, 0, 8)
    result = put(tree, B)  # all-fresh slots: the compressed ones are duplicates, the tail is new
    assert result.node is node and result.tail_adopted and result.new_tokens == 0
    assert [len(result.released[name]) for name in RATIOS] == [4, 4, 2]
    assert lens(tree.match([*B, 0])) == (8, 8, 0)
    tree.check(external={})


def test_insert_over_a_live_tail_releases_the_given_one() -> None:
    tree = make_tree()
    node = put(tree, B).node
    kept = list(node.window_tail or [])
    result = put(tree, B)
    assert not result.tail_adopted and node.window_tail == kept and len(result.released["window"]) == WINDOW
    assert result.released["state"] and result.released["window"][0] not in tree.pools["window"]
    tree.check(external={})


def test_insert_keeps_reused_prefix_slots() -> None:
    tree = make_tree()
    put(tree, A[:8])
    match = tree.match([*A, 0])
    assert match.compressed_len == 8
    slots = {
        name: tree.prefix_slots(match.compressed_node, name) + tree.pools[name].alloc(4 // ratio)
        for name, ratio in RATIOS.items()
    }
    result = tree.insert(A, slots, tree.pools["window"].alloc(WINDOW), tree.pools["state"].alloc(1)[0])
    assert result.new_tokens == 4 and not any(result.released.values())
    assert tree.prefix_slots(result.node, "c4") == slots["c4"]
    tree.check(external={})


def test_insert_rejects_bad_input_and_changes_no_ownership() -> None:
    tree = make_tree()
    node = put(tree, B).node
    owned = {name: tree.pools[name].owned() for name in POOLS}
    good = {name: tree.pools[name].alloc(8 // ratio) for name, ratio in RATIOS.items()}
    swapped = dict(good, c128=node.slots["c128"][::-1])  # tree-owned slots at the wrong positions
    with pytest.raises(ValueError, match="owned by the tree"):
        tree.insert(B, swapped)
    with pytest.raises(ValueError, match="not allocated"):
        tree.insert(B, dict(good, c4=[60, 61, 62, 63]))
    with pytest.raises(ValueError, match="multiple of 4"):
        tree.insert(B[:6], good)
    with pytest.raises(ValueError, match="c128 slots"):
        tree.insert(B, dict(good, c128=[]))
    with pytest.raises(ValueError, match="together"):
        tree.insert(B, good, window_tail=[0, 1])
    with pytest.raises(ValueError, match="2 slots"):
        tree.insert(B, good, window_tail=[0], state=0)
    extra = {name: set(slots) for name, slots in good.items()}
    tree.check(external=extra)
    assert all(tree.pools[name].owned() == owned[name] | extra.get(name, set()) for name in POOLS)


def test_window_eviction_is_lru_and_respects_window_locks() -> None:
    tree = make_tree()
    a, b = put(tree, A).node, put(tree, B).node
    tree.match([*A, 0])  # A is now more recent than B
    assert tree.evict("window", 1) == WINDOW and b.window_tail is None and a.window_tail is not None
    tree.lock(a, "window")
    assert tree.evict("state", 5) == 0 and a.window_tail is not None
    tree.unlock(a, "window")
    assert tree.evict("state", 1) == 1 and tree.stats()["tombstones"] == 2
    assert tree.stats()["slots"]["window"] == 0
    tree.check(external={})


def test_window_eviction_ties_go_shallowest_first() -> None:
    tree = make_tree()
    short = put(tree, A[:8]).node
    deep = put(tree, A).node  # touches both nodes at once
    assert tree.evict("window", 1) == WINDOW and short.window_tail is None and deep.window_tail is not None


def test_window_eviction_drops_superseded_tails_before_older_ones() -> None:
    tree = make_tree()
    other = put(tree, B).node  # the least recently used, but the only tail on its path
    short = put(tree, A[:8]).node
    deep = put(tree, A).node  # a conversation continued: the tail at A[:8] now only serves a branch there
    tree.match([*B, 0])
    tree.match([*A[:8], 0])  # even when the superseded tail was used last
    assert tree.evict("window", 1) == WINDOW and short.window_tail is None
    assert other.window_tail is not None and deep.window_tail is not None
    # a tail about to go below ``deep`` supersedes it: it goes before the older ``other``
    assert tree.evict("window", 1, above=[deep]) == WINDOW and deep.window_tail is None
    assert other.window_tail is not None


def test_compressed_eviction_removes_lru_leaves_then_their_parents() -> None:
    tree = make_tree()
    first = put(tree, A[:8]).node
    second = put(tree, [*A[:4], 0, 0, 0, 0]).node
    shared = first.parent
    assert shared is second.parent and shared is not None and shared.end == 4
    tree.match([*A[:8], 0])  # first is now more recent than second
    assert tree.evict("c128", 1) == 1 and second.parent is None and first.parent is shared
    tree.lock(first, "full")
    assert tree.evict("c4", 100) == 0
    tree.unlock(first, "full")
    assert tree.evict("c4", 3) == 4  # first (2 slots), then shared became a leaf (2 slots)
    empty = {"nodes": 0, "tombstones": 0, "cached_tokens": 0, "locked_nodes": 0, "slots": dict.fromkeys(POOLS, 0)}
    assert tree.stats() == empty
    assert all(tree.pools[name].used_count == 0 for name in POOLS)
    with pytest.raises(ValueError, match="evicted"):
        tree.lock(first, "full")


def test_window_lock_keeps_a_node_from_compressed_eviction() -> None:
    tree = make_tree()
    node = put(tree, B).node
    tree.lock(node, "window")
    assert tree.evict("c128", 1) == 0 and node.parent is tree.root
    with pytest.raises(KeyError, match="no pool named"):
        tree.evict("nope", 1)


def test_unlock_errors() -> None:
    tree = make_tree()
    node = put(tree, B).node
    with pytest.raises(ValueError, match="no window lock"):
        tree.unlock(node, "window")
    with pytest.raises(ValueError, match="no full lock"):
        tree.unlock(node, "full")
    with pytest.raises(ValueError, match="unknown lock kind"):
        tree.lock(node, "partial")


@pytest.mark.parametrize(
    ("chunk", "window", "ratios", "message"),
    [(4, 8, RATIOS, "window <= chunk"), (6, 2, RATIOS, "not a multiple"), (4, 2, {"c256": 4}, "missing: c256")],
)
def test_constructor_validates(chunk: int, window: int, ratios: dict[str, int], message: str) -> None:
    pools = PoolSet.from_capacities(dict.fromkeys(POOLS, 4))
    with pytest.raises(ValueError, match=message):
        ShadowRadix(pools, chunk, window, ratios)


def test_check_catches_a_leak() -> None:
    tree = make_tree()
    put(tree, B)
    tree.pools["c4"].alloc(1)
    with pytest.raises(AssertionError, match="leaked"):
        tree.check(external={})


def path_tokens(node: RadixNode) -> tuple[int, ...]:
    """The whole prefix a node ends."""
    parts: list[tuple[int, ...]] = []
    current: RadixNode | None = node
    while current is not None:
        parts.append(current.tokens)
        current = current.parent
    return tuple(token for part in reversed(parts) for token in part)


def cached(tree: ShadowRadix) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """The aligned prefixes whose compressed entries are cached, and the prefixes with a live tail."""
    present, tails = set(), set()
    for node in tree.nodes():
        full = path_tokens(node)
        present |= {full[:end] for end in range(node.start + CHUNK, node.end + 1, CHUNK)}
        if node.window_tail is not None:
            tails.add(full)
    return present, tails


@dataclass
class Held:
    """A lock the test holds: on ``node``, of ``kind``, taken when it ended ``prefix``."""

    node: RadixNode
    kind: str
    prefix: tuple[int, ...]


SMALL = {"window": 3 * WINDOW, "state": 3, "c4": 12, "c4_index": 12, "c128": 6}
# Whole chunks from a two-chunk alphabet (so prompts share prefixes often), then 0-2 loose tokens.
sequences = st.builds(
    lambda chunks, rest: [token for chunk in chunks for token in chunk] + rest,
    st.lists(st.sampled_from([(0, 0, 0, 0), (0, 1, 0, 1)]), max_size=4),
    st.lists(st.integers(0, 1), max_size=2),
)


class ShadowRadixMachine(RuleBasedStateMachine):
    """Drives the tree like an engine (match, lock, allocate with eviction, insert, unlock) over small
    pools, and compares it after every step with a reference: the set of cached aligned prefixes and the
    set of prefixes whose end boundary has a live tail."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = make_tree(SMALL)
        self.present: set[tuple[int, ...]] = set()
        self.tails: set[tuple[int, ...]] = set()
        self.locks: list[Held] = []
        self.held: dict[str, set[int]] = {name: set() for name in POOLS}

    def check_match(self, tokens: list[int], match: Match) -> None:
        """Match agrees with the reference: longest cached aligned prefix, deepest live tail within it."""
        limit = max(len(tokens) - 1, 0) // CHUNK * CHUNK
        ends = range(CHUNK, limit + 1, CHUNK)
        compressed = max((end for end in ends if tuple(tokens[:end]) in self.present), default=0)
        resume = max((end for end in ends if end <= compressed and tuple(tokens[:end]) in self.tails), default=0)
        assert lens(match) == (compressed, resume, compressed - resume)
        assert match.compressed_node.end == compressed and match.resume_node.end == resume
        assert [node.end for node in match.path] == sorted({node.end for node in match.path})
        assert path_tokens(match.compressed_node) == tuple(tokens[:compressed])

    def evict(self, pool: str, n_slots: int) -> None:
        """Evicts, then checks what went: only unlocked things, enough or all it could, and the right kind."""
        before = self.tree.pools[pool].used_count
        freed = self.tree.evict(pool, n_slots)
        assert before - self.tree.pools[pool].used_count == freed
        present, tails = cached(self.tree)
        assert present <= self.present and tails <= self.tails
        if pool in ("window", "state"):
            assert present == self.present
            stuck = all(node.window_locks for node in self.tree.nodes() if node.window_tail is not None)
        else:
            assert tails == self.tails & present
            stuck = all(node.children or node.full_locks or node.window_locks for node in self.tree.nodes())
        assert freed >= n_slots or stuck
        self.present, self.tails = present, tails
        self.check_locks()

    def alloc(self, pool: str, n: int) -> list[int] | None:
        """Allocates like the engine: evict what is missing first; None when even that is not enough."""
        slots = self.tree.pools[pool]
        if slots.free_count < n:
            self.evict(pool, n - slots.free_count)
        if slots.free_count < n:
            return None
        got = slots.alloc(n)
        self.held[pool] |= set(got)
        return got

    def check_locks(self) -> None:
        """Locked prefixes stay cached; window-locked tails stay live."""
        for held in self.locks:
            if held.kind == "full":
                assert not held.prefix or held.prefix in self.present
            elif held.prefix:
                assert held.prefix in self.tails

    def take(self, node: RadixNode, kind: str) -> None:
        self.tree.lock(node, kind)
        self.locks.append(Held(node, kind, path_tokens(node)))

    def release(self, held: Held) -> None:
        self.tree.unlock(held.node, held.kind)
        self.locks.remove(held)

    @rule(tokens=sequences, reuse=st.booleans(), with_tail=st.booleans())
    def serve(self, tokens: list[int], reuse: bool, with_tail: bool) -> None:
        match = self.tree.match(tokens)
        self.check_match(tokens, match)
        length = len(tokens) // CHUNK * CHUNK
        if not length:
            return
        self.take(match.compressed_node, "full")
        request = self.locks[-1]
        slots: dict[str, list[int]] = {}
        for name, ratio in RATIOS.items():
            reused = self.tree.prefix_slots(match.compressed_node, name) if reuse else []
            fresh = self.alloc(name, length // ratio - len(reused))
            if fresh is None:
                return self.abandon(request)
            slots[name] = reused + fresh
        window = state = None
        if with_tail:
            window, state = self.alloc("window", WINDOW), self.alloc("state", 1)
            if window is None or state is None:
                return self.abandon(request)
        result = self.tree.insert(tokens[:length], slots, window, state[0] if state else None)
        revived = with_tail and tuple(tokens[:length]) not in self.tails
        assert result.node.end == length and result.tail_adopted == revived
        for name, released in result.released.items():
            assert not set(released) & self.tree.pools[name].owned()
        self.held = {name: set() for name in POOLS}
        self.present |= {tuple(tokens[:end]) for end in range(CHUNK, length + 1, CHUNK)}
        if with_tail:
            self.tails.add(tuple(tokens[:length]))
        self.release(request)

    def abandon(self, request: Held) -> None:
        """The request could not get its slots: give back what it allocated and its lock."""
        for name, slots in self.held.items():
            self.tree.pools[name].free(slots)
        self.held = {name: set() for name in POOLS}
        self.release(request)

    @rule(tokens=sequences)
    def match(self, tokens: list[int]) -> None:
        self.check_match(tokens, self.tree.match(tokens))

    @precondition(lambda self: len(self.locks) < 4)
    @rule(tokens=sequences)
    def hold_prefix(self, tokens: list[int]) -> None:
        match = self.tree.match(tokens)
        self.check_match(tokens, match)
        self.take(match.compressed_node, "full")
        self.take(match.resume_node, "window")

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        self.release(data.draw(st.sampled_from(self.locks)))

    @rule(pool=st.sampled_from(POOLS), n_slots=st.integers(0, 8))
    def evict_some(self, pool: str, n_slots: int) -> None:
        self.evict(pool, n_slots)

    @invariant()
    def consistent(self) -> None:
        self.tree.check(external=self.held)
        assert cached(self.tree) == (self.present, self.tails)
        self.check_locks()


TestShadowRadixMachine = ShadowRadixMachine.TestCase
TestShadowRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
