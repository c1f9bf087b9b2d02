"""Normalisation of a tensor built by writes: a fresh constant buffer (``new_zeros``, ``new_full``, ``zeros``,
``full``, ``*_like``) filled by ``copy_`` into slices and selects of it, then read, becomes the concatenation those
writes describe, with constant blocks where nothing was written:

    buf = kv.new_zeros(B, N, 2R, W); buf[:, :, R:] = a; buf[:, 1:, :R] = b     # transformers' C4 overlap window
    -> cat([cat([full([B, 1, R, W], 0), b], dim=1), a], dim=2)                  # the model's spelling

Exact: every element of the result is the element the last write put there or the fill. Taken only when every use
of the buffer is a write (through slices and selects, steps of 1, static bounds) or a read after the last write,
and the boxes the writes cover split the buffer by straight cuts (a guillotine partition; overlapping writes never
do); anything else stays as written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .base import dtype, is_op, shape, traced_call

aten = torch.ops.aten
_FRESH = {aten.new_zeros: 0.0, aten.zeros: 0.0, aten.zeros_like: 0.0, aten.new_full: None, aten.full: None,
          aten.full_like: None}
"""Buffer constructors and their fill (None: the fill argument)."""


def constant_fill(node: object) -> float | None:
    """The value a fresh constant tensor is filled with, or None when ``node`` is not one."""
    for op, fill in _FRESH.items():
        if is_op(node, op):
            if fill is not None:
                return fill
            value = node.args[2] if is_op(node, aten.new_full) else node.args[1]
            return float(value) if isinstance(value, (int, float, bool)) else None
    return None


@dataclass
class _Write:
    """One ``copy_`` into the buffer: the box it covers (per buffer dim, [start, end)), its source and the
    buffer dims the view chain selected away (the source gains them back as size-1 dims)."""

    copy: fx.Node
    box: list[tuple[int, int]]
    source: fx.Node
    selected: list[int]
    chain: list[fx.Node]


def writes_to_cat(gm: fx.GraphModule) -> int:
    """Rewrites every written buffer the module docstring describes; returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rewritten = 0
    for node in list(gm.graph.nodes):
        if constant_fill(node) is not None and _rewrite(node, order):
            rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
    return rewritten


def _rewrite(buffer: fx.Node, order: dict[fx.Node, int]) -> bool:
    dims = shape(buffer)
    if dims is None or not all(isinstance(d, int) for d in dims) or dtype(buffer) is None:
        return False
    writes: list[_Write] = []
    reads: list[fx.Node] = []
    for user in list(buffer.users):
        found = _write_through(user, buffer, dims)
        if found is None:
            if is_op(user, aten.slice, aten.select, aten.copy_):
                return False
            reads.append(user)
        else:
            writes.append(found)
    if not writes or not reads:
        return False
    last_write = max(order[w.copy] for w in writes)
    first_read = min(order[r] for r in reads)
    if first_read < last_write:
        return False
    if any(_mutated_between(w.source, order, order[w.copy], first_read) for w in writes):
        return False
    plan = _plan([(0, d) for d in dims], [w.box for w in writes])
    if plan is None:
        return False
    graph = buffer.graph
    with graph.inserting_before(min(reads, key=order.__getitem__)):
        built = _build(graph, buffer, plan, writes)
    for read in reads:
        read.replace_input_with(buffer, built)
    for w in writes:
        graph.erase_node(w.copy)
        for view in reversed(w.chain):
            if not view.users:
                graph.erase_node(view)
    return True


def _write_through(user: fx.Node, buffer: fx.Node, dims: tuple[int, ...]) -> _Write | None:
    """The write a chain of slices / selects from the buffer ending in ``copy_`` makes, or None."""
    box = [(0, d) for d in dims]
    view_dims = list(range(len(dims)))
    selected: list[int] = []
    chain: list[fx.Node] = []
    node = user
    while is_op(node, aten.slice, aten.select):
        if len(node.users) != 1:
            return None
        chain.append(node)
        dim = node.args[1] % len(view_dims)
        base = view_dims[dim]
        lo, hi = box[base]
        if is_op(node, aten.select):
            index = node.args[2]
            if not isinstance(index, int):
                return None
            index = index + (hi - lo) if index < 0 else index
            box[base] = (lo + index, lo + index + 1)
            selected.append(base)
            del view_dims[dim]
        else:
            args = list(node.args) + [0, None, 1][len(node.args) - 2:]
            start, end, step = args[2] or 0, args[3], args[4]
            if step != 1 or not isinstance(start, int) or not isinstance(end, (int, type(None))):
                return None
            size = hi - lo
            start = max(0, min(size, start + size if start < 0 else start))
            end = size if end is None else max(0, min(size, end + size if end < 0 else end))
            box[base] = (lo + start, lo + max(start, end))
        node = next(iter(node.users))
    if not (is_op(node, aten.copy_) and node.args[0] is (chain[-1] if chain else buffer) and not node.users):
        return None
    source = node.args[1]
    want = tuple(hi - lo for i, (lo, hi) in enumerate(box) if i not in selected)
    if not isinstance(source, fx.Node) or shape(source) != want:
        return None
    return _Write(node, box, source, sorted(selected), chain)


