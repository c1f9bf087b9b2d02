"""Sparse MQA with an attention sink in TileLang, for Hopper (``cuda`` target): one block holds 64 query heads
of one query and walks its index row BLOCK_K entries at a time. The entries are gathered into shared memory by
asynchronous copies a stage ahead (an id outside ``[0, entries)`` copies zeros), both products run on the tensor
cores (wgmma) with the two warp groups splitting the entries of the scores and the value dims of the
[64, 512] fp32 accumulator (the layout FlashMLA uses), and an online softmax in base 2 keeps the sink in the
denominator. The probabilities enter the value product as two bf16 terms, hi + lo (the model's fp32 values to
about 16 bits); ``rounded_p`` keeps only hi, as the official kernels do. When batch x head blocks cannot fill the
GPU the entries are split over several blocks whose partial softmax states a second kernel combines.

The ``c`` target has no tensor-core products, so on the CPU (and for other dtypes or head dims) this op runs its
Triton kernel, and ``implementation_backend`` names Triton there.
"""

from __future__ import annotations

import torch

from ..ops import with_padded_heads
from ..registry import REGISTRY
from ..triton import sparse_attention as triton_attention
from .common import load_kernels

BLOCK_H = 64
"""Query heads per block: the wgmma tile height (fewer heads are padded with zero queries)."""

