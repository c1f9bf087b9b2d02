"""Kernels as the H100/H200 would run them, produced on the CPU: PTX from Triton's compiler, SASS from its bundled
``ptxas``, and the main loop's instruction mix (``codegen/triton/hopper.py``; ``benchmarks/sass_mix.py``)."""

from __future__ import annotations

import re
import shutil

import pytest

from v4compile.codegen.triton import moe
from v4compile.codegen.triton.hopper import main_loop, mma_loop, sm90_ptx, sm90_sass, unpredicated
from v4compile.codegen.triton.moe_kernels import SOURCE

pytest.importorskip("triton.backends.nvidia")


def _gated_fp4_sass(tokens: int) -> tuple[dict, list[str]]:
    """The launch configuration of the gated FP4 GEMM at ``tokens`` tokens (V4-Flash's shape: 256 experts, top-6,
    dim 4096, inter 2048) and the kernel's SASS for sm_90 with the launch's alignment hints."""
    config = moe.launch_config(6 * tokens, 256, tokens, 4096, 2048, True, "fp4")
    constexprs = {"GATED": True, "CLAMP": True, "PARTIAL": False, "BM": config["BM"], "BN": config["BN1"],
                  "BK": config["BK"], "E_BLOCK": 256, "TL_DOT": True, "SWAP": config["swap"],
                  "WIDEN": config["widen"]}
    signature = moe.GEMM_SIGNATURE | dict.fromkeys(constexprs, "constexpr")
    divisible = [n for n, t in signature.items() if t.startswith("*")] + ["N", "K", "k_part", "s_a", "s_w", "s_s",
                                                                          "s_we", "s_se", "s_o", "s_op"]
    ptx = sm90_ptx(SOURCE.format(fmt="fp4", dot="bfloat16"), "moe_gemm", signature, constexprs, divisible,
                   config["num_warps"])
    return config, sm90_sass(ptx)


