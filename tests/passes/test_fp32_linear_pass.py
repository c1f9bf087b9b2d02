"""``fp32_linear`` on fp32 products however they are spelled, on the tiny model (Triton kernel under the
interpreter, no Inductor), and its near-misses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import v4compile
from v4compile.debugging import sample_ids


class _Spellings(nn.Module):
    """One fp32 product written five ways, a batched product and a bf16 one."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.head = nn.Parameter(torch.randn(40, 64, generator=gen))
        self.router = nn.Parameter(torch.randn(24, 64, generator=gen).bfloat16())
        self.kn = nn.Parameter(torch.randn(64, 20, generator=gen))
        self.bias = nn.Parameter(torch.randn(40, generator=gen))
        self.batched = nn.Parameter(torch.randn(2, 64, 8, generator=gen))
        self.bf16 = nn.Parameter(torch.randn(16, 64, generator=gen).bfloat16())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x.float()
        return (F.linear(h, self.head), h @ self.router.float().t(), torch.matmul(h, self.kn),
                torch.addmm(self.bias, h.reshape(-1, 64), self.head.t()), F.linear(h, self.head, self.bias),
                torch.matmul(h, self.batched), F.linear(x, self.bf16))


def _stats(optimized: v4compile.OptimizedModel) -> object:
    [stats] = [p for report in optimized.reports() for p in report.passes if p.name == "fp32_linear"]
    return stats


def test_every_spelling_of_an_fp32_product_is_one_match() -> None:
    model = _Spellings()
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    optimized = v4compile.optimize(model, backend="triton", passes=["fp32_linear"], inductor=False)
    with torch.no_grad():
        got, want = optimized(x), model(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert (g.float() - w.float()).abs().max() <= 1e-5 * w.float().abs().max()
    stats = _stats(optimized)
    assert [(m.kernel, m.details["weight_dtype"], m.details["weight_layout"], m.details["bias"],
             m.details["activation_dtype"]) for m in stats.matches] == [
        ("fp32_linear.triton", "float32", "[N, K]", False, "bfloat16"),
        ("fp32_linear.triton", "bfloat16", "[N, K]", False, "bfloat16"),
        ("fp32_linear.triton", "float32", "[K, N]", False, "bfloat16"),
        ("fp32_linear.triton", "float32", "[N, K]", True, "float32"),  # reshaped after the cast: read in fp32
        ("fp32_linear.triton", "float32", "[N, K]", True, "bfloat16")]
    assert [m.details["out_features"] for m in stats.matches] == [40, 24, 20, 40, 40]
    assert [m.reason for m in stats.near_misses] == ["the right operand has rank 3, not a 2-D weight"]


class _Narrow(nn.Module):
    """A GEMV and a product with fewer columns than one tensor-core tile."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Parameter(torch.randn(32, 64))
        self.narrow = nn.Parameter(torch.randn(4, 64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(x[:1], self.wide), F.linear(x, self.narrow)


def test_a_gemv_and_a_product_narrower_than_a_tile_stay_cublas() -> None:
    optimized = v4compile.optimize(_Narrow(), backend="triton", passes=["fp32_linear"], inductor=False)
    with torch.no_grad():
        optimized(torch.randn(3, 64))
    stats = _stats(optimized)
    assert not stats.matches
    assert [m.reason.split(":")[0] for m in stats.near_misses] == ["one row", "4 output columns"]


def test_the_reference_backend_keeps_the_products() -> None:
    optimized = v4compile.optimize(_Spellings(), backend="reference", passes=["fp32_linear"], inductor=False)
    with torch.no_grad():
        optimized(torch.randn(2, 3, 64).bfloat16())
    stats = _stats(optimized)
    assert not stats.matches and len(stats.near_misses) == 6
    assert {m.reason for m in stats.near_misses} == {
        "reference backend: the fp32 product stays in Inductor's / ATen's fp32 code"}


@pytest.mark.slow
def test_the_tiny_models_head_and_compressor_products(tiny_model: v4compile.DeepSeekV4) -> None:
    ids = sample_ids(tiny_model)[:, :40]
    optimized = v4compile.optimize(tiny_model, regions=False, backend="triton", passes=["fp32_linear"], inductor=False)
    with torch.no_grad():
        got, want = optimized(ids), tiny_model(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    stats = _stats(optimized)
    assert {"head", "wkv", "wgate"} <= {m.location.module.split(".")[-1] for m in stats.matches}
    # the tiny preset's router scores 8 experts: narrower than a tile
    assert {m.location.module.split(".")[-1] for m in stats.near_misses} >= {"gate"}
