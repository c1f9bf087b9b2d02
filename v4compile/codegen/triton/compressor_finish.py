"""Compressor pooling with the entry's finish fused, in Triton: entries are pooled and, before their only
write, normalized, rotated (RoPE on the last dims) and simulated in the cache format: FP8 blocks on the other
dims (main branch) or the Hadamard rotation then FP4 blocks (indexer branch). A C4 program pools whole entries
(every dim, so the RMS is at hand) and its pooled values stay in registers; a C128 block is too much for one
program, so its dims are pooled by several programs into a scratch row and the entry's last program to finish
(a ticket) finishes it. Prefill form (entries of complete blocks) and decode-state form (the entry of the open
block); the result is the bf16 entry the model computes.

The rounding follows the model's code step by step (bf16 after the pooling, the norm, RoPE and the rotation;
quantization grids by exponent bits and round-half-even), so results differ from the model only where the
pooling's own fp32 rounding, in another summation order, moves a value across a rounding boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton

from ...model import quant
from .. import reference
from ..registry import REGISTRY
from .compressor import POOL_TILE, triton_next_pow2
from .formats import FORMATS_SOURCE
from .launch import ROUND_BF16, load_triton_module, lowered_text

_HEADER = '''
import triton
import triton.language as tl

RATIO = tl.constexpr({ratio})
WIDTH = tl.constexpr({width})
OVERLAP = tl.constexpr({overlap})
STATE = tl.constexpr({state})
HAS_BIAS = tl.constexpr({has_bias})  # a decode state's scores already hold the positional bias
ACC = tl.constexpr(tl.float32)
ROPE = tl.constexpr({rope})
ROTATE = tl.constexpr({rotate})
QUANTIZE = tl.constexpr({quantize})
POW2 = tl.constexpr({pow2})
BLOCK_W = tl.constexpr({block_w})
FP8_BLOCK = tl.constexpr({fp8_block})
FP4_BLOCK = tl.constexpr({fp4_block})
FP8_FLOOR = tl.constexpr({fp8_floor})
FP4_FLOOR = tl.constexpr({fp4_floor})
INV_SQRT_W = tl.constexpr({inv_sqrt_w})
ROUND_INT = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it - it rounds |x| < 2**22 to an integer, ties to even
'''

_GRID = '''

@triton.jit
def _floor_log2(x):
    # exact floor(log2|x|) of finite nonzero fp32, from the exponent bits
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _ceil_pow2(x):
    e = _floor_log2(x)
    return tl.where(_exp2i(e) == x, x, _exp2i(e + 1))


@triton.jit
def _round_to_grid(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, MAX: tl.constexpr):
    # nearest value with MANTISSA bits (spacing constant below 2**MIN_EXP), ties to even, saturating
    x = tl.minimum(tl.maximum(x, -MAX), MAX)
    e = tl.maximum(_floor_log2(tl.where(x == 0, 1.0, x)), MIN_EXP)
    v = x * _exp2i(MANTISSA - e)
    v = (v + ROUND_INT) - ROUND_INT
    return tl.minimum(tl.maximum(v * _exp2i(e - MANTISSA), -MAX), MAX)


@triton.jit
def _simulate(x, BLOCK_J: tl.constexpr, BLOCK: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
              MAX: tl.constexpr, FLOOR: tl.constexpr, POW2_SCALE: tl.constexpr):
    # quantize-dequantize [BLOCK_J, BLOCK_W] with one scale per BLOCK dims: amax / MAX, floored, maybe pow2
    xb = tl.reshape(x, [BLOCK_J, BLOCK_W // BLOCK, BLOCK])
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), FLOOR)
    scale = tl.div_rn(amax, MAX)
    if POW2_SCALE:
        scale = _ceil_pow2(scale)
    q = _round_to_grid(tl.div_rn(xb, scale[:, :, None]), MANTISSA, MIN_EXP, MAX) * scale[:, :, None]
    return tl.reshape(q, [BLOCK_J, BLOCK_W])
'''

_FINISH = '''

@triton.jit
def _finish(p, rows, COS, SIN, cs_off, NORM_W, eps, out, BLOCK_J: tl.constexpr):
    # pooled fp32 [BLOCK_J, BLOCK_W] (zero past WIDTH) -> the finished entry, rounded to bf16, stored at out
    d = tl.arange(0, BLOCK_W)
    x = _round_bf16(p)
    weight = tl.load(NORM_W + d, mask=d < WIDTH, other=0.0)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) * (1.0 / WIDTH) + eps)
    y = _round_bf16(weight[None, :] * (x * inv_rms[:, None]))
    a, b = tl.split(tl.reshape(y, [BLOCK_J, BLOCK_W // 2, 2]))
    k = tl.arange(0, BLOCK_W // 2)
    rope = (2 * k >= WIDTH - ROPE) & (2 * k < WIDTH)
    lane = rows[:, None] & rope[None, :]
    at = cs_off[:, None] + (k - (WIDTH - ROPE) // 2)[None, :]
    cos = tl.load(COS + at, mask=lane, other=1.0)
    sin = tl.load(SIN + at, mask=lane, other=0.0)
    a_rot = tl.where(rope[None, :], _round_bf16(a * cos - b * sin), a)
    b_rot = tl.where(rope[None, :], _round_bf16(a * sin + b * cos), b)
    e = tl.reshape(tl.join(a_rot, b_rot), [BLOCK_J, BLOCK_W])
    if QUANTIZE and ROTATE:
        e = _round_bf16(_hadamard(e, BLOCK_J) * INV_SQRT_W)
        e = _simulate(e, BLOCK_J, FP4_BLOCK, 1, 0, 6.0, FP4_FLOOR, True)
    elif QUANTIZE and WIDTH > ROPE:
        q = _simulate(tl.where((d < WIDTH - ROPE)[None, :], e, 0.0), BLOCK_J, FP8_BLOCK, 3, -6, 448.0, FP8_FLOOR, POW2)
        e = tl.where((d < WIDTH - ROPE)[None, :], q, e)
    # a NaN pooled value (a column of -inf scores) makes the model's whole entry NaN; max/min above drop NaNs
    e = tl.where((tl.sum((p != p).to(tl.int32), axis=1) > 0)[:, None], float("nan"), _round_bf16(e))
    tl.store(out[:, None] + d[None, :], e.to(tl.bfloat16), mask=rows[:, None] & (d < WIDTH)[None, :])
'''

_POOL = '''

@triton.jit
def {fn}(KV, SCORE, APE, COS, SIN, NORM_W, OUT, POOLED, TICKETS, n_blocks, s_kb, s_ks, s_ob, s_on, s_cb, s_cn, eps,
         BLOCK_J: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (entries, dims): BLOCK_J consecutive entries x BLOCK_D dims; kv and score are read once. With
    # every dim in the program it finishes and writes its entries; else it leaves its pooled dims in POOLED
    # and the entries' last program to finish (a ticket, zeroed by the caller) finishes them all.
    # The decode state is one block (two with the overlap: previous | current) whose scores hold the bias.
    KV, SCORE, OUT, b, jj, d = _program_tile(KV, SCORE, OUT, n_blocks, s_kb, s_ob, BLOCK_J, BLOCK_D)
    block = jj + (1 if STATE and OVERLAP else 0)
    rows = jj < n_blocks
    lane = rows[:, None, None] & (d < WIDTH)[None, None, :]
    pooled = _pool_tile(KV, SCORE, APE, block, lane, d, s_ks, HAS_BIAS, BLOCK_J, CHUNK, BLOCK_D)
    pooled = tl.where((d < WIDTH)[None, :], pooled, 0.0)
    cs_off = b * s_cb + jj * s_cn
    out = OUT + jj * s_on
    if BLOCK_D < BLOCK_W:
        here = POOLED + (tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J))[:, None] * BLOCK_W
        tl.store(here + d[None, :], pooled)
        tl.debug_barrier()
        ticket = tl.atomic_add(TICKETS + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            w = tl.arange(0, BLOCK_W)
            whole = tl.load(here + w[None, :], mask=(w < WIDTH)[None, :], other=0.0, cache_modifier=".cg")
            _finish(whole, rows, COS, SIN, cs_off, NORM_W, eps, out, BLOCK_J)
    else:
        _finish(pooled, rows, COS, SIN, cs_off, NORM_W, eps, out, BLOCK_J)
'''


def _hadamard_source(n: int) -> str:
    """The Walsh-Hadamard butterfly over ``n`` dims as unrolled reshapes (the model's order of sums)."""
    lines = ["", "", "@triton.jit", "def _hadamard(x, BLOCK_J: tl.constexpr):",
             "    # Sylvester order: pairs h apart become (a + b, a - b), h = 1, 2, 4, ..."]
    h = 1
    while h < n:
        lines += [f"    y = tl.permute(tl.reshape(x, [BLOCK_J, {n // (2 * h)}, 2, {h}]), (0, 1, 3, 2))",
                  "    a, b = tl.split(y)",
                  f"    x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [BLOCK_J, {n}])"]
        h *= 2
    return "\n".join(lines + ["    return x", ""])


SIGNATURE = {**dict.fromkeys(("KV", "SCORE", "APE", "COS", "SIN", "NORM_W"), "*fp32"), "OUT": "*bf16",
             "POOLED": "*fp32", "TICKETS": "*i32",
             **dict.fromkeys(("n_blocks", "s_kb", "s_ks", "s_ob", "s_on", "s_cb", "s_cn"), "i32"), "eps": "fp32"}
"""The fused kernel's arguments as Triton types, in order: for lowering it without a launch (``hopper.sm90_ptx``)."""


def finish_form(rotate: bool, quantize: bool) -> str:
    """The finish's name in kernel names and reports: ``fp8``, ``hadamard_fp4`` or ``bf16`` (kept unquantized)."""
    return "bf16" if not quantize else "hadamard_fp4" if rotate else "fp8"


def kernel_name(ratio: int, width: int, rotate: bool, state: bool, backend: str = "triton",
                quantize: bool = True) -> str:
    """Stable kernel name, e.g. ``compressor_entries.c4.w512.fp8.triton`` (``compressor_entry_state`` for the
    decode form, ``.hadamard_fp4`` for the indexer branch, ``.bf16`` for entries kept bf16, ``.tilelang`` for that
    backend's kernel)."""
    form = finish_form(rotate, quantize)
    return f"{'compressor_entry_state' if state else 'compressor_entries'}.c{ratio}.w{width}.{form}.{backend}"


def launch_config(ratio: int, width: int, state: bool) -> dict[str, int]:
    """Tiles measured on the H200 (65536 tokens, width 512): a C4 main entry per program with 4 warps (159 us;
    2 entries 175, 8 warps 184-302), several indexer entries per program; a C128 block as the pooling kernel
    reads it (all 128 rows, 64 dims a program), the last of an entry's programs finishing it (81 us; whole
    entries per program in 4-32-row chunks: 95-488 us, too few programs)."""
    block_w = triton_next_pow2(width)
    if ratio * block_w <= 4096:
        block_j = 1 if state or block_w >= 512 else 4096 // (ratio * block_w)
        return {"BLOCK_J": block_j, "CHUNK": ratio, "BLOCK_D": block_w, "num_warps": 4}
    return {"BLOCK_J": 1, "CHUNK": ratio, "BLOCK_D": min(64, block_w), "num_warps": 4}


def supports(width: int, rope: int, rotate: bool, quantize: bool = True) -> str | None:
    """Why the kernel cannot finish these entries (None when it can): the rotation needs a power-of-two width of
    whole FP4 blocks, the main branch whole FP8 blocks before the RoPE dims (entries kept bf16 need neither)."""
    if rope % 2 or not 0 < rope <= width:
        return f"RoPE dims {rope} are not an even count within the width {width}"
    if rotate and not quantize:
        return "the Hadamard rotation comes with the FP4 simulation"
    if not quantize:
        return None
    if rotate and (width & (width - 1) or width % quant.FP4_BLOCK):
        return f"the rotated width {width} is not a power of two of whole FP4 blocks of {quant.FP4_BLOCK}"
    if not rotate and (width - rope) % quant.FP8_KV_BLOCK:
        return f"the {width - rope} non-RoPE dims are not whole FP8 blocks of {quant.FP8_KV_BLOCK}"
    return None


def _kernel(ratio: int, width: int, overlap: bool, rope: int, rotate: bool, pow2: bool, quantize: bool, state: bool,
            interpret: bool):
    name = kernel_name(ratio, width, rotate, state, quantize=quantize)
    fn = name.split(".")[0]
    block_w = triton_next_pow2(width)

    def source() -> str:
        header = _HEADER.format(
            ratio=ratio, width=width, overlap=overlap, state=state, has_bias=not state, rope=rope, rotate=rotate,
            quantize=quantize, pow2=pow2, block_w=block_w, fp8_block=quant.FP8_KV_BLOCK, fp4_block=quant.FP4_BLOCK,
            fp8_floor=quant.FP8_AMAX_FLOOR, fp4_floor=quant.FP4_AMAX_FLOOR, inv_sqrt_w=1.0 / math.sqrt(width))
        hadamard = _hadamard_source(block_w) if rotate else ""
        helpers = POOL_TILE + ROUND_BF16 + FORMATS_SOURCE + _GRID + hadamard + _FINISH
        return header + helpers + _POOL.format(fn=fn)

    module = REGISTRY.build(name, "triton", f"v4compile::{fn}", source,
                            lambda path: load_triton_module(path, interpret), key=(overlap, rope, pow2, interpret))
    return name, getattr(module, fn)


def per_entry_table(table: torch.Tensor, bsz: int, n_blocks: int, state: bool) -> torch.Tensor:
    """The entries' cos or sin as fp32 [B, n_blocks, rope/2] with a unit last stride (broadcast dims keep stride
    0), from a table broadcastable to [B, n_blocks, rope/2] (prefill) or to [B, rope/2] (a decode state)."""
    table = table.float()
    table = table.expand(bsz, table.shape[-1])[:, None] if state else table.expand(bsz, n_blocks, table.shape[-1])
    return table if table.stride(-1) == 1 else table.contiguous()


def _launch(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            norm_weight: torch.Tensor, eps: float, ratio: int, width: int, n_blocks: int, rotate: bool,
            pow2: bool, quantize: bool, state: bool) -> torch.Tensor:
    bsz = kv.shape[0]
    ape = score if ape is None else ape  # a decode state's bias is in its scores: the kernel reads none
    rope = 2 * cos.shape[-1]
    kv, score = kv.float().contiguous(), score.float().contiguous()
    ape, norm_weight = ape.float().contiguous(), norm_weight.float().contiguous()
    cos, sin = per_entry_table(cos, bsz, n_blocks, state), per_entry_table(sin, bsz, n_blocks, state)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    overlap = kv.shape[-1] == 2 * width
    name, kernel = _kernel(ratio, width, overlap, rope, rotate, pow2, quantize, state, kv.device.type != "cuda")
    out = torch.empty(bsz, n_blocks, width, dtype=torch.bfloat16, device=kv.device)
    if out.numel():
        config = launch_config(ratio, width, state)
        grid = (bsz * triton.cdiv(n_blocks, config["BLOCK_J"]), triton.cdiv(width, config["BLOCK_D"]))
        split = grid[1] > 1  # entries finished by their last program, from the pooled dims left in scratch
        pooled = torch.empty(grid[0] * config["BLOCK_J"] * triton_next_pow2(width) if split else 1,
                             dtype=torch.float32, device=kv.device)
        tickets = (torch.zeros if split else torch.empty)(grid[0] if split else 1, dtype=torch.int32,
                                                          device=kv.device)
        REGISTRY.launch(name, lambda: kernel[grid](
            kv, score, ape, cos, sin, norm_weight, out, pooled, tickets, n_blocks, kv.stride(0), kv.stride(1),
            out.stride(0), out.stride(1), cos.stride(0), cos.stride(1), float(eps), **config))
        REGISTRY.note_launch(name, grid=grid, tokens=kv.shape[1], **config)
        if kv.device.type == "cuda" and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(kernel) or "")
    return out[:, 0] if state else out


