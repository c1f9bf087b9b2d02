"""TileLang compressor pooling, mHC and indexer scoring against their references on CPU (the ``c`` target),
through the custom ops.

TileLang's C build takes seconds per kernel: the cases share a few (ratio, width) shapes, and the kernels are
specialised on shape only through ratio and width (batch, tokens and entries are dynamic)."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import REGISTRY, load_module

pytest.importorskip("tilelang")

C4, C128 = (4, 24), (128, 16)


def _prefill(bsz: int, tokens: int, ratio: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    c = 2 if ratio == 4 else 1
    kv = torch.randn(bsz, tokens, c * width) * 3
    score = torch.randn(bsz, tokens, c * width) * 3
    return kv, score, torch.randn(ratio, c * width)


@pytest.mark.parametrize(("ratio", "width"), [C4, C128])
@pytest.mark.parametrize(("bsz", "tokens", "blocks"), [
    (2, 4 * 128 + 5, None),  # every complete block; the 5 remainder tokens are left out
    (3, 4 * 128, 2),         # fewer entries than the sequence holds
    (1, 4 * 128 + 64, 1),    # C4: entry 0 alone, with no previous block
])
def test_compressor_pool_matches_reference(ratio: int, width: int, bsz: int, tokens: int, blocks: int | None) -> None:
    kv, score, ape = _prefill(bsz, tokens, ratio, width, seed=tokens + bsz)
    n = tokens // ratio if blocks is None else blocks
    got = ops.compressor_pool(kv, score, ape, ratio, width, n, "tilelang")
    assert got.shape == (bsz, n, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference.compressor_pool(kv, score, ape, ratio, width, n), rtol=1e-5, atol=1e-5)
    record = REGISTRY.records[f"compressor_pool.c{ratio}.w{width}.tilelang"]
    assert record.error is None and "T.prim_func" in record.source and record.lowered


def test_compressor_pool_bf16_inputs_and_no_entries() -> None:
    kv, score, ape = _prefill(2, 4 * 20 + 3, *C4, seed=7)
    kv, score = kv.bfloat16(), score.bfloat16()
    got = ops.compressor_pool(kv, score, ape, *C4, 20, "tilelang")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference.compressor_pool(kv, score, ape, *C4, 20), rtol=1e-5, atol=1e-5)
    assert ops.compressor_pool(kv[:, :3], score[:, :3], ape, *C4, 0, "tilelang").shape == (2, 0, C4[1])


@pytest.mark.parametrize(("ratio", "width"), [C4, C128])
def test_compressor_pool_state_matches_reference_with_masked_slots(ratio: int, width: int) -> None:
    torch.manual_seed(ratio + width)
    c = 2 if ratio == 4 else 1
    kv = torch.randn(4, c * ratio, c * width)
    score = torch.randn(4, c * ratio, c * width) * 2
    score[0, : c * ratio // 2] = float("-inf")  # an open block: only its latest slots are filled
    score[1, :, : width // 2] = float("-inf")
    score[1, -1, : width // 2] = 0.5            # one live slot in some dims
    score[2, : c * ratio - 1] = float("-inf")   # a single live slot
    got = ops.compressor_pool_state(kv, score, ratio, width, "tilelang")
    want = reference.compressor_pool_state(kv, score, ratio, width)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.compressor_pool_state(kv.bfloat16(), score.bfloat16(), ratio, width, "tilelang"),
                               reference.compressor_pool_state(kv.bfloat16(), score.bfloat16(), ratio, width),
                               rtol=1e-5, atol=1e-5)
    record = REGISTRY.records[f"compressor_pool_state.c{ratio}.w{width}.tilelang"]
    assert record.launch["grid"] == (1, 4) and record.launch["threads"] == 128
    score[3, :, 1] = score[3, :, (c - 1) * width + 1] = float("-inf")  # dim 1: no slot written (either half)
    got = ops.compressor_pool_state(kv, score, ratio, width, "tilelang")
    want = reference.compressor_pool_state(kv, score, ratio, width)
    assert want[3, 1].isnan() and got[3, 1].isnan()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_fp64_inputs_accumulate_in_fp64() -> None:
    kv, score, ape = (t.double() for t in _prefill(2, 4 * 6 + 1, *C4, seed=3))
    got = ops.compressor_pool(kv, score, ape, *C4, 6, "tilelang")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference.compressor_pool(kv, score, ape, *C4, 6), rtol=1e-12, atol=1e-12)
    state, state_score = kv[:, :8], score[:, :8].clone()
    state_score[1, :4] = float("-inf")
    got = ops.compressor_pool_state(state, state_score, *C4, "tilelang")
    torch.testing.assert_close(got, reference.compressor_pool_state(state, state_score, *C4), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("lead", "n", "dim", "dtype"), [
    ((3,), 4, 128, torch.bfloat16), ((2, 5), 4, 64, torch.float32), ((70,), 4, 32, torch.bfloat16),
    ((5,), 3, 48, torch.bfloat16),
])
def test_mhc_pre_and_post_match_reference(lead: tuple[int, ...], n: int, dim: int, dtype: torch.dtype) -> None:
    """The split-K projection (rows in blocks of 4, splits of 128 columns: one short split at dim 48), the
    finishing blocks (y, post, Sinkhorn) and the post step, through the ops with backend="tilelang"."""
    gen = torch.Generator().manual_seed(n + dim)
    x = (torch.randn(*lead, n, dim, generator=gen) * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * dim, generator=gen) / (n * dim) ** 0.5 * 4
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn((2 + n) * n, generator=gen)
    y, post, comb = ops.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, "tilelang")
    want_y, want_post, want_comb = reference.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2.0**-7, atol=1e-5)
    assert y.dtype == dtype and (dtype != torch.bfloat16 or (y != want_y).float().mean() < 0.01)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-6)
    sub = torch.randn(*lead, dim, generator=gen).to(dtype)
    got = ops.mhc_post(sub, x, want_post, want_comb, "tilelang")
    torch.testing.assert_close(got.float(), reference.mhc_post(sub, x, want_post, want_comb).float(), rtol=2.0**-7,
                               atol=1e-5)
    for step in ("mhc_pre", "mhc_post"):
        record = REGISTRY.records[f"{step}.n{n}.d{dim}.tilelang"]
        assert record.error is None and record.launch["target"] == "c" and record.lowered


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_scores_match_the_model_rounding(dtype: torch.dtype) -> None:
    """The c target's scoring: 10 heads (zero-padded to the tile), 70 keys (a short last tile), two queries of
    two rows; in bf16 every step rounds as the model does (bitwise here), fp32 differs by the summation order."""
    torch.manual_seed(5)
    q, keys = torch.randn(2, 2, 10, 32).to(dtype), torch.randn(2, 70, 32).to(dtype)
    w = torch.randn(2, 2, 10).to(dtype)
    got = ops.indexer_scores(q, keys, w, "tilelang")
    want = reference.indexer_scores(q, keys, w)
    assert got.dtype == torch.float32 and got.shape == (2, 2, 70)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    record = REGISTRY.records[f"indexer_scores.d32.{'bf16' if dtype == torch.bfloat16 else 'fp32'}.tilelang"]
    assert record.error is None and record.launch["target"] == "c" and record.lowered
    assert ops.implementation_backend("indexer_scores", "tilelang", q) == "tilelang"


def test_indexer_scores_beyond_one_tile_of_heads_run_triton() -> None:
    q, keys, w = torch.randn(1, 1, 80, 16), torch.randn(1, 9, 16), torch.randn(1, 1, 80)
    assert ops.implementation_backend("indexer_scores", "tilelang", q) == "triton"
    torch.testing.assert_close(ops.indexer_scores(q, keys, w, "tilelang"), reference.indexer_scores(q, keys, w),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler to build for sm_90a")
def test_indexer_scores_hopper_source_streams_keys_into_wgmma(tmp_path) -> None:
    scores = importlib.import_module("v4compile.codegen.tilelang.indexer_scores")
    config = scores.launch_config(64, 16384, cuda=True)  # 16 tiles a block through 3 stages
    path = tmp_path / "scores.py"
    path.write_text(scores._SOURCE.format(dim=128, block_h=64, round=True, in_dtype="bfloat16", **config))
    source = load_module(path).build({"kind": "cuda", "arch": "sm_90a"}).get_kernel_source()
    assert "cp_async_gs_conditional" in source and "wgmma" in source  # keys a stage ahead, tensor-core product
    assert "tl::cp_async_wait<2>" in source  # three stages in flight


def test_compressor_entry_state_takes_what_the_reference_takes() -> None:
    """The decode-state finish takes the cos / sin shapes the reference takes (one table for every row, one row
    per sequence) and an empty batch."""
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    torch.manual_seed(11)
    cos, sin = rope_cos_sin(rope_frequencies(32, 1e4, 0, 1, 32, 1), torch.tensor([8, 40]))
    weight = torch.rand(96) + 0.5
    kv, score = torch.randn(2, 8, 192), torch.randn(2, 8, 192)
    for c, s in ((cos[0], sin[0]), (cos, sin)):  # [r/2] for every row, [B, r/2]
        args = (kv, score, 4, 96, c, s, weight, 1e-6, False, True, True)
        got, want = ops.compressor_entry_state(*args, "tilelang"), reference.compressor_entry_state(*args)
        assert torch.equal(got, want)
    empty = ops.compressor_entry_state(kv[:0], score[:0], 4, 96, cos[:0], sin[:0], weight, 1e-6, False, True, True,
                                       "tilelang")
    assert empty.shape == (0, 96) and empty.dtype == torch.bfloat16


def _topk_scores() -> torch.Tensor:
    """Rows that stress the selection: heavy ties at the threshold, NaN of either sign and signed zeros, fewer
    real scores than k (-inf fills the rest), and periodic scores (every group holds repeated values)."""
    torch.manual_seed(3)
    x = torch.randn(4, 3000)
    x[0, :1000] = torch.randint(-2, 3, (1000,)).float()
    x[1, 100:110] = float("nan")
    x[1, 200:205] = -float("nan")
    x[1, 300:310] = -0.0
    x[2] = float("-inf")
    x[2, ::500] = torch.randn(6)
    x[3] = (torch.arange(3000) % 50).float()
    return x


def _assert_same_selection(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))  # NaN payloads and zero signs too


@pytest.mark.parametrize("mask", [False, True])
def test_radix_topk_is_the_stable_sort_prefix(mask: bool) -> None:
    x = _topk_scores()
    _assert_same_selection(ops.radix_topk(x, 32, mask, "tilelang"), reference.radix_topk(x, 32, mask))
    assert REGISTRY.records["radix_topk.k32.tilelang"].launches


def test_radix_topk_bf16_short_rows_and_k_equal_to_the_row() -> None:
    x = torch.randn(3, 257).bfloat16()
    values, ids = ops.radix_topk(x, 32, False, "tilelang")
    want_v, want_i = reference.radix_topk(x, 32, False)
    assert values.dtype == torch.bfloat16 and torch.equal(ids, want_i) and torch.equal(values, want_v)
    whole = torch.randn(2, 32)
    _assert_same_selection(ops.radix_topk(whole, 32, False, "tilelang"), reference.radix_topk(whole, 32, False))
    from v4compile.codegen.tilelang import radix_topk

    with pytest.raises(ValueError, match="k=33"):
        radix_topk.radix_topk(whole, 33, False, radix_topk.launch_config(32, 33, cuda=False))
    # the op serves graphs compiled for every length: no more candidates than k gives every one, sorted
    for k in (32, 33):
        values, ids = ops.radix_topk(whole, k, True, "tilelang")
        assert torch.equal(ids, reference.radix_topk(whole, k, True)[1]) and ids.shape == (2, 32)


def test_radix_topk_candidate_overflow_takes_the_exact_path() -> None:
    from v4compile.codegen.tilelang import radix_topk

    x = _topk_scores()
    config = {**radix_topk.launch_config(3000, 32, cuda=False), "cap": 32}  # any extra candidate overflows
    for mask in (False, True):
        _assert_same_selection(radix_topk.radix_topk(x, 32, mask, config), reference.radix_topk(x, 32, mask))


def test_radix_topk_groups_fewer_than_k_are_refused() -> None:
    from v4compile.codegen.tilelang import radix_topk

    config = {**radix_topk.launch_config(20, 8, cuda=False), "group": 4}  # 5 group maxima for k=8
    with pytest.raises(ValueError, match="5 group maxima for 20 candidates, fewer than k=8"):
        radix_topk.radix_topk(torch.randn(1, 20), 8, False, config)
