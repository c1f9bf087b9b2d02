"""fp32 matrix products in Triton on tensor cores: ``x W^T (+ b)`` with fp32 accuracy from three TF32 products.

The model computes its output head, compressor projections and router scores in fp32 (V4-SPEC: "always fp32").
cuBLAS runs fp32 GEMMs on the SIMT units (``sm80_xmma_gemm_f32f32``, ``gemv2T``); at decode the head alone is
2.1 GB of fp32 weight, and at a prefill's 8192 rows the compressor's products are compute-bound on those units.
Here each operand is split into a TF32 value and its TF32 remainder, and the three significant cross products run
on the TF32 tensor cores with fp32 accumulation (``input_precision="tf32x3"``); the dropped remainder product is
below fp32 rounding. Measured on the H200 (benchmarks/gemm.py) the result is as close to an fp64 product as
cuBLAS's fp32 one (about 5e-7 of max|y| against its 3e-6 at K 4096), not bitwise equal to it: no two fp32 GEMMs
sum in the same order.

Operands are read in their stored dtype and widened in registers (a bf16 router weight or activation cast to fp32
by the model reads half the bytes; the widening is exact). When K is split (decode, few column tiles), each
K range's program stores its partial product and the last of an output tile's programs to finish adds them in split
order (one launch; a per-tile counter finds the last); the split depends on N and K only, never on the row count.
"""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import GROUPED_TILE, SPLIT_LAST, load_triton_module, lowered_text, split_counters

SMS = 132
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = '''
import triton
import triton.language as tl

PRECISION = tl.constexpr("{precision}")
''' + GROUPED_TILE + SPLIT_LAST + '''


@triton.jit
def fp32_mm(X, W, B, OUT, PARTS, COUNTER, M, N, K, s_xm, s_xk, s_wn, s_wk, s_o, s_part, HAS_BIAS: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr):
    # axis 0: the output tile in grouped order; axis 1: the K split, each a fixed range of BK-wide blocks, whose
    # last program to finish adds the splits' partial products in split order
    m0, n0 = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP)
    m = m0 + tl.arange(0, BM)
    n = n0 + tl.arange(0, BN)
    per_split = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = tl.program_id(1) * per_split
    k_hi = tl.minimum(K, k_lo + per_split)
    # rows past M and columns past N repeat the last one (never stored), so only K needs a mask
    xm = tl.minimum(m, M - 1)
    wn = tl.minimum(n, N - 1)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        a = tl.load(X + xm[:, None] * s_xm + k[None, :] * s_xk, mask=km[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + wn[:, None] * s_wn + k[None, :] * s_wk, mask=km[None, :], other=0.0).to(tl.float32)
        if PRECISION == "bcast":
            acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    at = m[:, None] * s_o + n[None, :]
    mask = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        _store_fp32(OUT, at, mask, acc, B, wn, HAS_BIAS)
    else:
        tl.store(PARTS + tl.program_id(1) * s_part + at, acc, mask=mask)
        if _last_split(COUNTER, tl.program_id(0), SPLIT):
            _store_fp32(OUT, at, mask, _sum_splits(PARTS, at, mask, s_part, SPLIT), B, wn, HAS_BIAS)


@triton.jit
def _store_fp32(OUT, at, mask, acc, B, wn, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(B + wn).to(tl.float32)[None, :]
    tl.store(OUT + at, acc, mask=mask)
'''


def kernel_name() -> str:
    """Stable kernel name."""
    return "fp32_linear.triton"


def launch_config(m: int, n: int, k: int, cuda: bool) -> dict[str, int]:
    """Row tiles of 16 / 64 / 128 by the row count; while decoding, 64-wide column tiles unless the columns fill
    the SMs at 128 (the output head), and K split until the column tiles times the splits cover the SMs twice (at
    most 16 splits of at least four K blocks each; the split depends on N and K only, so a row's sums do not
    depend on the batch). From an H200 sweep (benchmarks/fp32_gemm.py --sweep); the interpreter gets few, large
    programs."""
    if not cuda:
        return {"BM": min(32, triton_next_pow2(max(m, 1))), "BN": min(64, triton_next_pow2(n)), "BK": 64,
                "GROUP": 1, "SPLIT": 1, "num_warps": 4, "num_stages": 1}
    if m > 64:
        return {"BM": 128, "BN": 64, "BK": 32, "GROUP": 8, "SPLIT": 1, "num_warps": 4, "num_stages": 4}
    wide = triton.cdiv(n, 128) >= SMS
    bn, bk = (128, 64 if m <= 16 else 32) if wide else (64, 64)
    tiles, blocks, split = triton.cdiv(n, bn), triton.cdiv(k, bk), 1
    while split < 16 and tiles * split < 2 * SMS and blocks >= 4 * split:
        split *= 2
    return {"BM": 16 if m <= 16 else 64, "BN": bn, "BK": bk, "GROUP": 1, "SPLIT": split, "num_warps": 4,
            "num_stages": 4}


def _module(cuda: bool) -> object:
    precision = "tf32x3" if cuda else "bcast"
    return REGISTRY.build(kernel_name(), "triton", "v4compile::fp32_linear",
                          lambda: _SOURCE.format(precision=precision), lambda path: load_triton_module(path, not cuda),
                          key=cuda)


def check_fp32_linear(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raises a ValueError naming ``name`` when the activation, weight and bias do not fit together."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: activation of shape {tuple(x.shape)} does not take the weight's "
                         f"{weight.shape[1]} in_features")
    for what, t in (("activation", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in DTYPES:
            raise ValueError(f"{name}: {what} dtype {t.dtype} is not one of {DTYPES}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::fp32_linear``: fp32 ``x [..., K] @ weight [N, K]^T (+ bias)`` -> [..., N] (a
    ``transposed`` weight is [K, N]), the operands widened from their stored dtype in registers. ``config``
    overrides the launch configuration (benchmark sweeps)."""
    weight = weight.t() if transposed else weight
    check_fp32_linear("fp32_linear", x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    cuda = x.device.type == "cuda"
    if cuda and m == 1 and config is None and weight.dtype == torch.float32 and \
            (bias is None or bias.dtype == torch.float32):
        # one row against an fp32 weight: cuBLAS's GEMV reads the weight as fast in one launch (the row widened
        # first, as the model's own code does). The pass declines a static one-row product for that reason; a
        # graph whose rows are dynamic meets the case here.
        return torch.nn.functional.linear(rows.float(), weight, bias).reshape(*lead, n)
    module = _module(cuda)
    config = config or launch_config(m, n, k, cuda)
    split = config["SPLIT"]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    tiles = triton.cdiv(m, config["BM"]) * triton.cdiv(n, config["BN"])
    counters = split_counters(x.device, tiles) if split > 1 else out

    def run() -> None:
        module.fp32_mm[(tiles, split)](
            rows, weight, b, out, parts, counters, m, n, k, rows.stride(0), rows.stride(1), weight.stride(0),
            weight.stride(1), n, m * n, HAS_BIAS=bias is not None, BM=config["BM"], BN=config["BN"], BK=config["BK"],
            GROUP=config["GROUP"], SPLIT=split, num_warps=config["num_warps"], num_stages=config["num_stages"])

    if m and n:
        REGISTRY.launch(kernel_name(), run)
        REGISTRY.note_launch(kernel_name(), rows=m, n=n, k=k, **config)
        if cuda and REGISTRY.records[kernel_name()].lowered is None:
            REGISTRY.set_lowered(kernel_name(), lowered_text(module.fp32_mm) or "")
    return out.reshape(*lead, n)
