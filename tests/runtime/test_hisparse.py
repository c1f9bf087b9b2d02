"""HiSparse against fully resident caches: decode logits equal bit for bit under a hot buffer so small that
every step swaps (plain and speculative steps, draft rollbacks, row moves), the engine's greedy tokens equal
with prefix hits served from the host tier, admission counts the host tier, and a hot buffer below one
step's working set is refused at start."""

from __future__ import annotations

import copy

import pytest
import torch

from v4compile import DeepSeekV4, V4Config
from v4compile.runtime.cache_manager import pages_for
from v4compile.runtime.engine import Engine
from v4compile.runtime.hisparse import (
    HiSparse,
    HiSparseCache,
    copy_rows,
    device_row_bytes,
    min_hot_entries,
    slot_bytes,
)

MAX_LEN = 512


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4(V4Config.preset("tiny", max_seq_len=MAX_LEN), seed=3).eval()


ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
"""The same checks on the CPU (both tiers in host memory) and on a GPU (pinned host tier, device hot buffer)."""


def _on(model: DeepSeekV4, device: str) -> DeepSeekV4:
    return model if device == "cpu" else copy.deepcopy(model).to(device)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@ON_DEVICES
def test_decode_equals_a_resident_cache_while_every_step_swaps(model: DeepSeekV4, device: str) -> None:
    model = _on(model, device)
    config, rows = model.config, 3
    hisparse = HiSparse(config, rows, MAX_LEN, min_hot_entries(rows, config.index_topk, 2), device)
    caches = [model.new_cache(rows, MAX_LEN), HiSparseCache(config, hisparse, device)]
    prompts = [_ids(61, 1), _ids(130, 2), _ids(95, 3)]
    tokens = []
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            staging = model.new_cache(1, MAX_LEN)
            tokens.append(int(model(torch.tensor([prompt], device=device), cache=staging)[0, -1].argmax()))
            for cache in caches:
                cache.copy_row(row, staging, 0)
        positions = torch.tensor([len(p) for p in prompts], device=device)
        ids = torch.tensor(tokens, device=device).view(rows, 1)
        fetched = []
        for step in range(9):
            if step == 3:  # the engine's compaction: row 1 finished, row 2 moves down, row 2 becomes padding
                for cache in caches:
                    cache.copy_row(1, cache, 2)
                positions[1], ids[1] = positions[2], ids[2]
                positions[2], ids[2] = 0, 0
            draft = step % 3 == 2  # a wrong draft per row, verified then rolled back
            step_ids = torch.cat((ids, (ids + 1) % 512), dim=1) if draft else ids
            logits = []
            for cache in caches:
                checkpoint = cache.draft_checkpoint()
                out = (model.decode_tokens(step_ids, positions, cache)[0] if draft
                       else model.decode_step(step_ids, positions, cache))
                if draft:
                    cache.rollback_draft(checkpoint, torch.arange(rows, device=device), positions + 1)
                logits.append(out)
            assert torch.equal(logits[0], logits[1]), f"step {step}"
            ids = logits[0][:, 0].argmax(-1, keepdim=True)
            positions = positions + 1
            fetched.append(hisparse.stats()["fetched"])
    stats = hisparse.stats()
    assert fetched[0] > 0 and all(b > a for a, b in zip(fetched, fetched[1:], strict=False))  # every step swaps
    assert stats["backed_up"] > 0 and 0 < stats["hit_rate"] < 1 and stats["steps"] == 9
    assert stats["bytes_per_step"] > 0


