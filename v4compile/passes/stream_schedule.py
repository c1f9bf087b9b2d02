"""``stream_schedule``: independent branches of each layer on side CUDA streams, forked and joined with events.

Analysis (any device). The captured graph becomes a dependency DAG (networkx) of the nodes that launch work
(views are left out: every consumer remakes them), with an edge for every value a node reads, through views,
and for every ordering an in-place write imposes (read-after-write, write-after-read, write-after-write on one
base storage, from the ops' alias annotations; cache writes and reads are ordered so). Each node is costed from
its fake-tensor metadata (a launch, plus bytes over copy bandwidth or FLOPs over matmul rate, per target). The
DAG is cut into threads: a node continues the thread of the predecessor whose critical successor it is (the
longest cost-weighted path onwards), the critical path being the main thread; a thread cheaper than
``min_branch_us`` joins the thread it feeds, a thread forking from a side thread joins it, and one that reads
only graph inputs joins the thread it feeds. The side threads (in V4: a layer's query path, window KV,
compressor, indexer compressor; its experts and shared expert) get the target's side streams, a launch order
keeps each stream's work together, and it is cut into segments (one per stream run, cut after a node another
stream reads and before one that needs a new wait), adjacent ones merged while the simulated time does not
grow. A section is the span from a fork to the join of every side segment another stream reads; its
branches are named from the nodes' ``nn_module_stack`` (or code place). The pass annotates node metadata only
(stream, launch position, segment); its report is one match per section, one near-miss per branch too cheap.

On by default for CUDA graphs whose products have at most ``max_rows`` rows (decode steps, short prompts): on the
H200 the whole decode step gains 2-8% and an 8192-token prefill loses 9% (its kernels fill the device alone, and
region borders cost Inductor fusions; NOTES.md). CPU graphs are planned only when a ``target`` is given (the
``v4compile schedule`` report).

Execution (CUDA only; on CPU the plan is a report and the graph runs unchanged) is the backend's: its
executor (``v4compile/stream_runner.py``) rebuilds the segments from these annotations and builds a
``StreamRunner``: each segment becomes a graph module of its own, compiled by Inductor (or run as is),
launched on its stream after waiting on the events of the segments it depends on (fork: a side stream waits
on the main stream; join: the main stream waits on a side stream); every side stream joins the caller's
stream before the call returns, so the whole step can be captured in a CUDA graph. Only the streams change,
plus Inductor cannot fuse across a segment boundary.

The per-target stream count and cost rates are in ``v4compile/targets.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from ..targets import DEFAULT_GPU_TARGET, target_name
from .base import GraphPass, NoMatch, Rewrite, RewriteContext, SymDim, shape
from .streams.dag import META_KEY
from .streams.plan import Plan, SectionPlan, make_plan


# ---------------------------------------------------------------------------------------------- the pass
class StreamSchedule(GraphPass):
    """Independent branches of each layer on side CUDA streams, forked and joined with events."""

    name = "stream_schedule"
    on_by_default = True
    summary = ("run each layer's independent branches (query path, window KV, compressor, indexer; experts) on "
               "side CUDA streams with fork/join events, inside CUDA graphs too; on CPU a report only")
    matches = ("a fork in the dependency DAG whose branches each cost more than min_branch_us (estimated from "
               "fake-tensor bytes and FLOPs), up to the target's stream count (v4compile/targets.py)")
    option_help = {
        "target": "the target to plan for (v4compile/targets.py); default: the graph's GPU, sm90 on CPU",
        "min_branch_us": "estimated microseconds a branch must cost to get a stream of its own (default 10)",
        "max_rows": "graphs whose largest matrix product has more rows stay on one stream (default 1024: on the "
                    "H200 streams shorten decode steps and lengthen an 8192-token prefill, NOTES.md)",
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.plans: list[Plan] = []
        """Every graph's plan, in the order the graphs were compiled (what ``v4compile schedule`` prints)."""
        self._anchors: dict[int, tuple[Plan, SectionPlan]] = {}
        self._misses: dict[int, str] = {}

    def plan(self, gm: fx.GraphModule) -> Plan:
        """The schedule of ``gm`` for the configured (or the graph's) target."""
        name = self.options.get("target") or _graph_target(gm)
        return make_plan(gm, name, float(self.options.get("min_branch_us", 10.0)))

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """One anchor per section (its fork node, or its first side node when an earlier section forks at the
        same node), plus the first node of each near-miss thread."""
        declined = self._declined(gm)
        if declined:
            first = next(n for n in gm.graph.nodes if n.op != "placeholder")
            self._anchors, self._misses = {}, {id(first): declined}
            return [first]
        plan = self.plan(gm)
        self.plans.append(plan)
        anchors: dict[fx.Node, SectionPlan] = {}
        for section in plan.sections:
            first_side = next(n for i in section.segments if plan.segments[i].stream for n in plan.segments[i].nodes)
            anchors[section.fork if section.fork not in anchors else first_side] = section
        self._anchors = {id(n): (plan, s) for n, s in anchors.items()}
        self._misses = {id(n): reason for n, reason in plan.cheap}
        return list(anchors) + [n for n, _ in plan.cheap if n not in anchors]

    def _declined(self, gm: fx.GraphModule) -> str | None:
        """Why ``gm`` stays on one stream as a whole, or None: a CPU graph has no streams (unless a target is
        asked for, to plan for it), and a prefill-sized graph's kernels each fill the device already while its
        region borders cost Inductor fusions."""
        if not self.options.get("target") and _cuda_target(gm) is None:
            return "graph on the CPU: no CUDA streams (give the target option to plan for a GPU)"
        dynamic = _beyond_the_batch(gm)
        if dynamic:
            return (f"{dynamic}: stream regions compile with a dynamic batch only (Inductor failed on a region of "
                    "a chunk graph on the H100)")
        limit = int(self.options.get("max_rows", 1024))
        rows = max((_product_rows(n) for n in gm.graph.nodes), default=0)
        if rows > limit:
            return f"products of {rows} rows exceed max_rows {limit}: each kernel fills the device on its own"
        return None

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The section forking at ``node`` as an annotation (the graph is unchanged; node metadata carries
        each node's stream and launch position), or NoMatch for a thread too cheap for a stream."""
        if id(node) not in self._anchors:
            raise NoMatch(self._misses.get(id(node), "not a fork"))
        plan, section = self._anchors[id(node)]
        branches = [b for b in section.branches if not b.main]
        details = {"unit": section.unit, "target": plan.target,
                   "branches": ", ".join(f"{b.name}@s{b.stream}" for b in section.branches),
                   "streams": len({b.stream for b in section.branches}), "events": len(section.events),
                   "est_us": f"{section.serial_us:.1f} -> {section.overlapped_us:.1f}"}
        if plan.streams <= 1 or not branches:
            raise NoMatch(f"target {plan.target} has {plan.streams} stream(s): nothing runs side by side")

        def annotate(graph: fx.Graph) -> None:
            position = {n: i for i, n in enumerate(plan.launch)}
            for seg in plan.segments:
                for n in seg.nodes:
                    n.meta.setdefault(META_KEY, {}).update(launch=position[n], group=seg.id)
            for n, index in plan.section_of.items():
                if index == section.index:
                    n.meta[META_KEY]["stream"] = plan.stream_of[n]

        return Rewrite(node, f"streams[{plan.target}]", (), "-", details, annotate=annotate)


def _cuda_target(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return target_name(value.device)
    return None


def _graph_target(gm: fx.GraphModule) -> str:
    return _cuda_target(gm) or DEFAULT_GPU_TARGET


def _product_rows(node: fx.Node) -> int:
    """Rows of the left operand when ``node`` is a matrix product (ATen's or a custom linear op), else 0; a dynamic
    size counts as the size the graph was first compiled for."""
    if node.op != "call_function":
        return 0
    name = str(getattr(node.target, "__name__", node.target))
    if not any(key in name for key in ("mm", "matmul", "linear")):
        return 0
    left = node.args[1] if name.startswith("addmm") and len(node.args) > 1 else node.args[0] if node.args else None
    sizes = shape(left)
    if sizes is None or len(sizes) < 2:
        return 0
    rows = 1
    for size in sizes[:-1]:
        rows *= size if isinstance(size, int) else (size.hint or 0)
    return rows


def _beyond_the_batch(gm: fx.GraphModule) -> str | None:
    """What of ``gm``'s inputs is dynamic beyond the batch (dim 0), e.g. a chunk's length or start, or None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = [dims[0] for n in placeholders if (dims := shape(n)) and isinstance(dims[0], SymDim)]
    for node in placeholders:
        beyond = [d for d, size in enumerate(shape(node) or ()) if d and isinstance(size, SymDim)]
        if beyond:
            return f"input {node.name} has a dynamic size in dim {beyond[0]}"
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and not any(b == val for b in batch):
            return f"input {node.name} is a dynamic value other than the batch size"
    return None