def _is_view(node: fx.Node) -> bool:
    """Whether an ATen call returns a view of its first input."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _written(node: fx.Node) -> list[object]:
    """The inputs an ATen call writes into (``copy_``'s destination, an in-place op's self, ``out=``)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            found.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return found


def _mutated_between(source: fx.Node, order: dict[fx.Node, int], after: int, before: int) -> bool:
    """Whether anything writes into ``source``'s storage (through any view of its base) between the two positions:
    the written values are read later than the write, so they must not change in between."""
    base = source
    while _is_view(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    family, queue = {base}, [base]
    for node in queue:
        for user in node.users:
            if after < order.get(user, -1) < before and any(w is node for w in _written(user)):
                return True
            if _is_view(user) and user.args and user.args[0] is node and user not in family:
                family.add(user)
                queue.append(user)
    return False


def _inside(box: list[tuple[int, int]], region: list[tuple[int, int]]) -> bool:
    return all(r[0] <= b[0] and b[1] <= r[1] for b, r in zip(box, region, strict=True))


def _cut(region: list[tuple[int, int]], boxes: list[list[tuple[int, int]]]) -> tuple[int, int] | None:
    """A (dim, position) inside ``region`` that no box straddles, at a box's edge; None when there is none."""
    for d, (lo, hi) in enumerate(region):
        for c in sorted({e for b in boxes for e in b[d]}):
            if lo < c < hi and not any(b[d][0] < c < b[d][1] for b in boxes):
                return d, c
    return None


_Plan = tuple
"""A guillotine partition: ``("leaf", region)`` (one write's box, or a region nothing was written to) or
``("cut", dim, (plan, plan))``."""


def _plan(region: list[tuple[int, int]], boxes: list[list[tuple[int, int]]]) -> _Plan | None:
    """How ``boxes`` (inside ``region``) split it by straight cuts, or None when they do not (overlapping boxes
    never do: one of them straddles every cut)."""
    if not boxes or boxes == [region]:
        return ("leaf", region)
    cut = _cut(region, boxes)
    if cut is None:
        return None
    d, c = cut
    halves = (region[:d] + [(region[d][0], c)] + region[d + 1:], region[:d] + [(c, region[d][1])] + region[d + 1:])
    parts = tuple(_plan(half, [b for b in boxes if _inside(b, half)]) for half in halves)
    return None if None in parts else ("cut", d, parts)


def _build(graph: fx.Graph, buffer: fx.Node, plan: _Plan, writes: list[_Write]) -> fx.Node:
    if plan[0] == "cut":
        return traced_call(graph, aten.cat.default, [_build(graph, buffer, p, writes) for p in plan[2]], plan[1])
    region = plan[1]
    written = next((w for w in writes if w.box == region), None)
    if written is not None:
        return _source(graph, written, buffer)
    val = buffer.meta["val"]
    return traced_call(graph, aten.full.default, [hi - lo for lo, hi in region], constant_fill(buffer),
                       fake_mode=getattr(writes[0].source.meta.get("val"), "fake_mode", None),
                       dtype=val.dtype, device=val.device, pin_memory=False)


def _source(graph: fx.Graph, write: _Write, buffer: fx.Node) -> fx.Node:
    """The written values in the buffer's rank and dtype (copy_ converts to the destination's dtype)."""
    node = write.source
    for dim in write.selected:
        node = traced_call(graph, aten.unsqueeze.default, node, dim)
    if dtype(node) != dtype(buffer):
        node = traced_call(graph, aten._to_copy.default, node, dtype=dtype(buffer))
    return node
