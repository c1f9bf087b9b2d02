"""Tensor parallelism: which part of every tensor a rank holds, and the collectives the model calls.

With ``size`` ranks, rank r holds part r of every split dimension:
- query heads (``attn.wq_b`` rows, ``attn_sink``) and indexer heads (``indexer.wq_b`` and
  ``indexer.weights_proj`` rows) are column-parallel; the indexer's per-head scores are summed
  across ranks before the top-k, so every rank selects the same entries;
- the grouped output projection is row-parallel: the local groups' ``wo_a`` rows and the matching
  input columns of ``wo_b``, whose partial outputs are all-reduced;
- routed experts are sharded: rank r holds experts r*E/size .. (r+1)*E/size-1 (rows of the stacked
  expert tensors; per-expert checkpoint names map to local names counting from 0); the partial MoE
  outputs are all-reduced, then the replicated shared expert is added;
- embedding and output head are vocab-parallel: a masked local lookup plus an all-reduce, and
  local logits all-gathered along the vocabulary.
Everything else (KV, compressors, mHC, norms, router, shared expert, MTP projections) is replicated.
The collectives are ``torch.ops._c10d_functional`` ops, which torch.compile captures into the graph.
Training (Megatron's f and g): an all-reduce passes its gradient through, and a replicated tensor entering a
split region (``region_input``: the query latent and the KV entries before the local heads, the tokens and
combine weights before the local experts, the final hidden state before the local vocabulary) sums the ranks'
gradients in fp32, so every replicated parameter (KV path, compressors, mHC, norms, router, shared expert)
gets its whole gradient on every rank.
At ``size == 1`` every helper returns its input: the model runs exactly the single-process code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import quant
from .config import ConfigError, V4Config

SPLIT_FIELDS = ("n_heads", "index_n_heads", "o_groups", "n_routed_experts", "vocab_size")
"""Config fields the tensor-parallel degree must divide."""

_SPLIT_DIMS: tuple[tuple[re.Pattern[str], int], ...] = tuple((re.compile(p), d) for p, d in (
    (r"^embed\.weight$", 0),
    (r"^head\.weight$", 0),
    (r"\.attn\.attn_sink$", 0),
    (r"\.attn\.wq_b\.(weight|scale)$", 0),
    (r"\.attn\.wo_a\.weight$", 0),
    (r"\.attn\.wo_b\.(weight|scale)$", 1),
    (r"\.indexer\.wq_b\.(weight|scale)$", 0),
    (r"\.indexer\.weights_proj\.weight$", 0),
    (r"\.ffn\.experts\.w[123]\.(weight|scale)$", 0),
))
_EXPERT = re.compile(r"^(.*\.ffn\.experts\.)(\d+)(\..*)$")


class Placement(NamedTuple):
    """Where a rank keeps its part of a full tensor: the local name and the rows ``start:stop`` of ``dim``
    (``dim`` None: the whole tensor)."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.stop - self.start)


