"""One transformer block: mHC around hybrid attention and around the MoE."""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .cache import LayerCache
from .config import V4Config
from .mhc import hc_post, hc_pre
from .moe import MoE
from .norm import RMSNorm
from .parallel import TensorParallel
from .routing import Routing


class Block(nn.Module):
    """Official names: attn, ffn, attn_norm, ffn_norm, hc_{attn,ffn}_{fn,base,scale}. ``tp``: this rank's
    tensor-parallel place (attention heads and routed experts are split, the rest replicated)."""

    def __init__(self, config: V4Config, ratio: int, hashed: bool, tp: TensorParallel | None = None) -> None:
        super().__init__()
        c = config
        self.hc_iters, self.hc_eps, self.norm_eps = c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps
        self.attn = Attention(c, ratio, tp)
        self.ffn = MoE(c, hashed, tp)
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.dim
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, width, dtype=torch.float32)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, cache: LayerCache | None = None,
        positions: torch.Tensor | None = None, start: int | None = None, routing: Routing | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """Streams x [B, S, n, D] -> new streams. ``positions`` [B] selects one-token decode against ``cache``;
        ``start`` a chunk continuing ``cache`` at that position; with neither the call is a full sequence
        from position 0 (a prefill when ``cache`` is given). ``routing`` records or replays this block's
        expert and indexer choices as layer ``layer``."""
        y, post, comb = hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.hc_iters,
                               self.hc_eps, self.norm_eps)
        y = self.attn_norm(y)
        if positions is not None:
            y = self.attn.forward_decode(y, positions, cache, routing, layer)
        elif start is not None:
            y = self.attn.forward_chunk(y, start, cache, routing, layer)
        else:
            y = self.attn.forward_full(y, cache, routing, layer)
        x = hc_post(y, x, post, comb)
        y, post, comb = hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.hc_iters,
                               self.hc_eps, self.norm_eps)
        y = self.ffn(self.ffn_norm(y), input_ids, routing, layer)
        return hc_post(y, x, post, comb)
