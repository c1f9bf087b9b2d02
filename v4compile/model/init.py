"""Seeded random initialisation of the presets, in the config's weight formats."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import quant
from .linear import Linear


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """Fills every weight with seeded random values of sensible scale; quantized formats are quantized."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    for module in model.modules():
        if isinstance(module, Linear):
            w = normal((module.out_features, module.in_features), 1 / math.sqrt(module.in_features))
            if module.fmt == "fp8":
                q, s = quant.quantize_fp8_weight(w)
            elif module.fmt == "fp4":
                q, s = quant.quantize_fp4_weight(w)
            else:
                q, s = w.to(module.weight.dtype), None
            module.weight.copy_(q)
            if s is not None:
                module.scale.copy_(s)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed.weight"):
            p.copy_(normal(tuple(p.shape), 1.0))
        elif leaf.endswith("_fn"):
            p.copy_(normal(tuple(p.shape), 0.1 / math.sqrt(p.shape[-1])))
        elif leaf.endswith("_base") or leaf == "attn_sink" or leaf == "bias":
            p.zero_()
        elif leaf.endswith("_scale"):
            p.fill_(1.0)
        elif leaf == "ape":
            p.copy_(normal(tuple(p.shape), 0.1))
        elif name.endswith("ffn.gate.weight"):
            p.copy_(normal(tuple(p.shape), 1 / math.sqrt(p.shape[-1])))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            n_experts = model.config.n_routed_experts
            b.copy_(torch.rand(b.shape[0], n_experts, generator=gen).argsort(-1)[:, : b.shape[1]].int())
