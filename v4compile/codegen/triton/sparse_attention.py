"""Sparse MQA with an attention sink in Triton: each query row gathers the KV entries named by its index
row (-1 masked), scores all heads of a head block against them at once (one KV entry serves as key and
value), and keeps an online softmax whose denominator also holds the per-head sink.

bf16 inputs use tensor-core dots with fp32 accumulation; the probabilities enter the value product as
the sum of two bf16 terms, which keeps the model's fp32 numerics (the official kernels round them to one
bf16 term: ``rounded_p=True``, kept for the benchmark's comparison); other dtypes use exact fp32 dots. When batch x
head blocks cannot fill the GPU (small decode batches), the entries are split over several programs whose
partial softmax states a second kernel combines (split-K, "flash decoding"). The paged variant reads the
window keys and the entries on the serving engine's shared pages where they live: an id below the window's
length names a window key, the others an entry found through the row's page table.
"""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import ROUND_BF16, load_triton_module, lowered_text

_SOURCE = '''
import triton
import triton.language as tl

DIM = tl.constexpr({dim})
LOW = tl.constexpr({low})
ROUNDED_P = tl.constexpr({rounded_p})
DOT = tl.{dot}
PRECISION = tl.constexpr("{precision}")
PAGED = tl.constexpr({paged})
''' + ROUND_BF16 + '''


@triton.jit
def sparse_attention(Q, KV, WIN, TABLE, SINK, INDEX, OUT, PART, seqlen, heads, n_entries, n_window, per_page,
                     k_total, per_split, scale, s_qb, s_qs, s_qh, s_kvb, s_kvn, s_wb, s_wn, s_tb, s_ib, s_is,
                     s_ob, s_os, s_oh, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                     ALIGNED: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(2)
    b = row // seqlen
    s = row % seqlen
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < heads
    d = tl.arange(0, DIM)
    q = tl.load(Q + b * s_qb + s * s_qs + h[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(DOT)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DIM], tl.float32)
    k_begin = split * per_split
    k_end = tl.minimum(k_total, k_begin + per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(INDEX + b * s_ib + s * s_is + kk, mask=kk < k_end, other=-1)
        valid = (idx >= 0) & (idx < n_entries)
        if PAGED:
            # id < n_window: window key WIN[b, id]; else entry id - n_window, on page TABLE[b, entry // per_page]
            entry = tl.maximum(idx - n_window, 0)
            paged = valid & (idx >= n_window)
            page = tl.load(TABLE + b * s_tb + entry // per_page, mask=paged, other=0).to(tl.int64)
            where = tl.where(paged[:, None], KV + (page * per_page + entry % per_page)[:, None] * s_kvn,
                             WIN + b * s_wb + idx[:, None] * s_wn) + d[None, :]
            if ALIGNED:
                # the select hides that every row starts 16-byte aligned: without the hint Triton 3.9 loads the
                # rows two bytes at a time, unpipelined (tests/codegen: the sm_90 lowering)
                where = tl.multiple_of(where, [1, 16])
        else:
            where = KV + b * s_kvb + idx[:, None] * s_kvn + d[None, :]
        kv = tl.load(where, mask=valid[:, None], other=0.0)
        kv = kv.to(DOT)
        scores = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if LOW:
            # p = hi + lo, both bf16: two tensor-core products keep p to about 16 bits (the model's fp32
            # probabilities within 1e-5); ROUNDED_P keeps only hi, as the official kernels do
            p_hi = _round_bf16(p)
            acc += tl.dot(p_hi.to(DOT), kv, input_precision=PRECISION)
            if not ROUNDED_P:
                acc += tl.dot((p - p_hi).to(DOT), kv, input_precision=PRECISION)
        else:
            acc += tl.dot(p.to(DOT), kv, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:
        _finish(SINK, OUT, m, l, acc, h, hmask, d, b * s_ob + s * s_os, s_oh)
    else:
        # partial state per (row, head, split): DIM accumulator values, then m and l
        base = ((row * heads + h) * SPLITS + split) * (DIM + 2)
        tl.store(PART + base[:, None] + d[None, :], acc, mask=hmask[:, None])
        tl.store(PART + base + DIM, m, mask=hmask)
        tl.store(PART + base + DIM + 1, l, mask=hmask)


@triton.jit
def _finish(SINK, OUT, m, l, acc, h, hmask, d, out_base, s_oh):
    sink = tl.load(SINK + h, mask=hmask, other=0.0).to(tl.float32)
    m_safe = tl.where(m == float("-inf"), sink, tl.maximum(m, sink))
    denominator = l * tl.exp(m - m_safe) + tl.exp(sink - m_safe)
    out = acc * (tl.exp(m - m_safe) / denominator)[:, None]
    tl.store(OUT + out_base + h[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def sparse_attention_combine(SINK, OUT, PART, seqlen, heads, s_ob, s_os, s_oh,
                             BLOCK_H: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    b = row // seqlen
    s = row % seqlen
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < heads
    d = tl.arange(0, DIM)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DIM], tl.float32)
    for split in range(SPLITS):
        base = ((row * heads + h) * SPLITS + split) * (DIM + 2)
        m_part = tl.load(PART + base + DIM, mask=hmask, other=float("-inf"))
        l_part = tl.load(PART + base + DIM + 1, mask=hmask, other=0.0)
        acc_part = tl.load(PART + base[:, None] + d[None, :], mask=hmask[:, None], other=0.0)
        m_new = tl.maximum(m, m_part)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_part - m_safe)
        l = l * alpha + l_part * beta
        acc = acc * alpha[:, None] + acc_part * beta[:, None]
        m = m_new
    _finish(SINK, OUT, m, l, acc, h, hmask, d, b * s_ob + s * s_os, s_oh)
'''


