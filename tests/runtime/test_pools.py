"""SlotPool and PoolSet: deterministic allocation, all-or-nothing errors, usage reporting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v4compile.runtime.pools import PoolExhausted, PoolSet, SlotPool


def test_alloc_is_lowest_first_and_reuses_freed_slots() -> None:
    pool = SlotPool("c4", 8, bytes_per_slot=16)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(2) == [3, 4]
    pool.free([1, 3])
    assert pool.alloc(3) == [1, 3, 5]
    assert pool.used_count == 6 and pool.free_count == 2
    assert pool.used_bytes == 96 and pool.capacity_bytes == 128
    assert pool.owned() == {0, 1, 2, 3, 4, 5}
    assert 5 in pool and 6 not in pool


def test_exhausted_names_pool_and_allocates_nothing() -> None:
    pool = SlotPool("window", 4)
    pool.alloc(3)
    with pytest.raises(PoolExhausted, match="'window'.*requested 2.*1 free") as info:
        pool.alloc(2)
    assert (info.value.pool, info.value.requested, info.value.free) == ("window", 2, 1)
    assert pool.free_count == 1 and pool.alloc(1) == [3]


@pytest.mark.parametrize(("bad", "named"), [([0], 0), ([9], 9), ([1, 1], 1), ([2, 1, 0], 0)])
def test_bad_free_names_slot_and_frees_nothing(bad: list[int], named: int) -> None:
    pool = SlotPool("state", 4)
    pool.alloc(3)
    pool.free([0])
    with pytest.raises(ValueError, match=f"slot {named} is not in use"):
        pool.free(bad)
    assert pool.owned() == {1, 2}


def test_negative_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        SlotPool("c128", -1)
    with pytest.raises(ValueError):
        SlotPool("c128", 2).alloc(-1)


def test_pool_set_lookup_and_stats() -> None:
    pools = PoolSet.from_capacities({"window": 8, "c4": 4}, bytes_per_slot={"window": 10})
    assert list(pools) == ["window", "c4"] and len(pools) == 2
    pools["window"].alloc(3)
    assert pools.stats() == {
        "window": {"capacity": 8, "used": 3, "free": 5, "used_bytes": 30, "capacity_bytes": 80},
        "c4": {"capacity": 4, "used": 0, "free": 4, "used_bytes": 0, "capacity_bytes": 0},
    }
    with pytest.raises(KeyError, match="window, c4"):
        pools["c128"]
    with pytest.raises(ValueError, match="duplicate"):
        PoolSet([SlotPool("c4", 1), SlotPool("c4", 2)])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    pool, used = SlotPool("c4", 10), set[int]()
    for is_alloc, n in ops:
        if is_alloc:
            free = sorted(set(range(10)) - used)
            if n > len(free):
                with pytest.raises(PoolExhausted):
                    pool.alloc(n)
            else:
                assert pool.alloc(n) == free[:n]
                used |= set(free[:n])
        else:
            victims = sorted(used)[:n]
            pool.free(victims)
            used -= set(victims)
        assert pool.owned() == used and pool.free_count == 10 - len(used)
