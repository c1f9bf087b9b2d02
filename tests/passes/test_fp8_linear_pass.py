"""``fp8_linear`` on the model's FP8 layers: every FP8 ``Linear`` of the tiny-fp8-fp4 golden checkpoint is
rewritten and its logits stay in the golden band (Triton kernel under the interpreter, no Inductor); single layers
of any activation shape, dtype and scale rule keep the layer's numerics; near-misses say why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import v4compile
from v4compile.golden import Agreement
from v4compile.model import quant
from v4compile.model.linear import Linear


class _Apply(nn.Module):
    """Runs the layer it is given on ``x`` (compiled once per structure and shape)."""

    def forward(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x)


def fp8_layer(k: int, n: int, pow2: bool, seed: int = 0) -> Linear:
    layer = Linear(k, n, "fp8", pow2)
    weight, scale = quant.quantize_fp8_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.scale.copy_(scale)
    return layer


def _stats(optimized: v4compile.OptimizedModel) -> list:
    return [p for report in optimized.reports() for p in report.passes if p.name == "fp8_linear"]


@pytest.mark.parametrize(("lead", "dtype", "pow2"), [((1, 3), torch.bfloat16, True), ((5,), torch.bfloat16, False),
                                                     ((2, 1, 4), torch.float32, True)])
def test_a_layer_of_any_shape_dtype_and_scale_rule_is_rewritten(lead: tuple, dtype: torch.dtype, pow2: bool) -> None:
    layer = fp8_layer(256, 130, pow2)
    x = (torch.randn(*lead, 256, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    optimized = v4compile.optimize(_Apply(), backend="triton", passes=["fp8_linear"], inductor=False)
    with torch.no_grad():
        got, want = optimized(layer, x), layer(x)
    [stats] = _stats(optimized)
    assert stats.near_misses == [], [m.reason for m in stats.near_misses]
    [match] = stats.matches
    assert match.kernel == "fp8_linear.triton"
    assert match.details | {"weight": ""} == {"rows": torch.Size(lead).numel(), "out_features": 130,
                                              "in_features": 256, "pow2_scales": pow2, "weight": "",
                                              "out_dtype": "bfloat16"}
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, 130)
    assert (got != want).float().mean() <= 0.02
    assert (got.float() - want.float()).abs().max() <= 0.01 * want.float().abs().max()


class _UnroundedPlusOne(nn.Module):
    """The product used in fp32 (as a row-parallel layer's partial sum is) before any rounding."""

    def forward(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return (layer.unrounded(x) + 1.0).to(torch.bfloat16)


def test_a_product_used_in_fp32_stays_fp32_and_a_rounded_one_is_rounded_by_the_op() -> None:
    layer = fp8_layer(256, 64, True)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    optimized = v4compile.optimize(_UnroundedPlusOne(), backend="triton", passes=["fp8_linear"], inductor=False)
    with torch.no_grad():
        got = optimized(layer, x)
    [stats] = _stats(optimized)
    assert [m.details["out_dtype"] for m in stats.matches] == ["float32"]
    want = _UnroundedPlusOne()(layer, x)
    assert (got.float() - want.float()).abs().max() <= 0.01 * want.float().abs().max()


class _PlainDequant(nn.Module):
    """An e4m3 weight used without its block scales: not the model's FP8 linear."""

    def __init__(self, layer: Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = quant.fp8_simulate(x, quant.FP8_ACT_BLOCK, True).float()
        return F.linear(xq, self.layer.weight.float()).to(torch.bfloat16)


def test_a_weight_without_its_block_scales_is_a_near_miss_naming_the_difference() -> None:
    model = _PlainDequant(fp8_layer(256, 64, True))
    x = torch.randn(3, 256).bfloat16()
    optimized = v4compile.optimize(model, backend="triton", passes=["fp8_linear"], inductor=False)
    with torch.no_grad():
        assert torch.equal(optimized(x), model(x))
    [stats] = _stats(optimized)
    assert stats.matches == []
    [miss] = stats.near_misses
    assert "not the model's FP8 linear [64, 256]" in miss.reason and "expected" in miss.reason, miss.reason


def test_golden_fp8_layers_are_rewritten_and_stay_in_the_golden_band(golden_root: Path, golden_models: dict) -> None:
    model = golden_models["tiny-fp8-fp4"]
    cases = load_file(str(golden_root / "tiny-fp8-fp4" / "cases.safetensors"))
    ids, length = cases["case0.ids"][:1], int(cases["case0.prefill_len"])
    rows = slice(length - 1, length - 1 + cases["case0.prefill_logits"].shape[1])
    fp8_layers = [n for n, m in model.named_modules()  # the MTP block does not run in a forward
                  if isinstance(m, Linear) and m.fmt == "fp8" and not n.startswith("mtp.")]
    optimized = v4compile.optimize(model, backend="triton", passes=["fp8_linear"], inductor=False)
    with torch.no_grad():
        want = model(ids)[0, rows]
        got = optimized(ids)[0, rows]
    matches = [m for s in _stats(optimized) for m in s.matches]
    assert sorted(m.location.module for m in matches) == sorted(fp8_layers)
    assert [m for s in _stats(optimized) for m in s.near_misses] == []
    assert {m.kernel for m in matches} == {"fp8_linear.triton"}
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.999
    official, official_decode = cases["case0.prefill_logits"][0], cases["case0.decode_logits"][0]
    band = Agreement.of(got, official)
    top = got.argmax(-1)
    agree = ((top == official.argmax(-1)) | (top == official_decode.argmax(-1))).float().mean()
    assert band.median_cos >= 0.99 and band.mean_cos >= 0.97 and agree >= 0.8, (band, agree)
