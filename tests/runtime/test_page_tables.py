"""Entry pages under the engine's cache manager, driven by hypothesis: requests sharing prefixes are admitted (a hit
maps the tree's pages), save their prefixes, move to decode rows, move between rows and finish, while the tree
evicts; no page is ever leaked, double-owned or left in a table that no longer owns it."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from v4compile import V4Config
from v4compile.model.cache import PAGE_TOKENS
from v4compile.runtime.cache_manager import CacheManager, MemoryPlan, pages_for
from v4compile.runtime.pools import PagePool

CONFIG = V4Config.preset("tiny", max_seq_len=1024)
ROWS, SLOTS, PAGES, TAILS = 3, 2, 11, 3
"""Decode rows, staging slots, entry pages (page 0 the null page) and window tails: few, so pages run short."""

SYSTEMS = [torch.randint(0, 500, (640,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]


def manager() -> CacheManager:
    model = SimpleNamespace(config=CONFIG, embed=torch.nn.Embedding(1, 1))
    plan = MemoryPlan(prefill_rows=SLOTS, decode_rows=ROWS, hot_bytes=0, tails=TAILS, pages=PAGES)
    return CacheManager(model, plan, rows=ROWS, max_seq_len=1024, chunk=PAGE_TOKENS, prefix_cache=True, tail_every=0)


class PageTableMachine(RuleBasedStateMachine):
    """Sequences as (prompt, pages) in staging slots and decode rows; the model itself never runs (page ownership
    does not depend on the entries' values)."""

    def __init__(self) -> None:
        super().__init__()
        self.caches = manager()
        self.staging: dict[int, tuple[list[int], list[int], int]] = {}
        self.decoding: list[tuple[list[int], list[int], int]] = []
        """(prompt, pages, frozen): the first ``frozen`` pages hold a cached prefix (read only, shareable)."""

    @rule(system=st.integers(0, 1), length=st.integers(1, 600), extra=st.integers(0, 5), new=st.integers(1, 380))
    def admit(self, system: int, length: int, extra: int, new: int) -> None:
        free = [s for s in range(SLOTS) if s not in self.staging]
        if not free or len(self.staging) + len(self.decoding) >= ROWS:
            return
        prompt = SYSTEMS[system][:length] + [extra] * extra
        before = self._refs()
        hit = self.caches.begin_prefill(free[0], prompt, restore=True, tokens=len(prompt) + new)
        if hit is None:  # too few pages even after evicting: nothing taken (the tree may have evicted, freeing)
            after = self._refs()
            assert all(after.get(p, 0) <= n for p, n in before.items()) and set(after) <= set(before)
            return
        assert len(hit.pages) == pages_for(len(prompt) + new) and 0 not in hit.pages
        assert hit.resume_len % PAGE_TOKENS == 0 and hit.resume_len < len(prompt)
        self.staging[free[0]] = (prompt, hit.pages, hit.resume_len // PAGE_TOKENS)

    @precondition(lambda self: bool(self.staging))
    @rule(data=st.data())
    def prefill_done(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.staging)))
        prompt, pages, _ = self.staging.pop(slot)
        self.caches.save_prefix(prompt, len(prompt) // PAGE_TOKENS * PAGE_TOKENS, slot, pages)
        if data.draw(st.booleans()) and len(self.decoding) < ROWS:
            self.caches.to_decode(len(self.decoding), slot)
            self.decoding.append((prompt, pages, len(prompt) // PAGE_TOKENS))
        else:  # finished at its first token
            self.caches.release(pages)

    @precondition(lambda self: bool(self.decoding))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        row = data.draw(st.integers(0, len(self.decoding) - 1))
        _, pages, _ = self.decoding.pop(row)
        moves = [(r, r + 1) for r in range(row, len(self.decoding))]
        self.caches.move_rows(moves, live=len(self.decoding))
        self.caches.release(pages)

    @rule(n=st.integers(1, PAGES))
    def evict(self, n: int) -> None:
        assert self.caches.store is not None
        self.caches.store.tree.evict("pages", n)

    def _refs(self) -> dict[int, int]:
        pool: PagePool = self.caches.pages
        return {p: pool.refs(p) for p in range(PAGES) if pool.refs(p)}

    @invariant()
    def pages_are_owned_exactly(self) -> None:
        sequences = [*self.staging.values(), *self.decoding]
        held = [p for _, pages, _ in sequences for p in pages]
        assert self.caches.store is not None
        self.caches.store.tree.check({"pages": held})  # references = the tree's + one per sequence holding it
        pool = self.caches.pages
        assert pool.used_count + pool.free_count == PAGES - 1 and 0 not in pool.owned()
        # the pages a sequence still writes belong to it alone: no other sequence, and not the tree, names them
        counts, cached = Counter(held), self.caches.store.tree.held("pages")
        for _, pages, frozen in sequences:
            assert all(counts[p] == 1 and p not in cached for p in pages[frozen:])

    @invariant()
    def tables_name_the_owners_pages(self) -> None:
        table = self.caches.decode.table
        assert table is not None
        for row in range(ROWS):
            want = self.decoding[row][1] if row < len(self.decoding) else []
            assert table[row, : len(want)].tolist() == want and not table[row, len(want) :].any()
        for slot, (_, pages, _) in self.staging.items():
            staged = self.caches.staging[slot].table
            assert staged is not None and staged[0, : len(pages)].tolist() == pages


TestPageTables = PageTableMachine.TestCase
TestPageTables.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("end", [256, 300, 131])
def test_a_tail_saved_and_loaded_restores_rings_and_states_exactly(end: int) -> None:
    """A window tail and C4 state snapshot saved from one cache row and loaded into a cleared one give back the
    row's ring slots of the last ``window`` tokens and the previous-block states, wherever the ring wraps; a full
    reset clears windows and states (scores to -inf) and leaves shared pages alone."""
    from v4compile.model.cache import V4Cache
    from v4compile.model.pages import EntryPages
    from v4compile.runtime.prefix_pools import PrefixPools

    config = V4Config.preset("tiny", max_seq_len=512)
    pages = EntryPages(config, 9, "cpu")
    for pool in pages.pools.values():
        pool.normal_()
    source, target = V4Cache(config, 1, 512, "cpu", pages), V4Cache(config, 1, 512, "cpu", pages)
    for cache in (source, target):
        for t in cache.tensors():
            if t.is_floating_point():
                t.normal_()
    kept = {key: pool.clone() for key, pool in pages.pools.items()}
    pools = PrefixPools(config, tails=2, device=torch.device("cpu"))
    slots = list(range(config.window_size, 2 * config.window_size))
    pools.store_tail(source, end, slots, state=1)
    target.reset()
    for layer in target.all_layers:
        assert not layer.window.any()
        for c in (layer.compressor, layer.indexer):
            if c is not None:
                assert not c.kv_state.any() and bool((c.score_state == float("-inf")).all())
    assert all(torch.equal(pool, kept[key]) for key, pool in pages.pools.items())
    pools.load(target, end, slots, state=1, c4=[])
    ring = torch.arange(end - config.window_size, end) % config.window_size
    for mine, theirs in zip(target.layers, source.layers, strict=True):
        assert torch.equal(mine.window[0, ring], theirs.window[0, ring])
        for c, s in ((mine.compressor, theirs.compressor), (mine.indexer, theirs.indexer)):
            if c is not None and c.kv_state.shape[1] == 8:
                w = c.kv_state.shape[-1] // 2
                assert torch.equal(c.kv_state[0, :4, :w], s.kv_state[0, :4, :w])
                assert torch.equal(c.score_state[0, :4, :w], s.score_state[0, :4, :w])
