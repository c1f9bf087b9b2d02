"""The backend's executor for a stream-scheduled graph. The ``stream_schedule`` pass
(:mod:`v4compile.passes.stream_schedule`) only annotates nodes with a stream, a launch position and a segment;
here the segments are rebuilt from those annotations, each segment becomes a region (graph module),
:class:`StreamRunner` launches them on their streams with events, and :func:`scheduled` is the hook the backend
(:mod:`v4compile.backend`) calls, handing over how to compile a region."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx

from .passes.streams.dag import META_KEY, dependency_graph, is_view, node_values, written_input
from .passes.streams.segments import Segment, segments, unordered_edges

CompileRegion = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]
"""How a region is compiled: ``(region graph module, example inputs) -> callable``."""


def annotated_streams(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each scheduled node's stream from the pass's annotations (0 where none)."""
    return {n: n.meta.get(META_KEY, {}).get("stream", 0) for n in gm.graph.nodes}


@dataclass
class Region:
    """One segment as a callable: its graph module, the values it reads and makes, and what to free after."""

    segment: Segment
    module: fx.GraphModule
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    release: list[fx.Node] = field(default_factory=list)
    fn: Callable[..., Any] | None = None


def executable_segments(gm: fx.GraphModule) -> tuple[nx.DiGraph, list[Segment]] | None:
    """The segments of an annotated graph in launch order (None when every node is on the main stream):
    launch positions and streams come from the pass's node metadata, recomputed into a valid order should a
    later pass have added nodes; raises if the events leave a dependency unordered."""
    stream_of = annotated_streams(gm)
    if not any(stream_of.values()):
        return None
    dag = dependency_graph(gm.graph)
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    key = {n: (n.meta.get(META_KEY, {}).get("launch", len(index)), index[n]) for n in dag}
    launch = list(nx.lexicographical_topological_sort(dag, key=key.__getitem__))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stream_of[output] = 0
    group = {n: n.meta[META_KEY]["group"] for n in dag if "group" in n.meta.get(META_KEY, {})}
    segs = segments(dag, launch, stream_of, group)
    bad = unordered_edges(dag, segs)
    if bad:
        raise RuntimeError(f"stream schedule leaves {len(bad)} dependencies unordered, e.g. {bad[0]}")
    return dag, segs


def _region_graph(seg: Segment) -> tuple[fx.Graph, dict[fx.Node, fx.Node], list[fx.Node], list[fx.Node]]:
    """A segment's nodes copied into a graph of their own: ``(graph, copies, inputs, made)``. Views are remade
    from their bases, except items of a tuple made elsewhere: those, like other values, are inputs (a region
    returns tensors, never tuples, so it makes the items of every tuple it makes). The result of an in-place
    (or ``out=``) op made elsewhere is read as the tensor the op wrote, which it is: as an input of its own it
    would alias that tensor's base, and Inductor compiles aliased inputs against a synthetic base that its
    runtime wrapper does not rebuild the same way (a region reading a KV cache and an ``index_put_`` into it
    failed its input guard). So a region's inputs alias each other only where the graph's inputs do."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    made: list[fx.Node] = []

    def value(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op == "get_attr":
                env[n] = graph.get_attr(n.target)
            elif is_view(n) and n.target is not operator.getitem:
                env[n] = graph.node_copy(n, value)
                made.append(n)
            elif (written := written_input(n)) is not None:
                env[n] = value(written)
            else:
                env[n] = graph.placeholder(n.name)
                env[n].meta = dict(n.meta)
                inputs.append(n)
        return env[n]

    for node in seg.nodes:
        if node.op == "output":
            fx.map_arg(node.args, value)
            continue
        env[node] = graph.node_copy(node, value)
        made.append(node)
        for item in node.users:
            if item.target is operator.getitem:
                env[item] = graph.node_copy(item, value)
                made.append(item)
    return graph, env, inputs, made


def build_regions(gm: fx.GraphModule, segs: Sequence[Segment]) -> list[Region]:
    """Each segment as a graph module of its own: views it reads are remade inside from their bases, results of
    in-place ops made elsewhere are read as the tensors they wrote, other values from other segments and graph
    inputs become its inputs, values that later segments or the graph's output read become its outputs; each
    region also lists the values no later region reads (freed after it)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    final_values = set(output.all_input_nodes)
    built = [_region_graph(seg) for seg in segs]
    needed: set[fx.Node] = set(final_values)
    regions: list[Region] = []
    for seg, (graph, env, inputs, made) in reversed(list(zip(segs, built, strict=True))):
        outputs = [n for n in made if n in needed]
        graph.output(tuple(env[n] for n in outputs))
        regions.append(Region(seg, fx.GraphModule(gm, graph), inputs, outputs))
        needed.update(inputs)
    regions.reverse()
    last_use: dict[fx.Node, int] = {}
    for at, region in enumerate(regions):
        for n in region.inputs:
            last_use[n] = at
    for n, at in last_use.items():
        if n.op != "placeholder" and n not in final_values:
            regions[at].release.append(n)
    return regions


