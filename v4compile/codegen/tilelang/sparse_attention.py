"""Sparse MQA with an attention sink in TileLang, for Hopper (``cuda`` target), warp-specialised as FlashMLA
lays it out: one block holds 64 query heads of one query and walks its index row 64 entries at a time. A
producer warp group gathers each entry block into one of two shared buffers with asynchronous copies (an id
outside ``[0, entries)`` copies zeros and gets a -inf score bias) and signals an mbarrier when they land; the
first consumer warp group runs the score product (wgmma), the online softmax in base 2 (the sink joins the
denominator at the end) and the value product for the first half of the value dims; the second consumer takes
the probabilities from shared memory and runs the value product for the other half. So the gather of block
t + 1, the scores of block t + 1 and the second half's value product of block t overlap. The probabilities
enter the value product as two bf16 terms, hi + lo (the model's fp32 values to about 16 bits); ``rounded_p``
keeps only hi, as the official kernels do. When batch x head blocks cannot fill the GPU the rounds of 128
entries are split over several blocks whose partial softmax states a second kernel combines.

The ``c`` target has no tensor-core products, so on the CPU (and for other dtypes or head dims) this op runs its
Triton kernel, and ``implementation_backend`` names Triton there.
"""

from __future__ import annotations

import torch

from ..padding import with_padded_heads
from ..registry import REGISTRY
from ..triton import sparse_attention as triton_attention
from .common import load_kernels

BLOCK_H = 64
"""Query heads per block: the wgmma tile height (fewer heads are padded with zero queries)."""

ROUND = 128
"""Entries per producer round (its buffers of block_k entries each, filled in turn): the unit the splits share
out and the index is padded to."""

