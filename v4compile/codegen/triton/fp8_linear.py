"""The model's FP8 ``Linear`` in Triton: e4m3 activations times e4m3 weights read as stored, fp32 per K block.

Two launches for prefill rows, one while decoding:
1. ``fp8_quant``: each row's 128-wide K blocks to e4m3 codes (one byte each) and one fp32 scale per block,
   exactly as ``quant.fp8_simulate`` (amax floored at 1e-4, over 448 correctly rounded, rounded up to a power of
   two when asked, nearest-even rounding by integer arithmetic).
2. ``fp8_gemm``: per (row tile, column tile) and 128-wide K block, the codes' product with the weight's
   e4m3 codes, promoted to fp32 and times the activation's and the weight block's scales, summed over K in fp32.
   With power-of-two scales on the GPU the product is a native FP8 tensor-core dot (``FP8_DOT``). Its products
   are exact but Hopper's FP8 MMA keeps only about 14 mantissa bits while it sums a 128-wide block (the reason
   the official kernels promote to fp32 per block, as this one does): about 1e-4 normwise from the model's
   simulation, a few percent one-ulp flips of the bf16 output. ``FP8_DOT=0`` instead converts the codes in
   registers to the exact bf16 operands of an fp32-accumulating bf16 dot: the simulation up to summation order
   (1e-5), but decoding codes in registers makes it about 5x slower on the H200 (benchmarks/gemm.py); the
   weight is read as one byte either way. Otherwise the activation
   is the model's bf16 ``q * scale`` (not an e4m3 value) and the weight ``e4m3 * scale`` (exact in bf16): a bf16
   dot on the GPU, and under the CPU interpreter fp32 operands with a broadcast product; ``FP8_DOT`` runs there
   too when asked (the interpreter's FP8 dot is exact). Operands load unmasked as e4m3 tensors (the codes padded
   to whole row tiles, weight rows past N clamped), which is what lets Triton pipeline them into the FP8 dot.
3. At 16 rows or fewer ``fp8_gemm`` does step 1 itself (``QUANT``): each program quantizes the bf16 rows of its
   K blocks, the same codes and scales (on the GPU through the hardware's nearest-even saturating e4m3 conversion,
   ``HW_CAST``; recomputed per column tile, which costs less than the launch it saves at 16 rows but more at 64).
   While decoding (64 rows or fewer) a long K (16+ blocks) is split into ranges; each range's program stores its
   partial product and the tile's last one to finish adds them in split order (a per-tile counter finds it). The
   split depends only on K, so a row's result does not depend on the batch.
Prefill rows with K of 2048+ and bf16 output replace step 2 by torch's block-scaled cuBLAS GEMM where torch and
the GPU have it (``blockwise_scaled_mm``): the same e4m3 codes and scales, the same per-block fp32 promotion.

The weight stays one byte an element: nothing is dequantized to memory. The output is fp32 ([M, N], before the
model's rounding to bf16, which a row-parallel layer does after its all-reduce) or that rounding done in the
kernel (bf16, half the bytes written).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .formats import FORMATS_SOURCE
from .launch import GROUPED_TILE, ROUND_BF16, SPLIT_LAST, load_triton_module, lowered_text, split_counters

BLOCK = 128
SMS = 132
GEMM_SIGNATURE = {"X": "*bf16", "CODES": "*fp8e4nv", "SCALES": "*fp32", "W": "*fp8e4nv", "S": "*u8", "OUT": "*bf16",
                  "PARTS": "*fp32", "COUNTER": "*i32",
                  **dict.fromkeys("M N K s_x s_c s_s s_w s_ws s_o s_part".split(), "i32")}
"""``fp8_gemm``'s arguments as Triton types, in order: for lowering it without a launch (``hopper.sm90_ptx``)."""

