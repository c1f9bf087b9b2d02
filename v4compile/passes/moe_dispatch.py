"""``moe_dispatch``: the model's routed experts (sorted (token, expert) pairs through stacked grouped projections)
become ``v4compile::moe_experts``, one kernel pipeline over the chosen pairs (codegen/triton/moe.py).

The model (model/moe.py ``RoutedExperts``) sorts each token's expert ids, masks repeats and other ranks' experts,
sorts the pairs by expert, runs the clamped SwiGLU expert with ``torch._grouped_mm`` over the stacked weights and
adds each token's outputs in ascending expert order. The pass starts at each ``index_copy`` whose source is a
grouped matmul (the w2 outputs put back in pair order), follows its users to the end of the per-token sum, reads
the weight format, expert count and shapes from the stacked weights, the first local expert from the id offset
and the SwiGLU limit from the clamp, and binds the whole region against ``RoutedExperts.forward`` traced to ATen
with those settings (both FP8 scale rules are tried): the model's own code is the pattern, so a match computes
what the model computes and a near-miss names the first operation that differs.

transformers' grouped experts (one grouped matmul over a fused ``gate_up_proj`` [E, 2I, D] split by ``chunk``, the
routing weights applied after the down projection, the outputs put back by an inverse permutation) are not matched
yet: each is a near-miss saying so. (Its hash-routed layers count an expert listed twice for a token twice, the
kernel once, so those must stay declined whatever the spelling.)
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from functools import lru_cache

import torch
from torch import fx
from torch.func import functional_call

from ..codegen import ops
from ..model.linear import WEIGHT_DTYPES, weight_shapes
from ..model.moe import RoutedExperts
from .base import (
    GraphPass,
    NoMatch,
    Rewrite,
    RewriteContext,
    ancestors,
    dtype,
    is_op,
    locate,
    shape,
    users_past_noop_slices,
)
from .template import Template, bind, example_sizes, skip_noop_casts, trace

aten = torch.ops.aten
FORMATS = {torch.int8: "fp4", torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16"}
_PROJECTIONS = ("w1", "w3", "w2")


def _stacked_weight(mm: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """The stacked weight input (and its e8m0 scale) of a grouped matmul's second operand."""
    operand = mm.args[1]
    leaves = [n for n in [operand, *ancestors(operand, 64)] if n.op in ("placeholder", "get_attr")]
    weights = [n for n in leaves if dtype(n) in FORMATS and len(shape(n) or ()) == 3]
    scales = [n for n in leaves if dtype(n) == torch.float8_e8m0fnu]
    if len(weights) != 1 or len(scales) > 1:
        raise NoMatch(f"the grouped matmul at {locate(mm)} does not read one stacked bf16, FP8 or packed FP4 weight "
                      "(with one e8m0 scale)")
    return weights[0], scales[0] if scales else None


def _sum_end(view: fx.Node) -> fx.Node:
    """The last add of the per-token sum over the [tokens, top_k, dim] expert outputs ``view``: the adds that take
    a term computed from one of its slots, the one whose users are none of them."""
    terms = {u for select in users_past_noop_slices(view) for u in select.users}
    adds = [a for t in terms for a in t.users if is_op(a, aten.add)]
    ends = [a for a in dict.fromkeys(adds) if not any(u in adds for u in a.users)]
    if len(ends) != 1:
        raise NoMatch(f"the expert outputs at {locate(view)} do not feed one per-token sum")
    return ends[0]


def _constant_after(nodes: list[fx.Node], op: object, position: int) -> list[object]:
    """The numeric constants at argument ``position`` of the ``op`` calls among ``nodes``, in order (for ``sub``
    only those subtracted from a sort's values: the expert ids minus the first local expert)."""
    found = []
    for n in nodes:
        if not is_op(n, op) or len(n.args) <= position:
            continue
        value = n.args[position]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        source = n.args[0]
        if op is aten.sub and not (isinstance(source, fx.Node) and source.target is operator.getitem
                                   and is_op(source.args[0], aten.sort)):
            continue
        found.append(value)
    return found


@lru_cache(maxsize=64)
def _template(tokens: int, k: int, n: int, first: int, dim: int, inter: int, fmt: str, pow2: bool,
              limit: float, dynamic: bool) -> Template:
    """``RoutedExperts.forward`` with these settings traced for x [tokens, dim] bf16, weights/ids [tokens, k]
    (``dynamic``: a dynamic token count)."""
    with torch.device("meta"):
        module = RoutedExperts(n, first, dim, inter, fmt, pow2, limit)
    example = [torch.empty(tokens, dim, dtype=torch.bfloat16), torch.empty(tokens, k, dtype=torch.float32),
               torch.empty(tokens, k, dtype=torch.long)]
    names = []
    for w in _PROJECTIONS:
        in_f, out_f = (inter, dim) if w == "w2" else (dim, inter)
        for part, dims in weight_shapes(fmt, in_f, out_f).items():
            part_dtype = WEIGHT_DTYPES[fmt] if part == "weight" else torch.float8_e8m0fnu
            example.append(torch.empty(n, *dims, dtype=part_dtype))
            names.append(f"{w}.{part}")

    def forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return functional_call(module, dict(zip(names, params, strict=True)), (x, weights, ids))

    rows = (0,) if dynamic else ()
    return trace(forward, example, [rows, rows, rows] + [()] * len(names))