_SOURCE = '''
import tilelang
import tilelang.language as T

DIM = {dim}
HALF = DIM // 2
BLOCK_H = {block_h}
BLOCK_K = {block_k}
BUFFERS = {round} // BLOCK_K  # entry blocks in flight: a round of BUFFERS blocks
SPLITS = {splits}
ROUNDED_P = {rounded_p}
IDS = "{ids}"
LOG2E = 1.4426950408889634
START = -(2.0**30)  # the running maximum's start: finite, so no step computes -inf - -inf
CHUNKS = BLOCK_K * HALF // 8 // 128  # 16-byte copies per producer thread per half of an entry block
Q_CHUNKS = BLOCK_H * HALF // 8 // 128  # the same for the queries


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
        # block (s, b, hs): query s of row b, head block hs // SPLITS, the 128-entry rounds of split
        # hs % SPLITS.
        # Threads 0-127 (scorer): scores, softmax, probabilities to shared memory, value dims [0, HALF);
        # threads 128-255 (second consumer): value dims [HALF, DIM); threads 256-383 (producer): the queries,
        # then the entries of the next blocks into BUFFERS buffers (each block's full barrier: the copies
        # landing and the producer's plain arrival after writing the block's score bias).
        with T.Kernel(seqlen, batch, T.ceildiv(heads, BLOCK_H) * SPLITS, threads=384) as (s, b, hs):
            q_l = T.alloc_shared((BLOCK_H, HALF), "bfloat16")
            q_r = T.alloc_shared((BLOCK_H, HALF), "bfloat16")
            p_hi = T.alloc_shared((BLOCK_H, BLOCK_K), "bfloat16")
            p_lo = T.alloc_shared((BLOCK_H, BLOCK_K), "bfloat16")
            alpha_s = T.alloc_shared((BLOCK_H,), "float32")
            factor_s = T.alloc_shared((BLOCK_H,), "float32")
            score = T.alloc_fragment((BLOCK_H, BLOCK_K), "float32")
            acc_l = T.alloc_fragment((BLOCK_H, HALF), "float32")
            acc_r = T.alloc_fragment((BLOCK_H, HALF), "float32")
            m = T.alloc_fragment((BLOCK_H,), "float32")
            m_prev = T.alloc_fragment((BLOCK_H,), "float32")
            l = T.alloc_fragment((BLOCK_H,), "float32")
            total = T.alloc_fragment((BLOCK_H,), "float32")
            alpha = T.alloc_fragment((BLOCK_H,), "float32")
            rescale = T.alloc_fragment((BLOCK_H,), "float32")
            q_ready = T.alloc_barrier(arrive_count=128)
            p_full = T.alloc_barrier(arrive_count=128)
            p_empty = T.alloc_barrier(arrive_count=128)
            done = T.alloc_barrier(arrive_count=128)
            tx = T.get_thread_binding()
            h0 = hs // SPLITS * BLOCK_H
            split = hs % SPLITS
            rounds = T.ceildiv(k_total, BUFFERS * BLOCK_K)
            per_split = T.ceildiv(rounds, SPLITS)
            first = split * per_split
            count = T.max(T.min(rounds - first, per_split), 0)

            # per buffer: its index in the round, entries (two halves of the dims), score bias, full and empty
            # barriers (full: the producer's copies landing + its arrival after the bias; empty: both consumers)
            buffers = [(j, T.alloc_shared((BLOCK_K, HALF), "bfloat16"), T.alloc_shared((BLOCK_K, HALF), "bfloat16"),
                        T.alloc_shared((BLOCK_K,), "float32"), T.alloc_barrier(arrive_count=256),
                        T.alloc_barrier(arrive_count=256)) for j in range(BUFFERS)]
            if tx < 128:
                T.set_max_nreg(240, 1)
                T.fill(acc_l, 0.0)
                T.fill(m, START)
                T.fill(l, 0.0)
                T.barrier_wait(q_ready, 0)
                for i in T.serial(count):
                    for j, kv_l, kv_r, bias, full, empty in buffers:
                        # block t: scores, online softmax, probabilities out, value dims [0, HALF)
                        t = BUFFERS * i + j
                        T.barrier_wait(full, i & 1)
                        T.fence_proxy_async()
                        T.gemm(q_l, kv_l, score, transpose_B=True, clear_accum=True)
                        T.gemm(q_r, kv_r, score, transpose_B=True)
                        for h, c in T.Parallel(BLOCK_H, BLOCK_K):
                            score[h, c] = score[h, c] * (scale * LOG2E) + bias[c]
                        T.copy(m, m_prev)
                        T.reduce_max(score, m, dim=1, clear=False)
                        for h in T.Parallel(BLOCK_H):
                            alpha[h] = T.exp2(m_prev[h] - m[h])
                        for h, c in T.Parallel(BLOCK_H, BLOCK_K):
                            score[h, c] = T.exp2(score[h, c] - m[h])
                        T.reduce_sum(score, total, dim=1)
                        for h in T.Parallel(BLOCK_H):
                            l[h] = l[h] * alpha[h] + total[h]
                        for h, d in T.Parallel(BLOCK_H, HALF):
                            acc_l[h, d] *= alpha[h]
                        T.barrier_wait(p_empty, (t & 1) ^ 1)
                        for h in T.Parallel(BLOCK_H):
                            alpha_s[h] = alpha[h]
                        for h, c in T.Parallel(BLOCK_H, BLOCK_K):
                            p_hi[h, c] = T.cast(score[h, c], "bfloat16")
                            if not ROUNDED_P:
                                p_lo[h, c] = T.cast(score[h, c] - T.cast(T.cast(score[h, c], "bfloat16"), "float32"),
                                                    "bfloat16")
                        T.barrier_arrive(p_full)
                        T.gemm(p_hi, kv_l, acc_l)
                        if not ROUNDED_P:
                            T.gemm(p_lo, kv_l, acc_l)
                        T.barrier_arrive(empty)
                if SPLITS == 1:
                    # the sink joins the denominator; the normalised rows go out through the queries' buffer
                    for h in T.Parallel(BLOCK_H):
                        top = T.max(m[h], sink[h0 + h] * LOG2E)
                        alpha[h] = T.exp2(m[h] - top) / (l[h] * T.exp2(m[h] - top) + T.exp2(sink[h0 + h] * LOG2E - top))
                        factor_s[h] = alpha[h]
                    T.barrier_arrive(done)
                    for h, d in T.Parallel(BLOCK_H, HALF):
                        q_l[h, d] = T.cast(acc_l[h, d] * alpha[h], "bfloat16")
                    T.copy(q_l, out[b, s, h0:h0 + BLOCK_H, 0:HALF])
                else:
                    for h, d in T.Parallel(BLOCK_H, HALF):
                        part[b, s, h0 + h, split, d] = acc_l[h, d]
                    for h in T.Parallel(BLOCK_H):
                        part[b, s, h0 + h, split, DIM] = m[h]
                        part[b, s, h0 + h, split, DIM + 1] = l[h]
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0.0)
                T.barrier_wait(q_ready, 0)
                for i in T.serial(count):
                    for j, kv_l, kv_r, bias, full, empty in buffers:
                        # block t: the scorer's probabilities times value dims [HALF, DIM)
                        t = BUFFERS * i + j
                        T.barrier_wait(p_full, t & 1)
                        T.barrier_wait(full, i & 1)
                        T.fence_proxy_async()
                        for h in T.Parallel(BLOCK_H):
                            rescale[h] = alpha_s[h]
                        for h, d in T.Parallel(BLOCK_H, HALF):
                            acc_r[h, d] *= rescale[h]
                        T.gemm(p_hi, kv_r, acc_r)
                        if not ROUNDED_P:
                            T.gemm(p_lo, kv_r, acc_r)
                        T.barrier_arrive(p_empty)
                        T.barrier_arrive(empty)
                if SPLITS == 1:
                    T.barrier_wait(done, 0)  # also: the scorer's last product has read the queries
                    for h in T.Parallel(BLOCK_H):
                        rescale[h] = factor_s[h]
                    for h, d in T.Parallel(BLOCK_H, HALF):
                        q_r[h, d] = T.cast(acc_r[h, d] * rescale[h], "bfloat16")
                    T.copy(q_r, out[b, s, h0:h0 + BLOCK_H, HALF:DIM])
                else:
                    for h, d in T.Parallel(BLOCK_H, HALF):
                        part[b, s, h0 + h, split, HALF + d] = acc_r[h, d]
            else:
                T.set_max_nreg(80, 0)
                for c in T.serial(Q_CHUNKS):
                    chunk = c * 128 + tx - 256
                    row = chunk // (HALF // 8)
                    col = chunk % (HALF // 8) * 8
                    T.ptx_cp_async(T.access_ptr(q_l[row, col], "w", 8), T.access_ptr(q[b, s, h0 + row, col], "r", 8), 8)
                    T.ptx_cp_async(T.access_ptr(q_r[row, col], "w", 8),
                                   T.access_ptr(q[b, s, h0 + row, HALF + col], "r", 8), 8)
                T.cp_async_barrier_noinc(q_ready)
                for i in T.serial(count):
                    for j, kv_l, kv_r, bias, full, empty in buffers:
                        # block t's entries into buffer j (an id outside [0, entries) copies zeros) and their
                        # score bias (0, or -inf for such ids) for the scorer
                        k0 = ((first + i) * BUFFERS + j) * BLOCK_K
                        T.barrier_wait(empty, (i & 1) ^ 1)
                        for c in T.serial(CHUNKS):
                            chunk = c * 128 + tx - 256
                            row = chunk // (HALF // 8)
                            col = chunk % (HALF // 8) * 8
                            entry = index[b, s, k0 + row]
                            valid = (entry >= 0) & (entry < entries)
                            safe = T.if_then_else(valid, entry, 0)
                            T.ptx_cp_async(T.access_ptr(kv_l[row, col], "w", 8), T.access_ptr(kv[b, safe, col], "r", 8),
                                           8, valid)
                            T.ptx_cp_async(T.access_ptr(kv_r[row, col], "w", 8),
                                           T.access_ptr(kv[b, safe, HALF + col], "r", 8), 8, valid)
                        if tx < 256 + BLOCK_K:
                            entry = index[b, s, k0 + tx - 256]
                            bias[tx - 256] = T.if_then_else((entry >= 0) & (entry < entries), 0.0,
                                                            -T.infinity("float32"))
                        T.cp_async_barrier_noinc(full)
                        T.barrier_arrive(full)

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
    """64 entries a block, so two buffers of them (32-entry blocks in four buffers measured no faster on the
    H200: 59.4 vs 60.8 us at 128 rows, slower below); the 128-entry rounds split over blocks until about one
    block per SM (``sms``, 132 on the H200), as many as leave every split a round."""
    blocks = rows * -(-heads // BLOCK_H)
    rounds = -(-k_total // ROUND)
    splits = max(1, min(sms // max(1, blocks), rounds, 16))
    per_split = -(-rounds // splits) if rounds else 1
    return {"block_k": 64, "splits": max(1, -(-rounds // per_split))}


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
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernel writes it
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
        lambda: _SOURCE.format(dim=dim, block_h=BLOCK_H, round=ROUND, rounded_p=rounded_p, ids=ids, **config),
        lambda path: load_kernels(path, "cuda", name), key=(ids, *sorted(config.items())))
    q, kv = q.contiguous(), kv.contiguous()
    # ids as given (int32 or int64, compared with the entry count in their own width), padded with -1 to whole
    # rounds of 128 entries when needed, so that every block reads ids of its own query
    k_total = index.shape[-1]
    whole = -(-k_total // ROUND) * ROUND
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