_SOURCE = '''
import triton
import triton.language as tl

DOT = tl.{dot}
''' + ROUND_BF16 + GROUPED_TILE + SPLIT_LAST + FORMATS_SOURCE + '''


@triton.jit
def fp8_quant(X, CODES, SCALES, rows, s_x, s_c, s_s, s_sk, POW2: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    rm = r < rows
    x = tl.load(X + r[:, None] * s_x + c[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    scale = _act_scale(x, POW2)
    q = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0))
    tl.store(CODES + r[:, None] * s_c + c[None, :], _e4m3_code(q).to(tl.uint8).to(tl.float8e4nv, bitcast=True),
             mask=rm[:, None])
    tl.store(SCALES + r * s_s + tl.program_id(1) * s_sk, scale, mask=rm)


@triton.jit
def _quantized_block(X, m, mm, k, s_x, POW2: tl.constexpr, FP8_DOT: tl.constexpr, HW_CAST: tl.constexpr):
    # rows m of X's 128-wide K block k quantized as fp8_quant does: (e4m3 codes, their scales) for an FP8 dot, else
    # (the codes' values times the scale, as fp8_gemm's bf16 dot takes them, the scales). HW_CAST: the GPU's
    # nearest-even saturating e4m3 conversion in place of the integer rounding (same codes, a few instructions)
    x = tl.load(X + m[:, None] * s_x + k[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
    sa = _act_scale(x, POW2)
    if POW2:
        v = x * (1.0 / sa)[:, None]
    else:
        v = tl.math.div_rn(x, sa[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if FP8_DOT:
        if HW_CAST:
            a = v.to(tl.float8e4nv)
        else:
            a = _e4m3_code(_round_e4m3(v)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        a = _round_e4m3(v) * sa[:, None]
    return a, sa


@triton.jit
def fp8_gemm(X, CODES, SCALES, W, S, OUT, PARTS, COUNTER, M, N, K, s_x, s_c, s_s, s_w, s_ws, s_o, s_part,
             POW2: tl.constexpr, FP8_DOT: tl.constexpr, TL_DOT: tl.constexpr, QUANT: tl.constexpr,
             HW_CAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
             OUT_BF16: tl.constexpr):
    # axis 0: the output tile in grouped order; axis 1: the K split, each a fixed range of K blocks, whose last
    # program to finish adds the splits' partial products in split order. QUANT: the activation is X's bf16 rows,
    # quantized here block by block (decode: no fp8_quant launch), else fp8_quant's CODES and SCALES
    m0, n0 = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP)
    m = m0 + tl.arange(0, BM)
    n = n0 + tl.arange(0, BN)
    per_split = tl.cdiv(K // 128, SPLIT) * 128
    k_lo = tl.program_id(1) * per_split
    k_hi = tl.minimum(K, k_lo + per_split)
    mm = m < M
    nm = n < N
    wn = tl.minimum(n, N - 1)
    j = tl.arange(0, 128)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_lo, k_hi, 128):
        k = k0 + j
        # unmasked loads (CODES and SCALES hold whole row tiles, weight rows past N repeat row N-1): what is
        # computed past M or N is never stored
        w = tl.load(W + wn[:, None] * s_w + k[None, :])
        # a column tile lies in one 128-row weight block: one scale per K block
        sw = _e8m0(tl.load(S + (n0 // 128) * s_ws + k0 // 128))
        if QUANT:
            a, sa = _quantized_block(X, m, mm, k, s_x, POW2, FP8_DOT, HW_CAST)
        else:
            a = tl.load(CODES + m[:, None] * s_c + k[None, :])
            sa = tl.load(SCALES + m * s_s + k0 // 128)
            if not FP8_DOT:
                a = _e4m3(a.to(tl.uint8, bitcast=True)) * sa[:, None]
        if FP8_DOT:
            acc += tl.dot(a, tl.trans(w)) * (sa * sw)[:, None]
        else:
            if not POW2:
                a = _round_bf16(a)
            wv = _e4m3(w.to(tl.uint8, bitcast=True)) * sw
            if TL_DOT:
                acc += tl.dot(a.to(DOT), tl.trans(wv.to(DOT)), input_precision="ieee")
            else:
                acc += tl.sum(a[:, None, :] * wv[None, :, :], axis=2)
    at = m[:, None] * s_o + n[None, :]
    mask = mm[:, None] & nm[None, :]
    if SPLIT == 1:
        _store_out(OUT, at, mask, acc, OUT_BF16)
    else:
        tl.store(PARTS + tl.program_id(1) * s_part + at, acc, mask=mask)
        if _last_split(COUNTER, tl.program_id(0), SPLIT):
            _store_out(OUT, at, mask, _sum_splits(PARTS, at, mask, s_part, SPLIT), OUT_BF16)


@triton.jit
def _store_out(OUT, at, mask, acc, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        tl.store(OUT + at, _round_bf16(acc).to(tl.bfloat16), mask=mask)
    else:
        tl.store(OUT + at, acc, mask=mask)
'''


