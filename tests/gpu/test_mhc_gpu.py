"""The mHC kernels against the model's hc_pre / hc_post on the GPU at V4-Flash dims (n = 4, D = 4096), and the
mhc_tiling pass running them inside the tiny model. Tolerances as in tests/codegen/test_mhc_kernels.py, with
1e-4 for the fp32 outputs (a 16384-long fp32 projection summed in another order)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import v4compile
from v4compile.codegen import ops, reference

pytestmark = pytest.mark.gpu


def _inputs(lead: tuple[int, ...], n: int = 4, dim: int = 4096, dtype: torch.dtype = torch.bfloat16):
    x = (torch.randn(*lead, n, dim, device="cuda") * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * dim, device="cuda") / math.sqrt(n * dim) * 4
    return x, fn, torch.rand(3, device="cuda") + 0.5, torch.randn((2 + n) * n, device="cuda")


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5) -> None:
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=atol)
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize(("lead", "dtype"), [((1,), torch.bfloat16), ((4,), torch.bfloat16),
                                             ((16,), torch.bfloat16), ((64,), torch.bfloat16),
                                             ((3, 100), torch.bfloat16), ((2, 1027), torch.bfloat16),
                                             ((8,), torch.float32)])
def test_mhc_pre_and_post_cuda(lead: tuple[int, ...], dtype: torch.dtype) -> None:
    x, fn, scale, base = _inputs(lead, dtype=dtype)
    y, post, comb = ops.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, "triton")
    want_y, want_post, want_comb = reference.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    # y sums n streams weighted by pre, whose fp32 sums over n * D terms round in the kernel's order: where the
    # weighted streams cancel, y's error is relative to the streams, not to y (H100, 2054 and 8192 rows: up to 6.1e-5
    # at |y| ~ 5e-6, with one or four finishing rows a program alike)
    _close(y, want_y, atol=2.0**-14 * x.abs().max().item())
    torch.testing.assert_close(post, want_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb, want_comb, rtol=1e-4, atol=1e-5)
    sub = torch.randn(*lead, x.shape[-1], device="cuda").to(dtype)
    _close(ops.mhc_post(sub, x, want_post, want_comb, "triton"), reference.mhc_post(sub, x, want_post, want_comb))


def test_mhc_pre_is_deterministic_and_reusable_in_a_cuda_graph() -> None:
    """Split-K partials are reduced in a fixed order: replays give the same bits."""
    x, fn, scale, base = _inputs((2,))
    first = ops.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, "triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, "triton")
    for _ in range(3):
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(out, first, strict=True))


def test_the_pass_runs_the_kernels_inside_the_tiny_model() -> None:
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0).cuda().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), device="cuda")
    optimized = v4compile.optimize(model, backend="triton", passes=["mhc_tiling"], inductor=False)
    with torch.no_grad():
        got, want = optimized(ids), model(ids)
    cos = F.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    assert cos.median() > 0.9999
    rows = {row["pass"]: row for row in optimized.report()}
    # hc_pre and hc_post around attention and MoE in each region: layer 0, layers 1 and 3 (one region), layer 2
    assert rows["mhc_tiling"]["matches"] == 4 * 3
