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

transformers' grouped experts (``grouped_mm_experts_forward``: pairs sorted by expert, one grouped matmul over a fused
``gate_up_proj`` [E, 2I, D] split by ``chunk`` or two over separate gate and up weights, the routing weights applied
after the down projection, the outputs put back by an inverse permutation and summed per token) start at the down
projection's grouped matmul followed by the weights' multiply; they are bound against that function (the template
``_grouped_experts``, both weight layouts) and become the same op, ``w1`` and
``w3`` the two halves of the fused weight (views). Ids from a ``topk`` never repeat; ids from anywhere else
(transformers' hash routing: a table lookup) may list an expert twice, which transformers counts twice and the op (like
the official model) once: there each listing's weight becomes the sum of its expert's listings' weights, so the op's
one count computes transformers' sum.

The two place the routing weight differently, so they round differently: transformers rounds silu(g) * u, the down
projection and weight * output each to bf16 and sums in bf16; the op rounds weight * silu(g) * u once and sums in
fp32. Measured against transformers' rounding: at most 1.1% of max|y| over 18 random bf16 layers (64-256 tokens, 4-32
experts, top 2-6), 0.56% and 0.72% on the tiny transformers model's two score-routed layers (tests/passes/
test_hf_model.py); against the same math in fp64 the op is the closer of the two (0.34-0.48% against 0.46-0.60%).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from functools import lru_cache

