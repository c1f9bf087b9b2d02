"""Which KV columns an additive attention mask lets each query row read, as the [B, S, K] entry index lists the sparse
attention kernel takes (-1: masked), with K as small as the mask's construction proves.

A dense attention (``softmax(q K^T * scale + mask)``, transformers' spelling) is the sparse kernel's math when every
mask value is 0 (read) or masked (-inf, or the dtype's lowest value, whose exp is 0 beside any finite score). The
mask is read as column blocks (a ``cat`` over the last dim, a zero ``pad``), each one of:

- a **band**: ``where(lo(s) <= k <= hi(s), 0, lowest)`` with bounds affine in the row s built from ``arange``
  (a sliding-window causal mask): K = the band's width, ids ``lo(s) + j`` built from two ``arange`` calls;
- a **scatter**: ``full(lowest).scatter_(-1, ids, 0)[..., :T]`` whose ids are a ``topk``'s (distinct per row;
  ``where`` may swap some for constants outside [0, T), which the slice drops): K = the top-k's k, the ids kept;
- any other 0 / masked block (``masked_fill`` of zeros, ``where`` over an arbitrary condition, a constant 0): K =
  the block's width, ids ``where(block == 0, arange, -1)`` computed from the block itself.

Exact: the kernel reads each allowed column once and nothing else. A mask that varies per head, or whose values are
not provably 0 / masked (a bias), is a ``NoMatch`` naming why.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from .base import NoMatch, dtype, is_op, shape, traced_call
from .buffer_writes import constant_fill

aten = torch.ops.aten
Axes = dict[int, int]
"""An integer tensor's coefficient per axis, axes counted from the right (-1: the mask's columns, -2: its rows)."""


@dataclass(frozen=True)
class Affine:
    """An integer tensor whose element at index i is ``sum(coef[a] * i[a]) + const`` (a from the right)."""

    coef: tuple[tuple[int, int], ...]
    const: int

    @staticmethod
    def of(coef: Axes, const: int) -> Affine:
        return Affine(tuple(sorted((a, c) for a, c in coef.items() if c)), const)

    def axes(self) -> Axes:
        return dict(self.coef)

    def plus(self, other: Affine, sign: int = 1) -> Affine:
        coef = self.axes()
        for a, c in other.coef:
            coef[a] = coef.get(a, 0) + sign * c
        return Affine.of(coef, self.const + sign * other.const)

    def scaled(self, factor: int) -> Affine:
        return Affine.of({a: c * factor for a, c in self.coef}, self.const * factor)

    def moved(self, move: Callable[[int], int | None]) -> Affine:
        """The same values after a view that moves axis a to ``move(a)`` (None: a size-1 axis dropped)."""
        return Affine.of({move(a): c for a, c in self.coef if move(a) is not None}, self.const)


def _dims(node: object) -> tuple[int, ...]:
    dims = shape(node)
    if dims is None or not all(isinstance(d, int) for d in dims):
        raise NoMatch(f"{node} has no static shape ({dims}): the index lists are built for static sizes")
    return dims


def _unit_free(value: Affine, node: object) -> Affine:
    """``value`` without coefficients on ``node``'s size-1 axes (their index is always 0)."""
    dims = _dims(node)
    return value.moved(lambda a: None if dims[a] == 1 else a)


def _is_masked(value: object, kind: torch.dtype | None) -> bool:
    """-inf, or the lowest finite value of the mask's dtype (transformers' ``torch.finfo(dtype).min``)."""
    if not isinstance(value, (int, float)) or kind is None or not kind.is_floating_point:
        return False
    return value == float("-inf") or value <= torch.finfo(kind).min


def _scalar(node: object) -> float | None:
    """A Python number, or a constant tensor's value (``torch.zeros(())``, ``full_like(x, -1)``)."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    return constant_fill(node)


def _view_move(before: tuple, after: tuple) -> Callable[[int], int | None] | None:
    """The from-the-right axis map of a view that only adds or drops size-1 axes, else None."""
    kept_in = [i for i, s in enumerate(before) if s != 1]
    kept_out = [i for i, s in enumerate(after) if s != 1]
    if [before[i] for i in kept_in] != [after[i] for i in kept_out]:
        return None
    table = {i - len(before): o - len(after) for i, o in zip(kept_in, kept_out, strict=True)}
    return table.get


def _unsqueeze_move(ndim: int, dim: int) -> Callable[[int], int]:
    """From-the-right axis map of ``unsqueeze(dim)`` on a tensor of ``ndim`` axes."""
    dim = dim % (ndim + 1)
    return lambda a: a - 1 if a + ndim < dim else a


_PASS_THROUGH = (aten.expand, aten.alias, aten.to, aten._to_copy, aten.lift_fresh_copy, aten.clone)
"""Ops that keep every element's value (broadcasting an axis of size 1 keeps its index-0 value)."""


