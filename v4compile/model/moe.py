"""Mixture of experts: sqrt-softplus router (aux-free bias or hash table), clamped SwiGLU experts; the routed
experts' weights are stacked, one tensor a projection, and each expert runs only on the tokens that chose it."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .config import V4Config
from .linear import GroupedLinear, Linear, WeightFormat
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


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` in fp32 (no clamp when ``limit`` is 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """The shared expert: ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` with fp32 activation math."""

    def __init__(self, dim: int, inter_dim: int, fmt: WeightFormat, pow2_scales: bool, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fmt, pow2_scales)
        self.w2 = Linear(inter_dim, dim, fmt, pow2_scales)
        self.w3 = Linear(dim, inter_dim, fmt, pow2_scales)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Expert output for tokens x [T, D]."""
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class RoutedExperts(nn.Module):
    """The routed experts ``first .. first+n-1`` as stacked projections ``w1``, ``w3`` [n, inter, dim] and ``w2``
    [n, dim, inter] (state-dict names ``experts.w1.weight`` ...; on disk each expert keeps its official name
    ``experts.{e}.w1.weight``, see ``official_state``)."""

    def __init__(self, n: int, first: int, dim: int, inter_dim: int, fmt: WeightFormat, pow2_scales: bool,
                 limit: float) -> None:
        super().__init__()
        self.n, self.first, self.limit = n, first, limit
        self.w1 = GroupedLinear(n, dim, inter_dim, fmt, pow2_scales)
        self.w2 = GroupedLinear(n, inter_dim, dim, fmt, pow2_scales)
        self.w3 = GroupedLinear(n, dim, inter_dim, fmt, pow2_scales)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum [T, D] (fp32) of the experts that tokens x [T, D] chose (``ids`` [T, k], routing
        ``weights`` [T, k]) among this module's experts. Each (token, expert) pair is computed once (a repeated
        id counts once); a token adds its experts' outputs in ascending expert order. The pairs are sorted by
        expert and the projections run on each expert's rows: static shapes, no host syncs; pairs of other
        experts (another rank's) run with weight 0 on the nearest local expert and are dropped from the sum."""
        tokens, k = ids.shape
        ids, order = ids.sort(dim=-1, stable=True)
        weights = weights.gather(-1, order)
        repeat = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] == ids[:, :-1]], dim=-1)
        local = ids - self.first
        held = (local >= 0) & (local < self.n) & ~repeat
        experts, pairs = local.clamp(0, self.n - 1).flatten().sort(stable=True)
        ends = torch.searchsorted(experts, torch.arange(1, self.n + 1, device=ids.device)).to(torch.int32)
        rows = x[pairs // k]
        pair_weights = torch.where(held, weights, 0).flatten()[pairs].unsqueeze(-1)
        h = pair_weights * swiglu(self.w1(rows, ends), self.w3(rows, ends), self.limit)
        out = self.w2(h.to(x.dtype), ends).float()
        out = torch.zeros_like(out).index_copy(0, pairs, out).view(tokens, k, -1)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for j in range(k):
            y = y + torch.where(held[:, j : j + 1], out[:, j], 0)
        return y


_STACKED_NAME = re.compile(r"^(.*\.experts)\.(w[123]\.(?:weight|scale))$")


def official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict in the checkpoint's names: each stacked expert tensor becomes one view per expert named
    ``...experts.{e}.w1.weight`` (writing a view writes the stacked tensor); every other entry is unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _STACKED_NAME.match(name)
        if m is None:
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            out[f"{m.group(1)}.{e}.{m.group(2)}"] = tensor[e]
    return out


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
        self.experts = RoutedExperts(stop - self.first, self.first, config.dim, config.moe_inter_dim, expert_fmt,
                                     config.pow2_scales, limit)
        self.shared_experts = Expert(config.dim, config.moe_inter_dim, dense_fmt, config.pow2_scales, limit)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor,
              replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids for x [B, S, D] (``replay`` [B, S, k]: the experts to use)."""
        return self.gate(x.reshape(-1, self.dim), input_ids.reshape(-1),
                         None if replay is None else replay.reshape(-1, replay.shape[-1]))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, routing: Routing | None = None,
                layer: int = 0) -> torch.Tensor:
        """MoE output for x [B, S, D] (bf16): the routed experts' weighted sum plus the shared expert.
        ``routing`` records this layer's experts into ``routing.experts[layer]`` or replays them. A tensor-parallel
        rank runs its own experts and the ranks' partial sums are added before the shared expert."""
        flat = x.reshape(-1, self.dim)
        replay = routing.experts[layer] if routing is not None and routing.replay else None
        weights, ids = self.route(x, input_ids, replay)
        if routing is not None and not routing.replay:
            routing.experts[layer] = ids.view(*x.shape[:-1], -1)
        y = self.experts(self.tp.region_input(flat), self.tp.region_input(weights), ids)
        y = self.tp.all_reduce(y) + self.shared_experts(flat).float()
        return y.to(x.dtype).view(x.shape)
