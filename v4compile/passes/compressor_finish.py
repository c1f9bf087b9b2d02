"""``compressor_finish``: the entry's finish after the compressor's pooling (RMSNorm, RoPE, then FP8 simulation or
the Hadamard rotation and FP4 simulation) joins the pooling kernel, which then writes the bf16 cache entry.

Runs after ``compressor_fusion``: its anchors are the pooling ops that pass emitted. The finish is found by
matching the model's own ``finish_entries`` traced to ATen (``template.bind``) over the pooled entries, in each of
its forms (FP8 with either scale rule, Hadamard + FP4, or kept bf16) and with its RoPE in either spelling: the
model's (even and odd dims as pairs) or transformers' (``x * cos + rotate_half(x) * sin`` on tables repeated per
pair, entries given a head dim and bf16 tables), which compute the same products and sums (the same values).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import fx

from ..codegen import ops
from ..model.compressor import finish_entries
from ..model.norm import rms_norm
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, SymDim, is_op, only_user, shape
from .template import Binding, Template, bind, example_sizes, trace

aten = torch.ops.aten
_SEARCH = 400
"""Nodes after the pooled entries searched for the finish's output (the finish itself is about 100)."""

VARIANTS = ((False, True, True, "pairs"), (False, False, True, "pairs"), (True, True, True, "pairs"),
            (False, False, False, "pairs"), (False, False, False, "rotate_half"))
"""(rotate, pow2 scales, quantize, RoPE spelling) of the finishes: FP8 with power-of-two or plain scales, Hadamard +
FP4, and entries kept bf16 (transformers' V4, which has no FP8 KV), the last in both RoPE spellings."""


@dataclass
class Finish:
    """A matched finish: its output node, its inputs in the graph and its constants."""

    output: fx.Node
    cos: fx.Node
    sin: fx.Node
    weight: fx.Node
    eps: float
    rotate: bool
    pow2: bool
    quantize: bool
    rope: int


def _after(node: fx.Node, limit: int = _SEARCH) -> list[fx.Node]:
    """Up to ``limit`` nodes that use ``node`` directly or indirectly, nearest first."""
    seen, queue, order = {node}, deque([node]), []
    while queue and len(order) < limit:
        for user in queue.popleft().users:
            if user not in seen:
                seen.add(user)
                order.append(user)
                queue.append(user)
    return order


def _eps(after: list[fx.Node]) -> float:
    """The RMSNorm's epsilon: the constant added to the first mean that follows the pooled entries."""
    for node in after:
        if is_op(node, aten.add) and is_op(node.args[0], aten.mean) and isinstance(node.args[1], float):
            return node.args[1]
    raise NoMatch("no RMSNorm (mean of squares + eps) follows the pooled entries")


