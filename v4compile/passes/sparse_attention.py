"""``sparse_attention``: the attention's gather + softmax-with-sink + weighted sum, and the lightning
indexer's ``sum_h w * relu(q . k)`` scoring, become the sparse attention and indexer scoring kernels.

Attention (model/sparse_attention.py): ``keys = gather(kv, index.clamp(0))``, scores ``einsum(q, keys) *
scale`` masked where ``index < 0``, then the softmax with the sink in either spelling: the official order
``einsum(exp(s - max), keys) / (sum(exp(s - max)) + exp(sink - max))`` or ``softmax(cat(s, sink))[..., :k]``
before ``einsum(probs, keys)``. Neither the gathered keys nor the [B,S,H,K] scores are materialised by the
kernel, which keeps an online softmax (another summation order, hence the pass's tolerance). Indexer form
(model/indexer.py ``index_scores``): ``(relu(einsum(q, keys)) * w).sum(heads)``. The top-k that follows the
scores stays a separate kernel (``radix_topk``): scoring and selection are not fused on any backend yet.

Keys on the serving engine's shared pages (``pool[table].flatten(1, 2)``, model/cache.py) become the paged scoring
kernel, and attention over ``cat((window, pool[table].flatten(1, 2)))`` the paged attention kernel: each reads
entries in place through the page table instead of a gathered, concatenated copy.

The indexer's dot product also matches as ``matmul(q, keys.transpose(-1, -2).unsqueeze(1))`` with the softmax
scale applied to the relu'd dots (``relu(q . k) * c * w``, transformers' spelling): the op then takes ``w * c`` as
its weights, an fp32 rounding apart.

Dense attention (transformers' eager spelling: ``softmax(cat(q K^T * scale + mask, sink))[..., :N]``, perhaps shifted
by its row maximum, then ``matmul(probs, V)``, with one KV head broadcast as keys and values) becomes the same kernel
over the columns the additive mask lets each row read: ``attention_mask.py`` turns the mask's blocks into [B, S, K]
index lists (a sliding band, a top-k's scattered ids, or a block's every column), so a C4 row reads window + top-k
entries, not every position. transformers keeps the scores bf16 before the softmax; the kernel's fp32 scores are
another rounding, within the pass's tolerance.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx

from ..codegen import ops
from ..codegen.tilelang.sparse_attention import kernel_name as tilelang_attention_kernel_name
from ..codegen.triton.indexer_scores import kernel_name as indexer_kernel_name
from ..codegen.triton.sparse_attention import kernel_name as attention_kernel_name
from . import attention_mask
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, is_op, shape, skip_noop_slices, traced_call


def attention_kernel(dim: int, impl: str, q: fx.Node, kv: fx.Node, paged: bool = False) -> str:
    """The name the attention kernel of these operands registers under: the registry's, the CLI's and every
    report's one name (``head_padding`` reports its padded calls by it too)."""
    if impl == "triton":
        vals = (q.meta.get("val"), kv.meta.get("val"))
        low = all(v is not None and v.dtype == torch.bfloat16 for v in vals)
        return attention_kernel_name(dim, low, paged=paged)
    if impl == "tilelang":
        return tilelang_attention_kernel_name(dim)
    return f"sparse_attention{'_paged' if paged else ''}.d{dim}.{impl}"

aten = torch.ops.aten
ATTENTION_SCORES = "bshd,bskd->bshk"
ATTENTION_VALUES = "bshk,bskd->bshd"
INDEXER_DOTS = "bshd,bnd->bshn"


def _strip_casts(node: object) -> object:
    """The node under any dtype casts (``aten.to`` / ``_to_copy``) and aliases."""
    while is_op(node, aten.to, aten._to_copy, aten.alias):
        node = node.args[0]
    return node


def _einsum(node: object, equation: str, what: str) -> tuple[fx.Node, fx.Node]:
    if not is_op(node, aten.einsum) or node.args[0] != equation or len(node.args[1]) != 2:
        raise NoMatch(f"{what} is not einsum('{equation}')")
    left, right = node.args[1]
    return left, right


def _kernel_dim_ok(dim: int, what: str) -> None:
    if dim & (dim - 1) or dim < 16:
        raise NoMatch(f"{what} head dim {dim} is not a power of two >= 16 (the kernel's constraint)")


