"""``moe_dispatch``: the MoE's dense routed-expert loop becomes ``v4compile::moe_experts``, which computes only
the chosen (token, expert) pairs (codegen/triton/moe.py).

The model (model/moe.py) runs every local routed expert on every token with its routing weight, zero where
not chosen: ``y = zeros; y = y + expert_e(x, combine[:, e:e+1]).float()`` for e = first, first+1, ... The
pass starts at each add of an fp32 zeros tensor and a cast to fp32, follows the chain of adds and checks each
term: ``to(w2(to(combine[:, c:c+1] * (silu(min(w1 x, L)) * clamp(w3 x, -L, L)), bf16)), fp32)``, where every
Linear must equal the model's Linear in one weight format (matched against the model's code traced to ATen,
so the activation's e4m3 simulation and the weight dequantization are exactly the model's), all terms read
the same tokens and the same combine matrix at consecutive columns, and share one format. The chain ends at
the first term without a routing-weight column (the shared expert at tp=1; at tp>1 the chain ends at the
all-reduce). Every column of the combine matrix must belong to a matched term, and the matrix must be
``scatter(zeros, 1, ids, weights)``: the kernel takes the ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import fx
from torch.func import functional_call

from ..codegen import ops
from ..model.linear import WEIGHT_DTYPES, Linear, weight_shapes
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, is_op, locate, shape
from .template import Template, bind, skip_noop_casts, trace

aten = torch.ops.aten
FORMATS = {torch.int8: "fp4", torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16", torch.float32: "fp32"}
SUPPORTED = ("fp4", "fp8", "bf16")


class _Unweighted(NoMatch):
    """A term that is not scaled by a routing-weight column: it ends the chain of routed experts."""


@dataclass
class _Linear:
    x: fx.Node
    weight: fx.Node
    scale: fx.Node | None
    fmt: str
    pow2: bool


@dataclass
class _Term:
    x: fx.Node
    combine: fx.Node
    column: int
    column_node: fx.Node
    limit: float
    w1: _Linear
    w3: _Linear
    w2: _Linear


def _dtype(node: object) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _cast(node: object, dtype: torch.dtype) -> fx.Node | None:
    """The input of ``node`` when it is a real cast to ``dtype``, else None."""
    if is_op(node, aten.to, aten._to_copy) and _dtype(node) == dtype and _dtype(node.args[0]) != dtype:
        return node.args[0]
    return None


def _leaves(node: fx.Node, limit: int = 256) -> list[fx.Node]:
    """The graph inputs a weight expression is computed from (a bounded walk: weights depend on few nodes)."""
    seen, stack, leaves = set(), [node], []
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            leaves.append(n)
        stack.extend(a for a in n.all_input_nodes if a.op != "get_attr")
    return leaves


@lru_cache(maxsize=64)
def _linear_template(fmt: str, pow2: bool, tokens: int, in_features: int, out_features: int) -> Template:
    """The model's ``Linear.forward`` in one format, traced for a [tokens, in] bf16 input."""
    with torch.device("meta"):
        layer = Linear(in_features, out_features, fmt, pow2)
    shapes = weight_shapes(fmt, in_features, out_features)
    example = [torch.empty(tokens, in_features, dtype=torch.bfloat16),
               torch.empty(shapes["weight"], dtype=WEIGHT_DTYPES[fmt])]
    if "scale" in shapes:
        example.append(torch.empty(shapes["scale"], dtype=torch.float8_e8m0fnu))

    def forward(x: torch.Tensor, weight: torch.Tensor, *scale: torch.Tensor) -> torch.Tensor:
        return functional_call(layer, {"weight": weight, **dict(zip(("scale",), scale, strict=False))}, (x,))

    return trace(forward, example)


