"""The FP8 linear kernel against the model's FP8 ``Linear`` on random inputs (CPU: Triton interpreter).

Tolerance: the kernel's activation codes and scales equal ``quant.fp8_simulate`` bit for bit and its products are
exact, so only the fp32 summation order differs: the output rounded to bf16, as the model rounds it, is equal
but for rare one-ulp flips, and the fp32 difference stays below 1e-5 of max|y|.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from v4compile.codegen import ops
from v4compile.codegen.triton.fp8_linear import GEMM_SIGNATURE, fp8_linear, launch_config
from v4compile.model import quant
from v4compile.model.linear import Linear


def fp8_layer(k: int, n: int, pow2: bool, seed: int = 0) -> Linear:
    """The model's FP8 linear with a seeded normal / sqrt(in) weight quantized the checkpoint's way."""
    layer = Linear(k, n, "fp8", pow2)
    gen = torch.Generator().manual_seed(seed)
    weight, scale = quant.quantize_fp8_weight(torch.randn(n, k, generator=gen) / k**0.5)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.scale.copy_(scale)
    return layer


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 200, 256), (7, 130, 384), (40, 64, 128)])
def test_matches_the_models_fp8_linear(rows: int, n: int, k: int, pow2: bool) -> None:
    layer = fp8_layer(k, n, pow2)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, rows, k, generator=gen) * 4).bfloat16()
    x[0, 0, :128] *= 1e-6  # a block under the amax floor
    expected = layer.unrounded(x)
    out = fp8_linear(x, layer.weight, layer.scale, pow2)
    assert out.shape == (2, rows, n) and out.dtype == torch.float32
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
    flips = (out.bfloat16() != layer(x)).float().mean().item()
    assert flips <= 0.01


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 200, 256), (20, 130, 384)])
def test_the_fp8_tensor_core_path_runs_under_the_interpreter(rows: int, n: int, k: int) -> None:
    layer = fp8_layer(k, n, True)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    out = fp8_linear(x, layer.weight, layer.scale, True, config=launch_config(rows, n, k, False) | {"FP8_DOT": 1})
    expected = layer.unrounded(x)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize(("split", "group", "bm"), [(2, 1, 16), (3, 2, 16), (5, 4, 32)])
def test_k_splits_and_grouped_tiles_sum_what_one_program_sums(split: int, group: int, bm: int) -> None:
    layer = fp8_layer(640, 150, True, seed=split)
    x = (torch.randn(70, 640, generator=torch.Generator().manual_seed(group)) * 4).bfloat16()
    config = launch_config(70, 150, 640, False) | {"SPLIT": split, "GROUP": group, "BM": bm, "BN": 32}
    expected = layer.unrounded(x)
    out = fp8_linear(x, layer.weight, layer.scale, True, config=config)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
    rounded = fp8_linear(x, layer.weight, layer.scale, True, torch.bfloat16, config=config)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())


@pytest.mark.parametrize(("pow2", "fp8_dot"), [(True, 1), (True, 0), (False, 0)])
@pytest.mark.parametrize(("rows", "split"), [(1, 1), (5, 3), (16, 2)])
def test_quantizing_inside_the_gemm_changes_no_bit(rows: int, split: int, pow2: bool, fp8_dot: int) -> None:
    """Decode's one launch (``QUANT``: the GEMM quantizes its own activation blocks, a tile's last K range adds the
    splits) against the separate quantization and the same summation order: bitwise equal, fp32 and bf16 out."""
    layer = fp8_layer(640, 150, pow2, seed=rows)
    gen = torch.Generator().manual_seed(split)
    x = (torch.randn(rows, 640, generator=gen) * torch.exp2(torch.randint(-20, 12, (rows, 5, 1), generator=gen))
         .repeat_interleave(128, 1).flatten(1)).bfloat16()
    x[0, 128:256] *= 1e-9  # a block under the amax floor
    config = launch_config(rows, 150, 640, False) | {"SPLIT": split, "BM": 16, "BN": 32, "FP8_DOT": fp8_dot}
    for out_dtype in (torch.float32, torch.bfloat16):
        apart = fp8_linear(x, layer.weight, layer.scale, pow2, out_dtype, config=config | {"QUANT": 0})
        fused = fp8_linear(x, layer.weight, layer.scale, pow2, out_dtype, config=config | {"QUANT": 1})
        assert torch.equal(fused, apart)
    expected = layer.unrounded(x)
    assert (apart.float() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_bf16_output_is_the_fp32_output_rounded_once() -> None:
    layer = fp8_layer(256, 200, False)
    x = (torch.randn(9, 256, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    out = fp8_linear(x, layer.weight, layer.scale, False)
    assert torch.equal(fp8_linear(x, layer.weight, layer.scale, False, torch.bfloat16), out.bfloat16())
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_linear(x, layer.weight, layer.scale, False, torch.float16)


def test_op_runs_the_kernel_and_its_reference_alike() -> None:
    layer = fp8_layer(256, 96, True)
    x = torch.randn(3, 256).bfloat16()
    fast = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "triton")
    ref = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "reference")
    assert torch.equal(ref, layer.unrounded(x))
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
    rounded = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.bfloat16, "reference")
    assert torch.equal(rounded, layer(x))
    assert torch.equal(ops.fp8_linear(x, layer.weight, layer.scale, True, torch.bfloat16, "triton"), fast.bfloat16())


def test_gradient_is_the_models() -> None:
    layer = fp8_layer(128, 64, True)
    x = torch.randn(4, 128, requires_grad=True)
    ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "triton").sum().backward()
    y = x.detach().requires_grad_()
    layer.unrounded(y).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.grad)


def test_bad_scale_shape_names_the_tensor() -> None:
    layer = fp8_layer(256, 130, True)
    with pytest.raises(ValueError, match=r"block scales of shape \(2, 2\).*got \(1, 2\)"):
        ops.fp8_linear(torch.randn(1, 256), layer.weight, layer.scale[:1], True, torch.float32, "triton")
    with pytest.raises(ValueError, match="activation has 128 features"):
        ops.fp8_linear(torch.randn(1, 128), layer.weight, layer.scale, True, torch.float32, "triton")


@pytest.mark.parametrize("pow2", [True, False])
def test_the_decode_gemm_compiles_for_hopper_with_the_hardware_e4m3_conversion(
        pow2: bool, sm90_ptx: Callable[..., str]) -> None:
    """What the GPU runs while decoding, lowered on the CPU: the in-GEMM quantization converts with the hardware's
    nearest-even saturating e4m3 instruction (with power-of-two scales; otherwise the integer rounding feeds a bf16
    dot), and a split K finds its tile's last program with an acquire-release atomic after a barrier."""
    from v4compile.codegen.triton.fp8_linear import _SOURCE

    config = launch_config(1, 4096, 8192, True)
    assert config["QUANT"] == 1 and config["SPLIT"] > 1
    constexprs = {"POW2": pow2, "FP8_DOT": pow2, "TL_DOT": True, "QUANT": True, "HW_CAST": True, "BM": config["BM"],
                  "BN": config["BN"], "GROUP": 1, "SPLIT": config["SPLIT"], "OUT_BF16": True}
    ptx = sm90_ptx(_SOURCE.format(dot="bfloat16"), "fp8_gemm", GEMM_SIGNATURE | dict.fromkeys(constexprs, "constexpr"),
                   constexprs, ["X", "W", "OUT", "PARTS"], config["num_warps"])
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == pow2
    release = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, release):release]  # every thread's partial stored first