class StreamRunner:
    """Runs an annotated graph's regions on their streams: before a region, its stream waits on the events of
    the regions it depends on (fork and join points); after it, an event is recorded if a later region waits
    on it; at the end the main stream (the caller's current stream, which may be capturing a CUDA graph) waits
    for every side stream. A tensor read on another stream than the one that made it is marked with
    ``record_stream``, so the caching allocator does not hand its memory to new work of the making stream
    before the reading stream is done with it (during CUDA graph capture: not before the capture ends)."""

    def __init__(self, gm: fx.GraphModule, segs: Sequence[Segment], example_inputs: Sequence[Any],
                 compile_region: CompileRegion, overlap: bool = True) -> None:
        self.overlap = overlap
        """False runs every region on the caller's stream: the same regions without the overlap (an
        ablation for benchmarks)."""
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.regions = build_regions(gm, segs)
        made_on = {n: region.segment.stream for region in self.regions for n in region.outputs}
        self.crossing = [[i for i, n in enumerate(region.inputs) if made_on.get(n, region.segment.stream)
                          != region.segment.stream] for region in self.regions]
        values = node_values(gm)
        values.update(zip(self.placeholders, example_inputs, strict=False))
        for region in self.regions:
            region.fn = compile_region(region.module, [values[n] for n in region.inputs])
        self.last_of: dict[int, int] = {}
        for region in self.regions:
            self.last_of[region.segment.stream] = region.segment.id
        self.waited_at_end = sorted(self.last_of[s] for s in self.last_of if s != 0)
        self._streams: dict[int, Any] = {}
        self._events: dict[int, Any] = {}

    def _setup(self, device: torch.device) -> None:
        for region in self.regions:
            s = region.segment.stream
            if s and s not in self._streams:
                self._streams[s] = torch.cuda.Stream(device)
            if region.segment.recorded or region.segment.id in self.waited_at_end:
                self._events[region.segment.id] = torch.cuda.Event()
        self._events[-1] = torch.cuda.Event()

    def __call__(self, *args: Any) -> Any:
        """Runs the graph on ``args`` (the graph's inputs); on a CPU input every region runs in order."""
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args, strict=True))
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        if device is None or not self.overlap:
            for region in self.regions:
                self._run(region, env)
            return fx.map_arg(self.output.args[0], env.__getitem__)
        if not self._streams:
            self._setup(device)
        main = torch.cuda.current_stream(device)
        self._events[-1].record(main)
        for region, crossing in zip(self.regions, self.crossing, strict=True):
            seg = region.segment
            stream = main if seg.stream == 0 else self._streams[seg.stream]
            for w in seg.waits:
                stream.wait_event(self._events[w])
            with torch.cuda.stream(stream):
                self._run(region, env, crossing, stream)
            if seg.id in self._events:
                self._events[seg.id].record(stream)
        for w in self.waited_at_end:
            main.wait_event(self._events[w])
        return fx.map_arg(self.output.args[0], env.__getitem__)

    def _run(self, region: Region, env: dict[fx.Node, Any], crossing: Sequence[int] = (),
             stream: Any = None) -> None:
        inputs = [env[n] for n in region.inputs]
        for i in crossing:
            if isinstance(inputs[i], torch.Tensor):
                inputs[i].record_stream(stream)
        env.update(zip(region.outputs, region.fn(*inputs), strict=True))
        for n in region.release:
            env.pop(n, None)


def scheduled(gm: fx.GraphModule, example_inputs: Sequence[Any],
              compile_region: CompileRegion) -> Callable[..., Any] | None:
    """The backend's hook: ``gm`` as a :class:`StreamRunner` when the stream schedule annotated it, the inputs
    are on a CUDA device and no gradient is recorded (inference; training graphs compile as one), else None.
    ``compile_region``: how each region is compiled (the backend's Inductor compile, or :func:`as_is`)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    if not on_cuda or torch.is_grad_enabled():
        return None
    found = executable_segments(gm)
    if found is None:
        return None
    return StreamRunner(gm, found[1], example_inputs, compile_region)


def as_is(module: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A region run as its graph module, uncompiled (the backend without Inductor)."""
    return module