def _is_row_max(top: object, scores: fx.Node) -> bool:
    """Whether ``top`` is the last-dim maximum of ``scores`` (kept dim), possibly detached, floored, made finite
    with a ``where`` or raised to the sink: any of these leaves the softmax's value unchanged."""
    while True:
        if is_op(top, aten.where):
            top = top.args[2]
        elif is_op(top, aten.detach, aten.alias, aten.clamp, aten.clamp_min, aten.maximum):
            top = top.args[0]
        else:
            break
    return is_op(top, aten.amax) and top.args[0] is scores and list(top.args[1]) in ([3], [-1])


def _transposed_keys(node: fx.Node) -> fx.Node | None:
    """keys [B, N, d] when ``node`` is ``matmul(q [B, S, H, d], keys.transpose(-1, -2).unsqueeze(1))`` (under
    casts), the indexer's dot product spelled as a matmul; else None."""
    right = _strip_casts(node.args[1])
    if not is_op(right, aten.unsqueeze) or right.args[1] != 1 or len(shape(node.args[0]) or ()) != 4:
        return None
    keys = _strip_casts(right.args[0])
    if not is_op(keys, aten.transpose) or sorted(d % 3 for d in keys.args[1:3]) != [1, 2]:
        return None
    return keys.args[0] if len(shape(keys.args[0]) or ()) == 3 else None


def _paged_keys(keys: object) -> tuple[fx.Node, fx.Node] | None:
    """(pool [P, E, d], table [B, pages]) when ``keys`` [B, N, d] is ``pool[table].flatten(1, 2)`` (keys on the
    serving engine's shared pages, gathered through the rows' page table), else None."""
    if not is_op(keys, aten.view, aten.reshape, aten._unsafe_view, aten.flatten):
        return None
    gathered = keys.args[0]
    if not is_op(gathered, aten.index) or len(gathered.args[1]) != 1 or gathered.args[1][0] is None:
        return None
    pool, table = gathered.args[0], gathered.args[1][0]
    dims, rows = shape(pool), shape(table)
    if dims is None or rows is None or len(dims) != 3 or len(rows) != 2 or shape(keys) != (rows[0], rows[1] * dims[1],
                                                                                              dims[2]):
        return None
    return pool, table


def _paged_window(kv: object) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(window [B, W, d], pool, table) when ``kv`` is ``cat((window, pool[table].flatten(1, 2)), 1)``: window keys
    followed by entries on the serving engine's shared pages; else None."""
    if not is_op(kv, aten.cat) or len(kv.args[0]) != 2 or (kv.args[1] if len(kv.args) > 1 else 0) % 3 != 1:
        return None
    window, entries = kv.args[0]
    paged = _paged_keys(entries)
    if paged is None or len(shape(window) or ()) != 3:
        return None
    return window, *paged


def _dense_probs(node: fx.Node) -> fx.Node | None:
    """The softmax whose probabilities (under casts and a column slice) are ``node``'s left operand, else None."""
    left = _strip_casts(node.args[0])
    while is_op(left, aten.slice, aten.detach, aten.clone):
        left = _strip_casts(left.args[0])
    return left if is_op(left, aten.softmax, aten._softmax) else None


def _unshifted(node: object) -> object:
    """``x`` for ``x - rowmax(x)`` (a softmax's value does not change with a per-row shift), else ``node``."""
    if not is_op(node, aten.sub):
        return node
    x, top = node.args[:2]
    if isinstance(top, fx.Node) and top.target is operator.getitem and top.args[1] == 0 \
            and is_op(top.args[0], aten.max):
        reduce = top.args[0]
        keep = reduce.args[2] if len(reduce.args) > 2 else reduce.kwargs.get("keepdim", False)
        if reduce.args[0] is x and len(reduce.args) > 1 and reduce.args[1] % 4 == 3 and keep:
            return x
    return x if _is_row_max(top, x) else node


