"""``radix_topk``: top-k selection over many candidates becomes an exact select kernel (a threshold from group
maxima, a gathering pass and a rank, with radix rounds for heavy ties; see codegen/triton/radix_topk.py).

Matches the indexer's ``sort(descending, stable)[..., :k]`` (optionally with its ``-inf -> -1`` masking of the ids)
and any ``topk(k <= max_k)`` over at least ``min_candidates`` candidates. The kernel returns the same values and ids:
descending, ties to the lowest index. A ``topk`` over the lightning indexer's scores (``sum_h w * relu(q . k)``,
future entries masked to -inf: transformers' spelling of the indexer's selection) is rewritten at any size on CUDA
and is a near-miss on the CPU. The relu makes exact ties common (a score is 0 wherever every head's dot is
negative), so the selected set depends on the tie order: on CUDA ``torch.topk`` takes the tied values at the k-th
place in index order, the set the kernel takes (measured on the H100 in 21 tie-heavy cases, 40 to 262144 candidates,
k 4 and 512: every set equal; benchmarks/NOTES.md 33rd); on the CPU it does not (measured on a tiny transformers V4
with two index heads: rewritten there, the top token moved from 91% to 85% of positions equal to its eager run and
the median logit cosine from 0.99987 to 0.9987). Option ``any_ties`` rewrites it on the CPU too, for a user who
accepts the kernel's ties.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..codegen import ops
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, SymDim, is_op, shape

aten = torch.ops.aten
END = 2**63 - 1


def _last_dim_prefix(node: fx.Node, dims: tuple[int | SymDim, ...]) -> int | None:
    """k when ``node`` is ``x[..., :k]`` on the last dim, else None (see ``_constant_k``)."""
    if not is_op(node, aten.slice):
        return None
    args = list(node.args) + [0, 0, END][len(node.args) - 1:]
    dim, start, end = args[1] % len(dims), args[2] or 0, args[3]
    if dim != len(dims) - 1 or start != 0 or end is None:
        return None
    return _constant_k(end, dims[-1])


def _constant_k(k: object, candidates: int | SymDim) -> int:
    """k as an int. A dynamic ``min(c, candidates)`` (the indexer's ``min(topk, entries)`` in a graph compiled for
    every length) is c: the op returns min(k, candidates) columns. Any other dynamic k is a NoMatch (the kernel is
    built for one k)."""
    if isinstance(k, fx.Node):
        bound = [a for a in k.args if isinstance(a, int)]
        sizes = [a.meta.get("val") for a in k.args if isinstance(a, fx.Node)]
        count = candidates.value if isinstance(candidates, SymDim) else candidates
        if (k.target in (torch.sym_min, min) and len(bound) == 1 and len(sizes) == 1
                and isinstance(sizes[0], (int, torch.SymInt)) and statically_known_true(sizes[0] == count)):
            return bound[0]
        raise NoMatch(f"the top-k length is a dynamic size ({k.name}), known only at run time")
    return int(k)


def _indexer_scores(x: object) -> bool:
    """Whether ``x`` is the lightning indexer's scores: ``(relu(dots) [* c] * w.unsqueeze(-1)).sum(heads)``,
    possibly masked to -inf (``masked_fill``) first."""
    if is_op(x, aten.masked_fill) and x.args[2] == float("-inf"):
        x = x.args[0]
    if not is_op(x, aten.sum) or not is_op(x.args[0], aten.mul):
        return False
    for term in x.args[0].args[:2]:
        if is_op(term, aten.mul) and isinstance(term.args[1], float):
            term = term.args[0]
        if is_op(term, aten.relu):
            return True
    return False


def _kernel_name(k: int, ctx: RewriteContext) -> str:
    return f"radix_topk.k{k}.{ops.implementation_backend('radix_topk', ctx.backend)}"


class RadixTopK(GraphPass):
    """Top-k over many candidates -> the exact select kernel."""

    name = "radix_topk"
    summary = "replace large top-k selections with the exact select kernel (ties to the lowest index)"
    matches = ("sort(x, descending, stable)[..., :k] (the indexer) and topk(x, k) with k <= max_k over "
               ">= min_candidates candidates")
    option_help = {"max_k": "largest k rewritten (default 2048)",
                   "min_candidates": "smallest candidate count for plain topk (default 4096)",
                   "official_ties": "keep every plain topk (set by optimize for a model with index_ties='official', "
                                    "whose indexer needs torch.topk's own tie order)",
                   "any_ties": "also rewrite topk over the lightning indexer's scores on the CPU, taking the kernel's "
                               "tie order (lowest index) where the CPU's torch.topk takes others"}

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Every sort and topk."""
        return [n for n in gm.graph.nodes if is_op(n, aten.sort, aten.topk)]

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """A topk within the limits, or a stable descending sort whose outputs are only cut to [..., :k]."""
        dims = shape(node.args[0])
        if dims is None:
            raise NoMatch("selection over a dynamic shape")
        if is_op(node, aten.topk):
            return self._topk(node, dims, ctx)
        return self._sort(node, dims, ctx)

    def _limits(self) -> tuple[int, int]:
        return int(self.options.get("max_k", 2048)), int(self.options.get("min_candidates", 4096))

    def _topk(self, node: fx.Node, dims: tuple[int, ...], ctx: RewriteContext) -> Rewrite:
        max_k, min_candidates = self._limits()
        x, k = node.args[0], _constant_k(node.args[1], dims[-1])
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % len(dims)
        largest = node.args[3] if len(node.args) > 3 else node.kwargs.get("largest", True)
        if self.options.get("official_ties"):
            raise NoMatch("the model's index_ties='official' keeps torch.topk's own tie order (the kernel's ties go "
                          "to the lowest index)")
        if dim != len(dims) - 1:
            raise NoMatch(f"topk over dim {dim}, not the last dim")
        if not largest:
            raise NoMatch("topk of the smallest values")
        if k > max_k:
            raise NoMatch(f"k = {k} exceeds the select kernel's maximum {max_k}")
        indexer = _indexer_scores(x)
        val = x.meta.get("val")
        cuda = val is not None and val.device.type == "cuda"
        if indexer and not cuda and not self.options.get("any_ties"):
            raise NoMatch("topk over the indexer's relu-weighted scores on the CPU: exact ties (0 where every head's "
                          "dot is negative) are common, and the CPU's torch.topk does not take them by lowest index "
                          "as the kernel (and CUDA's torch.topk) do (the stable-sort spelling of the selection is "
                          "rewritten; option any_ties rewrites this one too)")
        if dims[-1] < min_candidates and not indexer:
            raise NoMatch(f"only {dims[-1]} candidates (< {min_candidates}): torch.topk is already cheap")
        return Rewrite(node, ops.radix_topk, (x, k, False, ctx.backend), _kernel_name(k, ctx),
                       {"source": ("indexer topk (kernel's ties)" if not cuda else "indexer topk (CUDA's tie set)")
                        if indexer else "topk", "k": k,
                        "candidates": dims[-1]})

    def _sort(self, node: fx.Node, dims: tuple[int, ...], ctx: RewriteContext) -> Rewrite:
        max_k, _ = self._limits()
        kwargs = node.kwargs
        if not kwargs.get("stable", False):
            raise NoMatch("unstable sort: its tie order is unspecified, so the slice is not a defined top-k")
        if not kwargs.get("descending", False):
            raise NoMatch("ascending sort (smallest first)")
        if kwargs.get("dim", -1) % len(dims) != len(dims) - 1:
            raise NoMatch("sort over another dim than the last")
        outputs: dict[int, fx.Node] = {}
        ks = set()
        for user in node.users:
            if user.target is not operator.getitem:
                raise NoMatch("sort result used whole")
            for use in user.users:
                k = _last_dim_prefix(use, dims)
                if k is None:
                    raise NoMatch("sorted values feed something other than a [..., :k] prefix")
                ks.add(k)
            outputs[user.args[1]] = user
        if len(ks) != 1:
            raise NoMatch(f"sorted outputs are cut at different lengths {sorted(ks)}")
        k = ks.pop()
        if k > max_k:
            raise NoMatch(f"k = {k} exceeds the select kernel's maximum {max_k}")
        if not isinstance(dims[-1], SymDim) and k >= dims[-1]:
            raise NoMatch(f"keeps all {dims[-1]} candidates: a full sort, not a selection")
        mask_invalid = self._masks_invalid(outputs)
        details = {"source": "stable sort prefix", "k": k, "candidates": dims[-1], "masks_invalid": mask_invalid}
        sink = outputs.get(1, outputs.get(0))
        rewrite = Rewrite(sink, ops.radix_topk, (node.args[0], k, mask_invalid, ctx.backend),
                          _kernel_name(k, ctx), details)
        rewrite.outputs = {i: next(iter(getter.users)) for i, getter in outputs.items()}
        if mask_invalid:
            ids_slice = rewrite.outputs[1]
            rewrite.outputs = {1: next(iter(ids_slice.users))}
        rewrite.details["replaced"] = [n.name for n in (node, *outputs.values())]
        return rewrite

    @staticmethod
    def _masks_invalid(outputs: dict[int, fx.Node]) -> bool:
        """Whether the only use of the values is ``where(values == -inf, -1, ids)`` on the ids prefix."""
        if set(outputs) != {0, 1}:
            return False
        values_slice = next(iter(outputs[0].users))
        ids_slice = next(iter(outputs[1].users))
        users = list(values_slice.users)
        if len(users) != 1 or not is_op(users[0], aten.eq) or users[0].args[1] != float("-inf"):
            return False
        masks = list(users[0].users)
        ids_users = list(ids_slice.users)
        return (len(masks) == 1 and is_op(masks[0], aten.where) and ids_users == masks
                and masks[0].args[0] is users[0] and masks[0].args[1] == -1 and masks[0].args[2] is ids_slice)