def _rope_dims(after: list[fx.Node], width: int) -> int:
    """The RoPE dims: the first slice of the last dims (``x[..., -r:]``) after the pooled entries."""
    for node in after:
        if is_op(node, aten.slice) and len(node.args) >= 3 and node.args[1] in (-1, len(shape(node) or ()) - 1):
            start = node.args[2]
            if isinstance(start, int) and -width <= start < 0:
                return -start
    raise NoMatch("no RoPE on the last dims (a slice x[..., -r:]) follows the pooled entries")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Each interleaved pair (a, b) of the last dim as (-b, a)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _finish_rotate_half(pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``finish_entries`` without quantization, its RoPE spelled as transformers' V4 spells it: entries given a head
    dim, bf16 tables of one angle per pair repeated for both of its dims, ``x * cos + rotate_half(x) * sin``."""
    e = rms_norm(pooled.to(torch.bfloat16), weight, eps).unsqueeze(1)
    cos, sin = cos.repeat_interleave(2, dim=-1).unsqueeze(1), sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    r = cos.shape[-1]
    rest, rot = e[..., :-r], e[..., -r:]
    turned = (rot.float() * cos + _rotate_half(rot).float() * sin).to(e.dtype)
    return torch.cat([rest, turned], dim=-1).squeeze(1)


@lru_cache(maxsize=64)
def _template(pooled: tuple[int, ...], rope: int, eps: float, rotate: bool, pow2: bool, quantize: bool,
              spelling: str, dynamic: tuple[int, ...]) -> Template:
    """``finish_entries`` traced for pooled entries of this shape, ``dynamic`` the pooled entries' dynamic dims:
    the model's spelling with cos/sin of one row per entry row, transformers' with bf16 cos/sin per entry."""
    if spelling == "rotate_half":
        table = torch.empty(*pooled[:-1], rope // 2, dtype=torch.bfloat16)
        tables = tuple(d for d in dynamic if d < len(pooled) - 1)
        example = [torch.empty(pooled), table, table.clone(), torch.empty(pooled[-1])]
        return trace(lambda p, cos, sin, w: _finish_rotate_half(p, cos, sin, w, eps), example,
                     [dynamic, tables, tables, ()])
    table = torch.empty(pooled[-2] if len(pooled) > 1 else 1, rope // 2)
    example = [torch.empty(pooled), table, table.clone(), torch.empty(pooled[-1])]
    rows = len(pooled) - 2
    tables = (0,) if len(pooled) > 1 and rows in dynamic else ()
    return trace(lambda p, cos, sin, w: finish_entries(p, cos, sin, w, eps, rotate, pow2, quantize), example,
                 [dynamic, tables, tables, ()])


def find_finish(pooled: fx.Node, dims: tuple[int | SymDim, ...]) -> Finish:
    """The finish applied to ``pooled`` (its only use; entries of shape ``dims``), or NoMatch naming what differs
    from the model's."""
    only_user(pooled, "the pooled entries have other uses than one finish")
    after = _after(pooled)
    eps, rope = _eps(after), _rope_dims(after, dims[-1])
    sizes, dynamic = example_sizes(dims)
    best: Binding | None = None
    for rotate, pow2, quantize, spelling in VARIANTS:
        template = _template(sizes, rope, eps, rotate, pow2, quantize, spelling, dynamic)
        for node in after:
            if node.op != "call_function" or node.target != template.output.target:
                continue
            binding = bind(template, node)
            if binding.inputs is not None and binding.inputs[0] is pooled:
                _, cos, sin, weight = binding.inputs
                shared = sorted(n.name for n in binding.region - {node} if not set(n.users) <= binding.region)
                if shared:
                    raise NoMatch(f"intermediate values of the finish ({', '.join(shared)}) are used elsewhere: "
                                  f"fused, the pooling and finish would be computed twice")
                return Finish(node, cos, sin, weight, eps, rotate, pow2, quantize, rope)
            if binding.inputs is not None:
                binding.reason = (f"it is applied to {binding.inputs[0].name}, computed from the pooled entries, "
                                  f"not to the pooled entries themselves")
            if best is None or binding.matched > best.matched:
                best = binding
    raise NoMatch(f"the pooled entries are not finished as the model's finish_entries: "
                  f"{best.reason if best else 'nothing after them ends like it'}")


def _pooled_value(pool: fx.Node) -> fx.Node:
    """The node the finish reads: the pooling op, or in check mode the recorder that passes its value on."""
    from .manager import CheckRecorder

    users = list(pool.users)
    return users[0] if len(users) == 1 and isinstance(users[0].target, CheckRecorder) else pool


class CompressorFinish(GraphPass):
    """The model's finish of pooled compressor entries -> the pooling kernel's epilogue."""

    name = "compressor_finish"
    summary = "fuse the entry's RMSNorm + RoPE + FP8 (or Hadamard + FP4, or no) simulation into the pooling kernel"
    matches = "finish_entries(compressor_pool(...) or compressor_pool_state(...), cos, sin, norm weight)"
    tolerance = 0.67
    """The pooling kernel's own fp32 rounding (~1e-7 relative) can move a value across a bf16 boundary and then
    across a quantization grid step: at most one FP4 step, two thirds of a block's largest value (an FP8 step
    is at most an eighth). Otherwise the fused entries are bitwise the unfused ones."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """The pooling ops ``compressor_fusion`` emitted."""
        pools = (torch.ops.v4compile.compressor_pool, torch.ops.v4compile.compressor_pool_state)
        return [n for n in gm.graph.nodes if is_op(n, *pools)]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The finish after the pooled entries, on dims the finishing kernel takes."""
        from ..codegen.triton.compressor_finish import finish_form, kernel_name, supports

        *pool_args, backend = node.args
        state = is_op(node, torch.ops.v4compile.compressor_pool_state)
        ratio, width = pool_args[-2:] if state else pool_args[-3:-1]
        rows = (shape(pool_args[0]) or (None,))[0]
        if rows is None:
            raise NoMatch("the pooled entries have an unknown shape")
        blocks = None if state else pool_args[-1]
        if isinstance(blocks, fx.Node):
            blocks = SymDim(blocks.meta["val"])
        finish = find_finish(_pooled_value(node), (rows, width) if state else (rows, blocks, width))
        unsupported = supports(width, finish.rope, finish.rotate, finish.quantize)
        if unsupported:
            raise NoMatch(unsupported)
        name = "compressor_entry_state" if state else "compressor_entries"
        kernel = kernel_name(ratio, width, finish.rotate, state, ops.implementation_backend(name, backend),
                             finish.quantize)
        args = (*pool_args, finish.cos, finish.sin, finish.weight, finish.eps, finish.rotate, finish.pow2,
                finish.quantize, backend)
        return Rewrite(finish.output, getattr(ops, name), args, kernel,
                       {"form": "decode" if state else "prefill", "ratio": ratio, "width": width,
                        "finish": finish_form(finish.rotate, finish.quantize), "rope": finish.rope,
                        "pow2_scales": finish.pow2})
