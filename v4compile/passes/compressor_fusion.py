"""``compressor_fusion``: the compressor's pooling chain becomes one fused kernel.

Prefill form: ``(blocks(kv) * softmax(blocks(score) + ape, over a block's tokens)).sum(tokens)``
(C128), or the overlapping C4 form whose softmax spans block j-1's first half and block j's second
half. Decode-state form: the same softmax-weighted sum over the rows of the compressor state.
Both read kv and score once and never materialise the blocked, shifted or concatenated views. The entry's
finish that follows (norm, RoPE, quantization) is fused into the same kernel by the next pass,
``compressor_finish``.

Blocks are ``unflatten`` or ``view`` of the tokens; the C4 window is the model's ``cat`` of shifted halves or
transformers' slice writes into a fresh buffer, which the normalisation turns into the same ``cat``
(``buffer_writes.py``). transformers also rounds the softmax weights to bf16 before the weighted sum (so each product
too), then sums: the op pools in fp32 and its entries are cast to the sum's dtype. transformers' rounded pooling is
itself 0.4-0.8% (of the largest entry) from the exact value (fp64) on random bf16 inputs, the op's 0.2-0.3%; the two
differ by up to 0.7% over C4's 8 slots and 1.5% over C128's 128 (20 seeds), hence the tolerance, 2^-5. Measured on the
tiny transformers V4: 0.21-0.37%; on the model's fp32 pooling ~1e-7.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..codegen import ops
from .base import (
    GraphPass,
    NoMatch,
    Rewrite,
    RewriteContext,
    SymDim,
    dtype,
    is_op,
    only_user,
    read_through_cast,
    shape,
    size_node,
    skip_noop_slices,
)
from .buffer_writes import constant_fill

aten = torch.ops.aten
END = 2**63 - 1
ROUNDED = (torch.bfloat16, torch.float16)
"""Dtypes a spelling may round the softmax weights (and so their products with the values) to before the sum."""


def _slice_args(node: fx.Node) -> tuple[fx.Node, int, int, int]:
    """(input, dim, start, end) of an ``aten.slice``; end is normalised to END when it runs to the end."""
    args = list(node.args) + [0, 0, END][len(node.args) - 1:]
    src, dim, start, end = args[0], args[1], args[2] or 0, args[3]
    full = shape(src)
    if full is not None and isinstance(end, int) and isinstance(full[dim], int) and end >= full[dim]:
        end = END
    return src, dim, start, END if end is None else end


def _expect_slices(node: object, want: dict[int, tuple[int, int]], what: str) -> fx.Node:
    """The tensor under a chain of slices that cuts exactly ``want`` ({dim: (start, end)}), in any order."""
    node, got = skip_noop_slices(node), {}
    while is_op(node, aten.slice) and len(got) < len(want):
        src, d, s, e = _slice_args(node)
        ndim = len(shape(src) or ())
        got[d % ndim if ndim else d] = (s, e)
        node = skip_noop_slices(src)
    if got != want:
        cuts = ", ".join(f"dim {d} [{s}:{e}]" for d, (s, e) in sorted(got.items())) or "nothing"
        wanted = ", ".join(f"dim {d} [{s}:{e}]" for d, (s, e) in sorted(want.items()))
        raise NoMatch(f"{what} slices {cuts} instead of {wanted}")
    return node




def _blocked_source(node: fx.Node, ratio: int, what: str) -> tuple[fx.Node, int]:
    """``unflatten(kv[:, :cutoff], 1, (-1, ratio))`` (or the same split spelled as a ``view``) -> (kv, n_blocks)."""
    if is_op(node, aten.view):
        src, dims = node.args[0], shape(node) or ()
        outer = shape(src) or ()
        if len(outer) != 3 or len(dims) != 4 or dims[0] != outer[0] or dims[3] != outer[2] or dims[2] != ratio:
            raise NoMatch(f"{what} is viewed as {dims}, not its tokens [B, S, C] split into blocks of {ratio}")
    elif is_op(node, aten.unflatten):
        src, dim, sizes = node.args[0], node.args[1], list(node.args[2])
        if dim != 1 or len(sizes) != 2 or sizes[1] != ratio:
            raise NoMatch(f"{what} is split as dim {dim} into {sizes}, not tokens into blocks of {ratio}")
    else:
        raise NoMatch(f"{what} is not split into blocks along the token axis")
    n_blocks = shape(node)[1]
    src = skip_noop_slices(src)
    if is_op(src, aten.slice):
        inner, d, start, end = _slice_args(src)
        if d != 1 or start != 0 or (end != END and not _same_size(end, n_blocks, ratio)):
            raise NoMatch(f"{what} takes tokens [{start}:{end}], not the complete blocks from token 0")
        src = skip_noop_slices(inner)
    return src, n_blocks


def _same_size(end: object, n_blocks: int | SymDim, ratio: int) -> bool:
    """Whether a slice's end (an int, or a node holding a dynamic size) is ``n_blocks * ratio`` (either may be
    dynamic: a graph guarded to one complete block has n_blocks 1 and the end still a size expression)."""
    val = end.meta.get("val") if isinstance(end, fx.Node) else end
    count = n_blocks.value if isinstance(n_blocks, SymDim) else n_blocks
    return isinstance(val, (int, torch.SymInt)) and statically_known_true(val == count * ratio)


def _block_count(kv: fx.Node, n_blocks: int | SymDim, ratio: int) -> int | fx.Node:
    """The pooling's block count as the op takes it: the int, or for a dynamic count a node computing it at run
    time as kv's token count // ratio (the complete blocks; a NoMatch when the blocks are not those)."""
    if not isinstance(n_blocks, SymDim):
        return n_blocks
    tokens = kv.meta["val"].shape[1]
    if not statically_known_true(n_blocks.value == tokens // ratio):
        raise NoMatch(f"the dynamic block count {n_blocks} is not the complete {ratio}-token blocks of kv")
    return size_node(kv, 1, ratio)


def _overlap_halves(node: fx.Node, width: int, fill: float, what: str) -> fx.Node:
    """``cat([shift(x[..., :w]) with fill, x[..., w:]], dim=2)`` -> x."""
    if not is_op(node, aten.cat) or len(node.args[0]) != 2 or (node.args[1] if len(node.args) > 1 else 0) != 2:
        raise NoMatch(f"{what} is not the two-half overlap window (cat along the slot axis)")
    shifted, current = node.args[0]
    base = _expect_slices(current, {3: (width, END)}, f"{what}'s current-block half")
    if not is_op(shifted, aten.cat) or (shifted.args[1] if len(shifted.args) > 1 else 0) != 1:
        raise NoMatch(f"{what}'s previous-block half is not shifted by one block")
    pad, previous = shifted.args[0]
    if constant_fill(pad) != fill:
        raise NoMatch(f"{what}'s block -1 is not filled with {fill}")
    if _expect_slices(previous, {1: (0, -1), 3: (0, width)}, f"{what}'s previous-block half") is not base:
        raise NoMatch(f"{what}'s two halves come from different tensors")
    return base


def _state_halves(node: fx.Node, ratio: int, width: int, what: str) -> fx.Node:
    """``cat([s[:, :R, :w], s[:, R:, w:]], dim=1)`` -> s."""
    if not is_op(node, aten.cat) or len(node.args[0]) != 2 or (node.args[1] if len(node.args) > 1 else 0) != 1:
        raise NoMatch(f"{what} is not the [previous block | current block] state window")
    prev, cur = node.args[0]
    a = _expect_slices(prev, {1: (0, ratio), 2: (0, width)}, f"{what}'s previous rows")
    b = _expect_slices(cur, {1: (ratio, END), 2: (width, END)}, f"{what}'s current rows")
    if a is not b:
        raise NoMatch(f"{what}'s halves come from different state tensors")
    return a


@dataclass
class _Window:
    """A softmax-weighted sum found by ``analyze``: its score and value operands and the slot geometry."""

    score: fx.Node
    values: fx.Node
    total: fx.Node
    ratio: int
    width: int
    overlap: bool


class CompressorFusion(GraphPass):
    """Softmax-pooled KV compression (C4 overlap and C128; prefill and decode state) -> one kernel."""

    name = "compressor_fusion"
    summary = "fuse the compressor's bias + per-dim softmax over a block's tokens + weighted sum into one kernel"
    tolerance = 2**-5
    matches = ("(kv_blocks * softmax(score_blocks + ape, dim=slots)).sum(slots), C128 or C4-overlap, "
               "prefill [B,N,slots,w] or decode state [B,slots,w]")

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Every softmax: the pooling's anchor."""
        return [n for n in gm.graph.nodes if is_op(n, aten.softmax, aten._softmax)]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """Softmax -> weighted values -> sum over the softmax axis, then the prefill or decode-state layout."""
        dims = shape(node)
        if dims is None:
            raise NoMatch("softmax with a dynamic shape")
        dim = node.args[1] % len(dims)
        weights = node
        mul = only_user(node, "softmax output has several users, not one weighted sum")
        if is_op(mul, aten.to, aten._to_copy) and len(mul.users) == 1 and dtype(mul) in ROUNDED:
            weights, mul = mul, next(iter(mul.users))
        if not is_op(mul, aten.mul) or len(mul.args) != 2 or weights not in mul.args:
            raise NoMatch("softmax output is not multiplied into values (no weighted sum)")
        values = mul.args[1] if mul.args[0] is weights else mul.args[0]
        if not isinstance(values, fx.Node) or shape(values) != dims:
            raise NoMatch("the values weighted by the softmax have another shape")
        total = only_user(mul, "weighted values are used elsewhere than one sum")
        if not is_op(total, aten.sum) or len(total.args) < 2 or [d % len(dims) for d in total.args[1]] != [dim]:
            raise NoMatch(f"weighted values are not summed over the softmax axis {dim}")
        if len(total.args) > 2 and total.args[2]:
            raise NoMatch("the pooled sum keeps its dim")
        if (len(dims), dim) not in ((4, 2), (3, 1)):
            raise NoMatch(f"softmax over dim {dim} of a rank-{len(dims)} tensor is not a per-dim pooling over a "
                          f"block's tokens (prefill: dim 2 of [B,N,slots,w]; decode: dim 1 of [B,slots,w])")
        score = node.args[0]
        overlap = is_op(score, aten.cat)
        window = _Window(score, values, total, dims[dim] // 2 if overlap else dims[dim], dims[-1], overlap)
        rewrite = self._prefill(window, ctx) if len(dims) == 4 else self._decode(window, ctx)
        if weights is not node:
            rewrite.details["rounding"] = f"weights and products in {dtype(weights)} (the op pools in fp32)"
        if dtype(total) != torch.float32:
            read_through_cast(total)  # the op pools in fp32
        return rewrite

    def _prefill(self, w: _Window, ctx: RewriteContext) -> Rewrite:
        score, values, ratio, width, overlap = w.score, w.values, w.ratio, w.width, w.overlap
        if overlap:
            score = _overlap_halves(score, width, float("-inf"), "score")
            values = _overlap_halves(values, width, 0.0, "kv")
        if not is_op(score, aten.add):
            raise NoMatch("scores have no positional bias (ape) added before the softmax")
        blocked, ape = score.args
        if shape(ape) != (ratio, (2 if overlap else 1) * width):
            blocked, ape = ape, blocked
        if shape(ape) != (ratio, (2 if overlap else 1) * width):
            raise NoMatch(f"the bias added to the scores is not a [{ratio}, {(2 if overlap else 1) * width}] ape")
        score_src, n_blocks = _blocked_source(blocked, ratio, "score")
        kv_src, kv_blocks = _blocked_source(values, ratio, "kv")
        if kv_blocks != n_blocks or shape(kv_src) != shape(score_src):
            raise NoMatch("kv and score are blocked differently")
        kernel = f"compressor_pool.c{ratio}.w{width}.{ops.implementation_backend('compressor_pool', ctx.backend)}"
        blocks = _block_count(kv_src, n_blocks, ratio)
        return Rewrite(w.total, ops.compressor_pool, (kv_src, score_src, ape, ratio, width, blocks, ctx.backend),
                       kernel, {"form": "prefill", "ratio": ratio, "width": width, "overlap": overlap,
                                "blocks": n_blocks})

    def _decode(self, w: _Window, ctx: RewriteContext) -> Rewrite:
        score, values, ratio, width, overlap = w.score, w.values, w.ratio, w.width, w.overlap
        if overlap:
            score = _state_halves(score, ratio, width, "score state")
            values = _state_halves(values, ratio, width, "kv state")
        if shape(score) != shape(values) or len(shape(score) or ()) != 3:
            raise NoMatch("kv and score states differ in shape")
        if not overlap and ratio < 8:
            raise NoMatch(f"a softmax-weighted sum over {ratio} rows without a positional bias is not a "
                          f"compressor state (C128 states have 128 rows)")
        impl = ops.implementation_backend("compressor_pool_state", ctx.backend)
        kernel = f"compressor_pool_state.c{ratio}.w{width}.{impl}"
        return Rewrite(w.total, ops.compressor_pool_state, (values, score, ratio, width, ctx.backend), kernel,
                       {"form": "decode", "ratio": ratio, "width": width, "overlap": overlap})
