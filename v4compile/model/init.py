"""Seeded random initialisation of the presets, in the config's weight formats."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from . import quant
from .linear import GroupedLinear, Linear
from .moe import RoutedExperts, official_state


def random_tensors(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every randomly initialised tensor of ``model`` as (checkpoint name, CPU value), in a fixed order drawn
    from one seeded generator; quantized formats are quantized. Only shapes are read, so ``model`` may live
    on the meta device (a tensor-parallel shard walks the whole model this way and keeps its parts)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def linear(name: str, layer: Linear | GroupedLinear) -> Iterator[tuple[str, torch.Tensor]]:
        w = normal((layer.out_features, layer.in_features), 1 / math.sqrt(layer.in_features))
        if layer.fmt == "fp8":
            q, s = quant.quantize_fp8_weight(w)
        elif layer.fmt == "fp4":
            q, s = quant.quantize_fp4_weight(w)
        else:
            q, s = w.to(layer.weight.dtype), None
        yield f"{name}weight", q
        if s is not None:
            yield f"{name}scale", s

    for prefix, module in model.named_modules():
        dot = "." if prefix else ""
        if isinstance(module, Linear):
            yield from linear(f"{prefix}{dot}", module)
        elif isinstance(module, RoutedExperts):
            for e in range(module.n):
                for w in ("w1", "w2", "w3"):
                    yield from linear(f"{prefix}{dot}{e}.{w}.", getattr(module, w))
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(p.shape)
        if name.endswith("embed.weight"):
            yield name, normal(shape, 1.0)
        elif leaf.endswith("_fn"):
            yield name, normal(shape, 0.1 / math.sqrt(shape[-1]))
        elif leaf.endswith("_base") or leaf == "attn_sink" or leaf == "bias":
            yield name, torch.zeros(shape)
        elif leaf.endswith("_scale"):
            yield name, torch.ones(shape)
        elif leaf == "ape":
            yield name, normal(shape, 0.1)
        elif name.endswith("ffn.gate.weight"):
            yield name, normal(shape, 1 / math.sqrt(shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            n_experts = model.config.n_routed_experts
            yield name, torch.rand(b.shape[0], n_experts, generator=gen).argsort(-1)[:, : b.shape[1]].int()


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """Fills every weight with seeded random values of sensible scale; quantized formats are quantized.

    A tensor-parallel shard (``model.tp.size > 1``) draws the whole model's values in the same order and keeps
    its part of each, so it equals the matching slices of the single-process model with the same seed."""
    tp = getattr(model, "tp", None)
    targets = official_state(model.state_dict())
    if tp is None or tp.size == 1:
        for name, value in random_tensors(model, seed):
            targets[name].copy_(value)
        return
    whole = type(model)(model.config, seed=None, device="meta")
    for name, value in random_tensors(whole, seed):
        place = tp.placement(name, tuple(value.shape), model.config)
        if place is not None:
            targets[place.name].copy_(place.take(value))
