"""TileLang kernels against their references on the GPU (the ``cuda`` target), at the model's shapes."""

from __future__ import annotations

import importlib

import pytest
import torch

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import REGISTRY

pytestmark = pytest.mark.gpu
pytest.importorskip("tilelang")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ratio", "width", "bsz", "tokens", "blocks"), [
    (4, 512, 3, 4096 + 3, None), (4, 512, 1, 65536, None), (4, 512, 2, 8192, 5),
    (128, 512, 3, 128 * 40 + 5, None), (128, 512, 1, 65536, None), (128, 512, 2, 8192, 3), (4, 128, 2, 64, None),
])
def test_compressor_pool_cuda(dtype: torch.dtype, ratio: int, width: int, bsz: int, tokens: int,
                              blocks: int | None) -> None:
    c = 2 if ratio == 4 else 1
    kv = torch.randn(bsz, tokens, c * width, device="cuda").to(dtype)
    score = (torch.randn(bsz, tokens, c * width, device="cuda") * 4).to(dtype)
    ape = torch.randn(ratio, c * width, device="cuda")
    n = tokens // ratio if blocks is None else blocks
    got = ops.compressor_pool(kv, score, ape, ratio, width, n, "tilelang")
    assert got.dtype == torch.float32 and got.shape == (bsz, n, width)
    torch.testing.assert_close(got, reference.compressor_pool(kv, score, ape, ratio, width, n), rtol=1e-5, atol=1e-5)
    record = REGISTRY.records[f"compressor_pool.c{ratio}.w{width}.tilelang"]
    assert record.error is None and record.launch["target"] == "cuda" and "__global__" in record.lowered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ratio", "width", "bsz"), [(4, 512, 5), (128, 512, 5), (4, 128, 3), (4, 512, 256)])
def test_compressor_pool_state_cuda(dtype: torch.dtype, ratio: int, width: int, bsz: int) -> None:
    c = 2 if ratio == 4 else 1
    kv = torch.randn(bsz, c * ratio, c * width, device="cuda").to(dtype)
    score = torch.randn(bsz, c * ratio, c * width, device="cuda").to(dtype)
    score[0, : c * ratio // 2] = float("-inf")
    score[1, : c * ratio - 1] = float("-inf")
    got = ops.compressor_pool_state(kv, score, ratio, width, "tilelang")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference.compressor_pool_state(kv, score, ratio, width), rtol=1e-5, atol=1e-5)
    record = REGISTRY.records[f"compressor_pool_state.c{ratio}.w{width}.tilelang"]
    assert record.launch["grid"] == (1, bsz)


def test_tilelang_matches_triton_on_cuda() -> None:
    kv, score = torch.randn(2, 4096, 1024, device="cuda"), torch.randn(2, 4096, 1024, device="cuda") * 4
    ape = torch.randn(4, 1024, device="cuda")
    torch.testing.assert_close(ops.compressor_pool(kv, score, ape, 4, 512, 1024, "tilelang"),
                               ops.compressor_pool(kv, score, ape, 4, 512, 1024, "triton"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead", [(1,), (16,), (64,), (3, 100)])
def test_mhc_pre_and_post_cuda(dtype: torch.dtype, lead: tuple[int, ...]) -> None:
    """V4-Flash dims (n = 4, D = 4096); tolerances of tests/gpu/test_mhc_gpu.py."""
    n, dim = 4, 4096
    x = (torch.randn(*lead, n, dim, device="cuda") * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * dim, device="cuda") / (n * dim) ** 0.5 * 4
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn((2 + n) * n, device="cuda")
    y, post, comb = ops.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, "tilelang")
    want_y, want_post, want_comb = reference.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2.0**-7, atol=1e-5)
    torch.testing.assert_close(post, want_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb, want_comb, rtol=1e-4, atol=1e-5)
    sub = torch.randn(*lead, dim, device="cuda").to(dtype)
    got = ops.mhc_post(sub, x, want_post, want_comb, "tilelang")
    torch.testing.assert_close(got.float(), reference.mhc_post(sub, x, want_post, want_comb).float(), rtol=2.0**-7,
                               atol=1e-5)
    for step in ("mhc_pre", "mhc_post"):
        record = REGISTRY.records[f"{step}.n{n}.d{dim}.tilelang"]
        assert record.error is None and record.launch["target"] == "cuda" and "__global__" in record.lowered


@pytest.mark.parametrize("rounded_p", [False, True])
@pytest.mark.parametrize(("batch", "heads", "k", "entries"), [(2, 64, 768, 4096), (1, 128, 200, 1000),
                                                             (3, 8, 130, 500), (128, 64, 768, 8192)])
def test_sparse_attention_cuda(batch: int, heads: int, k: int, entries: int, rounded_p: bool) -> None:
    attention = importlib.import_module("v4compile.codegen.tilelang.sparse_attention")
    q = torch.randn(batch, 1, heads, 512, device="cuda").bfloat16()
    kv = torch.randn(batch, entries, 512, device="cuda").bfloat16()
    sink = torch.randn(heads, device="cuda")
    index = torch.randint(-1, entries, (batch, 1, k), device="cuda")
    index[0, 0, :5] = entries + 3  # beyond the entries: masked like -1
    want = reference.sparse_attention(q.double(), kv.double(), sink.double(), torch.where(index < entries, index, -1),
                                      512**-0.5)
    index = index.int() if rounded_p else index  # both id widths the kernel reads
    got = attention.sparse_attention(q, kv, sink, index, 512**-0.5, rounded_p=rounded_p)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-3 if rounded_p else 1e-4)
    record = REGISTRY.records[attention.kernel_name(512, rounded_p)]
    assert record.error is None and "cp_async" in (record.lowered or "")
    if not rounded_p:
        assert torch.equal(ops.sparse_attention(q, kv, sink, index, 512**-0.5, "tilelang"), got)