def entry_bodies(launch: Callable[..., torch.Tensor], backend: str) -> tuple[Callable[..., torch.Tensor], ...]:
    """The bodies of ``v4compile::compressor_entries`` and ``v4compile::compressor_entry_state`` for a backend
    whose ``launch(kv, score, ape, cos, sin, norm_weight, eps, ratio, width, n_blocks, rotate, pow2, quantize,
    state)`` runs its kernel (``ape`` None for a decode state, whose scores already hold the bias); dims the kernel
    does not take (``supports``) run the reference, which names what is wrong."""

    def compressor_entries(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                           n_blocks: int, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, rotate: bool, pow2_scales: bool, quantize: bool) -> torch.Tensor:
        if supports(width, 2 * cos.shape[-1], rotate, quantize):
            return reference.compressor_entries(kv, score, ape, ratio, width, n_blocks, cos, sin, norm_weight, eps,
                                                rotate, pow2_scales, quantize)
        return launch(kv, score, ape, cos, sin, norm_weight, eps, ratio, width, n_blocks, rotate, pow2_scales, quantize,
                      False)

    def compressor_entry_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int,
                               cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               rotate: bool, pow2_scales: bool, quantize: bool) -> torch.Tensor:
        if supports(width, 2 * cos.shape[-1], rotate, quantize):
            return reference.compressor_entry_state(kv_state, score_state, ratio, width, cos, sin, norm_weight, eps,
                                                    rotate, pow2_scales, quantize)
        return launch(kv_state, score_state, None, cos, sin, norm_weight, eps, ratio, width, 1, rotate, pow2_scales,
                      quantize, True)

    compressor_entries.__doc__ = f"{backend} body of ``v4compile::compressor_entries``."
    compressor_entry_state.__doc__ = f"{backend} body of ``v4compile::compressor_entry_state``."
    return compressor_entries, compressor_entry_state


compressor_entries, compressor_entry_state = entry_bodies(_launch, "Triton")
