"""Sparse MQA with an attention sink: each query reads the KV entries named by an index tensor."""

from __future__ import annotations

import torch


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attends ``q`` [B, S, H, d] over ``kv[b, index[b, s, :]]`` (one entry is key and value).

    ``kv`` is [B, N, d]; ``index`` [B, S, K] (-1 = masked; duplicates count twice). Scores are fp32;
    the per-head ``sink`` [H] enters only the softmax denominator (fp64 inputs stay fp64). Rounded in the
    official order: the max over the scores alone (not the sink), ``exp(s - max)`` weights the values, and
    the sum is divided by ``sum exp(s - max) + exp(sink - max)`` last. Returns [B, S, H, d] in q's dtype.
    """
    bsz, seqlen, k = index.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = index >= 0
    gather = index.clamp(min=0).reshape(bsz, seqlen * k, 1).expand(-1, -1, kv.shape[-1])
    keys = torch.gather(kv, 1, gather).view(bsz, seqlen, k, -1).to(acc)
    scores = torch.einsum("bshd,bskd->bshk", q.to(acc), keys) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).detach()
    top = torch.where(top == float("-inf"), 0.0, top)  # a row with every entry masked attends to the sink only
    weights = torch.exp(scores - top)
    denominator = weights.sum(dim=-1, keepdim=True) + torch.exp(sink.to(acc).view(1, 1, -1, 1) - top)
    out = torch.einsum("bshk,bskd->bshd", weights, keys) / denominator
    return out.to(q.dtype)
