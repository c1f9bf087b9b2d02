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
The kernels' source, and their numerics on the GPU and under the interpreter: ``moe_kernels.py``.
"""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import load_triton_module, lowered_text
from .moe_kernels import SOURCE

FORMATS = ("fp4", "fp8", "bf16")
QUANT_BLOCK = 128
GEMM_SIGNATURE = {"A": "*bf16", "WEIGHTS": "*fp32", "SORTED": "*i32", "COUNTS": "*i32", "W_A": "*u8", "W_B": "*u8",
                  "S_A": "*u8", "S_B": "*u8", "OUT": "*bf16",
                  **dict.fromkeys("n_local top_k N K k_part s_a s_o s_op s_w s_s s_we s_se".split(), "i32"),
                  "limit": "fp32"}
"""``moe_gemm``'s arguments as Triton types, in order (FP4/FP8 experts, bf16 output): for lowering it without a
launch (``hopper.sm90_ptx``)."""


def kernel_name(fmt: str) -> str:
    """Stable kernel name, e.g. ``moe_experts.fp4.triton``."""
    return f"moe_experts.{fmt}.triton"


def launch_config(pairs: int, n_local: int, tokens: int, dim: int, inter: int, cuda: bool, fmt: str = "fp4"
                  ) -> dict[str, int]:
    """Row tiles sized by the mean pairs per expert. While decoding (16 pairs an expert or fewer) the products are
    computed transposed (``swap``): the weights are the tensor cores' 16-row operand and an expert's 8 (or 16) pairs
    the column operand, 32 weight rows on two warps, K blocks of 256, three stages. One Flash layer on the H100 at 1
    / 16 / 64 tokens: 86.8 / 585.2 / 1424.9 us against 93.6 / 717.9 / 1719.4 for the 16-row tile it replaced (the
    activation's 16-row padding gone: 4.8 SASS instructions a weight in the loop against 5.4-6.0, and the loop is
    issue-bound; ``benchmarks/sass_mix.py``, NOTES.md 33rd). Beyond: 32 rows up to 32 pairs an expert; FP4 experts
    up to 64 pairs, 64 rows on 128-wide output blocks with the weights widened by the kernel itself (``widen``: 4
    packed bytes at a time, stored to shared memory as the tensor cores' column operand) on the H100 at 1536 / 2048
    / 2560 tokens 4.16 / 4.34 / 5.30 ms against 4.62 / 5.36 / 6.29 for the 32-row ``tl.dot_scaled`` tile (and
    5.88-6.28 for that tile at 64 rows: the widening, not the tile, gains; it lost at 1024, 4096 and 8192 tokens,
    NOTES.md 36th); 128 rows on 128-wide output blocks; FP4 experts beyond 128 pairs, 256 rows, so each widened
    weight serves twice the rows (8192 tokens on the H100 took 9.99 against 11.64 ms per Flash layer, bitwise the
    same; not measured for FP8 and bf16 experts); K blocks of 128 (the quantization block; ``BK`` is the largest K
    block, each GEMM takes the largest that fits its K in whole quantization blocks), each the fastest measured at
    V4-Flash's shape on the H200 (256 experts at 1, 64 and 8192 tokens, 16 at 64: benchmarks/NOTES.md); the
    interpreter gets few, large programs (its cost is per program and op, not per element). ``programs``: a GEMM
    with fewer programs than this splits its K into parts until it has about that many (one token on the H100: the
    gated GEMM's 384 programs fill under half a wave, two parts took the layer from 94.3 to 86.5 us; more parts were
    slower)."""
    if not cuda:
        return {"programs": 0, "BM": 16, "BN1": min(256, triton_next_pow2(inter)),
                "BN2": min(256, triton_next_pow2(dim)),
                "BK": 512, "BT": 64, "BD": triton_next_pow2(dim), "BR": 64, "tl_dot": False, "swap": False,
                "widen": False, "num_warps": 4, "num_stages": 1}
    per_expert = pairs / max(n_local, 1)
    if per_expert <= 16:
        tiles = {"BM": 8 if per_expert <= 8 else 16, "BN1": 32, "BN2": 32, "BK": 256, "swap": True, "num_warps": 2,
                 "num_stages": 3}
    elif per_expert <= 32 or (per_expert <= 64 and fmt != "fp4"):
        tiles = {"BM": 32, "BN1": 64, "BN2": 64, "num_warps": 4, "num_stages": 3}
    elif per_expert <= 64:
        tiles = {"BM": 64, "BN1": 128, "BN2": 128, "num_warps": 4, "num_stages": 3, "widen": True}
    elif per_expert <= 128 or fmt != "fp4":
        tiles = {"BM": 128, "BN1": 128, "BN2": 128, "num_warps": 8, "num_stages": 3}
    else:
        tiles = {"BM": 256, "BN1": 64, "BN2": 128, "num_warps": 8, "num_stages": 2}
    return {"BK": 128, "swap": False, "widen": False, **tiles, "programs": 1024, "BT": 1 if tokens < 512 else 4,
            "BD": 512, "BR": 16, "tl_dot": True}


def _module(fmt: str, cuda: bool) -> object:
    return REGISTRY.build(kernel_name(fmt), "triton", "v4compile::moe_experts",
                          lambda: SOURCE.format(fmt=fmt, dot="bfloat16" if cuda else "float32"),
                          lambda path: load_triton_module(path, not cuda), key=(cuda, fmt))


COLUMN_ORDERS = {"natural": 0, "even_first": 1, "fragment": 2}
"""The orders ``quantize`` stores each 128-column block of an activation in, as the GEMM reading it wants them:
as they are; even columns first (this module's widened and interpreter FP4 tiles); the TileLang FP4 GEMM's
fragment order, column 32w + 16a + 8b + 2c + v holding 32c + 8w + 4v + 2b + a (its thread quad c reads 16
contiguous weight bytes, each bf16x2 register from one word)."""


def routing_buffers(pairs: int, n_local: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffers ``route`` fills: per-expert pair counts [n_local], sorted pairs [pairs], each pair's slot."""
    return (torch.empty(n_local, dtype=torch.int32, device=device),
            *(torch.empty(pairs, dtype=torch.int32, device=device) for _ in range(2)))


def route(ids: torch.Tensor, first: int, fmt: str, counts: torch.Tensor, order: torch.Tensor,
          slots: torch.Tensor) -> None:
    """``moe_route`` for the local experts ``first..first+len(counts)-1``: their pair counts, the pairs sorted by
    expert (a stable counting sort: token order within an expert) and each pair's slot in that order (-1 for
    another rank's expert)."""
    _module(fmt, ids.device.type == "cuda").moe_route[(counts.numel(),)](ids, counts, order, slots, ids.numel(), first,
                                                                         counts.numel(), BLOCK=1024)


def quantize(src: torch.Tensor, dst: torch.Tensor, counts: torch.Tensor, pow2: bool, fmt: str,
             columns: str = "natural", counted: bool = False, gather: tuple[torch.Tensor, int] | None = None,
             rows_per_program: int = 16) -> None:
    """``moe_quant``: dst's rows = src's rows through the model's e4m3 activation simulation, stored in the
    ``COLUMN_ORDERS`` order ``columns``; ``counted``: only the local experts' pair rows; ``gather`` (sorted pairs,
    top_k): dst row r (a pair slot) = src row (its token) sorted[r] // top_k."""
    sorted_pairs, top_k = gather if gather is not None else (counts, 1)
    n_local = counts.numel()
    grid = (triton.cdiv(dst.shape[0], rows_per_program), src.shape[1] // QUANT_BLOCK)
    _module(fmt, src.device.type == "cuda").moe_quant[grid](
        src, dst, counts, sorted_pairs, src.shape[0], n_local, top_k, src.stride(0), dst.stride(0), POW2=pow2,
        PERMUTE=COLUMN_ORDERS[columns], COUNTED=counted, GATHER=gather is not None, BR=rows_per_program,
        E_BLOCK=triton_next_pow2(n_local))


def tile_map(counts: torch.Tensor, rows: int, pairs: int, fmt: str) -> tuple[torch.Tensor, ...]:
    """``moe_tiles``: for each row tile of ``rows`` pairs (each expert's pairs in whole tiles, at most
    pairs / rows + experts tiles) its expert (-1 past the last), first pair slot and its expert's end slot."""
    n_tiles = triton.cdiv(pairs, rows) + counts.numel()
    tile_e, tile_row, tile_end = (torch.empty(n_tiles, dtype=torch.int32, device=counts.device) for _ in range(3))
    _module(fmt, counts.device.type == "cuda").moe_tiles[(triton.cdiv(n_tiles, 32),)](
        counts, tile_e, tile_row, tile_end, counts.numel(), n_tiles, BM=rows, E_BLOCK=triton_next_pow2(counts.numel()),
        BT=32)
    return tile_e, tile_row, tile_end


def combine(ids: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, y: torch.Tensor, fmt: str,
            tokens_per_program: int, columns_per_program: int) -> None:
    """``moe_combine``: y [tokens, dim] fp32 = each token's sum of its experts' outputs (``out`` [pairs, dim] bf16
    by slot, or fp32 K parts [parts, pairs, dim]) in ascending expert order."""
    (tokens, top_k), dim = ids.shape, y.shape[1]
    partial = out.dtype == torch.float32
    _module(fmt, out.device.type == "cuda").moe_combine[(triton.cdiv(tokens, tokens_per_program),
                                                         triton.cdiv(dim, columns_per_program))](
        ids, slots, out, y, tokens, dim, top_k, out.shape[0] if partial else 1, out.stride(0), out.stride(-2),
        y.stride(0), PARTIAL=partial, BT=tokens_per_program, BD=columns_per_program, KP=triton_next_pow2(top_k))


def simulate_fp8(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The kernel's activation quantization alone on bf16 rows x [R, C] (C a multiple of 128): equal to
    ``quant.fp8_simulate(x, 128, pow2)`` bit for bit (for tests and debugging)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    quantize(x, out, torch.zeros(1, dtype=torch.int32, device=x.device), pow2, "fp8")
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
    widen = fmt == "fp4" and bool(config["widen"])
    columns = "even_first" if fmt == "fp4" and not config["tl_dot"] or widen else "natural"
    x_q = torch.empty_like(x) if quantized else x
    counts, order, slots = routing_buffers(pairs, n_local, device)
    y = torch.empty(tokens, dim, dtype=torch.float32, device=device)
    tiles = min(pairs, triton.cdiv(pairs, bm) + min(n_local, pairs))
    warps, stages = config["num_warps"], config["num_stages"]

    def quant(src: torch.Tensor, dst: torch.Tensor, counted: bool) -> None:
        quantize(src, dst, counts, pow2, fmt, columns, counted, rows_per_program=config["BR"])

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
            TL_DOT=config["tl_dot"], SWAP=config["swap"], WIDEN=widen, num_warps=warps,
            num_stages=stages)

    split1 = parts(inter, dim, config["BN1"])
    split2 = parts(dim, inter, config["BN2"])
    gate_parts = torch.empty(split1[0], pairs, 2 * inter, dtype=torch.float32, device=device) \
        if split1[0] > 1 else None
    hidden = torch.empty(pairs, inter, dtype=torch.bfloat16, device=device)
    hidden_q = torch.empty_like(hidden) if quantized and gate_parts is None else hidden
    out = torch.empty(split2[0], pairs, dim, dtype=torch.float32, device=device) if split2[0] > 1 else \
        torch.empty(pairs, dim, dtype=torch.bfloat16, device=device)

    def run() -> None:
        route(ids, first, fmt, counts, order, slots)
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
                QUANT=quantized, POW2=pow2, PERMUTE=COLUMN_ORDERS[columns], BR=config["BR"], E_BLOCK=e_block)
        gemm(hidden_q, out, False, dim, inter, config["BN2"], split2)
        combine(ids, slots, out, y, fmt, config["BT"], config["BD"])

    if tokens:
        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, tiles=tiles, experts=n_local, pairs=pairs, k_parts=(split1[0], split2[0]), **config)
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.moe_gemm) or "")
    return y
