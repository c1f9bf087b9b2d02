"""The stream schedule's plan: the phases run in order (DAG and costs, threads, streams, launch order, segments)
and the sections the report shows, as the dataclasses the pass and ``v4compile schedule`` read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from ...targets import target
from .dag import Cost, dependency_graph, node_cost, node_values
from .naming import branch_name, module_path, unit_of
from .segments import Segment, coarsen, happens_before, segments, simulate
from .threads import assign_streams, launch_order, threads


@dataclass
class BranchPlan:
    """One branch of a section: a thread's nodes in the section, its stream and estimated cost."""

    name: str
    stream: int
    nodes: int
    cost: Cost
    main: bool


@dataclass
class EventPlan:
    """A fork (a side stream waits on the main stream) or join (the main stream waits on a side stream), or
    a side stream waiting on another side stream: the wait happens before ``before``, on ``waiter``, for the
    work up to ``after`` on ``recorder``."""

    kind: str
    recorder: int
    after: str
    waiter: int
    before: str


@dataclass
class SectionPlan:
    """A fork, the branches that run side by side, and the joins: usually one layer's attention inputs or its
    experts. ``serial_us``/``overlapped_us``: estimated time on one stream and with the schedule."""

    index: int
    unit: str
    fork: fx.Node
    branches: list[BranchPlan]
    events: list[EventPlan]
    segments: list[int]
    serial_us: float
    overlapped_us: float


