"""The Triton source of the routed-expert kernels; ``moe.py`` holds the launch sequence they serve, its launch
configuration and the host wrapper.

On the GPU the quantized products are ``tl.dot_scaled``: the weights are microscaled operands (e2m1 codes with
their e8m0 scale per 32, which is the model's FP4 format; e4m3 codes with their 128x128 block's scale repeated
per 32) that Triton widens to bf16 in registers, exactly, on Hopper; the bf16 products of those values with the
activation's are exact in fp32 and the tensor cores accumulate in fp32, so only the summation order differs from
the model. Scales are widened without NaN handling (``fast_math``, 10-35% faster): exact for every scale byte the
quantizer writes (1..254, ``quant.float_to_e8m0`` over floored amaxes); a byte 0 (2^-127) would read as 0.
Native FP8 dots were measured slower at every tile size and sum in about 14 bits (benchmarks/NOTES.md). The
FP4 tiles of 33-64 pairs an expert widen the weights themselves instead (``_widen_fp4``: the same exact bf16
values, built from the code bits; the products then ``tl.dot`` with the weights as the column operand).
Triton's CPU interpreter cannot multiply bf16 tensors and its dot is numpy's unblocked matmul loop: there the
weights are dequantized in registers to fp32 (each FP4 128-block's activation stored even columns first, to pair
with the low and high nibbles of the packed bytes) and multiplied by a broadcast product and sum (``tl_dot``
False); ``tl_dot`` True runs the GPU's formulation there too (slower; the tests check both).

The source is a format string for two fields, the expert format ``FMT`` and the dot operand dtype ``DOT``
(bf16 on the GPU, fp32 under the interpreter), which ``moe._module`` fills once per (format, device kind).
"""

from .formats import FORMATS_SOURCE
from .launch import ROUND_BF16

