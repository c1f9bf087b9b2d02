"""Entry pages under the engine's cache manager, driven by hypothesis: requests sharing prefixes are admitted (a hit
maps the tree's pages), save their prefixes, move to decode rows, move between rows and finish, while the tree
evicts; no page is ever leaked, double-owned or left in a table that no longer owns it."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

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