def test_the_moe_decode_tiles_main_loop_holds_its_mmas() -> None:
    """The gated FP4 GEMM at one token (V4-Flash's shape): the loop found is the K loop, one iteration of which
    runs the tile's tensor-core MMAs (2 weights x BK/16 k-steps x BN x BM / (16 x 8) output tiles, shared by the
    warps; the decode tile computes the product transposed, the weights as the 16-row side) and
    vector-loads the packed weights (no byte loads: the launch's alignment hints are applied)."""
    config, sass = _gated_fp4_sass(1)
    loop = main_loop(sass)
    mmas = 2 * (config["BK"] // 16) * (config["BN1"] * config["BM"] // 128) // config["num_warps"]
    assert loop.opcodes["HMMA"] == mmas and sum(t.startswith("HMMA") for t in sass) >= mmas
    assert 0 < loop.instructions < len(sass)
    assert not any(".U8" in t and t.startswith("LDG") for t in sass)
    weights = 2 * config["BN1"] * config["BK"]
    assert loop.per(weights, 32 * config["num_warps"]) == loop.instructions * 32 * config["num_warps"] / weights


def test_the_widened_fp4_tile_runs_on_tensor_cores_from_words() -> None:
    """The FP4 tile of 33-64 pairs an expert (2048 tokens at V4-Flash's shape) widens the packed weights itself:
    its loop issues Hopper's ``wgmma`` (``HGMMA``) and reads the weights as whole words: no byte loads from shared
    memory (the ``tl.dot_scaled`` form's ``LDS.U8``), and from memory only the scale bytes (one per 32 weights)."""
    config, sass = _gated_fp4_sass(2048)
    assert config["widen"] and config["BM"] == 64
    loop = main_loop(sass)
    assert loop.opcodes["HGMMA"] > 0
    byte_loads = [op for op in map(unpredicated, loop.text) if re.match(r"LD[SG]\S*\.U8", op)]
    scale_bytes = 2 * config["BN1"] * config["BK"] // 32 // (32 * config["num_warps"])
    assert not any(op.startswith("LDS") for op in byte_loads)
    assert len(byte_loads) <= scale_bytes, byte_loads


def test_a_kernel_the_gpu_compiler_rejects_is_named() -> None:
    """A jit function whose branches return different types (the interpreter runs it, the GPU's compiler does not):
    the error names the kernel and carries the compiler's reason."""
    source = '''
import triton
import triton.language as tl


@triton.jit
def _pick(x, FLAG: tl.constexpr):
    if FLAG:
        return x.to(tl.int32)
    return x


@triton.jit
def bad(X, n, FLAG: tl.constexpr):
    i = tl.arange(0, 16)
    v = tl.load(X + i)
    if n > 0:
        v = _pick(v, FLAG)
    tl.store(X + i, v)
'''
    with pytest.raises(RuntimeError, match=r"lowering bad for sm_90 failed(.|\n)*Return type mismatch"):
        sm90_ptx(source, "bad", {"X": "*fp32", "n": "i32", "FLAG": "constexpr"}, {"FLAG": True}, ["X"], 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler to assemble TileLang's CUDA")
def test_the_tilelang_fp4_gemm_widens_into_the_mma_registers() -> None:
    """TileLang's FP4 expert GEMM at 8192 tokens: the activation tiles arrive by TMA (a producer warp group), the
    widened weights are ``wgmma``'s register operand (``HGMMA`` reading registers, no shared-memory round trip),
    the consumer loop holds no block-wide barrier, so one warp group widens while the other's MMAs run, and the
    output leaves in 16-byte stores."""
    pytest.importorskip("tilelang")
    from v4compile.codegen.tilelang import moe as tilelang_moe
    from v4compile.codegen.tilelang.common import sm90_sass as tilelang_sass

    config = tilelang_moe.launch_config(6 * 8192, 256, True)
    source = tilelang_moe.hopper_source(2048, 4096, config["BM1"], True, config["S1"], config)
    assert "tma_load" in source and "wgmma_rs" in source
    # the producer warp group's copies are addressed by the tile's own expert and rows (a local the kernel set
    # before TileLang split the warp groups would reach the producer as an unwritten copy, "<name>_producer_ws")
    loads = [line for line in source.splitlines() if "tma_load(a_desc" in line or "tma_load(w_a_desc" in line]
    assert loads and all("tile_row[" in x or "tile_e[" in x for x in loads) and "_producer_ws" not in source
    sass = tilelang_sass(source)
    loop = mma_loop(sass)
    assert loop.opcodes["HGMMA"] == 2 * 128 // 16  # gate and up: 8 k-steps each a 128-wide K block
    # the epilogue goes through shared memory: each output row stored 16 bytes a lane, contiguously
    assert {unpredicated(t).split()[0] for t in sass if "STG" in t} == {"STG.E.128"}
    assert not any(unpredicated(t).startswith("BAR.SYNC") for t in loop.text)
    assert all(re.match(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", unpredicated(t))
               for t in loop.text if "HGMMA" in t)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler to assemble TileLang's CUDA")
def test_the_tilelang_fp8_gemm_promotes_each_block_after_its_fp8_mmas() -> None:
    """TileLang's FP8 GEMM at prefill rows: codes, weights and the block's activation scales arrive by TMA; each
    consumer warp group runs the 128-wide K block as four FP8 ``wgmma``s (``QGMMA``, m64n128k32) and adds it times
    the scales to its fp32 accumulator (64 FMAs a thread), with no block-wide barrier in the loop."""
    pytest.importorskip("tilelang")
    from v4compile.codegen.tilelang import fp8_linear as tilelang_fp8
    from v4compile.codegen.tilelang.common import hopper_cuda
    from v4compile.codegen.tilelang.common import sm90_sass as tilelang_sass

    source = hopper_cuda(tilelang_fp8.source(tilelang_fp8.launch_config(8192, True), True))
    assert source.count("tma_load") >= 3
    sass = tilelang_sass(source)
    assert any(unpredicated(t).startswith("UTMASTG") for t in sass)  # the tile leaves by a TMA store
    loop = mma_loop(sass)
    assert loop.opcodes["QGMMA"] == 4 and loop.opcodes["FFMA"] == 64
    assert all(unpredicated(t).startswith("QGMMA.64x128x32.F32.E4M3.E4M3") for t in loop.text if "GMMA" in t)
    assert not any(unpredicated(t).startswith("BAR.SYNC") for t in loop.text)