def affine(node: object) -> Affine:
    """``node``'s integer values as an ``Affine`` (built from ``arange``, integer +, -, * and broadcasting views)."""
    if isinstance(node, int) and not isinstance(node, bool):
        return Affine.of({}, node)
    return _unit_free(_affine(node), node)


def _affine(node: object) -> Affine:
    if is_op(node, aten.arange):
        args = [a for a in node.args if isinstance(a, int)]
        if len(args) != len(node.args):
            raise NoMatch(f"{node} is an arange with a dynamic bound")
        start, step = (args[0], args[2] if len(args) > 2 else 1) if len(args) > 1 else (0, 1)
        return Affine.of({-1: step}, start)
    if is_op(node, aten.add, aten.sub):
        sign = 1 if is_op(node, aten.add) else -1
        return affine(node.args[0]).plus(affine(node.args[1]).scaled(node.kwargs.get("alpha", 1)), sign)
    if is_op(node, aten.mul) and isinstance(node.args[1], int):
        return affine(node.args[0]).scaled(node.args[1])
    if is_op(node, aten.unsqueeze):
        return affine(node.args[0]).moved(_unsqueeze_move(len(_dims(node.args[0])), node.args[1]))
    if is_op(node, *_PASS_THROUGH) and dtype(node) in (torch.int64, torch.int32):
        return affine(node.args[0])
    if is_op(node, aten.view, aten.reshape, aten._unsafe_view):
        move = _view_move(_dims(node.args[0]), _dims(node))
        if move is not None:
            return affine(node.args[0]).moved(move)
    if is_op(node, aten.index) and len(node.args[1]) == len(_dims(node.args[0])) and None not in node.args[1]:
        # x[i0, i1, ...] of an affine x at affine indices (transformers' position_ids[batch_idx, q_idx])
        source, ndim = affine(node.args[0]), len(node.args[1])
        value = Affine.of({}, source.const)
        for axis, coef in source.coef:
            value = value.plus(affine(node.args[1][axis + ndim]).scaled(coef))
        return value
    raise NoMatch(f"{node} is not an affine function of arange indices")


def conditions(node: object) -> list[Affine | None]:
    """A boolean tensor as the conjunction it is: ``affine >= 0`` for each comparison of affine values (``&``,
    all-true constants and broadcasting views seen through), None for each other term (a padding mask's lookup)."""
    return [None if c is None else _unit_free(c, node) for c in _conditions(node)]


def _conditions(node: object) -> list[Affine | None]:
    if dtype(node) == torch.bool and (constant_fill(node) == 1.0 or is_op(node, aten.new_ones, aten.ones)):
        return []
    if is_op(node, aten.__and__, aten.bitwise_and, aten.logical_and):
        return conditions(node.args[0]) + conditions(node.args[1])
    compare = {aten.ge: (1, 0), aten.gt: (1, -1), aten.le: (-1, 0), aten.lt: (-1, -1)}
    for op, (sign, shift) in compare.items():
        if is_op(node, op):
            try:
                diff = affine(node.args[0]).plus(affine(node.args[1]), -1).scaled(sign)
            except NoMatch:
                return [None]
            return [diff.plus(Affine.of({}, shift))]
    if is_op(node, aten.unsqueeze):
        move = _unsqueeze_move(len(_dims(node.args[0])), node.args[1])
        return [None if c is None else c.moved(move) for c in conditions(node.args[0])]
    if is_op(node, aten.expand, aten.alias, aten.to, aten._to_copy):
        return conditions(node.args[0])
    return [None]


def band(conds: list[Affine | None]) -> tuple[int, int, int, bool] | None:
    """(a, c, W, exact) when ``conds`` bound every row s's columns k to ``a*s + c <= k < a*s + c + W`` (exact: the
    band is the whole condition, no other term), else None (bounds on another axis, or moving at different rates)."""
    lows, highs, exact = [], [], True
    for cond in conds:
        if cond is None:
            exact = False
            continue
        coef = cond.axes()
        k, s = coef.pop(-1, 0), coef.pop(-2, 0)
        if coef or k not in (1, -1, 0):
            exact = False
            continue
        if k == 0:
            exact = exact and s == 0 and cond.const >= 0
            continue
        (lows if k == 1 else highs).append((-s, -cond.const) if k == 1 else (s, cond.const))
    if not lows or not highs or len({a for a, _ in lows + highs}) != 1:
        return None
    low, high = max(c for _, c in lows), min(c for _, c in highs)
    return lows[0][0], low, high - low + 1, exact