@pytest.mark.parametrize("dim", [64, 128])
def test_sparse_attention_small_head_dims_and_permuted_queries_cuda(dim: int) -> None:
    """Head dims the kernel takes besides 512 (the tiny preset's 128 among them), with the queries given as a
    permuted view: the reference's output, laid out contiguously."""
    attention = importlib.import_module("v4compile.codegen.tilelang.sparse_attention")
    q = torch.randn(2, 64, 3, dim, device="cuda").bfloat16().transpose(1, 2)  # [2, 3, 64, dim], not contiguous
    kv = torch.randn(2, 700, dim, device="cuda").bfloat16()
    sink = torch.randn(64, device="cuda")
    index = torch.randint(-1, 700, (2, 3, 300), device="cuda")
    want = reference.sparse_attention(q.double(), kv.double(), sink.double(), index, dim**-0.5)
    got = attention.sparse_attention(q, kv, sink, index, dim**-0.5)
    assert got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-4)


def test_sparse_attention_prefill_masked_rows_and_wide_ids_cuda() -> None:
    attention = importlib.import_module("v4compile.codegen.tilelang.sparse_attention")
    q = torch.randn(2, 3, 64, 512, device="cuda").bfloat16()
    kv = torch.randn(2, 300, 512, device="cuda").bfloat16()
    sink = torch.randn(64, device="cuda")
    index = torch.randint(0, 300, (2, 3, 140), device="cuda")
    index[0, 1] = -1  # a query with no entry: the sink alone, output 0
    index[1, 2, :4] = torch.tensor([-(2**32), 2**32 + 5, 2**31 + 7, 300], device="cuda")  # all out of range
    want = reference.sparse_attention(q.double(), kv.double(), sink.double(),
                                      torch.where((index >= 0) & (index < 300), index, -1), 512**-0.5)
    for splits in (1, 3):
        config = dict(attention.launch_config(6, 64, 140), splits=splits)
        got = attention.sparse_attention(q, kv, sink, index, 512**-0.5, config=config)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-4)
        assert torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))


@pytest.mark.parametrize(("batch", "seqlen", "heads", "keys"), [(1, 1, 64, 16384), (64, 1, 64, 16384),
                                                               (16, 1, 64, 4096), (3, 5, 64, 1000), (2, 2, 8, 300)])
def test_indexer_scores_cuda(batch: int, seqlen: int, heads: int, keys: int) -> None:
    """The Hopper scoring (wgmma, keys streamed in three stages) rounds every step as the model: equal to the
    reference but for a rare last bit from the fp32 summation order; 8 heads are zero-padded to the tile, 1000
    and 300 keys end in a short tile."""
    q = torch.randn(batch, seqlen, heads, 128, device="cuda").bfloat16()
    k = torch.randn(batch, keys, 128, device="cuda").bfloat16()
    w = torch.randn(batch, seqlen, heads, device="cuda").bfloat16()
    got = ops.indexer_scores(q, k, w, "tilelang")
    want = reference.indexer_scores(q, k, w)
    assert (got != want).float().mean() < 1e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    record = REGISTRY.records["indexer_scores.d128.bf16.tilelang"]
    assert record.error is None and record.launch["target"] == "cuda" and "wgmma" in (record.lowered or "")


@pytest.mark.parametrize(("rows", "n", "k", "scores"), [
    (1, 262144, 512, "heavy"), (64, 262144, 512, "bf16"), (3, 262144, 512, "short"), (2, 50000, 512, "nan"),
    (2, 80000, 512, "periodic"), (1, 1 << 20, 2048, "bf16")])
def test_radix_topk_cuda(rows: int, n: int, k: int, scores: str) -> None:
    x = torch.randn(rows, n, device="cuda")
    if scores == "heavy":  # thousands tie at the threshold
        x[:, : n // 3] = torch.randint(-2, 3, (rows, n // 3), device="cuda").float()
    elif scores == "periodic":  # every group holds one repeated value
        x = (torch.arange(n, device="cuda") % 1250).float().expand(rows, n).contiguous()
    elif scores == "short":  # fewer real scores than k: -inf fills the rest from the lowest index
        x = torch.full((rows, n), float("-inf"), device="cuda")
        x[:, ::1000] = torch.randn(rows, -(-n // 1000), device="cuda")
    elif scores == "nan":  # NaN of either sign ranks first, ties by index; zeros keep their sign
        x[:, 100:110] = float("nan")
        x[:, 200:205] = -float("nan")
        x[:, 300:310] = -0.0
    else:  # bf16-valued scores like the indexer's
        x = x.bfloat16().float()
    x[0, n // 2 :] = float("-inf")
    for mask in (False, True):
        got_v, got_i = ops.radix_topk(x, k, mask, "tilelang")
        # the reference on the CPU: torch's CUDA sort ranks a NaN with the sign bit set last, its CPU sort first
        want_v, want_i = (t.cuda() for t in reference.radix_topk(x.cpu(), k, mask))
        assert torch.equal(got_i, want_i) and torch.equal(got_v.view(torch.int32), want_v.view(torch.int32))
    assert REGISTRY.records[f"radix_topk.k{k}.tilelang"].launches


def test_radix_topk_candidate_overflow_takes_the_exact_path_cuda() -> None:
    from v4compile.codegen.tilelang import radix_topk

    x = torch.randn(2, 262144, device="cuda")
    config = {**radix_topk.launch_config(262144, 512, True), "cap": 512}  # any extra candidate overflows
    got_v, got_i = radix_topk.radix_topk(x, 512, False, config)
    want_v, want_i = reference.radix_topk(x, 512, False)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
