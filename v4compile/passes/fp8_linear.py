"""``fp8_linear``: the model's FP8 ``Linear`` (activation simulated to e4m3 per 1x128 block, weight dequantized
from e4m3 codes and e8m0 128x128 block scales, an fp32 matmul) becomes ``v4compile::fp8_linear``: one block-scaled
FP8 GEMM that reads the weight as stored (one byte an element, no dequantized copy).

Anchors are the matrix products (``linear``, ``matmul``, ``mm``) whose weight operand is computed from a 2-D e4m3
tensor. Each is bound against ``Linear.unrounded`` traced to ATen for the product's activation shape and dtype
and the weight's shape, with both scale rules (power-of-two and unrounded activation scales): the model's own
code is the pattern, so a match computes what the model computes (up to fp32 summation order and, on the GPU's
FP8 tensor cores, their block accumulation; see codegen/triton/fp8_linear.py) and a near-miss names the first
operation that differs. When the product's one use is the model's rounding to bf16 (``Linear.forward``), the
op writes bf16 and replaces the rounding too (half the output bytes, no rounding kernel); a product used in fp32
(a row-parallel layer's partial sum, ``Linear.unrounded``) stays fp32.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import torch
from torch import fx

from ..codegen import ops
from ..codegen.triton.fp8_linear import BLOCK
from ..model.linear import Linear
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, ancestors, dtype, is_op, is_static, locate, numel, shape
from .template import Template, bind_first, example_sizes, trace

aten = torch.ops.aten
_PRODUCTS = (aten.linear, aten.matmul, aten.mm)


def _e4m3_leaf(operand: object, limit: int = 32) -> fx.Node | None:
    """The 2-D e4m3 graph input or constant that ``operand`` is computed from, within ``limit`` nodes."""
    if not isinstance(operand, fx.Node):
        return None
    return next((n for n in [operand, *ancestors(operand, limit)] if n.op in ("placeholder", "get_attr")
                 and dtype(n) == torch.float8_e4m3fn and len(shape(n) or ()) == 2), None)


@lru_cache(maxsize=256)
def _template(x_shape: tuple[int, ...], x_dtype: torch.dtype, n: int, pow2: bool,
              dynamic: tuple[int, ...]) -> Template:
    """``Linear.unrounded`` of an FP8 layer [n, K] with this scale rule, traced for x of this shape and dtype
    (``dynamic``: x's dynamic dims)."""
    k = x_shape[-1]
    with torch.device("meta"):
        layer = Linear(k, n, "fp8", pow2)
    example = [torch.empty(x_shape, dtype=x_dtype), torch.empty(n, k, dtype=torch.float8_e4m3fn),
               torch.empty(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float8_e8m0fnu)]

    def forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_Unrounded(layer), {"layer.weight": weight, "layer.scale": scale}, (x,))

    return trace(forward, example, [dynamic, (), ()])


class _Unrounded(torch.nn.Module):
    """``Linear.unrounded`` as a module's forward (``functional_call`` substitutes the weight and scale)."""

    def __init__(self, layer: Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.unrounded(x)


class Fp8Linear(GraphPass):
    """The model's FP8 linear (simulated e4m3 activation times the dequantized block-scaled weight) -> one FP8 GEMM
    over the stored weight."""

    name = "fp8_linear"
    summary = "run FP8 linear layers as one block-scaled FP8 GEMM over the stored e4m3 weight"
    matches = ("linear(fp8_simulate(x, 1x128, scale rule), e4m3 weight * e8m0 128x128 block scales) in fp32: the "
               "model's FP8 Linear, any activation shape, K a multiple of 128")
    tolerance = 1e-3
    """Products are exact; fp32 summation order differs, and Hopper's FP8 MMA sums each 128-wide block in about 14
    mantissa bits (1.3e-4 normwise measured, tests/gpu/test_fp8_linear_gpu.py)."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Matrix products whose second operand is computed from a 2-D e4m3 tensor."""
        return [n for n in gm.graph.nodes if is_op(n, *_PRODUCTS) and len(n.args) >= 2
                and _e4m3_leaf(n.args[1]) is not None]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The product bound against the model's FP8 linear, as the module docstring says."""
        if not is_op(node, aten.linear) or len(node.args) > 2 and node.args[2] is not None:
            raise NoMatch(f"{node.target} with an e4m3 weight is not the model's bias-free linear(x, W)")
        x_shape, weight = shape(node.args[0]), _e4m3_leaf(node.args[1])
        w_shape = shape(weight)
        if x_shape is None or not is_static(w_shape):
            raise NoMatch("the activation or the weight has an unknown shape")
        n, k = w_shape
        if k % BLOCK:
            raise NoMatch(f"in_features {k} is not a multiple of the activation block {BLOCK}")
        activation = _activation(node.args[0])
        x_dtype = dtype(activation)
        if x_dtype is None:
            raise NoMatch(f"the activation at {locate(node)} has no known dtype")
        sizes, dynamic = example_sizes(shape(activation) or x_shape)
        pow2, binding = bind_first((True, False), lambda pow2: _template(sizes, x_dtype, n, pow2, dynamic), node,
                                   f"not the model's FP8 linear [{n}, {k}] (neither scale rule)")
        x, w, s = binding.inputs
        if w is not weight:
            raise NoMatch(f"the product's weight is not {weight.name} as stored")
        impl = ops.implementation_backend("fp8_linear", ctx.backend)
        if impl == "tilelang" and not pow2:  # the FP8 tensor cores need e4m3 activations: Triton's body runs
            impl = "triton"
        rounding = _bf16_rounding(node)
        out_dtype = torch.float32 if rounding is None else torch.bfloat16
        details = {"rows": numel(x_shape[:-1]), "out_features": n, "in_features": k,
                   "pow2_scales": pow2, "weight": w.name, "out_dtype": str(out_dtype).removeprefix("torch.")}
        return Rewrite(rounding or node, ops.fp8_linear, (x, w, s, pow2, out_dtype, ctx.backend),
                       f"fp8_linear.{impl}", details)


def _bf16_rounding(product: fx.Node) -> fx.Node | None:
    """The product's rounding to bf16 when that is its only use (the cast the op then computes), else None."""
    users = list(product.users)
    if len(users) != 1:
        return None
    cast = users[0]
    if not is_op(cast, aten.to, aten._to_copy, torch.ops.prims.convert_element_type):
        return None
    targets = [a for a in (*cast.args[1:], cast.kwargs.get("dtype")) if isinstance(a, torch.dtype)]
    return cast if targets == [torch.bfloat16] and dtype(cast) == torch.bfloat16 else None


def _activation(operand: fx.Node) -> fx.Node:
    """The tensor the product's activation was simulated from: the input of its cast to fp32 when it has one (the
    template then starts from that dtype), else the operand itself."""
    if is_op(operand, aten.to, aten._to_copy) and isinstance(operand.args[0], fx.Node):
        return operand.args[0]
    return operand


__all__ = ["Fp8Linear"]