@ON_DEVICES
def test_engine_greedy_equals_without_and_prefix_hits_come_from_the_host_tier(model: DeepSeekV4,
                                                                               device: str) -> None:
    model = _on(model, device)

    def conversation(engine: Engine) -> list[list[int]]:
        first = [_ids(140, 4), _ids(200, 5), _ids(75, 6)]
        outs = engine.generate(first, 5)
        second = [p + r.tokens + _ids(30, 7 + i) for i, (p, r) in enumerate(zip(first, outs, strict=True))]
        again = engine.generate(second, 5)
        if engine.hisparse is not None:
            assert [r.cache.cached_tokens for r in again] == [128, 128, 0]
        return [r.tokens for r in outs + again]

    plain = conversation(Engine(model, prefix_cache=False, max_batch=3, decode_buckets=(3,), max_seq_len=MAX_LEN))
    hot = min_hot_entries(3, model.config.index_topk) * slot_bytes(model.config)
    engine = Engine(model, max_batch=3, decode_buckets=(3,), max_seq_len=MAX_LEN, hisparse_budget=hot)
    assert conversation(engine) == plain
    stats = engine.stats()
    assert stats["host_pools"] == ["c4"]
    assert stats["hisparse"]["fetched"] > 0 and stats["hisparse"]["hot_entries"] == 27


def test_admission_counts_the_host_tier(model: DeepSeekV4) -> None:
    config, length = model.config, 4096
    full = model.new_cache(1, length, "meta").nbytes()
    hot = min_hot_entries(16, config.index_topk) * slot_bytes(config)
    budget = 5 * full + hot
    off = Engine(model, memory_budget=budget, max_batch=16, max_seq_len=length, prefix_cache=False)
    on = Engine(model, memory_budget=budget, max_batch=16, max_seq_len=length, prefix_cache=False,
                hisparse_budget=hot)
    # the same 16 rows; full-length sequences the entry pages hold: HiSparse's pages leave the C4 main entries to
    # the host tier (in the tiny model a row's C128 state, 128 fp32 rows, outweighs its C4 entries)
    assert off.max_batch == on.max_batch == 16
    assert [e.caches.pages.capacity // pages_for(length) for e in (off, on)] == [2, 3]
    assert on.hisparse is not None
    row = on.caches.decode.rows(0, 1).nbytes() + on.hisparse.slot_map[:-1].nbytes // on.max_batch
    assert row == device_row_bytes(config, length)


def test_a_hot_buffer_below_one_steps_working_set_is_refused(model: DeepSeekV4) -> None:
    need = min_hot_entries(3, model.config.index_topk)
    with pytest.raises(ValueError, match="smaller than one decode step's working set"):
        Engine(model, max_batch=3, max_seq_len=MAX_LEN, hisparse_budget=(need - 1) * slot_bytes(model.config))
    engine = Engine(model, max_batch=3, max_seq_len=MAX_LEN, hisparse_budget=need * slot_bytes(model.config))
    with pytest.raises(ValueError, match=r"3 rows x \(2 token\(s\) x index_topk 8 \+ 1 new entry\) = 51"):
        engine.generate([_ids(20, 1)], 2, mtp=True)


def test_row_copy_kernel_matches_its_reference() -> None:
    pytest.importorskip("triton")
    import triton

    if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        pytest.skip("triton was imported without its interpreter")
    src = torch.randn(40, 96).to(torch.bfloat16)
    dst_rows = torch.tensor([3, -1, 0, 7, -1, 5, 9])
    src_rows = torch.tensor([39, 2, 0, 17, 1, 5, 20])
    want, got = torch.zeros(10, 96, dtype=torch.bfloat16), torch.zeros(10, 96, dtype=torch.bfloat16)
    copy_rows(want, dst_rows, src, src_rows, kernel=False)
    copy_rows(got, dst_rows, src, src_rows, kernel=True)
    assert torch.equal(got, want) and got[1].abs().sum() == 0 and want[3].equal(src[39])


def test_any_max_seq_len_serves_under_hisparse() -> None:
    """Decode rows and staging rows agree on their page tables whatever max_seq_len is (here 1 past a page)."""
    model = DeepSeekV4(V4Config.preset("tiny", max_seq_len=1025), seed=3).eval()
    hot = min_hot_entries(3, model.config.index_topk, 2) * slot_bytes(model.config)
    engine = Engine(model, max_batch=3, max_seq_len=1025, hisparse_budget=hot)
    plain = Engine(model, max_batch=3, max_seq_len=1025, prefix_cache=False)
    assert engine.generate([_ids(200, 7)], 4)[0].tokens == plain.generate([_ids(200, 7)], 4)[0].tokens
