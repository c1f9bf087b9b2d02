"""The Sylvester Walsh-Hadamard rotation used by the lightning indexer."""

from __future__ import annotations

import math

import torch


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Applies ``H_n / sqrt(n)`` (Sylvester order) to the last dim (a power of two); returns x's dtype."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {n}")
    y = x.float()
    h = 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).to(x.dtype)
