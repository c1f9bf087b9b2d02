"""Compressor pooling with the entry's finish fused, in TileLang (``cuda`` target on GPU, ``c`` target on CPU):
a block pools BLOCK_J whole entries (every dim, with the pooling macros of ``compressor.py``), then, before the
only write, normalizes them, applies RoPE to the last dims and simulates the cache format: FP8 blocks on the
other dims (main branch) or the Hadamard rotation then FP4 blocks (indexer branch). Long blocks (C128) are
pooled by the pooling kernel instead, many blocks per entry, and the finishing kernel reads its entries back.
Prefill form (entries of complete blocks) and decode-state form (the entry of the open block).

The rounding follows the model's code step by step, as the Triton kernel does: bf16 after the pooling, the norm,
RoPE and the rotation; power-of-two scales and the e4m3 / e2m1 grids from exponent and significand bits with
integer arithmetic (exact under the ``c`` target's fast math). A dim whose scores were all -inf (NaN in the
model's softmax) makes the whole entry NaN, as in the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...model import quant
from ..registry import REGISTRY
from ..triton.compressor_finish import entry_bodies, kernel_name, per_entry_table
from .common import TARGET_MACROS, load_kernels
from .compressor import _HEADER, compressor_pool, compressor_pool_state

_FINISH = '''
ROPE = {rope}
ROTATE = {rotate}
QUANTIZE = {quantize}
POW2 = {pow2}
STATE = {state}
POOLED = {pooled}
QBLOCK = {qblock}
QBLOCKS = BLOCK_D // QBLOCK
QMAX = {qmax}
LOG2_QMAX = {log2_qmax}
MANTISSA = {mantissa}
MIN_EXP = {min_exp}
AMAX_FLOOR = {amax_floor!r}
INV_SQRT_W = {inv_sqrt_w!r}
OUT = "{out_dtype}"
''' + TARGET_MACROS + '''

def build(target):
    batch, seq, n_blocks = T.dynamic("batch"), T.dynamic("seq"), T.dynamic("n_blocks")
    cuda = target != "c"

    to_bf16, reduce_rows = target_macros(cuda)

    @T.macro
    def exp2i(e):
        # exact 2**e for an integer e in the normal range
        return T.reinterpret((e + 127) << 23, "float32")

    @T.macro
    def floor_log2(x):
        # exact floor(log2|x|) of a finite nonzero float, from its exponent bits
        return ((T.reinterpret(x, "int32") >> 23) & 0xFF) - 127

    @T.macro
    def on_grid(v):
        # v (within +-QMAX) to the nearest value with MANTISSA bits (constant spacing below 2**MIN_EXP), ties to
        # even, on the integer significand
        bits = T.reinterpret(v, "int32")
        mag = bits & 0x7FFFFFFF
        e = (mag >> 23) - 127
        sig = (mag & 0x7FFFFF) | 0x800000
        shift = T.min(23 - MANTISSA + T.max(MIN_EXP - e, 0), 26)
        q = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
        out = T.if_then_else(mag < 0x800000, 0.0, T.cast(q, "float32") * exp2i(T.max(e, MIN_EXP) - MANTISSA))
        return T.if_then_else(bits < 0, -out, out)

    @T.macro
    def block_absmax(x, top):
        if cuda:
            T.reduce_absmax(x, top, dim=2)
        else:
            for j, g in T.Parallel(BLOCK_J, QBLOCKS):
                top[j, g] = 0.0
                for i in T.serial(QBLOCK):
                    top[j, g] = T.max(top[j, g], T.max(x[j, g, i], -x[j, g, i]))

    @T.macro
    def finish(m, s, acc, cos, sin, norm_w, eps, out, b, j0, n_blocks):
        # the pooled entries acc / s [BLOCK_J, BLOCK_D] -> finished bf16 entries out[b, j0 + j]; a dim whose
        # scores were all -inf (its running max never left FLOOR) is NaN in the model and makes the entry NaN
        scratch = T.alloc_shared((2, BLOCK_J, BLOCK_D), "float32")
        x, square, nan = tile("float32"), tile("float32"), tile("float32")
        total = T.alloc_fragment((BLOCK_J,), "float32")
        any_nan = T.alloc_fragment((BLOCK_J,), "float32")
        e = T.alloc_fragment((BLOCK_J, QBLOCKS, QBLOCK), "float32")
        amax = T.alloc_fragment((BLOCK_J, QBLOCKS), "float32")
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            p = T.if_then_else(d < WIDTH, acc[j, d] / s[j, d], 0.0)  # dims past WIDTH pooled nothing
            unset = d < WIDTH and m[j, d] <= FLOOR
            nan[j, d] = T.if_then_else(unset or (T.reinterpret(p, "uint32") & 0x7FFFFFFF) > 0x7F800000, 1.0, 0.0)
            x[j, d] = to_bf16(p)
            square[j, d] = x[j, d] * x[j, d]
        reduce_rows(square, total, BLOCK_J, BLOCK_D, "sum")
        reduce_rows(nan, any_nan, BLOCK_J, BLOCK_D, "max")
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            weight = T.if_then_else(d < WIDTH, norm_w[T.min(d, WIDTH - 1)], 0.0)
            scratch[0, j, d] = to_bf16(weight * (x[j, d] * T.rsqrt(total[j] * (1.0 / WIDTH) + eps)))
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            # RoPE on the interleaved pairs of the last ROPE dims, with entry j's cos / sin
            k = T.min(T.max(d - (WIDTH - ROPE), 0) // 2, ROPE // 2 - 1)  # in range for every d (loads are eager)
            jj = T.min(j0 + j, n_blocks - 1)
            a = scratch[0, j, d - d % 2]
            c = scratch[0, j, d - d % 2 + 1]
            turned = T.if_then_else(d % 2 == 0, to_bf16(a * cos[b, jj, k] - c * sin[b, jj, k]),
                                    to_bf16(a * sin[b, jj, k] + c * cos[b, jj, k]))
            scratch[1, j, d] = T.if_then_else(d >= WIDTH - ROPE and d < WIDTH, turned, scratch[0, j, d])
{hadamard}
        if QUANTIZE:
            for j, g, i in T.Parallel(BLOCK_J, QBLOCKS, QBLOCK):
                if ROTATE:
                    e[j, g, i] = to_bf16(scratch[{rotated}, j, g * QBLOCK + i] * INV_SQRT_W)
                else:
                    e[j, g, i] = T.if_then_else(g * QBLOCK + i < WIDTH - ROPE, scratch[1, j, g * QBLOCK + i], 0.0)
            block_absmax(e, amax)
        for j, g, i in T.Parallel(BLOCK_J, QBLOCKS, QBLOCK):
            d = g * QBLOCK + i
            if QUANTIZE:
                top = T.max(amax[j, g], AMAX_FLOOR)
                # the scale amax / QMAX rounded up to a power of two exactly: the smallest 2**k with QMAX 2**k >= amax
                k = floor_log2(top) - LOG2_QMAX
                k = T.if_then_else(QMAX * exp2i(k) >= top, k, k + 1)
                if POW2 or ROTATE:
                    quantized = on_grid(T.min(T.max(e[j, g, i] * exp2i(-k), -QMAX), QMAX)) * exp2i(k)
                else:
                    scale = top / QMAX
                    quantized = on_grid(T.min(T.max(e[j, g, i] / scale, -QMAX), QMAX)) * scale
                if ROTATE:
                    value = quantized
                else:
                    value = T.if_then_else(d < WIDTH - ROPE, quantized, scratch[1, j, d])
            else:
                value = scratch[1, j, d]
            value = T.if_then_else(any_nan[j] > 0.0, quiet_nan("float32"), to_bf16(value))
            if j0 + j < n_blocks and d < WIDTH:
                out[b, j0 + j, d] = T.cast(value, OUT)

    @T.prim_func
    def pool_and_finish(kv: T.Tensor((batch, seq, COLS), IN), score: T.Tensor((batch, seq, COLS), IN),
                        ape: T.Tensor((RATIO, COLS), ACC), cos: T.Tensor((batch, n_blocks, ROPE // 2), "float32"),
                        sin: T.Tensor((batch, n_blocks, ROPE // 2), "float32"), norm_w: T.Tensor((WIDTH,), "float32"),
                        eps: T.float32, out: T.Tensor((batch, n_blocks, WIDTH), OUT)):
        # one block: BLOCK_J whole entries of one sequence (a decode state: its one open entry, seq = SLOTS)
        with T.Kernel(T.ceildiv(n_blocks, BLOCK_J), batch, threads=THREADS) as (bj, b):
            m, s, acc = tile(ACC), tile(ACC), tile(ACC)
            if STATE:
                pool_state(kv, score, m, s, acc, b, 0)
            else:
                pool_blocks(kv, score, ape, m, s, acc, b, bj * BLOCK_J, 0, n_blocks)
            finish(m, s, acc, cos, sin, norm_w, eps, out, b, bj * BLOCK_J, n_blocks)

    @T.prim_func
    def finish_pooled(pooled: T.Tensor((batch, n_blocks, WIDTH), ACC),
                      cos: T.Tensor((batch, n_blocks, ROPE // 2), "float32"),
                      sin: T.Tensor((batch, n_blocks, ROPE // 2), "float32"), norm_w: T.Tensor((WIDTH,), "float32"),
                      eps: T.float32, out: T.Tensor((batch, n_blocks, WIDTH), OUT)):
        # entries the pooling kernel left in ``pooled`` (NaN where a dim had no score): BLOCK_J per block
        with T.Kernel(T.ceildiv(n_blocks, BLOCK_J), batch, threads=THREADS) as (bj, b):
            m, s, acc = tile(ACC), tile(ACC), tile(ACC)
            for j, d in T.Parallel(BLOCK_J, BLOCK_D):
                jj = T.min(bj * BLOCK_J + j, n_blocks - 1)
                m[j, d] = 0.0
                s[j, d] = 1.0
                acc[j, d] = T.if_then_else(d < WIDTH, pooled[b, jj, T.min(d, WIDTH - 1)], 0.0)
            finish(m, s, acc, cos, sin, norm_w, eps, out, b, bj * BLOCK_J, n_blocks)

    return compile_kernel(finish_pooled if POOLED else pool_and_finish, target)
'''


def _hadamard(width: int) -> tuple[str, int]:
    """The Walsh-Hadamard butterflies over ``width`` dims between the two scratch planes, pairs h apart becoming
    (a + b, a - b) for h = 1, 2, 4, ... (the model's order of sums); returns the source and the result's plane."""
    lines, plane, h = [], 1, 1
    while h < width:
        lines += ["        for j, d in T.Parallel(BLOCK_J, BLOCK_D):",
                  f"            scratch[{1 - plane}, j, d] = T.if_then_else((d & {h}) == 0, scratch[{plane}, j, d] + "
                  f"scratch[{plane}, j, d + {h}], scratch[{plane}, j, d - {h}] - scratch[{plane}, j, d])"]
        plane, h = 1 - plane, 2 * h
    return "\n".join(lines), plane


FUSED_RATIO = 16
"""Blocks of at most this many tokens are pooled by the finishing kernel itself (whole entries per block); longer
ones (C128) by the pooling kernel, many blocks per entry, whose pooled entries the finishing kernel then reads:
one block per entry leaves a C128 decode batch on a few SMs (H200: 32-74 us per call at batch 1-256)."""


def launch_config(width: int, state: bool) -> dict[str, int]:
    """Whole entries per block (the RMS needs every dim): 512 values over 128 threads, so one 512-wide entry or
    four 128-wide ones; a decode state has one entry per sequence."""
    block_d = 1 << (width - 1).bit_length()
    return {"block_j": 1 if state else max(1, 512 // block_d), "block_d": block_d, "threads": 128}


def _kernel(ratio: int, width: int, overlap: bool, rope: int, rotate: bool, pow2: bool, quantize: bool, state: bool,
            device: torch.device) -> tuple[str, Any, dict[str, int], str, bool]:
    """Builds (once) the finishing kernel; returns its name, the kernel, its launch config, its target and whether
    it reads pooled entries (else it pools them itself)."""
    target = "cuda" if device.type == "cuda" else "c"
    name = kernel_name(ratio, width, rotate, state, "tilelang", quantize)
    config = launch_config(width, state)
    pooled = ratio > FUSED_RATIO
    qblock, qmax = (quant.FP4_BLOCK, quant.FP4_MAX) if rotate else (quant.FP8_KV_BLOCK, quant.FP8_MAX)

    def source() -> str:
        hadamard, rotated = _hadamard(config["block_d"]) if rotate else ("", 1)
        finish = _FINISH.format(
            rope=rope, rotate=rotate, quantize=quantize, pow2=pow2, state=state, pooled=pooled, qblock=qblock,
            qmax=qmax, log2_qmax=math.floor(math.log2(qmax)), mantissa=1 if rotate else 3, min_exp=0 if rotate else -6,
            amax_floor=quant.FP4_AMAX_FLOOR if rotate else quant.FP8_AMAX_FLOOR, inv_sqrt_w=1.0 / math.sqrt(width),
            out_dtype="bfloat16" if target == "cuda" else "float32", hadamard=hadamard, rotated=rotated)
        return _HEADER.format(ratio=ratio, width=width, overlap=overlap, in_dtype="float32",
                              acc_dtype="float32", **config) + finish

    kernel = REGISTRY.build(name, "tilelang", f"v4compile::{name.split('.')[0]}", source,
                            lambda path: load_kernels(path, target, name), key=(overlap, rope, pow2, target))
    return name, kernel, config, target, pooled


def _launch(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            norm_weight: torch.Tensor, eps: float, ratio: int, width: int, n_blocks: int, rotate: bool,
            pow2: bool, quantize: bool, state: bool) -> torch.Tensor:
    bsz, half = kv.shape[0], cos.shape[-1]
    # a decode state's bias is in its scores: the kernel reads none (an unfilled table of the declared shape)
    ape = score.new_empty(ratio, score.shape[-1]) if ape is None else ape
    name, kernel, config, target, pooled = _kernel(ratio, width, kv.shape[-1] == 2 * width, 2 * half, rotate, pow2,
                                                   quantize, state, kv.device)
    kv, score, ape = kv.float().contiguous(), score.float().contiguous(), ape.float().contiguous()
    cos, sin = (per_entry_table(t, bsz, n_blocks, state).contiguous() for t in (cos, sin))
    norm_weight = norm_weight.float().contiguous()
    out = torch.empty(bsz, n_blocks, width, dtype=torch.bfloat16 if target == "cuda" else torch.float32,
                      device=kv.device)
    if out.numel():
        if pooled:
            entries = (compressor_pool_state(kv, score, ratio, width)[:, None] if state else
                       compressor_pool(kv, score, ape, ratio, width, n_blocks))
            REGISTRY.launch(name, lambda: kernel(entries, cos, sin, norm_weight, float(eps), out))
        else:
            REGISTRY.launch(name, lambda: kernel(kv, score, ape, cos, sin, norm_weight, float(eps), out))
        REGISTRY.note_launch(name, grid=(-(-n_blocks // config["block_j"]), bsz), tokens=kv.shape[1], target=target,
                             pooling="compressor_pool kernel" if pooled else "fused", **config)
    out = out.to(torch.bfloat16)
    return out[:, 0] if state else out


compressor_entries, compressor_entry_state = entry_bodies(_launch, "TileLang")
