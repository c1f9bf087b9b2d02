"""``fp32_linear``: matrix products computed in fp32 become ``v4compile::fp32_linear``, tensor cores at fp32
accuracy (three TF32 products, codegen/triton/fp32_linear.py) in place of cuBLAS's SIMT fp32 GEMMs.

In V4 these are the output head, the compressor's ``wkv`` / ``wgate`` and the router's scores (V4-SPEC: "always
fp32"; the router widens its bf16 weight). Whatever the spelling, the math is one product: anchors are ``linear``,
``matmul``, ``mm`` and ``addmm`` nodes with an fp32 result, normalised before matching by following each operand
back through exact widenings (casts to fp32 from bf16 / fp16, which the kernel then does in registers, reading
half the bytes) and the right operand through a transpose, so ``F.linear(x.float(), W.float())``,
``x.float() @ W.float().t()``, ``torch.matmul(x, B)`` with B [K, N] and ``addmm(b, x, W.t())`` all match.
A match computes the same fp32 product up to summation order (about 5e-7 of max|y| from an fp64 product on the
H200, as close as cuBLAS's fp32 result). Near-misses: the reference backend (the product stays in Inductor's
fp32 code, where tensor cores do not apply), deterministic mode (batch-invariant ATen products), a batched
right operand, a scaled ``addmm``, operands of other dtypes, a single row (a GEMV: cuBLAS reads the weight as fast
with one launch) and fewer than 16 output columns (under one tensor-core tile): measured on the H200,
benchmarks/fp32_gemm.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import batch_invariant
from ..codegen import ops
from ..codegen.triton.fp32_linear import DTYPES
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, dtype, is_op, numel, shape

aten = torch.ops.aten
_PRODUCTS = (aten.linear, aten.matmul, aten.mm, aten.addmm)
_CASTS = (aten.to, aten._to_copy, torch.ops.prims.convert_element_type)
MIN_COLUMNS = 16


def _widened(operand: object) -> object:
    """The tensor ``operand`` is an exact widening of: casts to fp32 followed back to a bf16 / fp16 / fp32 source."""
    while (is_op(operand, *_CASTS) and isinstance(operand.args[0], fx.Node) and dtype(operand) == torch.float32
           and dtype(operand.args[0]) in DTYPES):
        operand = operand.args[0]
    return operand


def _transposed(operand: object) -> fx.Node | None:
    """The 2-D tensor whose transpose ``operand`` is (``t``, ``transpose(0, 1)``, ``permute(1, 0)``), or None."""
    if not isinstance(operand, fx.Node) or _rank(operand) != 2:
        return None
    if is_op(operand, aten.t, aten.numpy_T):
        return operand.args[0]
    if is_op(operand, aten.transpose) and sorted(d % 2 for d in operand.args[1:3]) == [0, 1]:
        return operand.args[0]
    if is_op(operand, aten.permute) and [d % 2 for d in operand.args[1]] == [1, 0]:
        return operand.args[0]
    return None


def _name(dt: torch.dtype | None) -> str:
    return str(dt).removeprefix("torch.")


def _rank(node: object) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _may_be_one_row(node: fx.Node) -> bool:
    """Whether the product's row count (a dynamic size) may be 1 at run time."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return True
    return not statically_known_true(math.prod(val.shape[:-1]) >= 2)


class Fp32Linear(GraphPass):
    """fp32 matrix products -> one tensor-core GEMM at fp32 accuracy over the operands as stored."""

    name = "fp32_linear"
    summary = "run fp32 matrix products (output head, compressor, router) on tensor cores at fp32 accuracy (3xTF32)"
    matches = ("linear / matmul / mm / addmm with an fp32 result and a 2-D right operand, operands fp32 or widened "
               "to fp32 from bf16 / fp16, the right one as [N, K] or [K, N]")
    tolerance = 1e-5
    """Three TF32 products with fp32 accumulation: about 5e-7 of max|y| from an fp64 product at K 4096 (cuBLAS's
    fp32 GEMM: 3e-6), measured in tests/gpu/test_fp32_linear_gpu.py."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Matrix products with an fp32 result."""
        return [n for n in gm.graph.nodes if is_op(n, *_PRODUCTS) and dtype(n) == torch.float32]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The product normalised as the module docstring says."""
        if ctx.backend == "reference":
            raise NoMatch("reference backend: the fp32 product stays in Inductor's / ATen's fp32 code")
        if batch_invariant.enabled():
            raise NoMatch("deterministic mode: products stay on the batch-invariant ATen kernels")
        bias = None
        if is_op(node, aten.linear):
            x, right = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            weight, transposed = _widened(right), False
        else:
            if is_op(node, aten.addmm):
                if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                    raise NoMatch("addmm with beta or alpha other than 1")
                bias, x, right = node.args[0], node.args[1], node.args[2]
            else:
                x, right = node.args[0], node.args[1]
            base = _transposed(right)
            weight, transposed = (_widened(base), False) if base is not None else (_widened(right), True)
        if _rank(weight) != 2:
            raise NoMatch(f"the right operand has rank {_rank(weight)}, not a 2-D weight")
        activation, x = x, _widened(x)
        if bias is not None:
            if _rank(bias) != 1:
                raise NoMatch(f"the bias has rank {_rank(bias)}, not one value per output column")
            bias = _widened(bias)
        for what, operand in (("activation", x), ("weight", weight), ("bias", bias)):
            if operand is not None and dtype(operand) not in DTYPES:
                raise NoMatch(f"the {what} is {dtype(operand)}, not fp32 or a widened bf16 / fp16")
        out, w = shape(node), shape(weight)
        rows = numel(out[:-1]) if out is not None else None
        if out and out[-1] < MIN_COLUMNS:
            raise NoMatch(f"{out[-1]} output columns: under one {MIN_COLUMNS}-wide tensor-core tile (cuBLAS's fp32 "
                          "product is faster there)")
        if rows == 1:
            raise NoMatch("one row: a GEMV, where cuBLAS's fp32 GEMV reads the weight as fast (H200: output head "
                          "512 vs 542 us) with one launch")
        fp32_weights = dtype(weight) == torch.float32 and (bias is None or dtype(bias) == torch.float32)
        if not isinstance(rows, int) and fp32_weights and _may_be_one_row(node):
            # an unbacked decode batch: at one row the kernel takes cuBLAS's GEMV, which would widen a bf16
            # activation eagerly (a copy kernel per product); the widened activation is fused by Inductor into the
            # kernel that produces it, as in the static one-row graph (same values). Sizes known to be >= 2 (backed
            # batches, prefill lengths) keep the narrow activation: the kernel widens it in registers
            x = activation
        details = {"rows": rows if rows is not None else "unknown",
                   "out_features": w[0 if not transposed else 1] if w else "symbolic",
                   "in_features": w[1 if not transposed else 0] if w else "symbolic", "weight": weight.name,
                   "weight_dtype": _name(dtype(weight)), "activation_dtype": _name(dtype(x)),
                   "weight_layout": "[K, N]" if transposed else "[N, K]", "bias": bias is not None}
        return Rewrite(node, ops.fp32_linear, (x, weight, bias, transposed, ctx.backend),
                       f"fp32_linear.{ops.implementation_backend('fp32_linear', ctx.backend)}", details)


__all__ = ["Fp32Linear"]