def _linear(out: fx.Node, what: str) -> _Linear:
    """The model's Linear whose output is ``out``: its input, weight, scale, format and scale rule."""
    out = skip_noop_casts(out)
    core = _cast(out, torch.bfloat16) or out
    if not is_op(core, aten.linear):
        raise NoMatch(f"{what} is not a linear layer's output ({locate(out)})")
    leaves = [core.args[1]] if core.args[1].op == "placeholder" else _leaves(core.args[1])
    weights = [n for n in leaves if _dtype(n) in FORMATS]
    scales = [n for n in leaves if _dtype(n) == torch.float8_e8m0fnu]
    if len(weights) != 1 or len(scales) > 1:
        raise NoMatch(f"{what}: the weight is not one bf16, FP8 or packed FP4 tensor (with one e8m0 scale)")
    weight = weights[0]
    fmt = FORMATS[_dtype(weight)]
    if fmt not in SUPPORTED:
        raise NoMatch(f"{what}: {fmt} expert weights are not supported by the kernel (it takes {SUPPORTED})")
    rows, cols = shape(weight) or (0, 0)
    dims = shape(out)
    if dims is None or len(dims) != 2:
        raise NoMatch(f"{what}: the expert input is not a static [tokens, dim] matrix")
    in_features = cols * 2 if fmt == "fp4" else cols
    best = None
    for pow2 in ((True, False) if fmt != "bf16" else (False,)):
        binding = bind(_linear_template(fmt, pow2, dims[0], in_features, rows), out)
        if binding.inputs is not None:
            x, w, *s = binding.inputs
            return _Linear(x, w, s[0] if s else None, fmt, pow2)
        if best is None or binding.matched > best.matched:
            best = binding
    raise NoMatch(f"{what} is not the model's {fmt} Linear: {best.reason}")


def _clamp_bounds(node: fx.Node) -> tuple[object, object]:
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    return low, high


def _column(node: object) -> int | None:
    """c when ``node`` is ``m[:, c:c+1]`` of a 2-D fp32 matrix m."""
    if not is_op(node, aten.slice) or len(node.args) < 4 or node.args[1] not in (1, -1):
        return None
    if len(shape(node.args[0]) or ()) != 2 or _dtype(node.args[0]) != torch.float32:
        return None
    start, end = node.args[2], node.args[3]
    return start if isinstance(start, int) and end == start + 1 else None


def _term(term: fx.Node, index: int) -> _Term:
    """One routed expert's contribution; ``_Unweighted`` when it has no routing-weight column."""
    what = f"term {index} of the expert sum"
    out = _cast(term, torch.float32)
    if out is None:
        raise _Unweighted(f"{what} is not an expert output cast to fp32")
    try:
        w2 = _linear(out, f"{what}: w2")
    except NoMatch as miss:
        raise _Unweighted(str(miss)) from None
    h = _cast(w2.x, torch.bfloat16)
    if not is_op(h, aten.mul) or _dtype(h) != torch.float32:
        raise _Unweighted(f"{what}: the input of w2 is not an fp32 product cast to bf16")
    columns = [(a, _column(a)) for a in h.args[:2]]
    picked = [(a, c) for a, c in columns if c is not None]
    if not picked:
        raise _Unweighted(f"{what}: the hidden state is not scaled by a routing-weight column")
    column_node, column = picked[0]
    body = h.args[1] if h.args[0] is column_node else h.args[0]
    if not is_op(body, aten.mul):
        raise NoMatch(f"{what}: the weighted hidden state is not silu(gate) * up")
    silu = [a for a in body.args[:2] if is_op(a, aten.silu)]
    if len(silu) != 1:
        raise NoMatch(f"{what}: the gate activation is not silu ({locate(body)})")
    gate, up = silu[0].args[0], body.args[1] if body.args[0] is silu[0] else body.args[0]
    limit = 0.0
    if is_op(gate, aten.clamp) or is_op(up, aten.clamp):
        g_low, g_high = _clamp_bounds(gate) if is_op(gate, aten.clamp) else (None, None)
        u_low, u_high = _clamp_bounds(up) if is_op(up, aten.clamp) else (None, None)
        if g_low is not None or not isinstance(g_high, float) or (u_low, u_high) != (-g_high, g_high):
            raise NoMatch(f"{what}: the SwiGLU clamp is not min(gate, L) with clamp(up, -L, L)")
        limit, gate, up = g_high, gate.args[0], up.args[0]
    w1 = _linear(_cast(gate, torch.float32) or gate, f"{what}: w1")
    w3 = _linear(_cast(up, torch.float32) or up, f"{what}: w3")
    if w1.x is not w3.x:
        raise NoMatch(f"{what}: w1 and w3 read different inputs")
    if len({(w.fmt, w.pow2) for w in (w1, w3, w2)}) != 1:
        raise NoMatch(f"{what}: w1, w3 and w2 differ in weight format or scale rule")
    return _Term(w1.x, column_node.args[0], column, column_node, limit, w1, w3, w2)


def _zeros(node: object) -> bool:
    return is_op(node, aten.zeros) and _dtype(node) == torch.float32 and len(shape(node) or ()) == 2