def _scores_and_mask(scores: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(the scaled product, the additive mask) of ``scaled + mask`` in either order; (scores, None) unmasked."""
    if not is_op(scores, aten.add):
        return scores, None
    left, right = (_strip_casts(a) for a in scores.args[:2])
    if is_op(left, aten.mul, aten.div) and is_op(_strip_casts(left.args[0]), aten.matmul):
        return left, scores.args[1]
    if is_op(right, aten.mul, aten.div) and is_op(_strip_casts(right.args[0]), aten.matmul):
        return right, scores.args[0]
    raise NoMatch("the scores are not a scaled q K^T plus a mask")


def _constant_scale(scaled: fx.Node) -> float:
    """The softmax scale of ``product * c`` or ``product / c``."""
    if not is_op(scaled, aten.mul, aten.div) or not isinstance(scaled.args[1], (int, float)):
        raise NoMatch("the scores are not scaled by a constant softmax scale")
    return float(scaled.args[1]) if is_op(scaled, aten.mul) else 1.0 / float(scaled.args[1])


def _one_head(node: object) -> fx.Node:
    """kv [B, 1, N, d] or [B, N, d] when ``node`` [B, H, N, d] is it broadcast over the heads (``repeat_kv``: an
    unsqueeze, expand and a reshape merging size-1 axes), else ``NoMatch``."""
    chain = []
    node = skip_noop_slices(node)
    while is_op(node, aten.unsqueeze, aten.expand, aten.view, aten.reshape, aten._unsafe_view, aten.alias, aten.to,
                aten._to_copy):
        chain.append(node)
        node = skip_noop_slices(node.args[0])
    source = shape(node)
    if source is None or len(source) not in (3, 4) or len(source) == 4 and source[1] != 1:
        raise NoMatch("the keys are not one KV head [B,1,N,d] broadcast to every head")
    axes: list[int | None] = list(range(len(source)))
    for step in reversed(chain):
        before, after = shape(step.args[0]), shape(step)
        if is_op(step, aten.unsqueeze):
            axes.insert(step.args[1] % len(after), None)
        elif is_op(step, aten.expand):
            axes = [None] * (len(after) - len(before)) + axes
            axes = [None if b == 1 and a != 1 else x for x, b, a in zip(axes, (1,) * (len(after) - len(before))
                                                                     + tuple(before), after, strict=True)]
        elif is_op(step, aten.view, aten.reshape, aten._unsafe_view):
            kept_in = [i for i, s in enumerate(before) if s != 1]
            kept_out = [i for i, s in enumerate(after) if s != 1]
            if [before[i] for i in kept_in] != [after[i] for i in kept_out]:
                raise NoMatch("the keys' reshape moves values (it is more than adding or dropping size-1 axes)")
            moved: list[int | None] = [None] * len(after)
            for i, o in zip(kept_in, kept_out, strict=True):
                moved[o] = axes[i]
            axes = moved
    n = len(source)
    if len(axes) != 4 or axes[2:] != [n - 2, n - 1] or axes[1] not in (None, 1 if n == 4 else None) \
            or axes[0] not in (0, None if source[0] == 1 else 0):
        raise NoMatch("the keys are not one KV head's [B,N,d] broadcast over the head axis")
    return node


def _single_value(node: fx.Node) -> fx.Node:
    """``node``'s only user when that is a dtype cast (the region's real output), else ``node``."""
    users = list(node.users)
    if len(users) == 1 and is_op(users[0], aten.to, aten._to_copy):
        return users[0]
    return node


class SparseAttention(GraphPass):
    """Index-addressed MQA with a sink, and the indexer's relu-weighted scoring -> their kernels."""

    name = "sparse_attention"
    summary = "replace gather + softmax-with-sink + weighted sum, and the indexer scoring, with fused kernels"
    matches = ("einsum('bshk,bskd->bshd', softmax(cat(masked einsum(q, gather(kv, index)) * scale, sink))[..., :k], "
               "keys), matmul(softmax(cat(q K^T * scale + 0/-inf mask, sink))[..., :N], V) and "
               "(relu(einsum('bshd,bnd->bshn', q, keys)) * w).sum(heads)")
    tolerance = 1e-2

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """The value product of the attention and the dot product of the indexer."""
        return [n for n in gm.graph.nodes
                if is_op(n, aten.einsum) and n.args[0] in (ATTENTION_VALUES, INDEXER_DOTS)
                or is_op(n, aten.matmul) and (_transposed_keys(n) is not None or _dense_probs(n) is not None)]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """Attention or indexer scoring, by the anchor's equation (or matmul form)."""
        if is_op(node, aten.matmul):
            if _transposed_keys(node) is not None:
                return self._indexer(node, ctx)
            return self._dense(node, ctx)
        if node.args[0] == ATTENTION_VALUES:
            return self._attention(node, ctx)
        return self._indexer(node, ctx)

    def _attention(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        probs, values = _einsum(node, ATTENTION_VALUES, "the value product")
        if is_op(probs, aten.exp):
            masked, sink, out = self._official_softmax(node, probs)
        else:
            masked, sink, out = self._concatenated_softmax(node, probs)
        if not is_op(masked, aten.masked_fill) or masked.args[2] != float("-inf"):
            raise NoMatch("the scores are not masked to -inf where the index is -1")
        scaled, invalid = masked.args[0], masked.args[1]
        if not is_op(scaled, aten.mul) or not isinstance(scaled.args[1], float):
            raise NoMatch("the scores are not scaled by a constant softmax scale")
        scale = float(scaled.args[1])
        q, keys = _einsum(scaled.args[0], ATTENTION_SCORES, "the score product")
        if _strip_casts(keys) is not _strip_casts(values):
            raise NoMatch("scores and values read different entries (one KV entry must be key and value)")
        kv, index = self._gathered(_strip_casts(keys))
        if self._mask_index(invalid) is not index:
            raise NoMatch("the mask is not index < 0 of the same index that addresses the entries")
        q = _strip_casts(q)
        dims = shape(q)
        k = (shape(masked) or (0,))[-1]
        if dims is None or len(dims) != 4 or shape(index) is None or shape(index)[-1] != k:
            raise NoMatch("q is not [B,S,H,d] or the index width differs from the kept probabilities")
        _kernel_dim_ok(dims[-1], "attention")
        paged = _paged_window(kv)
        details = {"form": "attention", "heads": dims[2], "dim": dims[-1], "entries": k, "queries": dims[1],
                   "paged": paged is not None}
        if paged:
            impl = ops.implementation_backend("sparse_attention_paged", ctx.backend, q.meta.get("val"))
            return Rewrite(_single_value(out), ops.sparse_attention_paged,
                           (q, *paged, sink, index, scale, ctx.backend),
                           attention_kernel(dims[-1], impl, q, paged[0], paged=True), details)
        impl = ops.implementation_backend("sparse_attention", ctx.backend, q.meta.get("val"))
        return Rewrite(_single_value(out), ops.sparse_attention, (q, kv, sink, index, scale, ctx.backend),
                       attention_kernel(dims[-1], impl, q, kv), details)

    def _dense(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """``matmul(softmax(cat(q K^T * scale + mask, sink))[..., :N], V)`` with K = V one KV head broadcast to every
        head (transformers' eager attention) -> the kernel over the entries the mask lets each row read."""
        kept = _strip_casts(node.args[0])
        while is_op(kept, aten.detach, aten.clone):
            kept = _strip_casts(kept.args[0])
        scores, sink, _ = self._concatenated_softmax(node, kept)
        columns = (shape(scores) or (0,))[-1]
        scaled, mask = _scores_and_mask(_strip_casts(scores))
        scale = _constant_scale(scaled)
        product = _strip_casts(scaled.args[0])
        if not is_op(product, aten.matmul) or not is_op(product.args[1], aten.transpose) \
                or sorted(d % 4 for d in product.args[1].args[1:3]) != [2, 3]:
            raise NoMatch("the scores are not matmul(q, K.transpose(-2, -1))")
        kv = _one_head(product.args[1].args[0])
        if _one_head(node.args[1]) is not kv:
            raise NoMatch("keys and values are not one KV head read as both (MQA with K = V)")
        q = _strip_casts(product.args[0])
        dims = shape(q)
        if dims is None or len(dims) != 4 or not all(isinstance(d, int) for d in dims):
            raise NoMatch("q is not a static [B,H,S,d]")
        batch, heads, rows, dim = dims
        _kernel_dim_ok(dim, "attention")
        users = list(node.users)
        if len(users) != 1 or not is_op(users[0], aten.transpose) \
                or sorted(d % 4 for d in users[0].args[1:3]) != [1, 2]:
            raise NoMatch("the attention output is not read as [B,S,H,d] (one transpose(1, 2))")
        found = attention_mask.mask_blocks(mask, columns)
        out = users[0]
        graph = node.graph
        with graph.inserting_before(out):
            q = traced_call(graph, aten.transpose.int, q, 1, 2)
            if len(shape(kv)) == 4:
                kv = traced_call(graph, aten.select.int, kv, 1, 0)
            index = attention_mask.entry_index(graph, found, q, batch, rows)
        entries = sum(b.entries for b in found)
        details = {"form": "dense masked attention", "heads": heads, "dim": dim, "entries": entries,
                   "queries": rows, "paged": False, "mask": " + ".join(b.kind for b in found)}
        impl = ops.implementation_backend("sparse_attention", ctx.backend, q.meta.get("val"))
        return Rewrite(out, ops.sparse_attention, (q, kv, sink, index, scale, ctx.backend),
                       attention_kernel(dim, impl, q, kv), details)

    def _official_softmax(self, node: fx.Node, weights: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
        """``einsum(exp(s - max), keys) / (sum(exp(s - max)) + exp(sink - max))`` -> (s, sink, the division)."""
        shifted = weights.args[0]
        if not is_op(shifted, aten.sub):
            raise NoMatch("the value weights are exp() of something other than the scores minus their maximum")
        masked, top = shifted.args[0], shifted.args[1]
        if not _is_row_max(top, masked):
            raise NoMatch("the scores are not shifted by their row maximum before exp()")
        divisions = [u for u in node.users if is_op(u, aten.div) and u.args[0] is node]
        if len(divisions) != 1:
            raise NoMatch("the exp-weighted values are not divided by a softmax denominator")
        division = divisions[0]
        denominator = division.args[1]
        if not is_op(denominator, aten.add):
            raise NoMatch("the softmax denominator is not sum(weights) + exp(sink - max)")
        total, sink_term = denominator.args[:2]
        if not is_op(total, aten.sum):
            total, sink_term = sink_term, total
        if not is_op(total, aten.sum) or total.args[0] is not weights or list(total.args[1]) not in ([3], [-1]):
            raise NoMatch("the softmax denominator does not sum the same weights over the entries")
        if not is_op(sink_term, aten.exp) or not is_op(sink_term.args[0], aten.sub) \
                or sink_term.args[0].args[1] is not top:
            raise NoMatch("the softmax denominator adds no exp(sink - max) with the scores' maximum (no sink)")
        return masked, _strip_casts(self._sink_source(sink_term.args[0].args[0])), division

    def _concatenated_softmax(self, node: fx.Node, probs: object) -> tuple[fx.Node, fx.Node, fx.Node]:
        """``softmax(cat(s, sink) [- rowmax])[..., :k]`` -> (s, sink, the value product)."""
        if not is_op(probs, aten.slice) or probs.args[1] % 4 != 3 or (probs.args[2] or 0) != 0:
            raise NoMatch("the value weights are neither exp(scores - max) (a sink in the denominator) nor the "
                          "[..., :k] prefix of a softmax (a sink column cut off)")
        softmax = probs.args[0]
        if not is_op(softmax, aten.softmax, aten._softmax) or softmax.args[1] % 4 != 3:
            raise NoMatch("the value weights are not a softmax over the entries")
        joined = _unshifted(softmax.args[0])
        if not is_op(joined, aten.cat) or len(joined.args[0]) != 2 or joined.args[1] % 4 != 3:
            raise NoMatch("the softmax has no sink column appended to the scores")
        masked, sink_column = joined.args[0]
        if (shape(masked) or (0,))[-1] != (shape(probs) or (None,))[-1]:
            raise NoMatch("the kept probabilities are not exactly the scores' columns")
        return masked, _strip_casts(self._sink_source(sink_column)), node

    @staticmethod
    def _sink_source(column: fx.Node) -> fx.Node:
        """``sink.view(1, 1, H, 1).expand(B, S, H, 1)`` -> sink."""
        node = column
        while is_op(node, aten.expand, aten.view, aten.reshape, aten.unsqueeze):
            node = node.args[0]
        node = _strip_casts(node)
        if not isinstance(node, fx.Node) or len(shape(node) or ()) != 1:
            raise NoMatch("the appended softmax column is not a per-head sink broadcast")
        return node

    @staticmethod
    def _gathered(keys: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``gather(kv, 1, index.clamp(0).reshape(B, S*K, 1).expand(..., d)).view(B, S, K, d)`` -> (kv, index)."""
        if is_op(keys, aten.view, aten.reshape):
            keys = keys.args[0]
        if not is_op(keys, aten.gather) or keys.args[1] != 1:
            raise NoMatch("the entries are not gathered from a KV tensor along its entry axis")
        kv, where = keys.args[0], keys.args[2]
        while is_op(where, aten.expand, aten.reshape, aten.view):
            where = where.args[0]
        if not is_op(where, aten.clamp) or where.args[1] != 0:
            raise NoMatch("the gather index is not the entry index clamped at 0 (-1 masked entries)")
        return kv, where.args[0]

    @staticmethod
    def _mask_index(invalid: object) -> object:
        """``~(index >= 0).unsqueeze(2)`` -> index."""
        if not is_op(invalid, aten.bitwise_not, aten.logical_not):
            raise NoMatch("the mask is not the negation of the valid entries")
        valid = invalid.args[0]
        if is_op(valid, aten.unsqueeze):
            valid = valid.args[0]
        if not is_op(valid, aten.ge) or valid.args[1] != 0:
            raise NoMatch("the valid entries are not index >= 0")
        return valid.args[0]

    def _indexer(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        if is_op(node, aten.matmul):
            q, keys = node.args[0], _transposed_keys(node)
        else:
            q, keys = _einsum(node, INDEXER_DOTS, "the indexer's dot product")
        users = list(node.users)
        if len(users) != 1 or not is_op(users[0], aten.relu):
            raise NoMatch("the dot products are not passed through one relu")
        relu = users[0]
        users = list(relu.users)
        scale = None
        if len(users) == 1 and is_op(users[0], aten.mul) and isinstance(users[0].args[1], float):
            relu, scale = users[0], users[0].args[1]
            users = list(relu.users)
        if len(users) != 1 or not is_op(users[0], aten.mul):
            raise NoMatch("the relu'd dots are not weighted per head")
        weighted = users[0]
        weights = weighted.args[1] if weighted.args[0] is relu else weighted.args[0]
        if not is_op(weights, aten.unsqueeze):
            raise NoMatch("the head weights are not broadcast over the keys")
        weights = _strip_casts(weights.args[0])
        users = list(weighted.users)
        if len(users) != 1 or not is_op(users[0], aten.sum) or list(users[0].args[1]) not in ([2], [-2]):
            raise NoMatch("the weighted dots are not summed over the heads")
        total = users[0]
        if len(total.args) > 2 and total.args[2]:
            raise NoMatch("the head sum keeps its dim")
        dims = shape(q)
        if dims is None or len(dims) != 4:
            raise NoMatch("q is not [B,S,H,d]")
        _kernel_dim_ok(dims[-1], "indexer")
        sink = _single_value(total)
        if sink.meta.get("val") is None or sink.meta["val"].dtype != torch.float32:
            raise NoMatch("the head sum is not returned as fp32 scores")
        if scale is not None:
            with node.graph.inserting_before(sink):
                weights = node.graph.call_function(aten.mul.Tensor, (weights, scale))
        keys = _strip_casts(keys)
        paged = _paged_keys(keys)
        op = "indexer_scores_paged" if paged else "indexer_scores"
        impl = ops.implementation_backend(op, ctx.backend, q.meta.get("val"))
        dtype = q.meta["val"].dtype if q.meta.get("val") is not None else torch.float32
        name = (indexer_kernel_name(dims[-1], dtype, impl, paged is not None) if impl in ("triton", "tilelang")
                else f"{op}.d{dims[-1]}.{impl}")
        details = {"form": "indexer scores", "heads": dims[2], "dim": dims[-1], "keys": (shape(node) or (0,))[-1],
                   "fused_with_topk": False, "paged": paged is not None}
        if paged:
            return Rewrite(sink, ops.indexer_scores_paged, (q, *paged, weights, ctx.backend), name, details)
        return Rewrite(sink, ops.indexer_scores, (q, keys, weights, ctx.backend), name, details)


__all__ = ["SparseAttention"]