import torch
import torch.nn.functional as F
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
    read_through_cast,
    shape,
    traced_call,
    users_past_noop_slices,
)
from .template import Template, bind_first, example_sizes, skip_noop_casts, trace

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
               "ascending expert order; transformers' score-routed grouped experts (fused gate_up or separate "
               "gate and up, weight * w2(...) after the down projection, bf16)")
    tolerance = 2e-2
    """Products are exact and only fp32 summation order differs, but that noise can flip a bf16 or e4m3 rounding
    of the hidden state, which moves an output by a small fraction of max|y|. transformers' experts round three
    more times in bf16 (module docstring): measured up to 1.1% of max|y|."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """``index_copy`` nodes whose source is a grouped matmul's output (the experts' outputs in pair order), and
        grouped matmuls whose output is multiplied by per-pair weights (transformers' down projection)."""
        return [n for n in gm.graph.nodes if is_op(n, aten.index_copy) and len(n.args) >= 4
                and is_op(_source(n.args[3]), aten._grouped_mm) or _weighted_after(n) is not None]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The region from the tokens, routing weights and ids to the per-token sum, bound as the docstring says."""
        if is_op(node, aten._grouped_mm):
            return _analyze_grouped(node, ctx)
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
        pow2, binding = bind_first(
            (True, False) if fmt != "bf16" else (False,),
            lambda pow2: _template(tokens, k, n, first, dim, inter, fmt, pow2, limit, 0 in dynamic), end,
            f"not the model's routed experts ({fmt}, {n} experts from {first}, limit {limit})")
        x, weights, ids, *params = binding.inputs
        quantized = fmt != "bf16"
        w1, s1, w3, s3, w2, s2 = params if quantized else (params[0], None, params[1], None, params[2], None)
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        cuda = val is None or val.device.type == "cuda"
        impl = _implementation(ctx.backend, fmt, None if 0 in dynamic else tokens * k, n, cuda)
        details = {"experts": n, "first": first, "top_k": k, "format": fmt, "pow2_scales": pow2,
                   "swiglu_limit": limit, "tokens": shape(view)[0], "dim": dim, "inter_dim": inter}
        return Rewrite(end, ops.moe_experts, (x, weights, ids, first, w1, w3, w2, s1, s3, s2, fmt, pow2,
                                              limit, ctx.backend), f"moe_experts.{fmt}.{impl}", details)


def _implementation(backend: str, fmt: str, pairs: int | None = None, experts: int = 0, cuda: bool = True) -> str:
    """The backend whose kernels run the op for ``backend``: TileLang's body multiplies FP4 experts only, and on
    CUDA at prefill sizes only (it hands smaller calls to the Triton tiles), so a graph with a static ``pairs``
    count below those sizes (a decode step) is named Triton, as it runs; other formats run Triton's."""
    impl = ops.implementation_backend("moe_experts", backend)
    if impl != "tilelang":
        return impl
    if fmt != "fp4":
        return "triton"
    if pairs is not None and cuda:
        from ..codegen.tilelang.moe import launch_config

        return "tilelang" if launch_config(pairs, experts, True) is not None else "triton"
    return impl


def _weighted_after(node: fx.Node) -> fx.Node | None:
    """The multiply by per-pair routing weights [pairs, 1] that is the only user of the grouped matmul ``node`` (a
    down projection with the weights applied after it, transformers' spelling); None if it is not one."""
    if not is_op(node, aten._grouped_mm) or len(node.users) != 1:
        return None
    mul = next(iter(node.users))
    if not is_op(mul, aten.mul) or len(mul.args) != 2:
        return None
    other = mul.args[1] if mul.args[0] is node else mul.args[0]
    dims = shape(other)
    return mul if dims is not None and len(dims) == 2 and dims[1] == 1 else None


def _grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *projections: torch.Tensor,
                     limit: float, histc_dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` with the DeepSeek-V4 gate (``_apply_gate``), no bias, no expert
    parallelism: the pattern its graph is bound against. ``projections``: the fused ``gate_up`` [E, 2I, D] and
    ``down`` [E, D, I], or separate ``gate``, ``up`` [E, I, D] and ``down``; ``histc_dtype``: the dtype it counts the
    sorted ids in (float32 on CPU, int32 on CUDA)."""
    *gate_up, down = projections
    experts, k = down.shape[0], ids.shape[-1]
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    rows = x[perm // k]
    pair_weights = weights.reshape(-1)[perm]
    counts = torch.histc(sorted_ids.to(histc_dtype), bins=experts, min=0, max=experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if len(gate_up) == 1:
        gate, up = torch._grouped_mm(rows, gate_up[0].transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    else:
        gate, up = (torch._grouped_mm(rows, w.transpose(-2, -1), offs=offsets) for w in gate_up)
    hidden = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    out = torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offsets) * pair_weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inverse].view(x.shape[0], k, x.shape[-1]).sum(dim=1)


@lru_cache(maxsize=64)
def _grouped_template(tokens: int, k: int, n: int, dim: int, inter: int, fused: bool, weight_dtype: torch.dtype,
                      limit: float, device: str, dynamic: bool) -> Template:
    """``_grouped_experts`` with these settings traced for x [tokens, dim] bf16, weights/ids [tokens, k] on
    ``device`` (``dynamic``: a dynamic token count). transformers counts the sorted ids as float32 on CPU and int32
    on CUDA (CPU's histc has no int32 kernel, so each device is traced with its own)."""
    histc_dtype = torch.float32 if torch.device(device).type in ("cpu", "mps") else torch.int32
    shapes = [(n, 2 * inter, dim)] if fused else [(n, inter, dim), (n, inter, dim)]
    example = [torch.empty(tokens, dim, dtype=torch.bfloat16), torch.empty(tokens, k, dtype=weight_dtype),
               torch.empty(tokens, k, dtype=torch.long)]
    example += [torch.empty(s, dtype=torch.bfloat16) for s in [*shapes, (n, dim, inter)]]
    example = [t.to(device) for t in example]

    def forward(*args: torch.Tensor) -> torch.Tensor:
        return _grouped_experts(*args, limit=limit, histc_dtype=histc_dtype)

    rows = (0,) if dynamic else ()
    return trace(forward, example, [rows, rows, rows] + [()] * (len(example) - 3))


def _per_token_sum(mul: fx.Node) -> fx.Node:
    """The sum over top_k that ends transformers' experts: the first ``sum`` among the users downstream of the
    weighted outputs ``mul`` (through the inverse permutation and the [tokens, top_k, dim] view)."""
    node = mul
    for _ in range(4):
        users = list(node.users)
        if len(users) != 1:
            break
        node = users[0]
        if is_op(node, aten.sum):
            return node
    raise NoMatch(f"the weighted expert outputs at {locate(mul)} do not reach a per-token sum through one chain")


def _analyze_grouped(down_mm: fx.Node, ctx: RewriteContext) -> Rewrite:
    """transformers' grouped experts ending at the down projection ``down_mm`` -> ``moe_experts`` (module
    docstring), or a near-miss naming why not."""
    mul = _weighted_after(down_mm)
    end = _per_token_sum(mul)
    down, scale = _stacked_weight(down_mm)
    if scale is not None or dtype(down) != torch.bfloat16:
        raise NoMatch(f"the grouped experts at {locate(down_mm)} read {dtype(down)} weights; the routing weight "
                      "after the down projection is matched for bf16 experts only")
    n, dim, inter = shape(down) or (0, 0, 0)
    sum_shape = shape(end.args[0]) or ()
    if len(sum_shape) != 3:
        raise NoMatch(f"the expert outputs at {locate(end)} are not summed as [tokens, top_k, dim]")
    (tokens, k), dynamic = example_sizes(sum_shape[:2])
    clamps = [c for c in ancestors(down_mm, 40) if is_op(c, aten.clamp)]
    limits = [float(c) for c in _constant_after(clamps, aten.clamp, 2)]
    limit = max(limits) if limits else 0.0
    other = mul.args[1] if mul.args[0] is down_mm else mul.args[0]
    device = str(end.meta["val"].device)
    fused, binding = bind_first(
        (True, False),
        lambda fused: _grouped_template(tokens, k, n, dim, inter, fused, dtype(other), limit, device, 0 in dynamic),
        end, f"not transformers' grouped experts ({n} experts, limit {limit})")
    x, weights, ids, *projections = binding.inputs
    selector = _source(ids)
    top_k = selector.target is operator.getitem and is_op(selector.args[0], aten.topk) and selector.args[1] == 1
    if top_k:
        scores = shape(selector.args[0].args[0]) or ()
        if not scores or scores[-1] != n:
            raise NoMatch(f"the top-k at {locate(selector)} ranks {scores[-1] if scores else '?'} experts, the "
                          f"weights hold {n}")
    with end.graph.inserting_before(end):
        if not top_k:
            weights = _merge_repeats(end.graph, ids, weights)
        if fused:
            w1 = end.graph.call_function(aten.slice.Tensor, (projections[0], 1, 0, inter))
            w3 = end.graph.call_function(aten.slice.Tensor, (projections[0], 1, inter, 2 * inter))
            for half, start in ((w1, 0), (w3, inter)):
                half.meta["val"] = projections[0].meta["val"][:, start:start + inter]
        else:
            w1, w3 = projections[:2]
    read_through_cast(end)  # the op sums in fp32, transformers in bf16
    impl = _implementation(ctx.backend, "bf16")
    details = {"experts": n, "first": 0, "top_k": k, "format": "bf16", "pow2_scales": False, "swiglu_limit": limit,
               "tokens": sum_shape[0], "dim": dim, "inter_dim": inter,
               "form": "transformers fused gate_up" if fused else "transformers gate, up",
               "routing": "top-k" if top_k else f"ids from {_describe_source(selector)}: repeats counted per listing"}
    return Rewrite(end, ops.moe_experts, (x, weights, ids, 0, w1, w3, down, None, None, None, "bf16", False, limit,
                                          ctx.backend), f"moe_experts.bf16.{impl}", details)


def _merge_repeats(graph: fx.Graph, ids: fx.Node, weights: fx.Node) -> fx.Node:
    """Routing weights [T, k] where each listing of an expert carries the fp32 sum of the weights of every listing of
    that expert in its token's row. Ids not from a top-k (transformers' hash routing) may list an expert twice;
    transformers then counts it twice, the op once (its first listing): with the weights merged both compute the
    same sum (in the op, the merged weight scales the SwiGLU once)."""
    same = traced_call(graph, aten.eq.Tensor, traced_call(graph, aten.unsqueeze.default, ids, -1),
                       traced_call(graph, aten.unsqueeze.default, ids, -2))
    wide = traced_call(graph, aten.unsqueeze.default,
                       traced_call(graph, aten._to_copy.default, weights, dtype=torch.float32), -2)
    return traced_call(graph, aten.sum.dim_IntList, traced_call(graph, aten.mul.Tensor, same, wide), [-1])


def _describe_source(node: object) -> str:
    """A short name for the op that computed ``node``, and where."""
    if not isinstance(node, fx.Node):
        return repr(node)
    what = str(node.target) if node.op == "call_function" else node.op
    return f"{what} at {locate(node)}"


def _source(node: object) -> object:
    """``node`` under casts (to fp32 or to its own dtype)."""
    node = skip_noop_casts(node)
    while is_op(node, aten.to, aten._to_copy):
        node = skip_noop_casts(node.args[0])
    return node


__all__ = ["MoeDispatch"]
