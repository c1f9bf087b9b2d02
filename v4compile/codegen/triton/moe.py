"""Routed-expert dispatch in Triton: only the chosen (token, expert) pairs are computed.

Six launches, no host syncs, every buffer sized by tokens x top_k (so the launch shapes depend on the batch
shape alone and the sequence can be captured in a CUDA graph):
1. ``moe_route``: one program per local expert scans the expert ids twice, counts the pairs that chose an
   earlier expert (its offset) and writes its own pairs in token order (a stable counting sort); it also
   records each pair's slot in that order (-1 for another rank's expert).
2. ``moe_quant`` (FP8/FP4 experts): the activation's e4m3 simulation per 128 along K, exactly as
   ``quant.fp8_simulate`` (same scale rule, power-of-two scales when asked, nearest-even rounding by
   integer arithmetic, the product rounded to bf16, exact there).
3. ``moe_gemm`` gated: per (tile of one expert's pairs, block of the inter dim) the w1 and w3 products,
   fp32 accumulation, each rounded to bf16 as the model's Linear does, then the clamped SwiGLU times the
   routing weight, rounded to bf16.
4. ``moe_quant`` again on that hidden state (FP8/FP4), 5. ``moe_gemm`` with w2.
6. ``moe_combine``: every token sums its experts' outputs in ascending expert order, the order of the
   model's loop, in fp32; no atomics, so the result is deterministic (and equal to the model's sum when
   the expert outputs are).
With few pairs (decoding a token or two) a GEMM has too few programs to fill the GPU; it then splits its K
among programs that store fp32 partial sums, and the next kernel adds the parts in a fixed order before
rounding: ``moe_gated_finish`` (the gated epilogue with step 4's quantization fused in) and ``moe_combine``.

The tile -> expert map is derived in every GEMM program from the per-expert counts (a cumsum over at most
a few hundred entries), so no further launch is needed. Expert weights are the model's stacked tensors: expert
e's weight starts e strides into its projection's tensor, read as stored (half a byte a weight for FP4).
On the GPU the quantized products are ``tl.dot_scaled``: the weights are microscaled operands (e2m1 codes with
their e8m0 scale per 32, which is the model's FP4 format; e4m3 codes with their 128x128 block's scale repeated
per 32) that Triton widens to bf16 in registers, exactly, on Hopper; the bf16 products of those values with the
activation's are exact in fp32 and the tensor cores accumulate in fp32, so only the summation order differs from
the model. Scales are widened without NaN handling (``fast_math``, 10-35% faster): exact for every scale byte the
quantizer writes (1..254, ``quant.float_to_e8m0`` over floored amaxes); a byte 0 (2^-127) would read as 0.
Native FP8 dots were measured slower at every tile size and sum in about 14 bits (benchmarks/NOTES.md).
Triton's CPU interpreter cannot multiply bf16 tensors and its dot is numpy's unblocked matmul loop: there the
weights are dequantized in registers to fp32 (each FP4 128-block's activation stored even columns first, to pair
with the low and high nibbles of the packed bytes) and multiplied by a broadcast product and sum (``tl_dot``
False); ``tl_dot`` True runs the GPU's formulation there too (slower; the tests check both).
"""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .formats import FORMATS_SOURCE
from .launch import ROUND_BF16, load_triton_module, lowered_text

FORMATS = ("fp4", "fp8", "bf16")
QUANT_BLOCK = 128