def _chain(start: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(add, term) pairs of ``y = zeros + t0 + t1 + ...`` from its first add, each add the only user of the last."""
    node = start
    pairs = [(start, start.args[1] if _zeros(start.args[0]) else start.args[0])]
    while True:
        users = list(node.users)
        if len(users) != 1 or not is_op(users[0], aten.add) or users[0].kwargs.get("alpha", 1) != 1:
            return pairs
        nxt = users[0]
        a, b = nxt.args[:2]
        if a is b:
            return pairs
        pairs.append((nxt, b if a is node else a))
        node = nxt


class MoeDispatch(GraphPass):
    """The dense routed-expert sum -> the grouped kernel over the chosen (token, expert) pairs."""

    name = "moe_dispatch"
    summary = "compute only the chosen (token, expert) pairs of the MoE instead of every expert on every token"
    matches = ("y = zeros + sum over consecutive e of w2_e(combine[:, e] * silu(min(w1_e x, L)) * clamp(w3_e x, -L, "
               "L)) with the model's Linear in bf16, FP8 or FP4 and combine = scatter(zeros, 1, ids, weights)")
    tolerance = 2e-2
    """Products are exact and only fp32 summation order differs, but that noise can flip a bf16 or e4m3 rounding
    of the hidden state, which moves an output by a small fraction of max|y|."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Adds of an fp32 zeros matrix and a cast to fp32 (the first step of the model's expert sum)."""
        return [n for n in gm.graph.nodes if is_op(n, aten.add) and len(n.args) >= 2
                and any(_zeros(a) and is_op(b, aten.to, aten._to_copy)
                        for a, b in (n.args[:2], n.args[1::-1]))]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The routed-expert prefix of the chain starting at ``node``, checked as the module docstring says."""
        terms: list[_Term] = []
        ended = ""
        pairs = _chain(node)
        for index, (_, term) in enumerate(pairs):
            try:
                terms.append(_term(term, index))
            except _Unweighted as miss:
                if not terms:
                    raise NoMatch(f"not a routed-expert sum: {miss}") from None
                ended = str(miss)
                break
        first = terms[0]
        for i, t in enumerate(terms):
            if t.combine is not first.combine:
                raise NoMatch(f"term {i} reads another routing-weight matrix than term 0")
            if t.x is not first.x:
                raise NoMatch(f"term {i} reads other tokens than term 0")
            if t.column != first.column + i:
                raise NoMatch(f"term {i} reads routing column {t.column}, expected {first.column + i} (the experts "
                              "must be consecutive)")
            if (t.w1.fmt, t.w1.pow2, t.limit) != (first.w1.fmt, first.w1.pow2, first.limit):
                raise NoMatch(f"term {i} differs from term 0 in weight format, scale rule or SwiGLU limit")
        combine = first.combine
        matched = {t.column_node for t in terms}
        stray = [u for u in combine.users if _column(u) is not None and u not in matched]
        if stray:
            why = f" (the chain ended at term {len(terms)}: {ended})" if ended else ""
            raise NoMatch(f"routing column {_column(stray[0])} feeds something other than a matched expert "
                          f"({locate(stray[0])}){why}")
        if not (is_op(combine, aten.scatter) and len(combine.args) == 4 and combine.args[1] in (1, -1)
                and _zeros(combine.args[0])):
            raise NoMatch("the routing weights are not scatter(zeros, 1, ids, weights): the kernel needs the ids")
        x, ids, fmt = first.x, combine.args[2], first.w1.fmt
        dims = shape(x)
        if _dtype(x) != torch.bfloat16 or dims is None or dims[0] != (shape(combine) or (0,))[0]:
            raise NoMatch("the tokens are not a bf16 [tokens, dim] matrix matching the routing weights")
        lists = [[getattr(t, w).weight for t in terms] for w in ("w1", "w3", "w2")]
        scales = [[getattr(t, w).scale for t in terms] if fmt != "bf16" else [] for w in ("w1", "w3", "w2")]
        impl = ops.implementation_backend("moe_experts", ctx.backend)
        details = {"experts": len(terms), "first": first.column, "top_k": (shape(ids) or (0, 0))[-1],
                   "format": fmt, "pow2_scales": first.w1.pow2, "swiglu_limit": first.limit,
                   "tokens": dims[0], "dim": dims[1], "inter_dim": (shape(terms[0].w2.x) or (0, 0))[-1]}
        sink = pairs[len(terms) - 1][0]
        return Rewrite(sink, ops.moe_experts, (x, combine, ids, first.column, *lists, *scales, fmt, first.w1.pow2,
                                               first.limit, ctx.backend), f"moe_experts.{fmt}.{impl}", details)


__all__ = ["MoeDispatch"]
