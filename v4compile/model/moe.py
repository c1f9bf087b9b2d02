"""Mixture of experts: sqrt-softplus router (aux-free bias or hash table), clamped SwiGLU experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import V4Config
from .linear import Linear, WeightFormat
from .parallel import TensorParallel
from .routing import Routing


class Gate(nn.Module):
    """Official names: ``weight`` (bf16) and ``bias`` (fp32), or ``tid2eid`` (int32) for hash layers."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        self.topk, self.route_scale, self.hashed = config.n_activated_experts, config.route_scale, hashed
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.dim, dtype=torch.bfloat16))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.int32))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
            self.tid2eid = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] (fp32) and expert ids [T, k] for tokens x [T, D] with ids [T]; ``replay``
        [T, k] gives the experts (weights still come from this gate's scores, so gradients flow)."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        if replay is not None:
            ids = replay.long()
        elif self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return weights, ids


class Expert(nn.Module):
    """``w2(weight * silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` with fp32 activation math."""

    def __init__(self, dim: int, inter_dim: int, fmt: WeightFormat, pow2_scales: bool, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fmt, pow2_scales)
        self.w2 = Linear(inter_dim, dim, fmt, pow2_scales)
        self.w3 = Linear(dim, inter_dim, fmt, pow2_scales)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Expert output for tokens x [T, D], scaled inside by the routing ``weight`` [T, 1] when given."""
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    """Official names: ``gate``, ``experts.{e}``, ``shared_experts``. Under tensor parallelism a rank holds the
    routed experts ``first..first+len(experts)-1`` (local names count from 0); gate and shared expert are
    replicated."""

    def __init__(self, config: V4Config, hashed: bool, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.dim, self.n_experts = config.dim, config.n_routed_experts
        self.first, stop = self.tp.part(config.n_routed_experts)
        dense_fmt: WeightFormat = "fp8" if config.weights_fp8 else "bf16"
        expert_fmt: WeightFormat = "fp4" if config.expert_dtype == "fp4" else dense_fmt
        limit = config.swiglu_limit
        self.gate = Gate(config, hashed)
        self.experts = nn.ModuleList(
            Expert(config.dim, config.moe_inter_dim, expert_fmt, config.pow2_scales, limit)
            for _ in range(stop - self.first)
        )
        self.shared_experts = Expert(config.dim, config.moe_inter_dim, dense_fmt, config.pow2_scales, limit)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor,
              replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids for x [B, S, D] (``replay`` [B, S, k]: the experts to use)."""
        return self.gate(x.reshape(-1, self.dim), input_ids.reshape(-1),
                         None if replay is None else replay.reshape(-1, replay.shape[-1]))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, routing: Routing | None = None,
                layer: int = 0) -> torch.Tensor:
        """MoE output for x [B, S, D] (bf16). Every expert runs on every token with its routing weight
        (zero when not chosen): static shapes, no host syncs; the compiler replaces this dispatch.
        ``routing`` records this layer's experts into ``routing.experts[layer]`` or replays them. A tensor-parallel
        rank runs its own experts and the ranks' partial sums are added before the shared expert."""
        flat = x.reshape(-1, self.dim)
        replay = routing.experts[layer] if routing is not None and routing.replay else None
        weights, ids = self.route(x, input_ids, replay)
        if routing is not None and not routing.replay:
            routing.experts[layer] = ids.view(*x.shape[:-1], -1)
        combine = torch.zeros(flat.shape[0], self.n_experts, dtype=torch.float32, device=x.device)
        combine = combine.scatter(1, ids, weights)
        y = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        tokens, combine = self.tp.region_input(flat), self.tp.region_input(combine)
        for e, expert in enumerate(self.experts, start=self.first):
            y = y + expert(tokens, combine[:, e : e + 1]).float()
        y = self.tp.all_reduce(y) + self.shared_experts(flat).float()
        return y.to(x.dtype).view(x.shape)
