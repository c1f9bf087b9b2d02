"""``mhc_tiling``: the mHC pre and post steps (model/mhc.py) each become one op over split-K Triton kernels.

Pre form (``hc_pre``): ``m = linear(vec(X).float(), fn) * rsqrt(mean(vec(X)^2, -1) + eps)``, sliced into
``[:n]``, ``[n:2n]``, ``[2n:]``, each ``* scale[i] + base[slice]``; ``pre = sigmoid(.) + hc_eps``,
``post = 2 * sigmoid(.)``, ``comb`` = Sinkhorn of the ``n x n`` rest (row softmax + eps, a column step,
then row/column pairs, every step ``c / (sum + eps)``); ``y = (pre.unsqueeze(-1) * vec(X).view(X.shape))
.sum(-2).to(X.dtype)`` -> ``mhc_pre(X, fn, scale, base, iters, hc_eps, norm_eps)``. The output head's
``hc_head`` (n mixes, no Sinkhorn) is a near-miss.

Post form (``hc_post``): ``(post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * X.unsqueeze(-2))
.sum(-3)).to(y.dtype)`` -> ``mhc_post(y, X, post, comb)``.

Other spellings of the same math match too (transformers' DeepSeek-V4 writes them; the graph is normalised first,
so ``split`` / ``unbind`` read as slices / selects): vec(X) as ``X.view(..., n*D)``, the RMS scale applied before
the projection (``linear(vec(X) * rsqrt(...), fn)``: the op scales after it, a fp32 rounding apart), comb's mixes
viewed as ``n x n`` before ``* scale[2] + base[2n:].view(n, n)``, pre weighting X itself rather than
``vec(X).view(X.shape)`` (the same fp32 values), and the post step's mixing as ``matmul(comb.transpose(-1, -2), X)``
(in X's dtype when comb is cast to it: the op reads that comb and sums in fp32, one rounding of the output apart).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

from ..codegen import ops
from .base import (
    GraphPass,
    NoMatch,
    Region,
    Rewrite,
    RewriteContext,
    SymDim,
    dtype,
    is_op,
    keepdim,
    numel,
    other_operand,
    reduction_dims,
    scalar_operand,
    shape,
    slice_bounds,
)

aten = torch.ops.aten
class MhcTiling(GraphPass):
    """mHC pre (projection, RMS scale, sigmoids, Sinkhorn, weighted sum) and post (post*y + comb^T X) -> ops."""

    name = "mhc_tiling"
    summary = "fuse the mHC pre step (split-K projection, sigmoids, Sinkhorn, stream sum) and post step into kernels"
    matches = ("hc_pre: linear(vec(X), fn) * rsqrt(mean(vec(X)^2)+eps) -> pre/post/comb mixes -> Sinkhorn -> "
               "sum_j pre_j X_j; hc_post: post*y + (comb.unsqueeze(-1) * X.unsqueeze(-2)).sum(-3)")
    tolerance = 2**-6
    """y and the new streams are bf16: a value next to a rounding boundary may land one bf16 step away (at most
    2^-7 of it) where the fp32 sums differ from PyTorch's in their last bits; post and comb agree to about 1e-6. A
    post step spelled in bf16 arithmetic (``post.to(bf16) * y + matmul(comb.to(bf16)^T, X)``, transformers') rounds
    the product, the mixing and their sum: its result and the op's single rounding may be two steps (2^-6) apart."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Projections multiplied by an rsqrt (hc_pre, hc_head) and sums of a product of two unsqueezed
        operands or a matmul by a transposed n x n matrix (the stream mixing of hc_post)."""
        found = []
        for node in gm.graph.nodes:
            if is_op(node, aten.linear) and (any(is_op(u, aten.mul) and is_op(other_operand(u, node), aten.rsqrt)
                                                 for u in node.users) or _rms_normed(node.args[0]) is not None):
                found.append(node)
            elif is_op(node, aten.matmul) and _transposed_mixing(node) is not None:
                found.append(node)
            elif is_op(node, aten.sum) and is_op(node.args[0], aten.mul) and \
                    all(is_op(a, aten.unsqueeze) for a in node.args[0].args[:2]):
                found.append(node)
        return found

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The pre step from its projection, or the post step from its mixing sum."""
        if is_op(node, aten.linear):
            return self._pre(node, ctx)
        return self._post(node, ctx)

    # ------------------------------------------------------------------------------------------------ pre
    def _pre(self, linear: fx.Node, ctx: RewriteContext) -> Rewrite:
        region = Region()
        region.add(linear)
        if len(linear.args) > 2 and linear.args[2] is not None:
            raise NoMatch("the projection has a bias")
        flat, fn = linear.args[:2]
        normed = _rms_normed(flat)
        if normed is not None:
            flat = other_operand(flat, normed)
        x, streams, x_dtype = self._vec_streams(flat, region)
        n, dim = streams[-2:]
        mixes = shape(fn)
        if mixes is None or mixes[1] != n * dim:
            raise NoMatch(f"fn {mixes} does not project vec(X) of width n*D = {n * dim}")
        if mixes[0] == n:
            raise NoMatch(f"projects onto {n} mixes = n: the output head's collapse (hc_head: pre weights only, "
                          f"no post/comb, no Sinkhorn)")
        if mixes[0] != (2 + n) * n:
            raise NoMatch(f"projects onto {mixes[0]} mixes, not (2+n)n = {(2 + n) * n} for n = {n} streams")
        m, norm_eps = self._rms_scaled(linear, flat, normed, region)
        slices = self._slices(m, n, region)
        scale_base: list[tuple[object, object]] = []
        pre_in, post_in, comb_in = (self._affine(s, i, n, scale_base, region) for i, s in enumerate(slices))
        gate = region.follow(pre_in, aten.sigmoid, "pre is not a sigmoid of its mixes")
        pre = region.follow(gate, aten.add, "pre is not sigmoid(.) + eps")
        hc_eps = scalar_operand(pre, gate, "pre's eps")
        gate = region.follow(post_in, aten.sigmoid, "post is not a sigmoid of its mixes")
        post = region.follow(gate, aten.mul, "post is not 2 * sigmoid(.)")
        if scalar_operand(post, gate, "post's factor") != 2.0:
            raise NoMatch("post is not 2 * sigmoid(.)")
        comb, iters = self._sinkhorn(comb_in, n, hc_eps, region)
        y = self._weighted_sum(pre, flat, x, x_dtype, streams, region)
        region.check_closed((y, post, comb), "hc_pre")
        (scale, base), rows = scale_base[0], _rows(streams)
        details = {"step": "pre", "streams": n, "dim": dim, "rows": rows, "iters": iters}
        kernel = f"mhc_pre.n{n}.d{dim}.{ops.implementation_backend('mhc_pre', ctx.backend)}"
        sink = next(node for node in linear.graph.nodes if node in (y, post, comb))
        rewrite = Rewrite(sink, ops.mhc_pre, (x, fn, scale, base, iters, hc_eps, norm_eps, ctx.backend), kernel,
                          details)
        rewrite.outputs = {0: y, 1: post, 2: comb}
        return rewrite

    @staticmethod
    def _vec_streams(flat: object, region: Region) -> tuple[fx.Node, tuple[int, ...], torch.dtype | None]:
        """``flatten(X, -2).float()`` -> (X, X's shape, X's dtype). X may be an earlier rewrite's output, which
        carries no shape: then the shape comes from ``flat.view(X.shape)`` of the weighted sum."""
        region.add(flat)
        if dtype(flat) != torch.float32:
            raise NoMatch("the projection is not computed in fp32")
        source = flat.args[0] if is_op(flat, aten.to, aten._to_copy) else flat
        region.add(source)
        why = "the projected input is not vec(X): a flatten (or view) of the streams' last two dims [..., n, D]"
        if is_op(source, aten.view, aten.reshape):
            streams, merged = shape(source.args[0]), shape(source)
            if streams is None or len(streams) < 3 or merged != (*streams[:-2], numel(streams[-2:])):
                raise NoMatch(why)
            return source.args[0], streams, dtype(source)
        if not is_op(source, aten.flatten):
            raise NoMatch(why)
        views = [shape(u) for u in flat.users if is_op(u, aten.view, aten.reshape)]
        streams = shape(source.args[0]) or (views[0] if len(views) == 1 else None)
        if streams is None or len(streams) < 3 or [a % len(streams) for a in source.args[1:]] not in (
                [len(streams) - 2], [len(streams) - 2, len(streams) - 1]):
            raise NoMatch(why)
        return source.args[0], streams, dtype(source)

    @staticmethod
    def _rms_scaled(linear: fx.Node, flat: fx.Node, normed: fx.Node | None, region: Region) -> tuple[fx.Node, float]:
        """``linear * rsqrt(mean(flat^2, -1, keepdim) + eps)`` -> (that product, eps); with the scale applied before
        the projection (``normed`` is that rsqrt), ``linear(flat * rsqrt, fn)`` -> (the projection, eps)."""
        if normed is None:
            users = list(linear.users)
            if len(users) != 1:
                raise NoMatch("the projection is used elsewhere than its RMS scaling")
            m = users[0]
            rsqrt = other_operand(m, linear)
        else:
            m, rsqrt = linear, normed
            region.add(linear.args[0])
        add = rsqrt.args[0]
        mean = add.args[0] if is_op(add, aten.add) else None
        square = mean.args[0] if is_op(mean, aten.mean) else None
        ndim = len(shape(flat) or ())
        if not (is_op(square, aten.square) and square.args[0] is flat and reduction_dims(mean, 1, ndim) == [ndim - 1]
                and keepdim(mean, 2)):
            raise NoMatch("the RMS scale is not rsqrt(mean(vec(X)^2, -1, keepdim) + eps) of the projected input")
        region.add(m, rsqrt, add, mean, square)
        return m, scalar_operand(add, mean, "the RMS eps")

    @staticmethod
    def _slices(m: fx.Node, n: int, region: Region) -> list[fx.Node]:
        """The three last-dim slices ``[:n]``, ``[n:2n]``, ``[2n:]`` of the mixes, in that order."""
        ndim, total = len(shape(m) or ()), (2 + n) * n
        found: dict[tuple[int, int], fx.Node] = {}
        for user in m.users:
            if not is_op(user, aten.slice) or user.args[1] % ndim != ndim - 1:
                raise NoMatch("the mixes feed something other than slices of their last dim")
            found[slice_bounds(user, total)] = user
        wanted = [(0, n), (n, 2 * n), (2 * n, total)]
        if sorted(found) != wanted:
            raise NoMatch(f"the mixes are sliced as {sorted(found)}, not pre/post/comb {wanted} for n = {n}")
        region.add(*found.values())
        return [found[w] for w in wanted]

    @staticmethod
    def _affine(mixes: fx.Node, index: int, n: int, scale_base: list[tuple[object, object]],
                region: Region) -> fx.Node:
        """``mixes * scale[index] + base[slice]`` -> the sum; every part must use the same scale and base."""
        what = ("pre", "post", "comb")[index]
        users = list(mixes.users)
        grid = users[0] if index == 2 and len(users) == 1 and _splits_last(users[0], n) else None
        if grid is not None:
            region.add(grid)
        mul = region.follow(grid or mixes, aten.mul, f"the {what} mixes are not multiplied by scale[{index}]")
        select = other_operand(mul, grid or mixes)
        if not is_op(select, aten.select) or select.args[1:] != (0, index):
            raise NoMatch(f"the {what} mixes are not multiplied by scale[{index}]")
        add = region.follow(mul, aten.add, f"the {what} mixes have no base added")
        piece = other_operand(add, mul)
        if grid is not None:
            if not isinstance(piece, fx.Node) or not _splits_last(piece, n):
                raise NoMatch(f"the {what} mixes viewed as {n} x {n} are not shifted by base[2n:] viewed alike")
            region.add(piece)
            piece = piece.args[0]
        start, end = slice_bounds(mixes, (2 + n) * n)
        if not is_op(piece, aten.slice) or piece.args[1] != 0 or slice_bounds(piece, (2 + n) * n) != (start, end):
            raise NoMatch(f"the {what} mixes are not shifted by base[{start}:{end}]")
        scale, base = select.args[0], piece.args[0]
        if scale_base and scale_base[0] != (scale, base):
            raise NoMatch(f"the {what} mixes use another scale or base than pre's")
        if shape(scale) != (3,) or shape(base) != ((2 + n) * n,):
            raise NoMatch(f"scale {shape(scale)} / base {shape(base)} are not [3] / [(2+n)n]")
        scale_base.append((scale, base))
        region.add(select, piece)
        return add

    @staticmethod
    def _sinkhorn(logits: fx.Node, n: int, eps: float, region: Region) -> tuple[fx.Node, int]:
        """``unflatten(n, n)`` -> softmax(-1) + eps -> column step -> (row step, column step)* -> (comb, iters);
        logits already viewed as ``n x n`` (before their scale and base) go to the softmax directly."""
        grid = logits
        if (shape(logits) or (0,))[-2:] != (n, n):
            grid = region.follow(logits, aten.unflatten, "comb's mixes are not unflattened into an n x n matrix")
            rank = len(shape(logits) or (0,))
            if list(grid.args[2]) != [n, n] or grid.args[1] % rank != rank - 1:
                raise NoMatch(f"comb's mixes are unflattened as {list(grid.args[2])}, not [{n}, {n}]")
        softmax = region.follow(grid, (aten.softmax, aten._softmax), "comb's logits have no row softmax (no Sinkhorn)")
        ndim = len(shape(softmax) or ())
        if softmax.args[1] % ndim != ndim - 1:
            raise NoMatch("Sinkhorn's softmax is not over rows (the last dim)")
        c = region.follow(softmax, aten.add, "Sinkhorn's softmax has no eps added")
        if scalar_operand(c, softmax, "Sinkhorn's eps") != eps:
            raise NoMatch(f"Sinkhorn's eps {scalar_operand(c, softmax, 'eps')} differs from pre's eps {eps}")
        c = MhcTiling._normalize(c, ndim - 2, eps, region)
        if c is None:
            raise NoMatch("Sinkhorn's first column normalisation (after the softmax) is missing")
        iters = 1
        while True:
            if MhcTiling._step_axis(c, ndim) == ndim - 2:
                raise NoMatch(f"Sinkhorn iteration {iters + 1} normalises columns twice (its row step is missing)")
            rows = MhcTiling._normalize(c, ndim - 1, eps, region)
            if rows is None:
                return c, iters
            c = MhcTiling._normalize(rows, ndim - 2, eps, region)
            iters += 1
            if c is None:
                raise NoMatch(f"Sinkhorn iteration {iters} normalises rows but not columns")

    @staticmethod
    def _step_axis(c: fx.Node, ndim: int) -> int | None:
        """The axis of a ``c / (c.sum(axis, keepdim) + eps)`` step applied to ``c``, if any."""
        for user in c.users:
            if is_op(user, aten.sum) and keepdim(user, 2) and len(reduction_dims(user, 1, ndim)) == 1:
                return reduction_dims(user, 1, ndim)[0]
        return None

    @staticmethod
    def _normalize(c: fx.Node, axis: int, eps: float, region: Region) -> fx.Node | None:
        """``c / (c.sum(axis, keepdim) + eps)`` -> the quotient; None when ``c`` is not normalised on ``axis``."""
        ndim = len(shape(c) or ())
        if MhcTiling._step_axis(c, ndim) != axis:
            return None
        total = next(u for u in c.users if is_op(u, aten.sum))
        add = region.follow(total, aten.add, "a Sinkhorn sum has no eps added")
        div = region.follow(add, aten.div, "a Sinkhorn step does not divide by its sums")
        if div.args[0] is not c or scalar_operand(add, total, "Sinkhorn's eps") != eps:
            raise NoMatch(f"a Sinkhorn step is not c / (c.sum({axis - ndim}) + {eps})")
        if len(c.users) != 2:
            raise NoMatch("an intermediate Sinkhorn matrix is used outside the iteration")
        region.add(total)
        return div

    @staticmethod
    def _weighted_sum(pre: fx.Node, flat: fx.Node, x: fx.Node, x_dtype: torch.dtype | None,
                      streams: tuple[int, ...], region: Region) -> fx.Node:
        """``(pre.unsqueeze(-1) * flat.view(X.shape)).sum(-2)`` cast to X's dtype -> the cast (the y output); X
        itself in place of ``flat.view(X.shape)`` is the same fp32 product (pre is fp32)."""
        ndim = len(streams)
        lifted = region.follow(pre, aten.unsqueeze, "pre does not weight the streams (no pre.unsqueeze(-1))")
        mul = region.follow(lifted, aten.mul, "pre does not weight the streams (no pre.unsqueeze(-1) * X)")
        view = other_operand(mul, lifted)
        if view is not x and (lifted.args[1] % (ndim) != ndim - 1 or not is_op(view, aten.view, aten.reshape)
                              or view.args[0] is not flat or shape(view) != streams):
            raise NoMatch("pre does not weight the streams X or vec(X).view(X.shape)")
        total = region.follow(mul, aten.sum, "the weighted streams are not summed")
        if reduction_dims(total, 1, ndim) != [ndim - 2] or keepdim(total, 2):
            raise NoMatch("the weighted streams are not summed over the stream axis (-2)")
        if view is not x:
            region.add(view)
        users = list(total.users)
        if len(users) == 1 and is_op(users[0], aten.to, aten._to_copy) and dtype(users[0]) == x_dtype:
            region.add(users[0])
            return users[0]
        if dtype(total) != x_dtype:
            raise NoMatch(f"y is not cast back to the streams' dtype {x_dtype}")
        return total

    # ----------------------------------------------------------------------------------------------- post
    def _post(self, mixed: fx.Node, ctx: RewriteContext) -> Rewrite:
        region = Region()
        if is_op(mixed, aten.matmul):
            comb, x, lead, n, dim = self._matmul_mixing(mixed, region)
            ndim = len(lead) + 3
        else:
            comb, x, lead, n, dim, ndim = self._summed_mixing(mixed, region)
        add = region.follow(mixed, aten.add, "the mixed streams are not added to post * y")
        post_y = other_operand(add, mixed)
        if not is_op(post_y, aten.mul):
            raise NoMatch("the mixed streams are not added to post * y")
        post_u, y_u = self._lifted(post_y, ndim - 2, ndim - 3, "post.unsqueeze(-1) * y.unsqueeze(-2)")
        post, y = post_u.args[0], y_u.args[0]
        if shape(post_u) != (*lead, n, 1) or shape(y_u) != (*lead, 1, dim):
            raise NoMatch(f"post {shape(post_u)[:-1]} / y {shape(y_u)[:-2] + shape(y_u)[-1:]} do not match "
                          f"the streams [..., {n}, {dim}]")
        region.add(post_y, post_u, y_u)
        out = add
        users = list(add.users)
        if len(users) == 1 and is_op(users[0], aten.to, aten._to_copy) and dtype(users[0]) == dtype(y_u):
            out = users[0]
            region.add(out)
        elif dtype(add) != dtype(y_u):
            raise NoMatch(f"the new streams are not cast to y's dtype {dtype(y_u)}")
        region.check_closed((out,), "hc_post")
        kernel = f"mhc_post.n{n}.d{dim}.{ops.implementation_backend('mhc_post', ctx.backend)}"
        details = {"step": "post", "streams": n, "dim": dim, "rows": _rows((*lead, n, dim))}
        return Rewrite(out, ops.mhc_post, (y, x, post, comb, ctx.backend), kernel, details)

    def _summed_mixing(self, mixed: fx.Node, region: Region) -> tuple[fx.Node, fx.Node, tuple, int, int, int]:
        """``(comb.unsqueeze(-1) * X.unsqueeze(-2)).sum(-3)`` -> (comb, X, lead dims, n, D, the product's rank)."""
        prod = mixed.args[0]
        region.add(mixed, prod, *prod.args[:2])
        ndim = len(shape(prod) or ())
        if ndim < 4:
            raise NoMatch(f"a rank-{ndim} product is not the [..., n, n, D] stream mixing")
        comb_u, x_u = self._lifted(prod, ndim - 1, ndim - 2, "comb.unsqueeze(-1) * X.unsqueeze(-2)")
        lead, (n, _, dim) = shape(x_u)[:-3], shape(x_u)[-3:]
        if shape(comb_u) != (*lead, n, n, 1):
            raise NoMatch(f"the mixing matrix {shape(comb_u)[:-1]} is not [..., {n}, {n}] for {n} streams")
        axes = reduction_dims(mixed, 1, ndim)
        if axes == [ndim - 2]:
            raise NoMatch("mixes the streams with comb (sum over k, dim -2), not comb^T (sum over j, dim -3)")
        if axes != [ndim - 3] or keepdim(mixed, 2):
            raise NoMatch(f"the mixing product is summed over dims {axes}, not the stream axis j ({ndim - 3})")
        return comb_u.args[0], x_u.args[0], lead, n, dim, ndim

    @staticmethod
    def _matmul_mixing(mixed: fx.Node, region: Region) -> tuple[fx.Node, fx.Node, tuple, int, int]:
        """``matmul(comb.transpose(-1, -2), X)`` -> (comb, X, lead dims, n, D)."""
        comb = _transposed_mixing(mixed)
        x = mixed.args[1]
        dims = shape(x)
        if comb is None or dims is None or len(dims) < 3 or shape(comb) != (*dims[:-2], dims[-2], dims[-2]):
            raise NoMatch("the matmul is not comb^T [..., n, n] times the streams [..., n, D]")
        region.add(mixed, mixed.args[0])
        return comb, x, dims[:-2], dims[-2], dims[-1]

    @staticmethod
    def _lifted(prod: fx.Node, first: int, second: int, what: str) -> tuple[fx.Node, fx.Node]:
        """The operands of ``prod`` unsqueezed at dims ``first`` and ``second`` (of the product's rank)."""
        ndim = len(shape(prod) or ())
        by_dim: dict[int, fx.Node] = {}
        for arg in prod.args[:2]:
            if is_op(arg, aten.unsqueeze):
                by_dim[arg.args[1] % ndim] = arg
        if set(by_dim) != {first, second}:
            raise NoMatch(f"the product is not {what}")
        return by_dim[first], by_dim[second]


def _rms_normed(flat: object) -> fx.Node | None:
    """The rsqrt when ``flat`` is ``vec(X) * rsqrt(...)`` (streams RMS-normalised before the projection), else None."""
    if not is_op(flat, aten.mul):
        return None
    return next((a for a in flat.args[:2] if is_op(a, aten.rsqrt)), None)


def _splits_last(node: fx.Node, n: int) -> bool:
    """Whether ``node`` views its input's last dim of n*n values as ``[n, n]`` (``unflatten`` or ``view``)."""
    source = node.args[0] if is_op(node, aten.unflatten, aten.view, aten.reshape) else None
    before, after = shape(source) if isinstance(source, fx.Node) else None, shape(node)
    return before is not None and after is not None and after == (*before[:-1], n, n) and before[-1] == n * n


def _transposed_mixing(node: fx.Node) -> fx.Node | None:
    """comb when ``node`` is ``matmul(comb.transpose(-1, -2), X)`` of rank >= 3, else None."""
    left = node.args[0]
    rank = len(shape(left) or ())
    if rank < 3 or not is_op(left, aten.transpose) or sorted(d % rank for d in left.args[1:3]) != [rank - 2, rank - 1]:
        return None
    return left.args[0]


def _rows(streams: tuple[int | SymDim, ...]) -> int | str:
    return numel(streams[:-2])