def kernel_name(dim: int, low: bool, rounded_p: bool = False, paged: bool = False) -> str:
    """Stable kernel name, e.g. ``sparse_attention.d512.bf16dot.triton`` (``.roundedp`` for one-term P;
    ``sparse_attention_paged.d512.bf16dot.triton`` for window keys plus entries on pages)."""
    op = "sparse_attention_paged" if paged else "sparse_attention"
    return f"{op}.d{dim}.{'bf16dot' if low else 'fp32dot'}{'.roundedp' if rounded_p else ''}.triton"


def launch_config(rows: int, heads: int, k_total: int, cuda: bool) -> dict[str, int]:
    """Head block by batch (16 heads while rows are few, else 32: 64-head blocks spill the two-term
    probabilities' registers, 2-4x slower), 64 entries a step (32 with 4 warps from 128 rows), and the
    entries split over up to 4 programs while rows x head blocks stay under about 128 programs (H200 sweep
    of 48 configs at 16/64/128 rows: more splits cost more in the combine than they gain)."""
    if not cuda:
        return {"BLOCK_H": min(16, max(16, triton_next_pow2(heads))), "BLOCK_K": 16, "SPLITS": 1, "num_warps": 4}
    block_h = min(16 if rows < 32 else 32, max(16, triton_next_pow2(heads)))
    programs = rows * triton.cdiv(heads, block_h)
    splits = max(1, min(4, 128 // programs, triton.cdiv(k_total, 64)))
    wide = rows >= 128
    return {"BLOCK_H": block_h, "BLOCK_K": 32 if wide else 64, "SPLITS": splits, "num_warps": 4 if wide else 8}


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor,
                     scale: float, config: dict[str, int] | None = None, rounded_p: bool = False) -> torch.Tensor:
    """Triton body of ``v4compile::sparse_attention``: q [B,S,H,d], kv [B,N,d], sink [H], index [B,S,K].
    ``config`` overrides the launch configuration (benchmark sweeps); ``rounded_p`` rounds the probabilities
    to one bf16 term as the official kernels do (benchmark comparison; the op keeps the model's numerics)."""
    return _attend(q, kv, None, None, sink, index, scale, config, rounded_p)


def sparse_attention_paged(q: torch.Tensor, window: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
                           sink: torch.Tensor, index: torch.Tensor, scale: float,
                           config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::sparse_attention_paged``: window [B,W,d], entries on pages pool [P,E,d] with
    table [B,pages] (row b's entries ``pool[table[b]]``), ids below W naming window keys."""
    return _attend(q, pool, window, table, sink, index, scale, config, False)


def _attend(q: torch.Tensor, kv: torch.Tensor, window: torch.Tensor | None, table: torch.Tensor | None,
            sink: torch.Tensor, index: torch.Tensor, scale: float, config: dict[str, int] | None,
            rounded_p: bool) -> torch.Tensor:
    bsz, seqlen, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the sparse attention kernel needs a power-of-two head dim >= 16, got {dim}")
    paged = window is not None and table is not None
    low = q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and (window is None or window.dtype == kv.dtype)
    cuda = q.device.type == "cuda"
    # Triton's CPU interpreter cannot multiply bf16 tensors: there the bf16 operands are widened to fp32,
    # which gives the same products (exact in fp32) and the same fp32 accumulation.
    dot = "bfloat16" if low and cuda else "float32"
    name = kernel_name(dim, low, rounded_p, paged)
    module = REGISTRY.build(name, "triton", "v4compile::sparse_attention" + ("_paged" if paged else ""),
                            lambda: _SOURCE.format(dim=dim, low=low, dot=dot, precision="ieee", rounded_p=rounded_p,
                                                   paged=paged),
                            lambda path: load_triton_module(path, not cuda), key=(cuda, low))
    q, kv, index = q.contiguous(), kv.contiguous(), index.contiguous()
    if paged:
        window, table = window.contiguous(), table.contiguous()
        n_window, per_page = window.shape[1], kv.shape[1]
        n_entries, s_tb = n_window + table.shape[1] * per_page, table.stride(0)
        kv = kv.flatten(0, 1).unsqueeze(0)
    else:
        window, table, n_window, per_page, n_entries, s_tb = kv, index, 0, 1, kv.shape[1], 0
    # rows of 16-byte-aligned tensors whose rows are whole multiples of 16 bytes (dim is a power of two >= 16)
    aligned = paged and kv.data_ptr() % 16 == 0 and window.data_ptr() % 16 == 0
    out = torch.empty_like(q)
    k_total = index.shape[-1]
    rows = bsz * seqlen
    config = config or launch_config(rows, heads, k_total, cuda)
    block_h, splits = config["BLOCK_H"], config["SPLITS"]
    per_split = triton.cdiv(triton.cdiv(k_total, splits), config["BLOCK_K"]) * config["BLOCK_K"]
    part = torch.empty(rows * heads * splits * (dim + 2) if splits > 1 else 1, dtype=torch.float32,
                       device=q.device)
    sink = sink.float().contiguous()
    if out.numel():
        def run() -> None:
            grid = (rows, triton.cdiv(heads, block_h), splits)
            module.sparse_attention[grid](
                q, kv, window, table, sink, index, out, part, seqlen, heads, n_entries, n_window, per_page, k_total,
                per_split, scale, q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
                window.stride(0), window.stride(1), s_tb, index.stride(0), index.stride(1), out.stride(0),
                out.stride(1), out.stride(2), BLOCK_H=block_h, BLOCK_K=config["BLOCK_K"], SPLITS=splits,
                ALIGNED=aligned, num_warps=config["num_warps"])
            if splits > 1:
                module.sparse_attention_combine[(rows, triton.cdiv(heads, block_h))](
                    sink, out, part, seqlen, heads, out.stride(0), out.stride(1), out.stride(2),
                    BLOCK_H=block_h, SPLITS=splits, num_warps=config["num_warps"])

        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, grid=(rows, triton.cdiv(heads, block_h), splits), entries=k_total, **config)
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.sparse_attention) or "")
    return out
