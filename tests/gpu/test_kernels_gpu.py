"""Every kernel against its reference on the GPU, on fresh random inputs (ties and masked entries included)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch

from v4compile.codegen import ops, reference


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("ratio", "width", "tokens"), [(4, 512, 4096 + 3), (128, 512, 128 * 9 + 5), (4, 128, 64)])
def test_compressor_pool_cuda(ratio: int, width: int, tokens: int) -> None:
    c = 2 if ratio == 4 else 1
    kv, score = torch.randn(3, tokens, c * width, device="cuda"), torch.randn(3, tokens, c * width, device="cuda") * 4
    ape = torch.randn(ratio, c * width, device="cuda")
    n = tokens // ratio
    got = ops.compressor_pool(kv, score, ape, ratio, width, n, "triton")
    torch.testing.assert_close(got, reference.compressor_pool(kv, score, ape, ratio, width, n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize(("ratio", "width"), [(4, 512), (128, 512), (4, 128)])
def test_compressor_pool_state_cuda(backend: str, ratio: int, width: int) -> None:
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    c = 2 if ratio == 4 else 1
    kv, score = torch.randn(5, c * ratio, c * width, device="cuda"), torch.randn(5, c * ratio, c * width, device="cuda")
    score[0, : c * ratio // 2] = float("-inf")
    got = ops.compressor_pool_state(kv, score, ratio, width, backend)
    torch.testing.assert_close(got, reference.compressor_pool_state(kv, score, ratio, width), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", pytest.param("tilelang", marks=pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed"))])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize(("ratio", "width", "rotate", "pow2"), [(4, 512, False, True), (128, 512, False, False),
                                                              (128, 512, False, True), (4, 128, True, True)])
def test_compressor_entries_cuda(backend: str, ratio: int, width: int, rotate: bool, pow2: bool, state: bool,
                                 assert_finished_entries: Callable) -> None:
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    c, blocks = (2 if ratio == 4 else 1), 300
    freqs = rope_frequencies(64, 1.6e5, 65536, 16, 32, 1).cuda()
    weight = torch.rand(width, device="cuda") + 0.5
    if state:
        kv = torch.randn(64, c * ratio, c * width, device="cuda") * 3
        score = torch.randn(64, c * ratio, c * width, device="cuda") * 2
        score[0, c * ratio // 2:] = float("-inf")  # slots not yet written
        cos, sin = rope_cos_sin(freqs, torch.randint(0, 60000, (64,), device="cuda") * ratio)
        args = (kv, score, ratio, width, cos, sin, weight, 1e-6, rotate, pow2, True)
        want, got = reference.compressor_entry_state(*args), ops.compressor_entry_state(*args, backend)
    else:
        kv = torch.randn(2, blocks * ratio + 1, c * width, device="cuda") * 3
        score = torch.randn(2, blocks * ratio + 1, c * width, device="cuda") * 2
        ape = torch.randn(ratio, c * width, device="cuda")
        cos, sin = rope_cos_sin(freqs, torch.arange(blocks, device="cuda") * ratio)
        args = (kv, score, ape, ratio, width, blocks, cos, sin, weight, 1e-6, rotate, pow2, True)
        want, got = reference.compressor_entries(*args), ops.compressor_entries(*args, backend)
    assert_finished_entries(got, want, rotate, 0.99)


@pytest.mark.parametrize(("rows", "n", "k", "ties"), [(1, 262144, 512, "heavy"), (7, 32768, 1024, "heavy"),
                                                     (3, 5000, 2048, "heavy"), (2, 100, 8, "heavy"),
                                                     (64, 262144, 512, "bf16"), (2, 1 << 20, 2048, "bf16"),
                                                     (256, 4096, 64, "bf16"), (2, 80000, 128, "periodic"),
                                                     (3, 262144, 512, "short"), (2, 50000, 256, "nan")])
def test_radix_topk_cuda_exact_with_ties_and_masks(rows: int, n: int, k: int, ties: str) -> None:
    x = torch.randn(rows, n, device="cuda")
    if ties == "heavy":  # thousands tie at the threshold: the exact slow path
        x[:, : n // 3] = torch.randint(-2, 3, (rows, n // 3), device="cuda").float()
    elif ties == "periodic":  # every group holds one repeated value: the candidate room overflows
        x = (torch.arange(n, device="cuda") % 1250).float().expand(rows, n).contiguous()
    elif ties == "short":  # fewer real scores than k: -inf fills the rest from the lowest index
        x = torch.full((rows, n), float("-inf"), device="cuda")
        x[:, ::1000] = torch.randn(rows, triton_cdiv(n, 1000), device="cuda")
    elif ties == "nan":  # NaN of either sign ranks first, ties by index; zeros keep their sign
        x[:, 100:110] = float("nan")
        x[:, 200:205] = -float("nan")
        x[:, 300:310] = -0.0
    else:  # bf16-valued scores like the indexer's: tens tie at the threshold
        x = x.bfloat16().float()
    x[0, n // 2 :] = float("-inf")
    for mask in (False, True):
        got_v, got_i = ops.radix_topk(x, k, mask, "triton")
        # the reference on the CPU: torch's CUDA sort ranks a NaN with the sign bit set last, its CPU sort
        # (and the kernel) first, with every other NaN
        want_v, want_i = (t.cuda() for t in reference.radix_topk(x.cpu(), k, mask))
        assert torch.equal(got_i, want_i) and torch.equal(got_v.nan_to_num(), want_v.nan_to_num())
        assert torch.equal(got_v.signbit(), want_v.signbit())


def test_radix_topk_cuda_graph_replays_stay_exact() -> None:
    """The row counters persist between calls (each call's threshold program zeroes them for the next): a graph
    captured on its warm-up stream shares that stream's counters with eager calls there; its replays on fresh
    scores, interleaved with those eager calls and with calls on another stream, stay exact."""
    x = torch.randn(4, 65536, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.radix_topk(x, 512, False, "triton")  # makes the stream's counters, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        values, ids = ops.radix_topk(x, 512, False, "triton")
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.replay()
            want_v, want_i = (t.cuda() for t in reference.radix_topk(x.cpu(), 512, False))
            assert torch.equal(ids, want_i) and torch.equal(values, want_v)
            eager = ops.radix_topk(x[:3], 512, True, "triton")  # the same counters, between replays
            assert torch.equal(eager[1], reference.radix_topk(x[:3].cpu(), 512, True)[1].cuda())
        torch.cuda.current_stream().wait_stream(stream)
        other = ops.radix_topk(x[1:], 256, False, "triton")  # the default stream's counters
        assert torch.equal(other[1], reference.radix_topk(x[1:].cpu(), 256, False)[1].cuda())


@pytest.mark.parametrize(("heads", "k"), [(64, 128 + 512 + 16), (128, 200), (8, 64)])
def test_sparse_attention_cuda(heads: int, k: int) -> None:
    q = torch.randn(4, 1, heads, 512, device="cuda").bfloat16()
    kv = torch.randn(4, 2048, 512, device="cuda").bfloat16()
    sink = torch.randn(heads, device="cuda")
    index = torch.randint(-1, 2048, (4, 1, k), device="cuda")
    got = ops.sparse_attention(q, kv, sink, index, 512**-0.5, "triton")
    want = reference.sparse_attention(q, kv, sink, index, 512**-0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-4)  # one bf16 output rounding


@pytest.mark.parametrize(("batch", "keys"), [(1, 16384), (16, 4096), (3, 1000)])
def test_indexer_scores_cuda(batch: int, keys: int) -> None:
    q = torch.randn(batch, 2, 64, 128, device="cuda").bfloat16()
    k = torch.randn(batch, keys, 128, device="cuda").bfloat16()
    w = torch.randn(batch, 2, 64, device="cuda").bfloat16()
    got = ops.indexer_scores(q, k, w, "triton")
    want = reference.indexer_scores(q, k, w)
    assert (got != want).float().mean() < 1e-3  # a rare last-bit difference from the fp32 summation order
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("widened", [True, False])
def test_indexer_scores_of_fp32_queries_cuda(widened: bool) -> None:
    """transformers' indexer multiplies fp32 (bf16 widened) queries and keys: the kernel's three TF32 products stay
    within fp32 rounding of a float64 product, for widened bf16 values and for any fp32 values."""
    q = torch.randn(2, 300, 64, 128, device="cuda")
    k = torch.randn(2, 1000, 128, device="cuda")
    w = torch.randn(2, 300, 64, device="cuda")
    if widened:
        q, k = q.bfloat16().float(), k.bfloat16().float()
    got = ops.indexer_scores(q, k, w, "triton")
    want = reference.indexer_scores(q.double(), k.double(), w.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize(("batch", "pages"), [(1, 128), (16, 32), (64, 32)])
def test_paged_kernels_read_pages_in_place_cuda(batch: int, pages: int) -> None:
    """Flash's decode shapes on scattered pages (32 entries a page): attention over ring + entries and the indexer's
    scoring equal the same kernels over the gathered copy, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    pool = torch.randn(batch * pages + 1, 32, 512, generator=gen, device="cuda").bfloat16()
    keys = torch.randn(batch * pages + 1, 32, 128, generator=gen, device="cuda").bfloat16()
    table = (torch.randperm(batch * pages, device="cuda") + 1).view(batch, pages)
    window = torch.randn(batch, 128, 512, generator=gen, device="cuda").bfloat16()
    q, sink = torch.randn(batch, 1, 64, 512, generator=gen, device="cuda").bfloat16(), torch.randn(64, device="cuda")
    index = torch.randint(-1, 128 + pages * 32, (batch, 1, 128 + 512), device="cuda")
    got = ops.sparse_attention_paged(q, window, pool, table, sink, index, 512**-0.5, "triton")
    copied = torch.cat((window, pool[table].flatten(1, 2)), dim=1)
    assert torch.equal(got, ops.sparse_attention(q, copied, sink, index, 512**-0.5, "triton"))
    iq = torch.randn(batch, 1, 64, 128, device="cuda").bfloat16()
    w = torch.randn(batch, 1, 64, device="cuda").bfloat16()
    scores = ops.indexer_scores_paged(iq, keys, table, w, "triton")
    assert torch.equal(scores, ops.indexer_scores(iq, keys[table].flatten(1, 2), w, "triton"))