@dataclass
class Plan:
    """A graph's stream schedule: target, its stream count, sections, every node's stream and launch
    position, and the threads too cheap for a stream of their own (near-misses)."""

    target: str
    streams: int
    sections: list[SectionPlan]
    stream_of: dict[fx.Node, int]
    launch: list[fx.Node]
    segments: list[Segment]
    section_of: dict[fx.Node, int]
    cheap: list[tuple[fx.Node, str]]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (what ``v4compile schedule --json`` prints)."""
        return {"target": self.target, "streams": self.streams, "sections": [
            {"index": s.index, "unit": s.unit, "fork": s.fork.name, "serial_us": round(s.serial_us, 2),
             "overlapped_us": round(s.overlapped_us, 2),
             "branches": [{"name": b.name, "stream": b.stream, "main": b.main, "nodes": b.nodes,
                           "kernels": b.cost.kernels, "bytes": b.cost.bytes, "flops": b.cost.flops,
                           "us": round(b.cost.us, 2)} for b in s.branches],
             "events": [vars(e) for e in s.events]} for s in self.sections]}


def _unit(nodes: Iterable[fx.Node]) -> str:
    counts = Counter(unit_of(module_path(n)) for n in nodes if n.op != "output")
    return counts.most_common(1)[0][0] if counts else "model"


def make_plan(gm: fx.GraphModule, target_name_: str, min_branch_us: float) -> Plan:
    """The stream schedule of ``gm`` for a target (see the module docstring): DAG, costs, threads, streams,
    launch order, segments, and the sections the report shows."""
    facts = target(target_name_)
    dag = dependency_graph(gm.graph)
    order = [n for n in gm.graph.nodes if n in dag]
    values = node_values(gm)
    costs = {n: node_cost(n, values, facts) for n in order}
    seconds = {n: c.seconds for n, c in costs.items()}
    thread, main, spine, near = threads(dag, order, seconds, min_branch_us * 1e-6)
    stream = assign_streams(order, thread, main, facts["streams"], seconds)
    stream_of = {n: stream[thread[n]] for n in order}
    launch = launch_order(dag, order, stream_of, spine)
    group = coarsen(dag, launch, stream_of, seconds, facts["launch_s"])
    segs = segments(dag, launch, stream_of, group)
    spans = simulate(segs, seconds)
    cheap = [] if facts["streams"] <= 1 else [
        (node, f"a branch from {node.name} of about {weight * 1e6:.1f} us of work, below min_branch_us="
               f"{min_branch_us:g}: it runs on the stream of the branch it feeds") for node, weight in near]
    before = happens_before(segs)
    segment_of = {n: seg.id for seg in segs for n in seg.nodes}
    joined: dict[int, int] = {}
    for seg in reversed(segs):
        readers = {segment_of[v] for u in seg.nodes for v in dag.successors(u)} - {seg.id}
        joined[seg.id] = min((r if segs[r].stream == 0 else joined[r] for r in readers), default=seg.id)
    sections: list[SectionPlan] = []
    section_of: dict[fx.Node, int] = {}
    inside: list[Segment] = []
    until = -1
    for seg in segs:
        if seg.stream != 0:
            until = max(until, joined[seg.id])
            inside.append(seg)
        elif inside and seg.id >= until:
            sections.append(_section(len(sections), inside, seg if seg.id == until else None, segs, before,
                                     thread, main, costs, spans))
            inside = []
        elif inside:
            inside.append(seg)
    if inside:
        sections.append(_section(len(sections), inside, None, segs, before, thread, main, costs, spans))
    for section in sections:
        for seg_id in section.segments:
            if segs[seg_id].stream != 0:
                for n in segs[seg_id].nodes:
                    section_of[n] = section.index
    return Plan(target_name_, facts["streams"], sections, stream_of, launch, segs, section_of, cheap)


def _section(index: int, inside: list[Segment], join: Segment | None, segs: Sequence[Segment], before: list[int],
             thread: dict[fx.Node, int], main: int, costs: dict[fx.Node, Cost],
             spans: list[tuple[float, float]]) -> SectionPlan:
    """The report of the segments from a section's first side segment up to ``join``, the first main segment
    that reads, directly or through other side segments, the last of their results (None: side work that no
    main segment reads, such as state updates, joins at the graph's end)."""
    sides = [seg for seg in inside if seg.stream != 0]
    first = sides[0]
    forks = [w for seg in sides for w in seg.waits if w >= 0 and segs[w].stream == 0]
    fork_id = min(forks, default=max((m for m in range(first.id) if segs[m].stream == 0
                                      and (before[first.id] >> m) & 1), default=-1))
    fork = segs[fork_id].nodes[-1] if fork_id >= 0 else first.nodes[0]
    unit = _unit(n for seg in inside for n in seg.nodes)
    by_thread: dict[tuple[int, int], list[fx.Node]] = {}
    for seg in sorted(inside, key=lambda g: (g.stream, g.id)):
        for n in seg.nodes:
            if n.op != "output":
                by_thread.setdefault((seg.stream, thread[n]), []).append(n)
    branches = [BranchPlan(branch_name(members, unit), stream, len(members),
                           sum((costs[n] for n in members), Cost()), stream == 0)
                for (stream, _), members in by_thread.items()]
    events = []
    ids = {seg.id for seg in inside}
    for seg in [*inside, *([join] if join else [])]:
        for w in seg.waits:
            if w < 0:
                events.append(EventPlan("fork", 0, "(call start)", seg.stream, seg.nodes[0].name))
                continue
            source = segs[w]
            if seg.stream == 0 and source.stream == 0:
                continue
            kind = "fork" if source.stream == 0 else "join" if seg.stream == 0 else "cross"
            if kind == "join" and w not in ids:
                continue
            events.append(EventPlan(kind, source.stream, source.nodes[-1].name, seg.stream, seg.nodes[0].name))
    for stream in sorted({seg.stream for seg in sides}):
        last = max(seg.id for seg in sides if seg.stream == stream)
        if join is None or not (before[join.id] >> last) & 1:
            events.append(EventPlan("join", stream, segs[last].nodes[-1].name, 0, "(graph end)"))
    start = spans[fork_id][1] if fork_id >= 0 else 0.0
    end = max(spans[seg.id][1] for seg in inside)
    serial = sum(costs[n].seconds for seg in inside for n in seg.nodes)
    return SectionPlan(index, unit, fork, branches, events, sorted(ids), serial * 1e6, (end - start) * 1e6)
