"""Every kernel against its reference on the GPU, on fresh random inputs (ties and masked entries included)."""

from __future__ import annotations

import pytest
import torch

from v4compile.codegen import ops, reference

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


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 262144, 512), (7, 32768, 1024), (3, 5000, 2048), (2, 100, 8)])
def test_radix_topk_cuda_exact_with_ties_and_masks(rows: int, n: int, k: int) -> None:
    x = torch.randn(rows, n, device="cuda")
    x[:, : n // 3] = torch.randint(-2, 3, (rows, n // 3), device="cuda").float()
    x[0, n // 2 :] = float("-inf")
    for mask in (False, True):
        got_v, got_i = ops.radix_topk(x, k, mask, "triton")
        want_v, want_i = reference.radix_topk(x, k, mask)
        assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)


@pytest.mark.parametrize(("heads", "k"), [(64, 128 + 512 + 16), (128, 200), (8, 64)])
def test_sparse_attention_cuda(heads: int, k: int) -> None:
    q = torch.randn(4, 1, heads, 512, device="cuda").bfloat16()
    kv = torch.randn(4, 2048, 512, device="cuda").bfloat16()
    sink = torch.randn(heads, device="cuda")
    index = torch.randint(-1, 2048, (4, 1, k), device="cuda")
    got = ops.sparse_attention(q, kv, sink, index, 512**-0.5, "triton")
    torch.testing.assert_close(got.float(), reference.sparse_attention(q, kv, sink, index, 512**-0.5).float(),
                               rtol=2e-2, atol=2e-2)