def kernel_name() -> str:
    """Stable kernel name."""
    return "fp8_linear.triton"


def launch_config(m: int, n: int, k: int, cuda: bool) -> dict[str, int]:
    """Row tiles of 16 (the tensor cores' minimum) while decoding and 128 for prefill. Decode reads the weight
    once and is latency-bound: at 16 rows or fewer one launch that quantizes its own activation blocks (``QUANT``;
    at 64 rows requantizing per column tile was 22% slower on the H100), and a long K (16+ blocks) split into up to
    eight ranges summed by each tile's last program in a fixed order; the split depends only on K, so a row's sums
    do not depend on the batch. Prefill walks eight row tiles per band of column tiles, or (``CUBLAS``, K of 2048+,
    bf16 out, power-of-two scales) quantizes the activation here and multiplies in torch's block-scaled cuBLAS GEMM,
    bitwise equal to ours and 1.2-3.2x faster at the slice's prefill shapes (8192 rows on the H100: wkv 110 -> 35
    us, wq_a 138 -> 59, wo_b 603 -> 494; at K 1024, wq_b, ours was 4% faster). FP8 tensor-core dots where the
    scales allow. From H200 and H100 sweeps (NOTES.md); the interpreter gets few, large programs and the separate
    quantization (``QUANT`` there repeats the integer rounding per column tile; tests run it explicitly)."""
    if not cuda:
        return {"BM": min(64, triton_next_pow2(max(m, 1))), "BN": min(64, triton_next_pow2(n)), "BR": 64,
                "num_warps": 4, "num_stages": 1, "FP8_DOT": 0, "GROUP": 1, "SPLIT": 1}
    if m > 64:
        return {"BM": 128, "BN": 128, "BR": 16, "num_warps": 8, "num_stages": 4, "FP8_DOT": 1, "GROUP": 8,
                "SPLIT": 1, "CUBLAS": int(k >= 2048 and blockwise_scaled_mm() is not None)}
    blocks = k // BLOCK
    split = 1 if blocks < 16 else min(8, triton_next_pow2(blocks // 4 + 1) // 2)
    wide = m > 16 and triton.cdiv(n, 128) >= SMS
    return {"BM": 16 if m <= 16 else 64, "BN": 128 if wide else 64, "BR": 16, "num_warps": 4,
            "num_stages": 3 if wide else 4, "FP8_DOT": 1, "GROUP": 1, "SPLIT": split, "QUANT": int(m <= 16)}


@functools.cache
def blockwise_scaled_mm() -> Callable[..., torch.Tensor] | None:
    """torch's block-scaled FP8 GEMM (cuBLAS: 1x128 activation and 128x128 weight scales, fp32 promotion per
    K block, the model's numerics up to summation order) where this torch and GPU have it (Hopper), else None."""
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if scaled_mm is None or not hasattr(kinds, "BlockWise1x128") or not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability() != (9, 0):
        return None

    def gemm(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
        return scaled_mm(codes, weight.t(), scales, kinds.BlockWise1x128, scale.float().t(),
                         kinds.BlockWise128x128, output_dtype=out_dtype)

    return gemm


def _module(cuda: bool) -> object:
    return REGISTRY.build(kernel_name(), "triton", "v4compile::fp8_linear",
                          lambda: _SOURCE.format(dot="bfloat16" if cuda else "float32"),
                          lambda path: load_triton_module(path, not cuda), key=cuda)


def activation_buffers(rows: torch.Tensor, row_tile: int, m_major: bool = False) -> tuple[torch.Tensor, ...]:
    """The e4m3 codes and per-128 fp32 scales ``quantize_activation`` writes for ``rows`` [M, K], padded to whole
    tiles of ``row_tile`` rows (0: none, the GEMM quantizes itself); ``m_major``: the scales stored M-major, as
    cuBLAS takes them."""
    m, k = rows.shape
    padded = triton.cdiv(m, row_tile) * row_tile if row_tile else 0
    codes = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = (torch.empty(k // BLOCK, padded, dtype=torch.float32, device=rows.device).t() if m_major else
              torch.empty(padded, k // BLOCK, dtype=torch.float32, device=rows.device))
    return codes, scales


def quantize_activation(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, pow2: bool,
                        rows_per_program: int = 16) -> None:
    """``fp8_quant``: each row's 128-wide K blocks of bf16 ``rows`` [M, K] to e4m3 ``codes`` and fp32 ``scales``,
    exactly as ``quant.fp8_simulate`` (rows past M left as they are)."""
    m, k = rows.shape
    _module(rows.device.type == "cuda").fp8_quant[(triton.cdiv(m, rows_per_program), k // BLOCK)](
        rows, codes, scales, m, rows.stride(0), codes.stride(0), scales.stride(0), scales.stride(1), POW2=pow2,
        BR=rows_per_program)


def check_fp8_weight(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Raises a ValueError naming ``name`` when the activation, weight and block scales do not fit together."""
    n, k = weight.shape
    blocks = (-(-n // BLOCK), -(-k // BLOCK))
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if tuple(scale.shape) != blocks:
        raise ValueError(f"{name}: FP8 weight {tuple(weight.shape)} needs block scales of shape {blocks} "
                         f"(one per {BLOCK}x{BLOCK}), got {tuple(scale.shape)}")
    if k % BLOCK:
        raise ValueError(f"{name}: in_features {k} is not a multiple of the activation block {BLOCK}")
    if x.shape[-1] != k:
        raise ValueError(f"{name}: activation has {x.shape[-1]} features, the weight takes {k}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool,
               out_dtype: torch.dtype = torch.float32, config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::fp8_linear``: x [..., K] times the e4m3 weight [N, K] with e8m0 block scales
    [N/128, K/128] -> [..., N] in fp32, or rounded once to bf16 when ``out_dtype`` is bf16 (half the output
    bytes, no rounding pass after). ``config`` overrides the launch configuration (benchmark sweeps)."""
    check_fp8_weight("fp8_linear", x, weight, scale)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8_linear: out_dtype must be float32 or bfloat16, got {out_dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    cuda = x.device.type == "cuda"
    module = _module(cuda)
    config = config or launch_config(m, n, k, cuda)
    split, bf16 = config["SPLIT"], out_dtype == torch.bfloat16
    if BLOCK % config["BN"]:
        raise ValueError(f"fp8_linear: column tile {config['BN']} must divide the weight block {BLOCK}")
    cublas = blockwise_scaled_mm() if config.get("CUBLAS") and pow2 and bf16 and n % BLOCK == 0 else None
    quant = bool(config.get("QUANT"))
    row_tile = 16 if cublas else config["BM"]  # cuBLAS takes whole 16-row tiles
    codes, scales = activation_buffers(rows, 0 if quant else row_tile, m_major=cublas is not None)
    out = torch.empty((0 if cublas else m, n), dtype=out_dtype, device=x.device)  # cuBLAS returns its own
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    w, s = weight.contiguous(), scale.contiguous().view(torch.uint8)
    tiles = triton.cdiv(m, config["BM"]) * triton.cdiv(n, config["BN"])
    counters = split_counters(x.device, tiles) if split > 1 else out

    def run() -> None:
        nonlocal out
        if not quant:
            quantize_activation(rows, codes, scales, pow2, config["BR"])
        if cublas:
            out = cublas(codes, scales, w, scale, out_dtype)[:m]
            return
        module.fp8_gemm[(tiles, split)](
            rows, codes, scales, w, s, out, parts, counters, m, n, k, rows.stride(0), codes.stride(0),
            scales.stride(0), w.stride(0), s.stride(0), n, m * n, POW2=pow2, FP8_DOT=pow2 and bool(config["FP8_DOT"]),
            TL_DOT=cuda, QUANT=quant, HW_CAST=cuda, BM=config["BM"], BN=config["BN"], GROUP=config["GROUP"],
            SPLIT=split, OUT_BF16=bf16, num_warps=config["num_warps"], num_stages=config["num_stages"])

    if m:
        REGISTRY.launch(kernel_name(), run)
        REGISTRY.note_launch(kernel_name(), rows=m, n=n, k=k, **config)
        if cuda and REGISTRY.records[kernel_name()].lowered is None:
            REGISTRY.set_lowered(kernel_name(), lowered_text(module.fp8_gemm) or "")
    return out.reshape(*lead, n)