class MoeDispatch(GraphPass):
    """The routed experts over sorted pairs -> the grouped kernel pipeline over the chosen (token, expert) pairs."""

    name = "moe_dispatch"
    summary = "run the routed experts as one grouped kernel pipeline over the chosen (token, expert) pairs"
    matches = ("the model's RoutedExperts: pairs sorted by expert, w2(weight * silu(min(w1 x, L)) * clamp(w3 x, -L, "
               "L)) by grouped matmuls over stacked bf16, FP8 or FP4 weights, each token's outputs summed in "
               "ascending expert order")
    tolerance = 2e-2
    """Products are exact and only fp32 summation order differs, but that noise can flip a bf16 or e4m3 rounding
    of the hidden state, which moves an output by a small fraction of max|y|."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """``index_copy`` nodes whose source is a grouped matmul's output (the experts' outputs in pair order)."""
        return [n for n in gm.graph.nodes if is_op(n, aten.index_copy) and len(n.args) >= 4
                and is_op(_source(n.args[3]), aten._grouped_mm) or _fused_gate_up(n)]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The region from the tokens, routing weights and ids to the per-token sum, bound as the docstring says."""
        if _fused_gate_up(node):
            raise NoMatch("fused gate_up experts (one grouped matmul over [E, 2I, D] split by chunk, routing weights "
                          "after the down projection, transformers' spelling) are not the model's RoutedExperts; not "
                          "matched yet")
        w2_mm = _source(node.args[3])
        hidden = ancestors(w2_mm.args[0], 80)
        gated = [n for n in hidden if is_op(n, aten._grouped_mm)]
        if len(gated) != 2:
            raise NoMatch(f"the input of the grouped matmul at {locate(w2_mm)} does not come from two grouped "
                          f"matmuls (w1 and w3); found {len(gated)}")
        w2, _ = _stacked_weight(w2_mm)
        fmt = FORMATS[dtype(w2)]
        n, dim, packed = shape(w2) or (0, 0, 0)
        inter = packed * 2 if fmt == "fp4" else packed
        view = next((u for u in node.users if len(shape(u) or ()) == 3), None)
        if view is None:
            raise NoMatch(f"the expert outputs at {locate(node)} are not viewed as [tokens, top_k, dim]")
        end = _sum_end(view)
        (tokens, k), dynamic = example_sizes((shape(view) or (0, 0))[:2])
        offsets = _constant_after(ancestors(end), aten.sub, 1)
        first = int(offsets[0]) if offsets else 0
        clamps = [n for n in hidden if is_op(n, aten.clamp) and _source(n.args[0]) in gated]
        limits = [float(c) for c in _constant_after(clamps, aten.clamp, 2)]
        limit = max(limits) if limits else 0.0
        best = None
        for pow2 in ((True, False) if fmt != "bf16" else (False,)):
            binding = bind(_template(tokens, k, n, first, dim, inter, fmt, pow2, limit, 0 in dynamic), end)
            if binding.inputs is not None:
                break
            if best is None or binding.matched > best.matched:
                best = binding
        else:
            raise NoMatch(f"not the model's routed experts ({fmt}, {n} experts from {first}, limit {limit}): "
                          f"{best.reason}")
        x, weights, ids, *params = binding.inputs
        quantized = fmt != "bf16"
        w1, s1, w3, s3, w2, s2 = params if quantized else (params[0], None, params[1], None, params[2], None)
        impl = ops.implementation_backend("moe_experts", ctx.backend)
        details = {"experts": n, "first": first, "top_k": k, "format": fmt, "pow2_scales": pow2,
                   "swiglu_limit": limit, "tokens": shape(view)[0], "dim": dim, "inter_dim": inter}
        return Rewrite(end, ops.moe_experts, (x, weights, ids, first, w1, w3, w2, s1, s3, s2, fmt, pow2,
                                              limit, ctx.backend), f"moe_experts.{fmt}.{impl}", details)


def _fused_gate_up(node: fx.Node) -> bool:
    """Whether ``node`` is a grouped matmul whose output is split in two halves by ``chunk`` (fused gate and up)."""
    return is_op(node, aten._grouped_mm) and len(node.users) == 1 and is_op(next(iter(node.users)), aten.chunk) \
        and next(iter(node.users)).args[1] == 2


def _source(node: object) -> object:
    """``node`` under casts (to fp32 or to its own dtype)."""
    node = skip_noop_casts(node)
    while is_op(node, aten.to, aten._to_copy):
        node = skip_noop_casts(node.args[0])
    return node


__all__ = ["MoeDispatch"]