SOURCE = '''
import triton
import triton.language as tl

FMT = tl.constexpr("{fmt}")
DOT = tl.{dot}
DOT_BF16 = tl.constexpr("{dot}" == "bfloat16")
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
def _row_block(rows, BR: tl.constexpr):
    # program (i, b) of a row-block kernel: its rows i * BR + [0, BR), which of them exist, its 128 columns of block b
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.arange(0, 128)
    c = tl.program_id(1) * 128 + j
    return r, r < rows, c


@triton.jit
def _store_block(OUT, r, c, s_o, y, mask, PERMUTE: tl.constexpr):
    # y [BR, 128] as bf16 into rows r, columns c of block program_id(1), its columns in the order PERMUTE names
    # (``COLUMN_ORDERS`` in moe.py): 0 as they are; 1 the block's even columns first (the order moe_gemm's widened
    # and interpreter formulations read an FP4 expert's activation in); 2 the TileLang GEMM's fragment order
    # (column 32w + 16a + 8b + 2c + v holds 32c + 8w + 4v + 2b + a). Reordered in registers, so the store stays
    # contiguous
    if PERMUTE == 1:
        y = tl.reshape(tl.permute(tl.reshape(y, [y.shape[0], 64, 2]), (0, 2, 1)), [y.shape[0], 128])
    if PERMUTE == 2:
        y = tl.reshape(tl.permute(tl.reshape(y, [y.shape[0], 4, 4, 2, 2, 2]), (0, 2, 5, 4, 1, 3)),
                       [y.shape[0], 128])
    tl.store(OUT + r[:, None] * s_o + c[None, :], y.to(tl.bfloat16), mask=mask)


@triton.jit
def moe_quant(X, OUT, COUNTS, SORTED, rows, n_local, top_k, s_x, s_o, POW2: tl.constexpr, PERMUTE: tl.constexpr,
              COUNTED: tl.constexpr, GATHER: tl.constexpr, BR: tl.constexpr, E_BLOCK: tl.constexpr):
    # OUT row r = X row r quantized (COUNTED: the rows are the local experts' pairs); GATHER: OUT row r (a pair
    # slot) = X row SORTED[r] // top_k (its token), for the local experts' pairs
    if COUNTED or GATHER:
        rows = _n_valid(COUNTS, n_local, E_BLOCK)
    if tl.program_id(0) * BR >= rows:
        return
    r, rm, c = _row_block(rows, BR)
    src = r
    if GATHER:
        src = tl.load(SORTED + r, mask=rm, other=0) // top_k
    x = tl.load(X + src[:, None] * s_x + c[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    _store_block(OUT, r, c, s_o, _e4m3_simulate(x, POW2), rm[:, None], PERMUTE)


@triton.jit
def moe_tiles(COUNTS, TILE_E, TILE_ROW, TILE_END, n_local, n_tiles, BM: tl.constexpr, E_BLOCK: tl.constexpr,
              BT: tl.constexpr):
    # per row tile t of BM pairs (each expert's pairs in whole tiles, experts in order): its expert (-1 past the
    # last tile), its first pair slot and the end of its expert's slots
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e_idx = tl.arange(0, E_BLOCK)
    cnt = tl.load(COUNTS + e_idx, mask=e_idx < n_local, other=0)
    tiles = (cnt + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    offsets = tl.cumsum(cnt, 0) - cnt
    e = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), 1)
    here = e_idx[None, :] == e[:, None]
    first_tile = tl.sum(tl.where(here, (ends - tiles)[None, :], 0), 1)
    offset = tl.sum(tl.where(here, offsets[None, :], 0), 1)
    count = tl.sum(tl.where(here, cnt[None, :], 0), 1)
    tm = t < n_tiles
    tl.store(TILE_E + t, tl.where(e < n_local, e, -1), mask=tm)
    tl.store(TILE_ROW + t, offset + (t - first_tile) * BM, mask=tm)
    tl.store(TILE_END + t, offset + count, mask=tm)


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
def _dot_scaled(a, acc, W, S, n, nm, k0, s_w, s_s, BK: tl.constexpr, SWAP: tl.constexpr):
    # acc + a [BM, BK] (bf16 values, natural column order) times the expert weight rows n, columns k0..k0+BK as
    # microscaled operands: e2m1 codes with their e8m0 scale per 32, or e4m3 codes with their 128x128 block's
    # scale repeated per 32; Triton upcasts them to bf16 exactly (e2m1/e4m3 times a power of two). fast_math: scale
    # bytes 0 and 255 are not special-cased (read as 0, not 2^-127 / NaN); the quantizer writes only 1..254.
    # SWAP: the transposed product, a as [BK, BM] and acc as [BN, BM]: the weights are the MMA's row operand, so
    # few tokens pad the MMA's 8-wide column side instead of its 16-row side
    g = k0 // 32 + tl.arange(0, BK // 32)
    if FMT == "fp4":
        j = k0 // 2 + tl.arange(0, BK // 2)
        w = tl.load(W + n[:, None] * s_w + j[None, :], mask=nm[:, None], other=0)
        scale = tl.load(S + n[:, None] * s_s + g[None, :], mask=nm[:, None], other=127)
        if SWAP:
            acc = tl.dot_scaled(w, scale, "e2m1", a, None, "bf16", acc, fast_math=True)
        else:
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(w), scale, "e2m1", acc, fast_math=True)
    else:
        k = k0 + tl.arange(0, BK)
        w = tl.load(W + n[:, None] * s_w + k[None, :], mask=nm[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        scale = tl.load(S + (n // 128)[:, None] * s_s + (g // 4)[None, :], mask=nm[:, None], other=127)
        if SWAP:
            acc = tl.dot_scaled(w, scale, "e4m3", a, None, "bf16", acc, fast_math=True)
        else:
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(w), scale, "e4m3", acc, fast_math=True)
    return acc


@triton.jit
def _permuted_halves(A, rows, rm, s_a, k0, BK: tl.constexpr):
    # rows of A, columns k0..k0+BK stored in moe_quant's PERMUTE order (each 128-block's even columns first), as
    # DOT: the even columns and the odd ones, [BM, BK // 2] each, both loaded contiguously
    j = tl.arange(0, BK // 2)
    col = k0 + (j // 64) * 128 + j % 64
    a0 = tl.load(A + rows[:, None] * s_a + col[None, :], mask=rm[:, None], other=0.0).to(DOT)
    a1 = tl.load(A + rows[:, None] * s_a + (col + 64)[None, :], mask=rm[:, None], other=0.0).to(DOT)
    return a0, a1


@triton.jit
def _halves(x):
    # the two 16-bit halves of each uint32 word, as a trailing pair (low half first)
    return tl.join((x & 0xFFFF).to(tl.int16), (x >> 16).to(tl.int16))


@triton.jit
def _as_dot(bits):
    # int16 bf16 bit patterns as DOT values (fp32 built from the bits: the interpreter's bf16 casts flush subnormals)
    if DOT_BF16:
        value = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        value = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return value


@triton.jit
def _widen_fp4(w, scale, BN: tl.constexpr, BK: tl.constexpr):
    # w [BN, BK // 8] uint32 words of packed e2m1 codes (4 bytes, 8 codes a word), scale [BN, BK // 32] its e8m0
    # bytes -> the low and the high nibbles, each [BN, BK // 2] as DOT values times their scale. Bytes 0 and 2 of
    # a word (then 1 and 3) go to the two 16-bit halves of a bf16 pair: a code's magnitude bits land in bf16's
    # exponent and mantissa as value x 2^-126 (code 1 a subnormal), its sign bit on bf16's, both halves at once;
    # then two exact power-of-two products, 2^(min(s, 128) - 1) and 2^(s - min(s, 128)), each a bf16
    lo = tl.join(_halves(((w & 0x70007) << 6) | ((w & 0x80008) << 12)),
                 _halves(((w & 0x7000700) >> 2) | ((w & 0x8000800) << 4)))
    hi = tl.join(_halves(((w & 0x700070) << 2) | ((w & 0x800080) << 8)),
                 _halves(((w & 0x70007000) >> 6) | (w & 0x80008000)))
    s = scale.to(tl.int16)
    low = tl.minimum(s, 128)
    s_lo = _as_dot((low + 126) << 7)[:, :, None, None, None]
    s_hi = _as_dot((s - low + 127) << 7)[:, :, None, None, None]
    lo = tl.reshape(_as_dot(lo), [BN, BK // 32, 4, 2, 2]) * s_lo * s_hi
    hi = tl.reshape(_as_dot(hi), [BN, BK // 32, 4, 2, 2]) * s_lo * s_hi
    return tl.reshape(lo, [BN, BK // 2]), tl.reshape(hi, [BN, BK // 2])


@triton.jit
def _dot_widened(a0, a1, acc, W, S, n, nm, k0, s_w, s_s, BN: tl.constexpr, BK: tl.constexpr):
    # acc + the product of a (a0: the even, a1: the odd columns of each 128-block, moe_quant's PERMUTE order) with
    # the FP4 expert rows n, columns k0..k0+BK, widened here (``_widen_fp4``) and stored by Triton to shared memory
    # as the tensor cores' column operand; the low nibbles pair with a0, the high with a1
    j = k0 // 8 + tl.arange(0, BK // 8)
    g = k0 // 32 + tl.arange(0, BK // 32)
    words = tl.load(W.to(tl.pointer_type(tl.uint32)) + n[:, None] * (s_w // 4) + j[None, :], mask=nm[:, None],
                    other=0)
    scale = tl.load(S + n[:, None] * s_s + g[None, :], mask=nm[:, None], other=127)
    w_lo, w_hi = _widen_fp4(words, scale, BN, BK)
    acc = tl.dot(a0, tl.trans(w_lo), acc, input_precision="ieee")
    return tl.dot(a1, tl.trans(w_hi), acc, input_precision="ieee")


@triton.jit
def moe_gemm(A, WEIGHTS, SORTED, COUNTS, W_A, W_B, S_A, S_B, OUT, n_local, top_k, N, K, k_part,
             s_a, s_o, s_op, s_w, s_s, s_we, s_se, limit, GATED: tl.constexpr, CLAMP: tl.constexpr,
             PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_BLOCK: tl.constexpr,
             TL_DOT: tl.constexpr, SWAP: tl.constexpr, WIDEN: tl.constexpr):
    # GATED: OUT[slot] = bf16(weight * silu(min(bf16(A W_A^T), L)) * clamp(bf16(A W_B^T), -L, L)) with A's
    # rows gathered by token; else OUT[slot] = bf16(A[slot] W_A^T). Expert e's weight is W + e * s_we (its
    # scale S + e * s_se) in the stacked tensors. Programs of one row tile are adjacent (its rows stay in L2).
    # PARTIAL: program_id(1) sums only K columns [k_part * id, k_part * (id + 1)) and stores its fp32 sums at
    # OUT + id * s_op (A W_A^T at column n, A W_B^T at N + n); the finishing kernels add the parts in order.
    # SWAP (FP4/FP8 on tensor cores): the products computed transposed (``_dot_scaled``). WIDEN (FP4): the
    # weights widened by ``_dot_widened``, A in moe_quant's PERMUTE order
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
    k_lo = tl.program_id(1) * k_part
    k_hi = tl.minimum(k_lo + k_part, K)
    if FMT == "fp4" and WIDEN:
        acc_a = tl.zeros([BM, BN], tl.float32)
        acc_b = tl.zeros([BM, BN], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            a0, a1 = _permuted_halves(A, rows, rm, s_a, k0, BK)
            acc_a = _dot_widened(a0, a1, acc_a, wa, sa, n, nm, k0, s_w, s_s, BN, BK)
            if GATED:
                acc_b = _dot_widened(a0, a1, acc_b, wb, sb, n, nm, k0, s_w, s_s, BN, BK)
    elif FMT != "bf16" and TL_DOT:
        if SWAP:
            acc_a = tl.zeros([BN, BM], tl.float32)
            acc_b = tl.zeros([BN, BM], tl.float32)
        else:
            acc_a = tl.zeros([BM, BN], tl.float32)
            acc_b = tl.zeros([BM, BN], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            if SWAP:
                a = tl.load(A + rows[None, :] * s_a + k[:, None], mask=rm[None, :], other=0.0)
            else:
                a = tl.load(A + rows[:, None] * s_a + k[None, :], mask=rm[:, None], other=0.0)
            acc_a = _dot_scaled(a, acc_a, wa, sa, n, nm, k0, s_w, s_s, BK, SWAP)
            if GATED:
                acc_b = _dot_scaled(a, acc_b, wb, sb, n, nm, k0, s_w, s_s, BK, SWAP)
        if SWAP:
            acc_a = tl.trans(acc_a)
            acc_b = tl.trans(acc_b)
    else:
        acc_a = tl.zeros([BM, BN], tl.float32)
        acc_b = tl.zeros([BM, BN], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            if FMT == "fp4":
                a0, a1 = _permuted_halves(A, rows, rm, s_a, k0, BK)
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
    r, rm, c = _row_block(rows, BR)
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
    _store_block(OUT, r, c, s_o, y, mask, PERMUTE)


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