class _Emitter:
    """Inserts the index-building nodes, with traced values, at the graph's insertion point."""

    def __init__(self, graph: fx.Graph, like: fx.Node) -> None:
        val = like.meta["val"]
        self.graph, self.device, self.mode = graph, val.device, getattr(val, "fake_mode", None)

    def __call__(self, op: object, *args: object, **kwargs: object) -> fx.Node:
        return traced_call(self.graph, op, *args, fake_mode=self.mode, **kwargs)

    def arange(self, n: int) -> fx.Node:
        return self(aten.arange.default, n, dtype=torch.int64, device=self.device)

    def rows(self, block: fx.Node, batch: int, rows: int, width: int) -> fx.Node:
        """``block`` broadcast to [batch, rows, width] (its head axis, of size 1, dropped)."""
        dims = _dims(block)
        if len(dims) == 4:
            block = self(aten.select.int, block, 1, 0)
        return self(aten.expand.default, block, [batch, rows, width])

    def masked(self, ids: fx.Node, width: int) -> fx.Node:
        """``ids`` with every id outside [0, width) replaced by -1."""
        inside = self(aten.bitwise_and.Tensor, self(aten.ge.Scalar, ids, 0), self(aten.lt.Scalar, ids, width))
        return self(aten.where.ScalarOther, inside, ids, -1)


@dataclass
class Block:
    """A column block of the mask: its width, how many ids a row reads from it (K), and how to build them."""

    kind: str
    width: int
    entries: int
    build: Callable[[_Emitter, int, int], fx.Node]
    """(emit, batch, rows) -> [batch, rows, entries] int64 column ids within the block, -1 masked."""


def blocks(mask: fx.Node) -> list[Block]:
    """The mask's column blocks, in order; ``NoMatch`` when a block is not a 0 / masked mask of one of the forms
    the module docstring lists."""
    while is_op(mask, aten.alias, aten.to, aten._to_copy):
        mask = mask.args[0]
    dims = _dims(mask)
    if is_op(mask, aten.cat) and (mask.args[1] if len(mask.args) > 1 else 0) % len(dims) == len(dims) - 1:
        return [b for part in mask.args[0] for b in blocks(part)]
    if _zero_pad(mask):
        return [*blocks(mask.args[0]), _everything(mask.args[1][1])]
    if len(dims) > 4 or len(dims) >= 3 and dims[-3] != 1:
        raise NoMatch(f"the mask {mask} differs per head (the kernel's entries are one list per query row)")
    return [_block(mask, dims[-1])]


def _zero_pad(mask: fx.Node) -> bool:
    """Whether ``mask`` is ``F.pad(x, (0, n), value=0)``: x, then n columns every row reads."""
    if is_op(mask, aten.pad):
        mode = mask.args[2] if len(mask.args) > 2 else mask.kwargs.get("mode", "constant")
        value = mask.args[3] if len(mask.args) > 3 else mask.kwargs.get("value")
        if mode != "constant" or value not in (None, 0):
            return False
    elif is_op(mask, aten.constant_pad_nd):
        if (mask.args[2] if len(mask.args) > 2 else 0) != 0:
            return False
    else:
        return False
    return len(mask.args[1]) == 2 and mask.args[1][0] == 0 and isinstance(mask.args[1][1], int)


def _block(mask: fx.Node, width: int) -> Block:
    kind = dtype(mask)
    if is_op(mask, aten.where):
        read, masked = _scalar(mask.args[1]), _scalar(mask.args[2])
        if read == 0 and _is_masked(masked, kind):
            found = band(conditions(mask.args[0]))
            if found is not None and 0 < found[2] < width:
                return _band(*found[:3], width, None if found[3] else mask)
            return _dense(mask, width)
        if _is_masked(read, kind) and masked == 0:
            return _dense(mask, width)
    if is_op(mask, aten.masked_fill) and constant_fill(mask.args[0]) == 0 and _is_masked(mask.args[2], kind):
        return _dense(mask, width)
    if constant_fill(mask) == 0:
        return _everything(width)
    scattered = mask
    if is_op(mask, aten.slice) and mask.args[1] % len(_dims(mask)) == len(_dims(mask)) - 1 \
            and (mask.args[2] or 0) == 0:
        scattered = mask.args[0]
    if is_op(scattered, aten.scatter, aten.scatter_) and len(scattered.args) == 4 and not scattered.kwargs:
        base, dim, ids, value = scattered.args[:4]
        dims = _dims(base)
        if dim % len(dims) == len(dims) - 1 and value == 0 and _is_masked(constant_fill(base), dtype(base)) \
                and len(base.users) == 1 and _dims(ids)[:-1] == dims[:-1]:
            return _top_k(ids, width) if _distinct(ids, width) else _dense(mask, width)
    raise NoMatch(f"the mask block {mask} is not 0 where read and -inf / the lowest value where masked (a where, "
                  "masked_fill, scatter or constant of those)")


