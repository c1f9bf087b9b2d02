"""The fp32 product kernel on the H200 (three TF32 products) against an fp64 product on fresh random inputs: decode
rows (1..64), odd row counts, prefill rows, N and K not multiples of the tiles, bf16 operands, a bias, a weight
given [K, N], and inside a CUDA graph.

Tolerance: within 2e-6 of max|y| of the fp64 product, and no further from it than twice cuBLAS's fp32 GEMM.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from v4compile.codegen import ops
from v4compile.codegen.registry import REGISTRY
from v4compile.codegen.triton.fp32_linear import fp32_linear, kernel_name

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 129280, 4096), (5, 1000, 4000), (16, 256, 4096), (64, 1024, 4096),
                                              (333, 520, 1000), (8192, 1024, 4096)])
def test_as_close_to_fp64_as_cublas_fp32(rows: int, n: int, k: int, w_dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(w_dtype)
    x = torch.randn(rows, k, generator=gen, device="cuda")
    bias = torch.randn(n, generator=gen, device="cuda")
    want = F.linear(x.double(), weight.double(), bias.double())
    scale = want.abs().max()
    cublas = ((F.linear(x, weight.float(), bias).double() - want).abs().max() / scale).item()
    for transposed, w in ((False, weight), (True, weight.t().contiguous())):
        got = fp32_linear(x, w, bias, transposed)
        err = ((got.double() - want).abs().max() / scale).item()
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert err <= max(2e-6, 2 * cublas), (err, cublas)
    record = REGISTRY.records.get(kernel_name())
    assert record is None or record.error is None


def test_replays_in_a_cuda_graph() -> None:
    weight = torch.randn(1024, 4096, device="cuda")
    x = torch.randn(16, 4096, device="cuda")
    ops.fp32_linear(x, weight, None, False, "triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp32_linear(x, weight, None, False, "triton")
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, ops.fp32_linear(x, weight, None, False, "triton"))


def test_one_row_against_an_fp32_weight_runs_cublas_gemv_and_a_bf16_weight_the_kernel() -> None:
    """A graph with dynamic rows meets one-row products the pass declines in static graphs: against an fp32 weight
    the op returns cuBLAS's GEMV of the widened row (bit for bit what the model's ``F.linear(x.float(), w)`` gives,
    no kernel launch), whatever the row's dtype; a bf16 weight still runs the kernel."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    weight = torch.randn(1000, 4096, generator=gen, device="cuda")
    x = torch.randn(1, 4096, generator=gen, device="cuda")
    fp32_linear(x, weight.bfloat16())
    launches = REGISTRY.records[kernel_name()].launches
    assert torch.equal(fp32_linear(x, weight), F.linear(x, weight))
    assert torch.equal(fp32_linear(x.bfloat16(), weight), F.linear(x.bfloat16().float(), weight))
    assert REGISTRY.records[kernel_name()].launches == launches
    fp32_linear(x, weight.bfloat16())
    assert REGISTRY.records[kernel_name()].launches == launches + 1