@pytest.mark.parametrize(("rows", "n", "k"), [(7, 130, 384), (40, 256, 256), (1, 64, 128)])
def test_the_tilelang_gemm_matches_the_models_fp8_linear(rows: int, n: int, k: int) -> None:
    """TileLang's FP8 GEMM (the ``c`` target: the same source's per-block promotion, a loop for the tensor cores)
    on the Triton quantizer's codes: the model's simulation up to summation order, partial row and column tiles,
    the bf16 output the fp32 one rounded once."""
    pytest.importorskip("tilelang")
    from v4compile.codegen.registry import REGISTRY

    layer = fp8_layer(k, n, True)
    x = (torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    x[0, 0, :128] *= 1e-6  # a block under the amax floor
    want = layer.unrounded(x)
    got = ops.fp8_linear(x, layer.weight, layer.scale, True, torch.float32, "tilelang")
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(ops.fp8_linear(x, layer.weight, layer.scale, True, torch.bfloat16, "tilelang"), got.bfloat16())
    record = REGISTRY.records["fp8_linear.tilelang"]
    assert record.error is None and record.launch["target"] == "c" and record.launch["rows"] == 2 * rows


def test_the_tilelang_body_leaves_non_power_of_two_scales_to_triton() -> None:
    """With non-power-of-two scales the model's activation is bf16 ``q * scale``, not an e4m3 value: the FP8 tensor
    cores do not apply and the Triton body runs, with its results."""
    pytest.importorskip("tilelang")
    from v4compile.codegen.tilelang import fp8_linear as tilelang_fp8

    layer = fp8_layer(256, 130, False)
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(5)) * 4).bfloat16()
    assert torch.equal(tilelang_fp8.fp8_linear(x, layer.weight, layer.scale, False),
                       fp8_linear(x, layer.weight, layer.scale, False))