def _band(a: int, low: int, span: int, width: int, mask: fx.Node | None) -> Block:
    """Columns ``a*s + low + j`` (j < span) of row s, each kept where ``mask`` reads it when the band is not the
    whole condition (``mask`` None: it is)."""
    def build(emit: _Emitter, batch: int, rows: int) -> fx.Node:
        starts = emit(aten.add.Tensor, emit(aten.mul.Tensor, emit.arange(rows), a), low)
        ids = emit(aten.add.Tensor, emit(aten.unsqueeze.default, starts, 1), emit.arange(span))
        ids = emit(aten.expand.default, emit.masked(ids, width), [batch, rows, span])
        if mask is None:
            return ids
        read = emit(aten.eq.Scalar, emit.rows(mask, batch, rows, width), 0)
        kept = emit(aten.gather.default, read, 2, emit(aten.clamp.default, ids, 0))
        return emit(aten.where.ScalarOther, kept, ids, -1)
    return Block(f"band of {span}" + ("" if mask is None else " (within the mask)"), width, span, build)


def _dense(mask: fx.Node, width: int) -> Block:
    def build(emit: _Emitter, batch: int, rows: int) -> fx.Node:
        read = emit(aten.eq.Scalar, emit.rows(mask, batch, rows, width), 0)
        return emit(aten.where.ScalarOther, read, emit.arange(width), -1)
    return Block(f"every column of {width}", width, width, build)


def _everything(width: int) -> Block:
    def build(emit: _Emitter, batch: int, rows: int) -> fx.Node:
        return emit(aten.expand.default, emit.arange(width), [batch, rows, width])
    return Block(f"every column of {width}", width, width, build)


def _top_k(ids: fx.Node, width: int) -> Block:
    """The scattered ids themselves (distinct per row), those outside [0, width) masked."""
    k = _dims(ids)[-1]

    def build(emit: _Emitter, batch: int, rows: int) -> fx.Node:
        return emit.masked(emit.rows(ids, batch, rows, k), width)
    return Block(f"top-{k}", width, k, build)


def _distinct(ids: object, width: int) -> bool:
    """Whether each row of ``ids`` provably holds distinct values in [0, width) (a duplicate is one column for the
    mask, two reads for the kernel): a top-k's indices, some swapped for constants outside [0, width)."""
    while is_op(ids, aten.unsqueeze, aten.alias, aten.expand):
        ids = ids.args[0]
    if is_op(ids, aten.where):
        outside = [_scalar(a) for a in ids.args[1:3]]
        kept = [a for a, v in zip(ids.args[1:3], outside, strict=True) if v is None]
        constants = [v for v in outside if v is not None]
        if len(kept) == 1 and all(v < 0 or v >= width for v in constants):
            return _distinct(kept[0], width)
    if isinstance(ids, fx.Node) and ids.target is operator.getitem and ids.args[1] == 1 \
            and is_op(ids.args[0], aten.topk, torch.ops.v4compile.radix_topk):
        return True
    return False


def mask_blocks(mask: fx.Node | None, columns: int) -> list[Block]:
    """The column blocks of the additive ``mask`` over ``columns`` KV columns (None: no mask, every column read)."""
    found = [_everything(columns)] if mask is None else blocks(mask)
    if sum(b.width for b in found) != columns:
        raise NoMatch(f"the mask's blocks cover {sum(b.width for b in found)} columns of {columns}")
    return found


def entry_index(graph: fx.Graph, found: list[Block], like: fx.Node, batch: int, rows: int) -> fx.Node:
    """Inserts at the graph's insertion point the [batch, rows, K] int64 ids of the columns ``found``'s blocks let
    each row read, -1 padded, on ``like``'s device."""
    emit = _Emitter(graph, like)
    parts, offset = [], 0
    for block in found:
        ids = block.build(emit, batch, rows)
        if offset:
            ids = emit(aten.where.ScalarOther, emit(aten.ge.Scalar, ids, 0), emit(aten.add.Tensor, ids, offset), -1)
        parts.append(ids)
        offset += block.width
    return parts[0] if len(parts) == 1 else emit(aten.cat.default, parts, -1)
