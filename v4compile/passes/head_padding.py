"""``head_padding``: pads each rank's query heads up to the attention kernel's head multiple.

Under tensor parallelism every rank holds ``n_heads / tp`` query heads (V4-Flash at tp=8: 8), while a
tensor-core attention kernel takes heads as the rows of its matrix tile (a multiple of 64 on Hopper's
wgmma, 128 on Blackwell; ``v4compile/targets.py``). The pass turns each ``sparse_attention`` call whose
head count is not a multiple into ``sparse_attention_padded``: zero heads are appended, the kernel runs,
the real heads are kept. Heads are independent, so numerics are unchanged. ``sparse_attention_paged`` calls
are near-misses: that op has one kernel (Triton, on every backend), which masks the rows of its head block, so
padding would only add work.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

from ..codegen import ops
from ..targets import target, target_name
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, shape
from .sparse_attention import attention_kernel


class HeadPadding(GraphPass):
    """Sparse attention over a head count the kernel cannot tile -> the padded call."""

    name = "head_padding"
    summary = "pad each rank's query heads with zero heads to the attention kernel's head multiple, then trim"
    matches = "v4compile::sparse_attention calls whose head count is not a multiple of the target's tile"
    _ATTENTION = (torch.ops.v4compile.sparse_attention.default, torch.ops.v4compile.sparse_attention_paged.default)
    option_help = {"target": "hardware target whose head multiple applies (default: the graph's device)",
                   "multiple": "head multiple to pad to, overriding the target table",
                   "tp": "tensor-parallel degree, reported with each match (heads per rank come from the graph)"}

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Every sparse attention call, paged or not (after the ``sparse_attention`` pass)."""
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in self._ATTENTION]

    def _multiple(self, q: fx.Node) -> tuple[int, str]:
        if "multiple" in self.options:
            multiple = int(self.options["multiple"])
            if multiple < 1:
                raise ValueError(f"head_padding: multiple must be >= 1, got {multiple}")
            return multiple, "option"
        val = q.meta.get("val")
        name = self.options.get("target") or target_name(val.device if val is not None else None)
        return int(target(name)["attention_head_multiple"]), name

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The padded call when the heads are not a multiple of the kernel's tile."""
        if node.target is torch.ops.v4compile.sparse_attention_paged.default:
            raise NoMatch("sparse_attention_paged has one kernel (Triton), which masks its head block: nothing to pad")
        q, kv, sink, index, scale, backend = node.args
        dims = shape(q)
        if dims is None or len(dims) != 4:
            raise NoMatch("queries are not a static [B,S,H,d]")
        heads = dims[2]
        multiple, source = self._multiple(q)
        if heads % multiple == 0:
            raise NoMatch(f"{heads} heads are already a multiple of {multiple} ({source})")
        padded = heads + (-heads % multiple)
        impl = ops.implementation_backend("sparse_attention", backend, q.meta.get("val"))
        return Rewrite(node, ops.sparse_attention_padded, (q, kv, sink, index, scale, multiple, backend),
                       attention_kernel(dims[-1], impl, q, kv),
                       {"heads": heads, "padded_heads": padded, "multiple": multiple, "from": source,
                        "tp": int(self.options.get("tp", 1))})
