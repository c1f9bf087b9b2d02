"""The TileLang sparse attention: off CUDA it runs the Triton kernel (the ``c`` target has no tensor-core
products) and says so; its Hopper source builds for sm_90a, warp-specialised: a producer's asynchronous gather
signalling mbarriers, wgmma products (where a CUDA compiler is installed). Its numerics are tested on the H200
(tests/gpu/test_tilelang_gpu.py)."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import load_module

pytest.importorskip("tilelang")

tilelang_attention = importlib.import_module("v4compile.codegen.tilelang.sparse_attention")


def test_cpu_runs_the_triton_kernel_and_reports_it() -> None:
    torch.manual_seed(0)
    q, kv = torch.randn(2, 1, 8, 64).bfloat16(), torch.randn(2, 40, 64).bfloat16()
    sink, index = torch.randn(8), torch.randint(-1, 40, (2, 1, 24))
    got = ops.sparse_attention(q, kv, sink, index, 0.125, "tilelang")
    torch.testing.assert_close(got.float(), reference.sparse_attention(q, kv, sink, index, 0.125).float(),
                               rtol=2**-7, atol=1e-4)
    assert ops.implementation_backend("sparse_attention", "tilelang", q) == "triton"
    on_meta = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    assert not tilelang_attention.takes(on_meta)  # the meta device is not CUDA either
    assert ops.implementation_backend("sparse_attention", "tilelang") == "tilelang"
    assert ops.implementation_backend("fp32_linear", "tilelang", q) == "triton"  # no TileLang kernel
    assert not tilelang_attention.runs_here(q, kv)


def test_launch_config_fills_the_gpu_with_splits() -> None:
    assert tilelang_attention.launch_config(1, 64, 768)["splits"] == 6  # one 128-entry round per split
    assert tilelang_attention.launch_config(16, 64, 768)["splits"] == 6
    assert tilelang_attention.launch_config(64, 64, 768)["splits"] == 2
    assert tilelang_attention.launch_config(128, 64, 768)["splits"] == 1
    assert tilelang_attention.launch_config(1, 64, 100)["splits"] == 1  # never more splits than rounds
    assert tilelang_attention.launch_config(33, 64, 640)["splits"] == 3  # 5 rounds as 2 + 2 + 1, none idle


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler to build for sm_90a")
@pytest.mark.parametrize("rows", [16, 128])
def test_hopper_source_gathers_asynchronously_into_wgmma(tmp_path, rows: int) -> None:
    """Both launch forms (6 splits with the combine kernel at 16 rows, one at 128): the producer's gather, the
    consumers' register split and wgmma, and no block-wide barrier after the barriers' setup (the warp groups
    run different code, so one would deadlock them)."""
    config = tilelang_attention.launch_config(rows, 64, 768)
    path = tmp_path / "attention.py"
    path.write_text(tilelang_attention._SOURCE.format(dim=512, block_h=64, round=tilelang_attention.ROUND,
                                                      rounded_p=False, ids="int64", **config))
    attend, combine = load_module(path).build({"kind": "cuda", "arch": "sm_90a"})
    source = attend.get_kernel_source()
    assert "cp_async_gs_conditional" in source  # ids outside [0, entries) copy zeros
    assert "mbarrier_cp_async_arrive_noinc" in source  # the producer signals landed blocks
    assert "warpgroup_reg_alloc" in source and "warpgroup_reg_dealloc" in source  # consumers take the registers
    assert "wgmma" in source
    assert source.count("__syncthreads()") == 1
    assert combine is None if config["splits"] == 1 else "__global__" in combine.get_kernel_source()
