"""Sparse MQA with an attention sink in Triton: each query row gathers the KV entries named by its index
row (-1 masked), scores all heads of a head block against them at once (one KV entry serves as key and
value), and keeps an online softmax whose denominator also holds the per-head sink."""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import load_triton_module, lowered_text

_SOURCE = '''
import triton
import triton.language as tl

DIM = tl.constexpr({dim})


@triton.jit
def sparse_attention(Q, KV, SINK, INDEX, OUT, seqlen, heads, n_entries, k_total, scale,
                     s_qb, s_qs, s_qh, s_kvb, s_kvn, s_ib, s_is, s_ob, s_os, s_oh,
                     BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    b = row // seqlen
    s = row % seqlen
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < heads
    d = tl.arange(0, DIM)
    q = tl.load(Q + b * s_qb + s * s_qs + h[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DIM], tl.float32)
    for k0 in range(0, k_total, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(INDEX + b * s_ib + s * s_is + kk, mask=kk < k_total, other=-1)
        valid = (idx >= 0) & (idx < n_entries)
        kv = tl.load(KV + b * s_kvb + idx[:, None] * s_kvn + d[None, :], mask=valid[:, None], other=0.0)
        kv = kv.to(tl.float32)
        scores = tl.dot(q, tl.trans(kv)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, kv)
        m = m_new
    sink = tl.load(SINK + h, mask=hmask, other=0.0).to(tl.float32)
    m_safe = tl.where(m == float("-inf"), sink, m)
    denominator = l * tl.exp(m - m_safe) + tl.exp(sink - m_safe)
    out = acc * tl.exp(m - m_safe)[:, None] / denominator[:, None]
    tl.store(OUT + b * s_ob + s * s_os + h[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=hmask[:, None])
'''


def kernel_name(dim: int) -> str:
    """Stable kernel name, e.g. ``sparse_attention.d512.triton``."""
    return f"sparse_attention.d{dim}.triton"


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Triton body of ``v4compile::sparse_attention``: q [B,S,H,d], kv [B,N,d], sink [H], index [B,S,K]."""
    bsz, seqlen, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the sparse attention kernel needs a power-of-two head dim >= 16, got {dim}")
    cuda = q.device.type == "cuda"
    name = kernel_name(dim)
    module = REGISTRY.build(name, "triton", "v4compile::sparse_attention", lambda: _SOURCE.format(dim=dim),
                            lambda path: load_triton_module(path, not cuda), key=cuda)
    q, kv, index = q.contiguous(), kv.contiguous(), index.contiguous()
    out = torch.empty_like(q)
    block_h = min(64 if cuda else 16, max(16, triton_next_pow2(heads)))
    block_k = 32 if cuda else 16
    grid = (bsz * seqlen, triton.cdiv(heads, block_h))
    if out.numel():
        REGISTRY.launch(name, lambda: module.sparse_attention[grid](
            q, kv, sink.float().contiguous(), index, out, seqlen, heads, kv.shape[1], index.shape[-1], scale,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), index.stride(0), index.stride(1),
            out.stride(0), out.stride(1), out.stride(2), BLOCK_H=block_h, BLOCK_K=block_k))
        REGISTRY.note_launch(name, grid=grid, BLOCK_H=block_h, BLOCK_K=block_k, entries=index.shape[-1])
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.sparse_attention) or "")
    return out