_SOURCE = '''
import triton
import triton.language as tl

FMT = tl.constexpr("{fmt}")
DOT = tl.{dot}
''' + ROUND_BF16 + FORMATS_SOURCE + '''


@triton.jit
def moe_route(IDS, COUNTS, SORTED, SLOT, n_pairs, first, n_local, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    below = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for p0 in range(0, n_pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        key = tl.load(IDS + p, mask=p < n_pairs, other=-1).to(tl.int32) - first
        valid = (p < n_pairs) & (key >= 0) & (key < n_local)
        below += tl.sum((valid & (key < e)).to(tl.int32), 0)
    seen = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for p0 in range(0, n_pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        key = tl.load(IDS + p, mask=p < n_pairs, other=-1).to(tl.int32) - first
        valid = (p < n_pairs) & (key >= 0) & (key < n_local)
        mine = valid & (key == e)
        slot = below + seen + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(SORTED + slot, p, mask=mine)
        elsewhere = (p < n_pairs) & ((key < 0) | (key >= n_local)) & ((tl.zeros([BLOCK], tl.int32) + e) == 0)
        tl.store(SLOT + p, tl.where(mine, slot, -1), mask=mine | elsewhere)
        seen += tl.sum(mine.to(tl.int32), 0)
    tl.store(COUNTS + e, seen)


@triton.jit
def _n_valid(COUNTS, n_local, E_BLOCK: tl.constexpr):
    e = tl.arange(0, E_BLOCK)
    return tl.sum(tl.load(COUNTS + e, mask=e < n_local, other=0), 0)


@triton.jit
def _e4m3_simulate(x, POW2: tl.constexpr):
    # each row of x [R, 128] as quant.fp8_simulate leaves it: e4m3 codes times the row's scale, rounded to bf16
    scale = _act_scale(x, POW2)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    return _round_bf16(_round_e4m3(v) * scale[:, None])


@triton.jit
def moe_quant(X, OUT, COUNTS, rows, n_local, s_x, s_o, POW2: tl.constexpr, PERMUTE: tl.constexpr,
              COUNTED: tl.constexpr, BR: tl.constexpr, E_BLOCK: tl.constexpr):
    if COUNTED:
        rows = _n_valid(COUNTS, n_local, E_BLOCK)
    if tl.program_id(0) * BR >= rows:
        return
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.arange(0, 128)
    c = tl.program_id(1) * 128 + j
    rm = r < rows
    x = tl.load(X + r[:, None] * s_x + c[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    y = _e4m3_simulate(x, POW2)
    if PERMUTE:
        c = tl.program_id(1) * 128 + (j % 2) * 64 + j // 2
    tl.store(OUT + r[:, None] * s_o + c[None, :], y.to(tl.bfloat16), mask=rm[:, None])


@triton.jit
def _locate(COUNTS, n_local, tile, BM: tl.constexpr, E_BLOCK: tl.constexpr):
    # expert of a row tile, its first row among the expert's pairs, the expert's pair offset and count
    e_idx = tl.arange(0, E_BLOCK)
    cnt = tl.load(COUNTS + e_idx, mask=e_idx < n_local, other=0)
    tiles = (cnt + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    e = tl.sum((ends <= tile).to(tl.int32), 0)
    start = tl.sum(tl.where(e_idx == e, ends - tiles, 0), 0)
    offset = tl.sum(tl.where(e_idx < e, cnt, 0), 0)
    count = tl.sum(tl.where(e_idx == e, cnt, 0), 0)
    return e, (tile - start) * BM, offset, count


@triton.jit
def _e2m1_pair(packed):
    # the e2m1 values of the low and the high nibble of each packed byte
    return _e2m1(packed & 15), _e2m1((packed >> 4) & 15)


@triton.jit
def _dot_w(a0, a1, W, S, n, nm, k0, K, s_w, s_s, BK: tl.constexpr, TL_DOT: tl.constexpr):
    # a's product with the expert weight rows n, columns k0..k0+BK (whole 128-blocks for FP8/FP4), dequantized in
    # registers; for FP4, a0 and a1 hold the even and the odd columns (the low and high nibbles). TL_DOT: tensor
    # cores; else a broadcast product and sum (the interpreter's dot is numpy's slow unblocked matmul loop)
    if FMT == "fp4":
        j = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(W + n[:, None] * s_w + j[None, :], mask=nm[:, None], other=0)
        scale = _e8m0(tl.load(S + n[:, None] * s_s + (j // 16)[None, :], mask=nm[:, None], other=127))
        lo, hi = _e2m1_pair(packed)
        w0 = (lo * scale).to(DOT)
        w1 = (hi * scale).to(DOT)
    else:
        k = k0 + tl.arange(0, BK)
        if FMT == "fp8":
            codes = tl.load(W + n[:, None] * s_w + k[None, :], mask=nm[:, None], other=0)
            scale = _e8m0(tl.load(S + (n // 128)[:, None] * s_s + (k // 128)[None, :], mask=nm[:, None], other=127))
            w0 = (_e4m3(codes) * scale).to(DOT)
        else:
            w0 = tl.load(W + n[:, None] * s_w + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0).to(DOT)
        w1 = w0
    if TL_DOT:
        acc = tl.dot(a0, tl.trans(w0), input_precision="ieee")
    else:
        acc = tl.sum(a0[:, None, :] * w0[None, :, :], axis=2)
        if FMT == "fp4":
            acc += tl.sum(a1[:, None, :] * w1[None, :, :], axis=2)
    return acc


@triton.jit
def _dot_scaled(a, acc, W, S, n, nm, k0, s_w, s_s, BK: tl.constexpr):
    # acc + a [BM, BK] (bf16 values, natural column order) times the expert weight rows n, columns k0..k0+BK as
    # microscaled operands: e2m1 codes with their e8m0 scale per 32, or e4m3 codes with their 128x128 block's
    # scale repeated per 32; Triton upcasts them to bf16 exactly (e2m1/e4m3 times a power of two). fast_math: scale
    # bytes 0 and 255 are not special-cased (read as 0, not 2^-127 / NaN); the quantizer writes only 1..254
    g = k0 // 32 + tl.arange(0, BK // 32)
    if FMT == "fp4":
        j = k0 // 2 + tl.arange(0, BK // 2)
        w = tl.load(W + n[:, None] * s_w + j[None, :], mask=nm[:, None], other=0)
        scale = tl.load(S + n[:, None] * s_s + g[None, :], mask=nm[:, None], other=127)
        return tl.dot_scaled(a, None, "bf16", tl.trans(w), scale, "e2m1", acc, fast_math=True)
    k = k0 + tl.arange(0, BK)
    w = tl.load(W + n[:, None] * s_w + k[None, :], mask=nm[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    scale = tl.load(S + (n // 128)[:, None] * s_s + (g // 4)[None, :], mask=nm[:, None], other=127)
    return tl.dot_scaled(a, None, "bf16", tl.trans(w), scale, "e4m3", acc, fast_math=True)


@triton.jit
def moe_gemm(A, WEIGHTS, SORTED, COUNTS, W_A, W_B, S_A, S_B, OUT, n_local, top_k, N, K, k_part,
             s_a, s_o, s_op, s_w, s_s, s_we, s_se, limit, GATED: tl.constexpr, CLAMP: tl.constexpr,
             PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_BLOCK: tl.constexpr,
             TL_DOT: tl.constexpr):
    # GATED: OUT[slot] = bf16(weight * silu(min(bf16(A W_A^T), L)) * clamp(bf16(A W_B^T), -L, L)) with A's
    # rows gathered by token; else OUT[slot] = bf16(A[slot] W_A^T). Expert e's weight is W + e * s_we (its
    # scale S + e * s_se) in the stacked tensors. Programs of one row tile are adjacent (its rows stay in L2).
    # PARTIAL: program_id(1) sums only K columns [k_part * id, k_part * (id + 1)) and stores its fp32 sums at
    # OUT + id * s_op (A W_A^T at column n, A W_B^T at N + n); the finishing kernels add the parts in order
    tile = tl.program_id(0) // tl.cdiv(N, BN)
    nb = tl.program_id(0) % tl.cdiv(N, BN)
    e, row0, offset, count = _locate(COUNTS, n_local, tile, BM, E_BLOCK)
    if e >= n_local:
        return
    r = row0 + tl.arange(0, BM)
    rm = r < count
    slot = offset + r
    if GATED:
        pair = tl.load(SORTED + slot, mask=rm, other=0)
        rows = pair // top_k
    else:
        rows = slot
    wa = W_A + e.to(tl.int64) * s_we
    wb = W_B + e.to(tl.int64) * s_we
    sa = S_A + e.to(tl.int64) * s_se
    sb = S_B + e.to(tl.int64) * s_se
    n = nb * BN + tl.arange(0, BN)
    nm = n < N
    acc_a = tl.zeros([BM, BN], tl.float32)
    acc_b = tl.zeros([BM, BN], tl.float32)
    k_lo = tl.program_id(1) * k_part
    k_hi = tl.minimum(k_lo + k_part, K)
    if FMT != "bf16" and TL_DOT:
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(A + rows[:, None] * s_a + k[None, :], mask=rm[:, None], other=0.0)
            acc_a = _dot_scaled(a, acc_a, wa, sa, n, nm, k0, s_w, s_s, BK)
            if GATED:
                acc_b = _dot_scaled(a, acc_b, wb, sb, n, nm, k0, s_w, s_s, BK)
    else:
        for k0 in range(k_lo, k_hi, BK):
            if FMT == "fp4":
                # A's 128-blocks hold their even columns first (moe_quant's PERMUTE): both halves load contiguously
                j = tl.arange(0, BK // 2)
                col = k0 + (j // 64) * 128 + j % 64
                a0 = tl.load(A + rows[:, None] * s_a + col[None, :], mask=rm[:, None], other=0.0).to(DOT)
                a1 = tl.load(A + rows[:, None] * s_a + (col + 64)[None, :], mask=rm[:, None], other=0.0).to(DOT)
            else:
                k = k0 + tl.arange(0, BK)
                a0 = tl.load(A + rows[:, None] * s_a + k[None, :], mask=rm[:, None] & (k < K)[None, :],
                             other=0.0).to(DOT)
                a1 = a0
            acc_a += _dot_w(a0, a1, wa, sa, n, nm, k0, K, s_w, s_s, BK, TL_DOT)
            if GATED:
                acc_b += _dot_w(a0, a1, wb, sb, n, nm, k0, K, s_w, s_s, BK, TL_DOT)
    mask = rm[:, None] & nm[None, :]
    if PARTIAL:
        part = OUT + tl.program_id(1) * s_op + slot[:, None] * s_o + n[None, :]
        tl.store(part, acc_a, mask=mask)
        if GATED:
            tl.store(part + N, acc_b, mask=mask)
    else:
        out = _round_bf16(acc_a)
        if GATED:
            weight = tl.load(WEIGHTS + pair, mask=rm, other=0.0)
            out = _swiglu(out, acc_b, weight, limit, CLAMP)
        tl.store(OUT + slot[:, None] * s_o + n[None, :], out.to(tl.bfloat16), mask=mask)


@triton.jit
def _swiglu(gate, up_sum, weight, limit, CLAMP: tl.constexpr):
    # bf16(weight * silu(min(gate, L)) * clamp(bf16(up_sum), -L, L)) for gate already bf16-rounded
    up = _round_bf16(up_sum)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return _round_bf16(weight[:, None] * (gate / (1.0 + tl.exp(-gate)) * up))


@triton.jit
def moe_gated_finish(PART, SORTED, WEIGHTS, COUNTS, OUT, n_local, top_k, N, parts, s_pp, s_p, s_o, limit,
                     CLAMP: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, PERMUTE: tl.constexpr,
                     BR: tl.constexpr, E_BLOCK: tl.constexpr):
    # the gated GEMM's epilogue over its K parts: OUT[slot] = the SwiGLU of the parts' sums (added in part
    # order), then (QUANT) its e4m3 simulation per 128 columns, as moe_quant would compute it from OUT
    rows = _n_valid(COUNTS, n_local, E_BLOCK)
    if tl.program_id(0) * BR >= rows:
        return
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.arange(0, 128)
    c = tl.program_id(1) * 128 + j
    rm = r < rows
    mask = rm[:, None] & (c < N)[None, :]
    gate = tl.zeros([BR, 128], tl.float32)
    up = tl.zeros([BR, 128], tl.float32)
    for p in range(0, parts):
        at = PART + p * s_pp + r[:, None] * s_p + c[None, :]
        gate += tl.load(at, mask=mask, other=0.0)
        up += tl.load(at + N, mask=mask, other=0.0)
    pair = tl.load(SORTED + r, mask=rm, other=0)
    weight = tl.load(WEIGHTS + pair, mask=rm, other=0.0)
    y = _swiglu(_round_bf16(gate), up, weight, limit, CLAMP)
    if QUANT:
        y = _e4m3_simulate(y, POW2)
    if PERMUTE:
        c = tl.program_id(1) * 128 + (j % 2) * 64 + j // 2
    tl.store(OUT + r[:, None] * s_o + c[None, :], y.to(tl.bfloat16), mask=mask)


@triton.jit
def moe_combine(IDS, SLOT, OUT, Y, tokens, dim, top_k, parts, s_op, s_o, s_y,
                PARTIAL: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr):
    # y[t] = sum of t's expert outputs in ascending expert order (a repeated id counts once); PARTIAL: an
    # expert output is bf16 of its fp32 K parts' sum (added in part order), the parts p at OUT + p * s_op
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, KP)
    tm = t < tokens
    jm = tm[:, None] & (j < top_k)[None, :]
    ids = tl.load(IDS + t[:, None] * top_k + j[None, :], mask=jm, other=2**62)
    slot = tl.load(SLOT + t[:, None] * top_k + j[None, :], mask=jm, other=-1)
    same = ids[:, :, None] == ids[:, None, :]
    earlier = j[None, :, None] > j[None, None, :]
    rank = tl.sum(((ids[:, None, :] < ids[:, :, None]) | (same & earlier)).to(tl.int32), 2)
    use = (slot >= 0) & (tl.sum((same & earlier).to(tl.int32), 2) == 0)
    acc = tl.zeros([BT, BD], tl.float32)
    for i in tl.static_range(KP):
        pick = rank == i
        row = tl.sum(tl.where(pick, slot, 0), 1)
        take = tl.sum((pick & use).to(tl.int32), 1) > 0
        mask = take[:, None] & (d < dim)[None, :]
        if PARTIAL:
            part = tl.zeros([BT, BD], tl.float32)
            for p in range(0, parts):
                part += tl.load(OUT + p * s_op + row[:, None] * s_o + d[None, :], mask=mask, other=0.0)
            acc += _round_bf16(part)
        else:
            acc += tl.load(OUT + row[:, None] * s_o + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + t[:, None] * s_y + d[None, :], acc, mask=tm[:, None] & (d < dim)[None, :])
'''