_SOURCE = '''
import tilelang
import tilelang.language as T

DIM = {dim}
BLOCK_H = {block_h}
BLOCK_K = {block_k}
STAGES = {stages}
THREADS = {threads}
SPLITS = {splits}
ROUNDED_P = {rounded_p}
IDS = "{ids}"
LOG2E = 1.4426950408889634


def build(target):
    batch, seqlen, heads = T.dynamic("batch"), T.dynamic("seqlen"), T.dynamic("heads")
    entries, k_total = T.dynamic("entries"), T.dynamic("k_total")
    # the partial softmax states of the splits (a placeholder without splits)
    part_shape = (batch, seqlen, heads, SPLITS, DIM + 2) if SPLITS > 1 else (1,)

    @T.prim_func
    def attend(q: T.Tensor((batch, seqlen, heads, DIM), "bfloat16"), kv: T.Tensor((batch, entries, DIM), "bfloat16"),
               index: T.Tensor((batch, seqlen, k_total), IDS), sink: T.Tensor((heads,), "float32"),
               scale: T.float32, out: T.Tensor((batch, seqlen, heads, DIM), "bfloat16"),
               part: T.Tensor(part_shape, "float32")):
        # block (s, b, hs): query s of row b, head block hs // SPLITS, entry blocks of split hs % SPLITS
        with T.Kernel(seqlen, batch, T.ceildiv(heads, BLOCK_H) * SPLITS, threads=THREADS) as (s, b, hs):
            q_s = T.alloc_shared((BLOCK_H, DIM), "bfloat16")
            kv_s = T.alloc_shared((BLOCK_K, DIM), "bfloat16")
            p_s = T.alloc_shared((BLOCK_H, BLOCK_K), "bfloat16")
            p_lo_s = T.alloc_shared((BLOCK_H, BLOCK_K), "bfloat16")
            score = T.alloc_fragment((BLOCK_H, BLOCK_K), "float32")
            acc = T.alloc_fragment((BLOCK_H, DIM), "float32")
            m = T.alloc_fragment((BLOCK_H,), "float32")
            m_prev = T.alloc_fragment((BLOCK_H,), "float32")
            l = T.alloc_fragment((BLOCK_H,), "float32")
            total = T.alloc_fragment((BLOCK_H,), "float32")
            alpha = T.alloc_fragment((BLOCK_H,), "float32")
            h0 = hs // SPLITS * BLOCK_H
            blocks = T.ceildiv(k_total, BLOCK_K)
            per_split = T.ceildiv(blocks, SPLITS)
            first = hs % SPLITS * per_split
            T.copy(q[b, s, h0:h0 + BLOCK_H, :], q_s)
            T.fill(acc, 0.0)
            T.fill(m, -T.infinity("float32"))
            T.fill(l, 0.0)
            for kb in T.Pipelined(T.max(T.min(blocks - first, per_split), 0), num_stages=STAGES):
                k0 = (first + kb) * BLOCK_K
                for i, d in T.Parallel(BLOCK_K, DIM):
                    kv_s[i, d] = kv[b, index[b, s, k0 + i], d]
                T.gemm(q_s, kv_s, score, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for h, i in T.Parallel(BLOCK_H, BLOCK_K):
                    score[h, i] = T.if_then_else((index[b, s, k0 + i] >= 0) & (index[b, s, k0 + i] < entries),
                                                 score[h, i] * (scale * LOG2E), -T.infinity("float32"))
                T.copy(m, m_prev)
                T.reduce_max(score, m, dim=1, clear=False)
                for h in T.Parallel(BLOCK_H):
                    alpha[h] = T.if_then_else(m[h] == -T.infinity("float32"), 1.0, T.exp2(m_prev[h] - m[h]))
                for h, i in T.Parallel(BLOCK_H, BLOCK_K):
                    score[h, i] = T.if_then_else(m[h] == -T.infinity("float32"), 0.0, T.exp2(score[h, i] - m[h]))
                T.reduce_sum(score, total, dim=1)
                for h in T.Parallel(BLOCK_H):
                    l[h] = l[h] * alpha[h] + total[h]
                for h, d in T.Parallel(BLOCK_H, DIM):
                    acc[h, d] *= alpha[h]
                for h, i in T.Parallel(BLOCK_H, BLOCK_K):
                    p_s[h, i] = T.cast(score[h, i], "bfloat16")
                    if not ROUNDED_P:
                        p_lo_s[h, i] = T.cast(score[h, i] - T.cast(T.cast(score[h, i], "bfloat16"), "float32"),
                                              "bfloat16")
                T.gemm(p_s, kv_s, acc, policy=T.GemmWarpPolicy.FullCol)
                if not ROUNDED_P:
                    T.gemm(p_lo_s, kv_s, acc, policy=T.GemmWarpPolicy.FullCol)
            if SPLITS == 1:
                for h, d in T.Parallel(BLOCK_H, DIM):
                    if h0 + h < heads:
                        top = T.max(m[h], sink[h0 + h] * LOG2E)
                        out[b, s, h0 + h, d] = T.cast(acc[h, d] * T.exp2(m[h] - top) / (
                            l[h] * T.exp2(m[h] - top) + T.exp2(sink[h0 + h] * LOG2E - top)), "bfloat16")
            else:
                for h, d in T.Parallel(BLOCK_H, DIM):
                    if h0 + h < heads:
                        part[b, s, h0 + h, hs % SPLITS, d] = acc[h, d]
                        if d == 0:
                            part[b, s, h0 + h, hs % SPLITS, DIM] = m[h]
                            part[b, s, h0 + h, hs % SPLITS, DIM + 1] = l[h]

    @T.prim_func
    def combine(sink: T.Tensor((heads,), "float32"), out: T.Tensor((batch, seqlen, heads, DIM), "bfloat16"),
                part: T.Tensor((batch, seqlen, heads, SPLITS, DIM + 2), "float32")):
        # one block per query head: the splits' states merged, then the sink
        with T.Kernel(seqlen, batch, heads, threads=128) as (s, b, h):
            top = T.alloc_local((1,), "float32")
            denominator = T.alloc_local((1,), "float32")
            top[0] = sink[h] * LOG2E
            for j in T.serial(SPLITS):
                top[0] = T.max(top[0], part[b, s, h, j, DIM])
            denominator[0] = T.exp2(sink[h] * LOG2E - top[0])
            for j in T.serial(SPLITS):
                denominator[0] += part[b, s, h, j, DIM + 1] * T.exp2(part[b, s, h, j, DIM] - top[0])
            value = T.alloc_fragment((DIM,), "float32")
            for d in T.Parallel(DIM):
                value[d] = 0.0
                for j in T.serial(SPLITS):
                    value[d] += part[b, s, h, j, d] * T.exp2(part[b, s, h, j, DIM] - top[0])
                out[b, s, h, d] = T.cast(value[d] / denominator[0], "bfloat16")

    configs = {{tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
               tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}}
    return (tilelang.compile(attend, target=target, pass_configs=configs),
            tilelang.compile(combine, target=target, pass_configs=configs) if SPLITS > 1 else None)
'''


