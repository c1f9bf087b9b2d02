"""``slice_update``: a ``cat`` that rebuilds a tensor from an untouched slice of it and a new piece becomes a
``slice_scatter`` of the new piece into that tensor.

RoPE spells its output as ``cat(x[..., :-r], rotated(x[..., -r:]))``: the values are x's except in the last r
columns. As a ``cat`` Inductor writes a new tensor of x's full size (at an 8192-token V4-Flash prefill the queries'
and the attention output's RoPE copies moved about 5 ms of 105 on the H100: benchmarks/NOTES.md 35th). As
``slice_scatter(x, rotated, -1, d - r, d)`` the values are the same, bitwise, and when nothing reads x after it
Inductor's reinplacing writes only the r new columns into x's own buffer. The pass rewrites a two-piece ``cat``
along a static dimension when one piece is a unit-step slice of some x, the other piece fills exactly the rest
of x along that dimension, and x (through any views) is read nowhere after the ``cat``; otherwise the near-miss
says which of these failed. Shapes with an unbacked size (the CPU's decode batch) are declined: Inductor's matmul
lowering then guards on that size's value, which an unbacked size does not allow (torch 2.13).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .base import GraphPass, NoMatch, Rewrite, RewriteContext, is_op, shape

aten = torch.ops.aten
_VIEWS = (aten.view, aten._unsafe_view, aten.reshape, aten.unflatten, aten.flatten)


class SliceUpdate(GraphPass):
    """``cat`` of an untouched slice of x and a new piece -> ``slice_scatter`` of the piece into x."""

    name = "slice_update"
    summary = "a cat that rebuilds x from a slice of x and a new piece -> slice_scatter (written in place)"
    matches = "two-piece aten.cat where one piece is a unit-step slice of x and the other fills the rest of x"
    tolerance = 0.0

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Every two-piece ``cat`` with a slice among its pieces."""
        return [n for n in gm.graph.nodes if is_op(n, aten.cat) and len(n.args[0]) == 2
                and any(is_op(p, aten.slice) for p in n.args[0])]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The ``slice_scatter`` when the cat rebuilds x and x dies with it."""
        pieces = list(node.args[0])
        out = shape(node)
        if out is None:
            raise NoMatch("the cat's shape is unknown")
        if free_unbacked_symbols(node.meta["val"].shape):
            raise NoMatch("a size is unbacked (known only at run time, e.g. the CPU's decode batch): Inductor's "
                          "layout choices for what reads the update would have to guard on its value")
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
        if not isinstance(out[dim], int):
            raise NoMatch(f"the cat's dimension {dim} is dynamic")
        for kept, new in ((0, 1), (1, 0)):
            piece = pieces[kept]
            if not is_op(piece, aten.slice):
                continue
            base, start, end = _slice_bounds(piece, dim)
            base_shape, new_shape = shape(base), shape(pieces[new])
            if base_shape is None or new_shape is None or base_shape != out:
                raise NoMatch(f"the slice's input {base.name} does not have the cat's shape")
            if base.meta["val"].dtype != node.meta["val"].dtype:
                raise NoMatch(f"{base.name} is {base.meta['val'].dtype}, the cat {node.meta['val'].dtype}")
            size = out[dim]
            lo, hi = (end, size) if kept == 0 else (0, start)
            if start is None or (kept == 0 and start != 0) or (kept == 1 and end != size) or \
                    new_shape[dim] != hi - lo:
                raise NoMatch(f"the slice of {base.name} and the new piece do not tile its dimension {dim}")
            _check_dies(base, node)
            return Rewrite(sink=node, op=aten.slice_scatter.default, args=(base, pieces[new], dim, lo, hi),
                           kernel="aten.slice_scatter", details={"dim": dim, "columns": f"{lo}:{hi} of {size}"})
        raise NoMatch("the slice is not one of the cat's pieces")


def _slice_bounds(node: fx.Node, dim: int) -> tuple[fx.Node, int | None, int | None]:
    """The sliced tensor and the slice's [start, end) along ``dim`` (None, None when it is along another dimension,
    has a step or dynamic bounds)."""
    base, sdim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    dims = shape(base)
    if dims is None or sdim % len(dims) != dim or step != 1:
        return base, None, None
    size = dims[dim]
    start, end = 0 if start is None else start, sys.maxsize if end is None else end
    if not all(isinstance(v, int) for v in (size, start, end)):
        return base, None, None
    start, end = (v + size if v < 0 else v for v in (start, end))
    return base, max(0, min(start, size)), max(0, min(end, size))


def _check_dies(base: fx.Node, cat: fx.Node) -> None:
    """NoMatch unless ``base`` is computed in the graph (not an input) and neither it nor what it is a view of is
    read after ``cat``: then Inductor can write the new piece into its buffer."""
    order = {n: i for i, n in enumerate(cat.graph.nodes)}
    chain = [base]
    while is_op(chain[-1], *_VIEWS):
        chain.append(chain[-1].args[0])
    if chain[-1].op != "call_function":
        raise NoMatch(f"{base.name} is a graph input or parameter: the update would copy it, as the cat does")
    for n in chain:
        later = [u.name for u in n.users if u not in chain and order[u] > order[cat]]
        if later:
            raise NoMatch(f"{n.name} is read after the cat (by {', '.join(later)}): it cannot be written in place")
