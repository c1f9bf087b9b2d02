"""RMSNorm in fp32, cast back to the input dtype."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``w * x * rsqrt(mean(x^2) + eps)`` computed in fp32; returns the input dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (official name ``<module>.weight``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes the last dim of ``x``."""
        return rms_norm(x, self.weight, self.eps)