def kernel_name(dim: int, rounded_p: bool = False) -> str:
    """Stable kernel name, e.g. ``sparse_attention.d512.bf16dot.tilelang`` (``.roundedp`` for one-term P)."""
    return f"sparse_attention.d{dim}.bf16dot{'.roundedp' if rounded_p else ''}.tilelang"


def takes(q: torch.Tensor) -> bool:
    """Whether the TileLang kernel takes these queries: bf16 on a CUDA device, head dim 64..512, a power of
    two (the shared-memory budget holds 64 queries and two entry blocks of it)."""
    dim = q.shape[-1]
    return q.device.type == "cuda" and q.dtype == torch.bfloat16 and 64 <= dim <= 512 and dim & (dim - 1) == 0


def runs_here(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the TileLang kernel runs for these queries and entries (bf16 entries too)."""
    return takes(q) and kv.dtype == torch.bfloat16


def launch_config(rows: int, heads: int, k_total: int, sms: int = 132) -> dict[str, int]:
    """64 entries a step through two stages with 256 threads (more stages do not build with a loop count
    known only at run time); the entries split over blocks until about one block per SM (``sms``, 132 on the
    H200)."""
    blocks = rows * -(-heads // BLOCK_H)
    steps = -(-k_total // 64)
    splits = max(1, min(sms // max(1, blocks), steps, 16))
    return {"block_k": 64, "stages": 2, "threads": 256, "splits": splits}


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor, scale: float,
                     config: dict[str, int] | None = None, rounded_p: bool = False) -> torch.Tensor:
    """TileLang body of ``v4compile::sparse_attention``: q [B,S,H,d], kv [B,N,d], sink [H], index [B,S,K]
    (ids outside ``[0, N)`` masked: their entries are copied as zeros and their scores are -inf). Inputs the
    kernel does not take (see ``runs_here``) run the Triton kernel. ``config`` overrides the launch
    configuration (benchmark sweeps); ``rounded_p`` keeps one bf16 term of the probabilities."""
    if not runs_here(q, kv):
        return triton_attention.sparse_attention(q, kv, sink, index, scale, rounded_p=rounded_p)
    bsz, seqlen, heads, dim = q.shape
    if heads % BLOCK_H:  # zero queries (and sinks) up to the tile; heads are independent
        return with_padded_heads(lambda padded_q, padded_sink: sparse_attention(
            padded_q, kv, padded_sink, index, scale, config, rounded_p), q, sink, BLOCK_H)
    out = torch.empty_like(q)
    if not out.numel():
        return out
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    config = config or launch_config(bsz * seqlen, heads, index.shape[-1], sms)
    name = kernel_name(dim, rounded_p)
    if index.dtype not in (torch.int32, torch.int64):
        index = index.long()
    ids = str(index.dtype).removeprefix("torch.")
    attend, combine = REGISTRY.build(
        name, "tilelang", "v4compile::sparse_attention",
        lambda: _SOURCE.format(dim=dim, block_h=BLOCK_H, rounded_p=rounded_p, ids=ids, **config),
        lambda path: load_kernels(path, "cuda", name), key=(ids, *sorted(config.items())))
    q, kv = q.contiguous(), kv.contiguous()
    # ids as given (int32 or int64, compared with the entry count in their own width), padded with -1 to whole
    # entry blocks when needed, so that every block reads ids of its own query
    k_total = index.shape[-1]
    whole = -(-k_total // config["block_k"]) * config["block_k"]
    if whole == k_total:
        padded_index = index.contiguous()
    else:
        padded_index = torch.full((bsz, seqlen, whole), -1, dtype=index.dtype, device=q.device)
        padded_index[..., :k_total] = index
    splits = config["splits"]
    part_shape = (bsz, seqlen, heads, splits, dim + 2) if splits > 1 else (1,)
    part = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    sink = sink.float().contiguous()

    def run() -> None:
        attend(q, kv, padded_index, sink, float(scale), out, part)
        if combine is not None:
            combine(sink, out, part)

    REGISTRY.launch(name, run)
    REGISTRY.note_launch(name, grid=(seqlen, bsz, -(-heads // BLOCK_H) * splits), entries=k_total, **config)
    return out