def kernel_name(fmt: str) -> str:
    """Stable kernel name, e.g. ``moe_experts.fp4.triton``."""
    return f"moe_experts.{fmt}.triton"


def launch_config(pairs: int, n_local: int, tokens: int, dim: int, inter: int, cuda: bool, fmt: str = "fp4"
                  ) -> dict[str, int]:
    """Row tiles sized by the mean pairs per expert (16 rows, the tensor cores' minimum, while decoding, on two
    warps; 32 up to 64 pairs an expert; 128 rows on 128-wide output blocks beyond; FP4 experts beyond 128 pairs,
    256 rows, so each widened weight serves twice the rows: the widening's integer work had matched the tensor work,
    8192 tokens on the H100 took 9.99 against 11.64 ms per Flash layer, bitwise the same; not measured for FP8 and
    bf16 experts),
    K blocks of 128 (the quantization block; ``BK`` is the largest K block, each GEMM takes the largest that fits
    its K in whole quantization blocks), each the fastest measured at V4-Flash's shape on the H200 (256 experts
    at 1, 64 and 8192 tokens, 16 at 64: benchmarks/NOTES.md); the interpreter gets few, large programs (its
    cost is per program and op, not per element). ``programs``: a GEMM with fewer programs than this splits its K
    into parts until it has about that many (one token on the H100: the gated GEMM's 384 programs fill under half
    a wave, two parts took the layer from 94.3 to 86.5 us; more parts were slower)."""
    if not cuda:
        return {"programs": 0, "BM": 16, "BN1": min(256, triton_next_pow2(inter)),
                "BN2": min(256, triton_next_pow2(dim)),
                "BK": 512, "BT": 64, "BD": triton_next_pow2(dim), "BR": 64, "tl_dot": False, "num_warps": 4,
                "num_stages": 1}
    per_expert = pairs / max(n_local, 1)
    if per_expert <= 16:
        tiles = {"BM": 16, "BN1": 32, "BN2": 32, "num_warps": 2, "num_stages": 4}
    elif per_expert <= 64:
        tiles = {"BM": 32, "BN1": 64, "BN2": 64, "num_warps": 4, "num_stages": 3}
    elif per_expert <= 128 or fmt != "fp4":
        tiles = {"BM": 128, "BN1": 128, "BN2": 128, "num_warps": 8, "num_stages": 3}
    else:
        tiles = {"BM": 256, "BN1": 64, "BN2": 128, "num_warps": 8, "num_stages": 2}
    return {**tiles, "programs": 1024, "BK": 128, "BT": 1 if tokens < 512 else 4, "BD": 512, "BR": 16,
            "tl_dot": True}


