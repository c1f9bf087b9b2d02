"""The fp32 product kernel against ``F.linear`` in fp32 on random inputs (CPU: Triton interpreter, whose products
are exact fp32; the GPU's three TF32 products are tests/gpu/test_fp32_linear_gpu.py).

Tolerance: only the fp32 summation order differs, 1e-6 of max|y|.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from v4compile.codegen import ops
from v4compile.codegen.triton.fp32_linear import fp32_linear, launch_config


@pytest.mark.parametrize(("lead", "n", "k", "x_dtype", "w_dtype", "bias", "split"),
                         [((1,), 70, 200, torch.float32, torch.float32, False, 1),
                          ((2, 5), 33, 128, torch.bfloat16, torch.bfloat16, True, 1),
                          ((37,), 130, 300, torch.float32, torch.bfloat16, True, 3),
                          ((3,), 16, 1000, torch.float16, torch.float32, False, 4)])
def test_matches_fp32_linear_of_the_widened_operands(lead: tuple, n: int, k: int, x_dtype: torch.dtype,
                                                    w_dtype: torch.dtype, bias: bool, split: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(*lead, k, generator=gen).to(x_dtype)
    weight = torch.randn(n, k, generator=gen).to(w_dtype)
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x.float(), weight.float(), b)
    config = launch_config(torch.Size(lead).numel(), n, k, False) | {"SPLIT": split, "BK": 32}
    for transposed, w in ((False, weight), (True, weight.t().contiguous())):
        got = fp32_linear(x, w, b, transposed, config=config)
        assert got.shape == (*lead, n) and got.dtype == torch.float32
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_decode_splits_depend_on_n_and_k_only() -> None:
    configs = {m: launch_config(m, 1024, 4096, True) for m in (1, 7, 16)}
    assert len({c["SPLIT"] for c in configs.values()}) == 1 and configs[1]["SPLIT"] > 1
    assert launch_config(16, 129280, 4096, True)["SPLIT"] == 1


def test_bad_operands_are_named() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"v4compile::fp32_linear: weight must be 2-D"):
        ops.fp32_linear(x, torch.randn(2, 8, 64), None, False, "triton")
    with pytest.raises(ValueError, match=r"activation of shape \(4, 64\) does not take the weight's 32 in_features"):
        ops.fp32_linear(x, torch.randn(8, 32), None, False, "triton")
    with pytest.raises(ValueError, match=r"bias must be \[8\], got shape \(9,\)"):
        ops.fp32_linear(x, torch.randn(8, 64), torch.randn(9), False, "triton")
    with pytest.raises(ValueError, match=r"weight dtype torch.int8 is not one of"):
        ops.fp32_linear(x, torch.zeros(8, 64, dtype=torch.int8), None, False, "triton")


def test_the_split_decode_kernel_compiles_for_hopper(sm90_ptx: Callable[..., str]) -> None:
    """The decode configuration lowered for sm_90 on the CPU: three TF32 products per step, and the split K's last
    program found by an acquire-release atomic after a barrier."""
    from v4compile.codegen.triton.fp32_linear import _SOURCE

    config = launch_config(4, 1024, 4096, True)
    assert config["SPLIT"] > 1
    constexprs = {"HAS_BIAS": True, **{k: config[k] for k in ("BM", "BN", "BK", "GROUP", "SPLIT")}}
    pointers = {"X": "*fp32", "W": "*fp32", "B": "*fp32", "OUT": "*fp32", "PARTS": "*fp32", "COUNTER": "*i32"}
    scalars = dict.fromkeys(("M", "N", "K", "s_xm", "s_xk", "s_wn", "s_wk", "s_o", "s_part"), "i32")
    ptx = sm90_ptx(_SOURCE.format(precision="tf32x3"), "fp32_mm",
                   pointers | scalars | dict.fromkeys(constexprs, "constexpr"), constexprs, list(pointers),
                   config["num_warps"])
    assert "tf32" in ptx
    release = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, release):release]
