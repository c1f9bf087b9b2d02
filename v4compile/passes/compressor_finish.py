"""The compressor's finish after its pooled entries (RMSNorm, RoPE, then FP8 simulation or the Hadamard rotation
and FP4 simulation), found by matching the model's own ``finish_entries`` traced to ATen, so that
``compressor_fusion`` can emit one kernel that pools and finishes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import fx

from ..model.compressor import finish_entries
from .base import NoMatch, is_op, only_user, shape
from .template import Binding, Template, bind, trace

aten = torch.ops.aten
_SEARCH = 400
"""Nodes after the pooled entries searched for the finish's output (the finish itself is about 100)."""

VARIANTS = ((False, True), (False, False), (True, True))
"""(rotate, pow2 scales) of the finishes the model has: FP8 with power-of-two or plain scales, Hadamard + FP4."""


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


@lru_cache(maxsize=64)
def _template(pooled: tuple[int, ...], rope: int, eps: float, rotate: bool, pow2: bool) -> Template:
    """``finish_entries`` traced for pooled entries of this shape (cos/sin of one row per entry row)."""
    table = torch.empty(pooled[-2] if len(pooled) > 1 else 1, rope // 2)
    example = [torch.empty(pooled), table, table.clone(), torch.empty(pooled[-1])]
    return trace(lambda p, cos, sin, w: finish_entries(p, cos, sin, w, eps, rotate, pow2), example)


def find_finish(pooled: fx.Node) -> Finish:
    """The finish applied to ``pooled`` (its only use), or NoMatch naming what differs from the model's."""
    only_user(pooled, "the pooled entries have other uses than one finish")
    dims = shape(pooled)
    if dims is None:
        raise NoMatch("the pooled entries have a dynamic shape")
    after = _after(pooled)
    eps, rope = _eps(after), _rope_dims(after, dims[-1])
    best: Binding | None = None
    for rotate, pow2 in VARIANTS:
        template = _template(dims, rope, eps, rotate, pow2)
        for node in after:
            if node.op != "call_function" or node.target != template.output.target:
                continue
            binding = bind(template, node)
            if binding.inputs is not None and binding.inputs[0] is pooled:
                _, cos, sin, weight = binding.inputs
                return Finish(node, cos, sin, weight, eps, rotate, pow2, rope)
            if binding.inputs is not None:
                binding.reason = (f"it is applied to {binding.inputs[0].name}, computed from the pooled entries, "
                                  f"not to the pooled entries themselves")
            if best is None or binding.matched > best.matched:
                best = binding
    raise NoMatch(f"the pooled entries are not finished as the model's finish_entries: "
                  f"{best.reason if best else 'nothing after them ends like it'}")