def _module(fmt: str, cuda: bool) -> object:
    return REGISTRY.build(kernel_name(fmt), "triton", "v4compile::moe_experts",
                          lambda: _SOURCE.format(fmt=fmt, dot="bfloat16" if cuda else "float32"),
                          lambda path: load_triton_module(path, not cuda), key=(cuda, fmt))


def simulate_fp8(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The kernel's activation quantization alone on bf16 rows x [R, C] (C a multiple of 128): equal to
    ``quant.fp8_simulate(x, 128, pow2)`` bit for bit (for tests and debugging)."""
    module = _module("fp8", x.device.type == "cuda")
    x = x.contiguous()
    out = torch.empty_like(x)
    module.moe_quant[(triton.cdiv(x.shape[0], 16), x.shape[1] // QUANT_BLOCK)](
        x, out, x, x.shape[0], 0, x.stride(0), out.stride(0), POW2=pow2, PERMUTE=False, COUNTED=False, BR=16,
        E_BLOCK=1)
    return out


def check_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor, s1: torch.Tensor | None, s3: torch.Tensor | None, s2: torch.Tensor | None,
                  fmt: str) -> None:
    """Raises a ValueError naming the tensor when the tokens, routing and stacked expert weights and scales do not
    fit together (a misshapen tensor would otherwise be read out of bounds by the kernels)."""
    from ...model.linear import WEIGHT_DTYPES, weight_shapes

    if fmt not in FORMATS:
        raise ValueError(f"the MoE kernel supports expert formats {FORMATS}, got {fmt!r}")
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [tokens, dim], got shape {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"moe_experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[tokens, top_k] with tokens = {x.shape[0]}")
    if w1.dim() != 3:
        raise ValueError(f"moe_experts: w1 must be stacked [experts, inter, ...], got shape {tuple(w1.shape)}")
    n, inter, dim = w1.shape[0], w1.shape[1], x.shape[1]
    expect = {"w1": (weight_shapes(fmt, dim, inter), w1, s1), "w3": (weight_shapes(fmt, dim, inter), w3, s3),
              "w2": (weight_shapes(fmt, inter, dim), w2, s2)}
    for name, (shapes, w, s) in expect.items():
        if tuple(w.shape) != (n, *shapes["weight"]) or w.dtype != WEIGHT_DTYPES[fmt]:
            raise ValueError(f"moe_experts: {fmt} expert weight {name} must be {WEIGHT_DTYPES[fmt]} "
                             f"{(n, *shapes['weight'])} for {n} experts, dim {dim}, inter {inter}; got "
                             f"{w.dtype} {tuple(w.shape)}")
        if "scale" in shapes and (s is None or tuple(s.shape) != (n, *shapes["scale"])):
            got = None if s is None else tuple(s.shape)
            raise ValueError(f"moe_experts: scale of {name} must be {(n, *shapes['scale'])} (one per "
                             f"{'32 inputs' if fmt == 'fp4' else '128x128 block'}), got {got}")


def _row_major(first: torch.Tensor, second: torch.Tensor, third: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The stacked tensors as the kernels read them: each expert's rows contiguous, at any expert stride, so halves
    of a fused gate/up weight are read where they are, not copied per call; the gated pair (first, second) shares
    one expert stride (copied when they differ)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()

    first, second, third = rows(first), rows(second), rows(third)
    if first.stride() != second.stride():
        first, second = first.contiguous(), second.contiguous()
    return first, second, third


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.view(torch.uint8)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None, s3: torch.Tensor | None,
                s2: torch.Tensor | None, fmt: str, pow2: bool, limit: float,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::moe_experts``: x [T, D] bf16, routing weights [T, k] fp32 and ids [T, k],
    stacked local experts ``first..first+E-1`` -> y [T, D] fp32 (the model's expert sum). ``config`` overrides
    the launch configuration (benchmark sweeps)."""
    check_experts(x, weights, ids, w1, w3, w2, s1, s3, s2, fmt)
    tokens, dim = x.shape
    top_k, n_local, inter = ids.shape[1], w1.shape[0], w1.shape[1]
    quantized = fmt != "bf16"
    if quantized and (dim % QUANT_BLOCK or inter % QUANT_BLOCK):
        raise ValueError(f"quantized experts need dim {dim} and inter dim {inter} divisible by {QUANT_BLOCK}")
    cuda = x.device.type == "cuda"
    name = kernel_name(fmt)
    module = _module(fmt, cuda)
    w1, w3, w2 = (_bytes(w) for w in _row_major(w1, w3, w2))
    if quantized:
        s1, s3, s2 = (s.view(torch.uint8) for s in _row_major(s1, s3, s2))
    else:
        s1, s3, s2 = w1, w3, w2
    pairs = tokens * top_k
    config = config or launch_config(pairs, n_local, tokens, dim, inter, cuda, fmt)
    bm = config["BM"]
    e_block = triton_next_pow2(n_local)
    device = x.device
    x, weights, ids = x.contiguous(), weights.float().contiguous(), ids.contiguous()
    counts = torch.empty(n_local, dtype=torch.int32, device=device)
    order = torch.empty(pairs, dtype=torch.int32, device=device)
    slots = torch.empty(pairs, dtype=torch.int32, device=device)
    permute = fmt == "fp4" and not config["tl_dot"]
    x_q = torch.empty_like(x) if quantized else x
    y = torch.empty(tokens, dim, dtype=torch.float32, device=device)
    tiles = min(pairs, triton.cdiv(pairs, bm) + min(n_local, pairs))
    warps, stages = config["num_warps"], config["num_stages"]

    def quant(src: torch.Tensor, dst: torch.Tensor, counted: bool) -> None:
        grid = (triton.cdiv(src.shape[0], config["BR"]), src.shape[1] // QUANT_BLOCK)
        module.moe_quant[grid](src, dst, counts, src.shape[0], n_local, src.stride(0), dst.stride(0), POW2=pow2,
                               PERMUTE=permute, COUNTED=counted, BR=config["BR"], E_BLOCK=e_block)

    def k_block(k: int) -> int:
        if not quantized:
            return min(config["BK"], 64 if cuda else triton_next_pow2(k))
        blocks = 1
        while blocks * 2 * QUANT_BLOCK <= config["BK"] and k % (blocks * 2 * QUANT_BLOCK) == 0:
            blocks *= 2
        return blocks * QUANT_BLOCK

    def parts(n: int, k: int, bn: int) -> tuple[int, int]:
        # K parts of a GEMM and the columns per part: enough programs to cover the GPU (config "programs")
        bk = k_block(k)
        wanted = max(1, config["programs"] // (tiles * triton.cdiv(n, bn)))
        per_part = bk * triton.cdiv(triton.cdiv(k, bk), min(wanted, triton.cdiv(k, bk)))
        return triton.cdiv(k, per_part), per_part

    def gemm(a: torch.Tensor, dst: torch.Tensor, gated: bool, n: int, k: int, bn: int, split: tuple[int, int]
             ) -> None:
        w = (w1, w3, s1, s3) if gated else (w2, w2, s2, s2)
        row = {"fp4": (k // 2, k // 32), "fp8": (k, triton.cdiv(k, QUANT_BLOCK)), "bf16": (k, 0)}[fmt]
        scale_stride = w[2].stride(0) if quantized else 0
        partial = dst.dtype == torch.float32
        module.moe_gemm[(tiles * triton.cdiv(n, bn), split[0])](
            a, weights, order, counts, *w, dst, n_local, top_k, n, k, split[1], a.stride(0),
            dst.stride(-2), dst.stride(0) if partial else 0, *row, w[0].stride(0), scale_stride, float(limit),
            GATED=gated, CLAMP=limit > 0, PARTIAL=partial, BM=bm, BN=bn, BK=k_block(k), E_BLOCK=e_block,
            TL_DOT=config["tl_dot"], num_warps=warps, num_stages=stages)

    split1 = parts(inter, dim, config["BN1"])
    split2 = parts(dim, inter, config["BN2"])
    gate_parts = torch.empty(split1[0], pairs, 2 * inter, dtype=torch.float32, device=device) \
        if split1[0] > 1 else None
    hidden = torch.empty(pairs, inter, dtype=torch.bfloat16, device=device)
    hidden_q = torch.empty_like(hidden) if quantized and gate_parts is None else hidden
    out = torch.empty(split2[0], pairs, dim, dtype=torch.float32, device=device) if split2[0] > 1 else \
        torch.empty(pairs, dim, dtype=torch.bfloat16, device=device)

    def run() -> None:
        module.moe_route[(n_local,)](ids, counts, order, slots, pairs, first, n_local, BLOCK=1024)
        if quantized:
            quant(x, x_q, False)
        if gate_parts is None:
            gemm(x_q, hidden, True, inter, dim, config["BN1"], split1)
            if quantized:
                quant(hidden, hidden_q, True)
        else:
            gemm(x_q, gate_parts, True, inter, dim, config["BN1"], split1)
            module.moe_gated_finish[(triton.cdiv(pairs, config["BR"]), triton.cdiv(inter, QUANT_BLOCK))](
                gate_parts, order, weights, counts, hidden_q, n_local, top_k, inter, split1[0],
                gate_parts.stride(0), gate_parts.stride(1), hidden_q.stride(0), float(limit), CLAMP=limit > 0,
                QUANT=quantized, POW2=pow2, PERMUTE=permute, BR=config["BR"], E_BLOCK=e_block)
        gemm(hidden_q, out, False, dim, inter, config["BN2"], split2)
        module.moe_combine[(triton.cdiv(tokens, config["BT"]), triton.cdiv(dim, config["BD"]))](
            ids, slots, out, y, tokens, dim, top_k, split2[0], out.stride(0), out.stride(-2), y.stride(0),
            PARTIAL=out.dtype == torch.float32, BT=config["BT"], BD=config["BD"], KP=triton_next_pow2(top_k))

    if tokens:
        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, tiles=tiles, experts=n_local, pairs=pairs, k_parts=(split1[0], split2[0]), **config)
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.moe_gemm) or "")
    return y
