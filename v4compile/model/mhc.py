"""mHC: manifold-constrained hyper-connections over ``hc_mult`` residual streams.

Each sub-layer reads a sigmoid-weighted sum of the streams and writes back
``X'_k = post_k * y + sum_j C[j, k] X_j`` with C projected towards doubly stochastic by Sinkhorn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), then alternating column/row normalisation: ``iters`` column steps in all."""
    c = logits.softmax(dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fn . vec(X)) * rsqrt(mean(vec(X)^2) + eps)`` in fp32, and vec(X) in fp32."""
    flat = x.flatten(-2).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn) * rsqrt, flat


def hc_pre(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams [..., n, D] -> (sub-layer input [..., D] in x's dtype, post [..., n], comb [..., n, n])."""
    n = x.shape[-2]
    m, flat = hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (m[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    comb = sinkhorn(comb, iters, hc_eps)
    y = (pre.unsqueeze(-1) * flat.view(x.shape)).sum(dim=-2)
    return y.to(x.dtype), post, comb


def hc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_k = post_k * y + sum_j comb[j, k] X_j``, returned in y's dtype."""
    mixed = (comb.unsqueeze(-1) * streams.unsqueeze(-2)).sum(dim=-3)
    return (post.unsqueeze(-1) * y.unsqueeze(-2) + mixed).to(y.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapses the streams for the output head: ``sum_j (sigmoid(m*s + b) + eps)_j X_j`` (no Sinkhorn)."""
    m, flat = hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(m * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * flat.view(x.shape)).sum(dim=-2).to(x.dtype)
