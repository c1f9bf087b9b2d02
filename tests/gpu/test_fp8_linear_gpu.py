"""The FP8 linear kernel on the H200 against the model's FP8 ``Linear`` on fresh random inputs: decode rows
(1..64), odd row counts, prefill rows, N not a multiple of the 128 tile, both scale rules, and inside a CUDA graph.

Tolerance: with power-of-two scales the FP8 tensor-core products are exact, but Hopper's FP8 MMA sums a 128-wide
block in about 14 mantissa bits before the fp32 promotion: under 5e-4 normwise, under 8% one-ulp bf16 flips.
With ``FP8_DOT=0``, and with unrounded scales, the operands are the simulation's exact bf16 values in a dot
with fp32 accumulation: under 1e-5 normwise, under 1% flips.
"""

from __future__ import annotations

import pytest
import torch

from v4compile.codegen import ops
from v4compile.codegen.registry import REGISTRY
from v4compile.codegen.triton.fp8_linear import blockwise_scaled_mm, fp8_linear, kernel_name, launch_config
from v4compile.model import quant
from v4compile.model.linear import Linear

pytestmark = pytest.mark.gpu


def fp8_layer(k: int, n: int, pow2: bool, seed: int) -> Linear:
    """The model's FP8 linear on the GPU with a seeded weight quantized the checkpoint's way."""
    layer = Linear(k, n, "fp8", pow2).cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight, scale = quant.quantize_fp8_weight(torch.randn(n, k, generator=gen, device="cuda") / k**0.5)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.scale.copy_(scale)
    return layer


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize(("pow2", "fp8_dot"), [(True, 1), (True, 0), (False, 1)])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 4096, 8192), (5, 1000, 1024), (16, 512, 4096), (64, 2048, 4096),
                                              (333, 4096, 2048), (2048, 1300, 1024)])
def test_matches_the_models_fp8_linear(rows: int, n: int, k: int, pow2: bool, fp8_dot: int) -> None:
    layer = fp8_layer(k, n, pow2, seed=rows + n)
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(rows, k, generator=gen, device="cuda") * 3).bfloat16()
    want = layer.unrounded(x)
    config = launch_config(rows, n, k, True) | {"FP8_DOT": fp8_dot, "CUBLAS": 0}
    got = fp8_linear(x, layer.weight, layer.scale, pow2, config=config)
    assert torch.equal(fp8_linear(x, layer.weight, layer.scale, pow2, torch.bfloat16, config=config), got.bfloat16())
    exact = not (pow2 and fp8_dot)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert rel_err(got, want) < (1e-5 if exact else 5e-4)
    assert (got.bfloat16() != layer(x)).float().mean().item() <= (0.01 if exact else 0.08)
    assert REGISTRY.records[kernel_name()].error is None


@pytest.mark.skipif(blockwise_scaled_mm() is None, reason="this torch or GPU has no block-scaled FP8 GEMM")
@pytest.mark.parametrize(("rows", "n", "k"), [(65, 4096, 8192), (333, 1024, 4096), (2048, 4096, 2048)])
def test_prefill_rows_on_cublas_match_the_model(rows: int, n: int, k: int) -> None:
    """Prefill rows with bf16 out take torch's block-scaled GEMM: the Triton dot's FP8 tolerance (one-ulp flips of
    the model's bf16 output on under 8% of the elements), so within one bf16 rounding of the unrounded product."""
    layer = fp8_layer(k, n, True, seed=rows + n)
    x = (torch.randn(rows, k, generator=torch.Generator(device="cuda").manual_seed(k), device="cuda") * 3).bfloat16()
    assert launch_config(rows, n, k, True)["CUBLAS"] == 1
    got = fp8_linear(x, layer.weight, layer.scale, True, torch.bfloat16)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, layer.unrounded(x)) < 2**-8
    assert (got != layer(x)).float().mean().item() <= 0.08


def test_replays_in_a_cuda_graph() -> None:
    layer = fp8_layer(4096, 2048, True, seed=3)
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "triton")
    x.copy_(torch.randn(16, 4096, device="cuda").bfloat16())
    graph.replay()
    assert rel_err(out, layer.unrounded(x)) < 5e-4


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 32768, 1024), (7, 1024, 4096), (16, 4096, 2048), (13, 8192, 4096)])
def test_decode_quantizes_inside_the_gemm_bit_for_bit(rows: int, n: int, k: int, pow2: bool) -> None:
    """Decode's one launch (the GEMM quantizes its own blocks through the hardware's e4m3 conversion, a tile's last
    K range adds the splits) against the separate quantization kernel, on blocks of very different magnitudes
    (subnormal e4m3 codes, the amax floor): bitwise equal, twice in a row (the tile counters are left at 0)."""
    layer = fp8_layer(k, n, pow2, seed=rows)
    gen = torch.Generator(device="cuda").manual_seed(n)
    magnitude = torch.exp2(torch.randint(-30, 14, (rows, k // 128, 1), generator=gen, device="cuda").float())
    x = (torch.randn(rows, k // 128, 128, generator=gen, device="cuda") * magnitude).flatten(1).bfloat16()
    config = launch_config(rows, n, k, True)
    assert config["QUANT"] == 1
    for out_dtype in (torch.float32, torch.bfloat16):
        apart = fp8_linear(x, layer.weight, layer.scale, pow2, out_dtype, config=config | {"QUANT": 0})
        for _ in range(2):
            assert torch.equal(fp8_linear(x, layer.weight, layer.scale, pow2, out_dtype), apart)


@pytest.mark.parametrize(("rows", "n", "k"), [(65, 4096, 1024), (333, 1300, 2048), (2048, 32768, 1024),
                                              (1000, 4096, 8192)])
def test_tilelang_fp8_gemm_cuda(rows: int, n: int, k: int) -> None:
    """TileLang's FP8 GEMM (FP8 wgmma, per-block fp32 promotion) at prefill rows: odd row counts, N not a multiple
    of the 128 tile; the FP8 tensor cores' tolerance, fp32 and bf16 out."""
    pytest.importorskip("tilelang")
    layer = fp8_layer(k, n, True, seed=rows)
    x = (torch.randn(rows, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)) * 3).bfloat16()
    want = layer.unrounded(x)
    got = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "tilelang")
    assert rel_err(got, want) < 5e-4
    rounded = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.bfloat16, "tilelang")
    assert rel_err(rounded.float(), want) < 5e-3
    record = REGISTRY.records["fp8_linear.tilelang"]
    assert record.error is None and record.launch["target"] == "cuda" and "wgmma" in record.lowered
