"""The routed experts' FP4 GEMMs in TileLang: the widened weights are the tensor cores' register operand.

``moe_experts`` keeps the Triton launch sequence (``codegen/triton/moe.py``: route, quantize, GEMM, quantize,
GEMM, combine) and replaces its two GEMMs where the tiles are large (prefill). Per (row tile of one expert's pairs,
block of BN output columns) a kernel computes the transposed product acc[n, slot] = sum_k W[e, n, k] A[slot, k]:
the e2m1 weights are widened to bf16 in registers straight into wgmma's A fragment (``widen``: code bits to bf16
bits as value x 2^-126, then two exact power-of-two products for the e8m0 scale, any byte 1..254), and the
activation tile streams from shared memory (TMA, STAGES deep, a producer warp group; TileLang's warp
specialization). Nothing widened goes through shared memory, so the consumer warp groups never wait on each
other: one widens while the other's MMAs run. A thread's fragment of a 128-wide K block is 32 values of one
weight row; the activation is stored so that those are 16 contiguous bytes of the packed row and one scale group:
slot column 32w + 16a + 8b + 2c + v of each 128-block holds column 32c + 8w + 4v + 2b + a, so each bf16x2
register comes from one packed word (``moe.COLUMN_ORDERS["fragment"]``,
written by the Triton quantizer, which also gathers the gated GEMM's rows by pair). Products of bf16 values exact
in fp32, fp32 accumulation: the Triton kernels' numerics but for the summation order. The epilogues are the
Triton ones: bf16 rounding of each product, the clamped SwiGLU times the routing weight (gated), bf16 out; the
transposed tile goes back through shared memory so each output row is stored in 16-byte pieces (stored straight
from the accumulator, every 2-byte value would land in another row).

On the ``c`` target (CPU tests) the same source computes in fp32 loops: the bit patterns are widened to fp32
by a 16-bit shift (exact), the products summed in K order.
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import REGISTRY
from ..triton import moe as triton_moe
from .common import TARGET_MACROS, hopper_cuda, load_kernels

_SOURCE = '''
import tilelang
import tilelang.language as T

N = {n}
K = {k}
BM = {bm}
BN = {bn}
BK = 128
STAGES = {stages}
THREADS = {threads}
GATED = {gated}
''' + TARGET_MACROS + '''

def build(target):
    cuda = target != "c"
    pairs, experts, n_tiles, n_weights = (T.dynamic(n) for n in ("n_pairs", "n_experts", "n_tiles", "n_weights"))
    IN = "bfloat16" if cuda else "float32"
    staged = T.alloc_shared if cuda else T.alloc_fragment
    to_bf16, _ = target_macros(cuda)

    @T.macro
    def bf16_value(bits):
        # a uint16 bf16 bit pattern's value (fp32 built from the bits on the c target)
        if cuda:
            return T.reinterpret(bits, "bfloat16")
        return T.reinterpret(T.cast(bits, "uint32") << T.uint32(16), "float32")

    @T.macro
    def moved(word, mask, shift):
        # the bits of word under mask, shifted left by shift (right for a negative shift)
        if shift >= 0:
            return (word & T.uint32(mask)) << T.uint32(shift)
        return (word & T.uint32(mask)) >> T.uint32(-shift)

    @T.macro
    def widen(w_s, s_s, frag, k):
        # frag[i, j], j = 8q + 2c + v, q = 4w + r: a thread quad c's 32 values of weight row i in K block k are its
        # 4 words w of packed codes; each pair (v = 0, 1) is one bf16x2 register built from two codes of one word:
        # r 0 / 1 the low nibbles of bytes (0, 2) / (1, 3), r 2 / 3 their high nibbles, the magnitude bits landing
        # in bf16's exponent and mantissa as value x 2^-126 (code 1 a subnormal), the sign bit on bf16's
        for i, j in T.Parallel(BN, BK):
            c = (j % 8) // 2
            q = j // 8
            r = q % 4
            word = T.cast(w_s[i, 4 * c + q // 4], "uint32")
            pair = T.if_then_else(
                r == 0, moved(word, 0x70007, 6) | moved(word, 0x80008, 12),
                T.if_then_else(r == 1, moved(word, 0x7000700, -2) | moved(word, 0x8000800, 4),
                               T.if_then_else(r == 2, moved(word, 0x700070, 2) | moved(word, 0x800080, 8),
                                              moved(word, 0x70007000, -6) | moved(word, 0x80008000, 0))))
            bits = T.cast((pair >> T.cast((j % 2) * 16, "uint32")) & T.uint32(0xFFFF), "uint16")
            s = T.cast(s_s[i, k * 4 + c], "uint16")
            low = T.min(s, T.uint16(128))
            frag[i, j] = bf16_value(bits) * bf16_value((low + T.uint16(126)) << T.uint16(7)) \\
                * bf16_value((s - low + T.uint16(127)) << T.uint16(7))

    @T.macro
    def zero(acc):
        if cuda:
            T.clear(acc)
        else:
            for i, j in T.Parallel(BN, BM):
                acc[i, j] = 0.0

    @T.macro
    def product(frag, a_s, acc):
        if cuda:
            T.gemm(frag, a_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        else:
            for i, j in T.Parallel(BN, BM):
                for kk in T.serial(BK):
                    acc[i, j] += frag[i, kk] * a_s[j, kk]

    @T.prim_func
    def moe_gemm(a: T.Tensor((pairs, K), IN), w_a: T.Tensor((experts, N, K // 8), "int32"),
                 w_b: T.Tensor((experts, N, K // 8), "int32"), s_a: T.Tensor((experts, N, K // 32), "uint8"),
                 s_b: T.Tensor((experts, N, K // 32), "uint8"), tile_e: T.Tensor((n_tiles,), "int32"),
                 tile_row: T.Tensor((n_tiles,), "int32"), tile_end: T.Tensor((n_tiles,), "int32"),
                 sorted_pairs: T.Tensor((pairs,), "int32"), weights: T.Tensor((n_weights,), "float32"),
                 out: T.Tensor((pairs, N), IN), limit: T.float32):
        # block (nb, t): output columns nb * BN.., row tile t (tile_e[t] its expert, -1: none; its pair slots
        # tile_row[t].. below tile_end[t]); GATED: out = bf16(weight * silu(min(bf16(A W_a^T), L)) *
        # clamp(bf16(A W_b^T), -L, L)), else out = bf16(A W_a^T)
        with T.Kernel(T.ceildiv(N, BN), n_tiles, threads=THREADS) as (nb, t):
            a_s = staged((BM, BK), IN)
            wa_s = staged((BN, BK // 8), "int32")
            wb_s = staged((BN, BK // 8), "int32")
            sa_s = staged((BN, K // 32), "uint8")
            sb_s = staged((BN, K // 32), "uint8")
            fa = T.alloc_fragment((BN, BK), IN)
            fb = T.alloc_fragment((BN, BK), IN)
            acc_a = T.alloc_fragment((BN, BM), "float32")
            acc_b = T.alloc_fragment((BN, BM), "float32")
            o_s = staged((BM, BN), IN)
            # the tile's expert (-1: none), first pair slot and its expert's end slot, read where used (a local
            # copy would not reach the producer warp group TileLang splits off)
            tile = (tile_e[t], tile_row[t], tile_end[t])
            if tile[0] >= 0:
                zero(acc_a)
                T.copy(s_a[tile[0], nb * BN:(nb + 1) * BN, :], sa_s)
                if GATED:
                    zero(acc_b)
                    T.copy(s_b[tile[0], nb * BN:(nb + 1) * BN, :], sb_s)
                for k in T.Pipelined(K // BK, num_stages=STAGES):
                    T.copy(a[tile[1]:tile[1] + BM, k * BK:(k + 1) * BK], a_s)
                    T.copy(w_a[tile[0], nb * BN:(nb + 1) * BN, k * (BK // 8):(k + 1) * (BK // 8)], wa_s)
                    if GATED:
                        T.copy(w_b[tile[0], nb * BN:(nb + 1) * BN, k * (BK // 8):(k + 1) * (BK // 8)], wb_s)
                    widen(wa_s, sa_s, fa, k)
                    product(fa, a_s, acc_a)
                    if GATED:
                        widen(wb_s, sb_s, fb, k)
                        product(fb, a_s, acc_b)
                # the epilogue through shared memory, transposed, so each row of the tile is stored contiguously
                for i, j in T.Parallel(BN, BM):
                    g = to_bf16(acc_a[i, j])
                    if GATED:
                        u = to_bf16(acc_b[i, j])
                        gc = T.if_then_else(limit > 0, T.min(g, limit), g)
                        uc = T.if_then_else(limit > 0, T.min(T.max(u, -limit), limit), u)
                        w = T.if_then_else(tile[1] + j < tile[2], weights[sorted_pairs[tile[1] + j]], 0.0)
                        o_s[j, i] = T.cast(to_bf16(w * (gc / (1.0 + T.exp(-gc)) * uc)), IN)
                    else:
                        o_s[j, i] = T.cast(g, IN)
                for j, i in T.Parallel(BM, BN):
                    if tile[1] + j < tile[2] and nb * BN + i < N:
                        out[tile[1] + j, nb * BN + i] = o_s[j, i]

    # no fast math: the widened code 1 (0.5) is a bf16 subnormal before its scale, which flushing would zero
    configs = {{"tirx.disable_vectorize": not cuda, tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}}
    return tilelang.compile(moe_gemm, target=target, pass_configs=configs)
'''


def kernel_name() -> str:
    """Stable kernel name of the TileLang FP4 expert GEMMs."""
    return "moe_experts.fp4.tilelang"


def launch_config(pairs: int, n_local: int, cuda: bool) -> dict[str, int] | None:
    """Row tiles (the wgmma's N: pairs of one expert) and stages for both GEMMs, or None where the Triton tiles
    serve (decode: 32 pairs an expert or fewer on CUDA). 128 weight rows a block, two consumer warp groups of 64
    rows; 64 pairs a tile up to 64 pairs an expert, else 128 (gated: two fp32 accumulators of 64 x 128 a warp
    group, its largest), and w2 256 beyond 128 pairs an expert (one widening of a weight tile serves twice the
    pairs). Timed on the H100 (``benchmarks/moe.py --backend tilelang --tiles``, NOTES 38th): 2048 tokens, 48 an
    expert, 3.27 ms at 64 against 4.04 at 128; 4096 (96), 4.42 ms at 128 against 5.07 with w2 at 256; 8192 (192),
    8.03 ms with w2 at 256 against 8.58 at 128. Small tiles on the ``c`` target."""
    if not cuda:
        return {"BM1": 16, "BM2": 16, "BN": 32, "S1": 1, "S2": 1, "threads": 128}
    per_expert = pairs / max(n_local, 1)
    if per_expert <= 32:
        return None
    if per_expert <= 64:
        return {"BM1": 64, "BM2": 64, "BN": 128, "S1": 3, "S2": 4, "threads": 256}
    if per_expert <= 128:
        return {"BM1": 128, "BM2": 128, "BN": 128, "S1": 2, "S2": 3, "threads": 256}
    return {"BM1": 128, "BM2": 256, "BN": 128, "S1": 2, "S2": 2, "threads": 256}


def source(n: int, k: int, rows: int, gated: bool, stages: int, config: dict[str, int]) -> str:
    """The kernel's generated Python source: ``n`` x ``k`` expert matrices (gate and up when ``gated``), row tiles
    of ``rows`` pairs, ``stages`` activation tiles in flight."""
    return _SOURCE.format(n=n, k=k, bm=rows, bn=config["BN"], stages=stages, threads=config["threads"], gated=gated)


def hopper_source(n: int, k: int, rows: int, gated: bool, stages: int, config: dict[str, int]) -> str:
    """The CUDA TileLang generates for the H100/H200 (sm_90a) from ``source``, lowered on any machine (no GPU)."""
    return hopper_cuda(source(n, k, rows, gated, stages, config))


def _gemm(n: int, k: int, rows: int, gated: bool, stages: int, config: dict[str, int], target: str) -> Any:
    return REGISTRY.build(kernel_name(), "tilelang", "v4compile::moe_experts",
                          lambda: source(n, k, rows, gated, stages, config),
                          lambda path: load_kernels(path, target, kernel_name()),
                          key=(target, n, k, rows, gated, stages, config["BN"], config["threads"]))


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None, s3: torch.Tensor | None,
                s2: torch.Tensor | None, fmt: str, pow2: bool, limit: float,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """TileLang body of ``v4compile::moe_experts``: FP4 experts at prefill sizes (``launch_config``) multiply in
    the TileLang GEMMs; other formats, decode sizes and experts not stored contiguously (the halves of a fused
    gate/up tensor, which the Triton kernels read in place) run the Triton body. ``config`` overrides the launch
    configuration (benchmark sweeps)."""
    triton_moe.check_experts(x, weights, ids, w1, w3, w2, s1, s3, s2, fmt)
    tokens, dim = x.shape
    top_k, n_local, inter = ids.shape[1], w1.shape[0], w1.shape[1]
    cuda = x.device.type == "cuda"
    pairs = tokens * top_k
    config = config or (launch_config(pairs, n_local, cuda) if fmt == "fp4" else None)
    whole = all(t is not None and t.is_contiguous() for t in (w1, w3, w2, s1, s3, s2))
    if config is None or not whole or dim % 128 or inter % 128 or not tokens:
        return triton_moe.moe_experts(x, weights, ids, first, w1, w3, w2, s1, s3, s2, fmt, pow2, limit)
    target = "cuda" if cuda else "c"
    compute = torch.bfloat16 if cuda else torch.float32
    gate_up = _gemm(inter, dim, config["BM1"], True, config["S1"], config, target)
    down = _gemm(dim, inter, config["BM2"], False, config["S2"], config, target)
    w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))  # 8 packed codes a word
    s1, s3, s2 = (s.view(torch.uint8) for s in (s1, s3, s2))
    x, weights, ids = x.contiguous(), weights.float().contiguous().view(-1), ids.contiguous()
    counts, order, slots = triton_moe.routing_buffers(pairs, n_local, x.device)
    gathered = torch.empty(pairs, dim, dtype=torch.bfloat16, device=x.device)
    hidden = torch.empty(pairs, inter, dtype=compute, device=x.device)
    hidden_q = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(pairs, dim, dtype=compute, device=x.device)
    y = torch.empty(tokens, dim, dtype=torch.float32, device=x.device)

    def run() -> None:
        triton_moe.route(ids, first, fmt, counts, order, slots)
        triton_moe.quantize(x, gathered, counts, pow2, fmt, "fragment", gather=(order, top_k))
        tiles = triton_moe.tile_map(counts, config["BM1"], pairs, fmt)
        gate_up(gathered.to(compute), w1, w3, s1, s3, *tiles, order, weights, hidden, float(limit))
        triton_moe.quantize(hidden.to(torch.bfloat16), hidden_q, counts, pow2, fmt, "fragment", counted=True)
        if config["BM2"] != config["BM1"]:
            tiles = triton_moe.tile_map(counts, config["BM2"], pairs, fmt)
        down(hidden_q.to(compute), w2, w2, s2, s2, *tiles, order, weights, out, float(limit))
        triton_moe.combine(ids, slots, out.to(torch.bfloat16), y, fmt, 4, 512)

    REGISTRY.launch(kernel_name(), run)
    REGISTRY.note_launch(kernel_name(), target=target, experts=n_local, pairs=pairs, **config)
    return y
