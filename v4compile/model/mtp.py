"""The multi-token-prediction block: predicts one token further from the main model's streams."""

from __future__ import annotations

import torch
from torch import nn

from .block import Block
from .config import V4Config
from .linear import Linear
from .norm import RMSNorm
from .parallel import TensorParallel


class MTPBlock(Block):
    """A window-only, score-routed block plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``
    and its own ``hc_head_{fn,base,scale}``. Embedding and output head are shared with the main model."""

    def __init__(self, config: V4Config, k: int, tp: TensorParallel | None = None) -> None:
        super().__init__(config, config.mtp_ratio(k), hashed=False, tp=tp)
        c = config
        fmt = "fp8" if c.weights_fp8 else "bf16"
        self.e_proj = Linear(c.dim, c.dim, fmt, c.pow2_scales)
        self.h_proj = Linear(c.dim, c.dim, fmt, c.pow2_scales)
        self.enorm = RMSNorm(c.dim, c.norm_eps)
        self.hnorm = RMSNorm(c.dim, c.norm_eps)
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(c.hc_mult, c.hc_mult * c.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(c.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def streams(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Input streams: ``e_proj(enorm(e))`` broadcast to every stream plus ``h_proj(hnorm(H))`` per stream."""
        e = self.e_proj(self.enorm(embedded)).unsqueeze(-2)
        h = self.h_proj(self.hnorm(hidden))
        return e + h