def check_degree(config: V4Config, size: int, rank: int = 0) -> None:
    """Raises ConfigError (a ValueError) naming the field when ``size`` ranks cannot split ``config``:
    a split field it does not divide, a rank out of range, or an FP8 weight whose per-rank part would cut
    through its 128x128 scale blocks. Called before any weight is built or read."""
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"tensor-parallel rank {rank} of size {size} is invalid: need size >= 1 and 0 <= rank < size")
    for name in SPLIT_FIELDS:
        value = getattr(config, name)
        if value % size:
            raise ConfigError(f"tensor-parallel degree {size} does not divide {name} = {value}")
    if not config.weights_fp8 or size == 1:
        return
    block = quant.FP8_WEIGHT_BLOCK
    c = config
    parts = (
        ("attn.wq_b rows (n_heads/tp * head_dim)", c.n_heads // size * c.head_dim),
        ("attn.wo_b input columns and wo_a rows (o_groups/tp * o_lora_rank)", c.o_groups // size * c.o_lora_rank),
        ("attn.indexer.wq_b rows (index_n_heads/tp * index_head_dim)", c.index_n_heads // size * c.index_head_dim),
    )
    for what, width in parts:
        if width % block:
            raise ConfigError(f"FP8 weight {what} = {width} per rank at tensor-parallel degree {size} is not a "
                              f"multiple of the {block}-wide scale block, so it cannot be split on a block boundary")


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``. ``group_name`` names the
    process group the collectives run on (the default group, bound on first use or by ``bind``)."""

    rank: int = 0
    size: int = 1
    group_name: str | None = None

    def part(self, total: int) -> tuple[int, int]:
        """This rank's range ``start, stop`` of ``total`` items split evenly."""
        step = total // self.size
        return self.rank * step, (self.rank + 1) * step

    def bind(self, group: dist.ProcessGroup | None = None) -> None:
        """Names the process group the collectives use (default: the initialised default group)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"a tensor-parallel model (tp={self.size}) runs inside an initialised process group: "
                               "start it with torchrun and call torch.distributed.init_process_group first")
        self.group_name = (group or dist.group.WORLD).group_name

    def _group(self) -> str:
        if self.group_name is None:
            self.bind()
        return self.group_name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (``x`` itself at size 1): where the ranks' partial results of a
        split region meet. Its gradient passes through unchanged (every rank already holds the whole one)."""
        if self.size == 1:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            return _tp_sum(x, self._group())
        return _all_reduce(x, self._group())

    def region_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself, marking a replicated tensor that enters a split region (local heads, local experts,
        local vocabulary): each rank's gradient of it covers only its own part, so the backward sums the
        ranks' gradients, in fp32 whatever ``x``'s dtype (the compressor's and KV path's precision control)."""
        if self.size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return _tp_enter(x, self._group())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim in rank order (``x`` itself at size 1); the
        gradient of a rank's part is its slice of the whole gradient."""
        if self.size == 1:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            return _tp_gather(x, self._group(), self.size, self.rank)
        return _all_gather(x, self._group(), self.size)

    def placement(self, name: str, shape: tuple[int, ...], config: V4Config) -> Placement | None:
        """Where this rank keeps full tensor ``name`` (official name, full ``shape``): None when another
        rank holds it (a routed expert of another rank), else its local name and the part of the tensor."""
        if self.size == 1:
            return Placement(name)
        expert = _EXPERT.match(name)
        if expert is not None:
            first, stop = self.part(config.n_routed_experts)
            e = int(expert.group(2))
            return Placement(f"{expert.group(1)}{e - first}{expert.group(3)}") if first <= e < stop else None
        for pattern, dim in _SPLIT_DIMS:
            if pattern.search(name):
                return Placement(name, dim, *self.part(shape[dim]))
        return Placement(name)


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", group))


def _all_gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    gathered = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), size, group))
    return _side_by_side(gathered, size)


def _side_by_side(gathered: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` ranks' parts stacked along dim 0 (what ``all_gather_into_tensor`` returns) concatenated along
    the last dim instead, as a view and one copy: ``torch.cat(gathered.chunk(size), -1)`` computes the same, but
    ``chunk`` of a dim whose size is unbacked (the decode batch) guards on it being 0, which Dynamo cannot, so the
    head's graph broke in two there."""
    parts = gathered.view(size, gathered.shape[0] // size, *gathered.shape[1:])
    return parts.movedim(0, -2).reshape(*parts.shape[1:-1], size * parts.shape[-1])


@torch.library.custom_op("v4compile::tp_sum", mutates_args=())
def _tp_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    """The all-reduce as one differentiable op (training): its gradient passes through."""
    return _all_reduce(x, group)


@_tp_sum.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("v4compile::tp_enter", mutates_args=())
def _tp_enter(x: torch.Tensor, group: str) -> torch.Tensor:
    """The identity as one differentiable op whose gradient is the fp32 all-reduce of the ranks' gradients."""
    return x.clone()


@_tp_enter.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("v4compile::tp_gather", mutates_args=())
def _tp_gather(x: torch.Tensor, group: str, size: int, rank: int) -> torch.Tensor:
    """The all-gather along the last dim as one differentiable op: a rank's gradient is its slice."""
    return _all_gather(x, group, size)


@_tp_gather.register_fake
def _(x: torch.Tensor, group: str, size: int, rank: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * size)


def _save_args(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.args = inputs[1:]


_tp_sum.register_autograd(lambda ctx, grad: (grad, None), setup_context=_save_args)
_tp_enter.register_autograd(
    lambda ctx, grad: (_all_reduce(grad.float(), ctx.args[0]).to(grad.dtype), None), setup_context=_save_args)
_tp_gather.register_autograd(
    lambda ctx, grad: (grad.chunk(ctx.args[1], dim=-1)[ctx.args[2]].contiguous(), None, None, None),
    setup_context=_save_args)
