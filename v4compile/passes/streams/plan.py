"""The stream schedule's plan: threads (branches) cut from the DAG, stream assignment, launch order, segments and
their fork/join events, sections, and the plan dataclasses the pass and the report use."""

from __future__ import annotations

import heapq
import inspect
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from torch import fx

from ...targets import target
from .dag import (
    Cost,
    dependency_graph,
    node_cost,
    node_values,
)


# ---------------------------------------------------------------------------------------------- naming
def module_path(node: fx.Node) -> str:
    """The model module that produced ``node`` (``layers.1.attn.wq_a``), from ``nn_module_stack``; "" if none."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("._modules['", ".").replace("']", "").replace("_modules['", "").strip(".")


def unit_of(path: str) -> str:
    """The repeated unit a module path belongs to: up to its first numeric part (``layers.1``), else its
    first part (``embed``), else ``model``."""
    parts = [p for p in path.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else "model"


def code_label(node: fx.Node) -> str:
    """Where in the model's code a node was made, for nodes of a unit's own code (no submodule): the function
    two calls below the unit's module (``attention._window_kv``, ``compressor.forward_decode``), from the
    trace's stack; "" if unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    owner = list(stack.values())[-1][1] if stack else None
    try:
        owner_file = inspect.getsourcefile(owner) if isinstance(owner, type) else None
    except TypeError:
        owner_file = None
    frames = []
    for line in (node.meta.get("stack_trace") or "").splitlines():
        line = line.strip()
        if line.startswith("File ") and ", in " in line:
            path = line[len("File "):].split(",")[0].strip('"')
            frames.append((path, line.rsplit(", in ", 1)[1]))
    last = max((i for i, (path, _) in enumerate(frames) if path == owner_file), default=-1)
    rest = frames[last + 1:]
    if not rest:
        return ""
    path, func = rest[1] if len(rest) > 1 else rest[0]
    return f"{path.rsplit('/', 1)[-1].removesuffix('.py')}.{func}"


def branch_name(nodes: Sequence[fx.Node], unit: str) -> str:
    """A branch's name from its nodes' modules relative to ``unit``: their common module when it is below the
    unit's direct children (``attn.compressor``), else the children it touches (``attn.{wq_a,q_norm,wq_b}``);
    when a third or more of its nodes are the unit's own code, the commonest code place follows
    (``attn.{wq_a,q_norm,wq_b} + indexer.forward_decode``), or names it alone (``attention._window_kv``)."""
    seen: list[list[str]] = []
    plain: list[fx.Node] = []
    for node in nodes:
        path = module_path(node)
        rel = path[len(unit) + 1:] if path.startswith(unit + ".") else ("" if path == unit else path)
        parts = rel.split(".") if rel else []
        if not parts:
            plain.append(node)
        elif parts not in seen:
            seen.append(parts)
    code = ""
    if 3 * len(plain) >= len(nodes):
        counts = Counter(label for label in map(code_label, plain) if label)
        code = counts.most_common(1)[0][0] if counts else ""
    if not seen:
        return code or unit
    common: list[str] = []
    for column in zip(*seen, strict=False):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    if len(common) >= 2 or (common and len(seen) == 1):
        modules = ".".join(common)
    else:
        rest = []
        for parts in seen:
            tail = ".".join(parts[len(common):])
            if tail and tail not in rest:
                rest.append(tail)
        prefix = ".".join(common) + "." if common else ""
        shown = rest[:4] + ([f"+{len(rest) - 4}"] if len(rest) > 4 else [])
        modules = prefix + "{" + ",".join(shown) + "}"
    return f"{modules} + {code}" if code else modules


# ---------------------------------------------------------------------------------------------- threads
def threads(dag: nx.DiGraph, order: Sequence[fx.Node], cost: dict[fx.Node, float], min_seconds: float,
            ) -> tuple[dict[fx.Node, int], int, list[fx.Node], list[tuple[fx.Node, float]]]:
    """Cuts the DAG into threads and returns ``(thread of each node, main thread, critical path, near-misses)``;
    near-misses are the threads merged for cost although they cost at least half of ``min_seconds`` (their
    first node and cost).

    A node continues the thread of a predecessor whose critical successor it is (the successor with the
    longest cost-weighted path to the end; ties go to the earlier node), preferring the predecessor that
    finishes last; otherwise it starts a thread. The critical path is forced into one thread, the main
    thread. A thread cheaper than ``min_seconds`` joins the one thread it feeds; feeding several or none, the
    thread it came from; coming from none (it reads graph inputs only, like a rotary table), the main thread.
    Then the branches are the threads that fork from the main thread: a thread forking from another side
    thread joins it (nested forks run in order on one stream), and one reading graph inputs only joins the
    one thread it feeds, or the main thread."""
    index = {n: i for i, n in enumerate(order)}
    down: dict[fx.Node, float] = {}
    for node in reversed(order):
        down[node] = cost[node] + max((down[s] for s in dag.successors(node)), default=0.0)
    top: dict[fx.Node, float] = {}
    for node in order:
        top[node] = cost[node] + max((top[p] for p in dag.predecessors(node)), default=0.0)
    critical = {n: max(dag.successors(n), key=lambda s: (down[s], -index[s]), default=None) for n in order}
    spine: set[fx.Node] = set()
    node = max(order, key=lambda n: (top[n], -index[n]), default=None)
    while node is not None:
        spine.add(node)
        pred = max(dag.predecessors(node), key=lambda p: (top[p], index[p]), default=None)
        if pred is not None:
            critical[pred] = node
        node = pred
    thread: dict[fx.Node, int] = {}
    members: list[list[fx.Node]] = []
    for node in order:
        chose = [p for p in dag.predecessors(node) if critical[p] is node and (p in spine) == (node in spine)]
        if chose:
            thread[node] = thread[max(chose, key=lambda p: (top[p], index[p]))]
        else:
            thread[node] = len(members)
            members.append([])
        members[thread[node]].append(node)
    parent = list(range(len(members)))

    def find(t: int) -> int:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    weight = [sum(cost[n] for n in nodes) for nodes in members]
    main = thread[next(iter(spine))] if spine else 0
    near: list[tuple[fx.Node, float]] = []
    for t in sorted(range(len(members)), key=lambda t: weight[t]):
        if weight[t] >= min_seconds or t == main:
            continue
        inside = set(members[t])
        feeds = {find(thread[s]) for n in members[t] for s in dag.successors(n) if s not in inside}
        sources = [p for p in dag.predecessors(members[t][0]) if p not in inside]
        if len(feeds) == 1:
            into = feeds.pop()
        elif sources:
            into = find(thread[max(sources, key=lambda p: (top[p], index[p]))])
        else:
            into = find(main)
        if into != find(t):
            parent[find(t)] = into
            weight[into] += weight[t]
            if weight[t] >= min_seconds / 2:
                near.append((members[t][0], weight[t]))
    main = find(main)
    changed = True
    while changed:
        changed = False
        groups: dict[int, list[fx.Node]] = defaultdict(list)
        for node in order:
            groups[find(thread[node])].append(node)
        for t, nodes in groups.items():
            if t == main:
                continue
            inside = set(nodes)
            sources = [p for p in dag.predecessors(nodes[0]) if p not in inside]
            if sources:
                into = find(thread[max(sources, key=lambda p: (top[p], index[p]))])
                if into == main:
                    continue
            else:
                feeds = {find(thread[s]) for n in nodes for s in dag.successors(n) if s not in inside}
                into = feeds.pop() if len(feeds) == 1 else main
            parent[t] = into
            changed = True
            break
    return {n: find(t) for n, t in thread.items()}, main, [n for n in order if n in spine], near


def assign_streams(order: Sequence[fx.Node], thread: dict[fx.Node, int], main: int, streams: int,
                   cost: dict[fx.Node, float]) -> dict[int, int]:
    """Stream of each thread: the main thread on stream 0; side threads, by first node, on the side stream
    free longest (its threads ended before this one starts), else on the least loaded one."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    weight: dict[int, float] = defaultdict(float)
    for i, node in enumerate(order):
        t = thread[node]
        first.setdefault(t, i)
        last[t] = i
        weight[t] += cost[node]
    stream = {t: 0 for t in first}
    if streams <= 1:
        return stream
    busy_until = {s: -1 for s in range(1, streams)}
    load = {s: 0.0 for s in range(1, streams)}
    for t in sorted(first, key=first.get):
        if t == main:
            continue
        free = [s for s in busy_until if busy_until[s] < first[t]]
        s = min(free, key=lambda s: (busy_until[s], s)) if free else min(load, key=lambda s: (load[s], s))
        stream[t] = s
        busy_until[s] = max(busy_until[s], last[t])
        load[s] += weight[t]
    return stream


def launch_order(dag: nx.DiGraph, order: Sequence[fx.Node], stream_of: dict[fx.Node, int],
                 spine: Sequence[fx.Node]) -> list[fx.Node]:
    """A topological order that launches each stream's nodes in long runs and lets the main stream wait late.

    ``spine``: the main stream's critical path in order. Only nodes up to a horizon (in graph order) may
    launch: the next fork on the spine (a spine node read on another stream) after the first spine node not
    launched yet, so one fork's side work launches together, before the main stream's joins. Among those it
    stays on the current side stream, else takes a side stream, else the main stream: side work launches as
    soon as its fork has, and the main stream's own share after it. A node that reads graph inputs only
    ranks as its first reader, so it launches with that reader's work rather than as early as it could."""
    index = {n: i for i, n in enumerate(order)}
    for node in reversed(order):
        if dag.in_degree(node) == 0:
            index[node] = min((index[s] for s in dag.successors(node)), default=index[node])
    missing = {n: dag.in_degree(n) for n in order}
    forks = [any(stream_of[x] != stream_of[n] for x in dag.successors(n)) for n in spine]
    ready: dict[int, list[tuple[int, fx.Node]]] = defaultdict(list)
    for node in order:
        if missing[node] == 0:
            heapq.heappush(ready[stream_of[node]], (index[node], node))
    launched: set[fx.Node] = set()
    out: list[fx.Node] = []
    current, at = 0, 0
    while len(out) < len(order):
        while at < len(spine) and spine[at] in launched:
            at += 1
        end = at + 1
        while end < len(spine) and not forks[end]:
            end += 1
        horizon = index[spine[end]] if end < len(spine) else len(order)
        near = [s for s in ready if ready[s] and ready[s][0][0] <= horizon]
        if current != 0 and current in near:
            pick = current
        elif any(s != 0 for s in near):
            pick = min((s for s in near if s != 0), key=lambda s: ready[s][0][0])
        else:
            pick = min((s for s in ready if ready[s]), key=lambda s: ready[s][0][0])
        _, node = heapq.heappop(ready[pick])
        current = pick
        out.append(node)
        launched.add(node)
        for succ in dag.successors(node):
            missing[succ] -= 1
            if missing[succ] == 0:
                heapq.heappush(ready[stream_of[succ]], (index[succ], succ))
    return out


@dataclass
class Segment:
    """A maximal run of one stream's nodes in launch order, compiled as one region. ``waits``: the earlier
    segments on other streams whose end events it waits on before it starts (-1: the main stream at the
    start of the call); ``recorded``: whether a later segment waits on its end event."""

    id: int
    stream: int
    nodes: list[fx.Node]
    waits: list[int] = field(default_factory=list)
    recorded: bool = False


def segments(dag: nx.DiGraph, launch: Sequence[fx.Node], stream_of: dict[fx.Node, int],
             group: dict[fx.Node, int] | None = None) -> list[Segment]:
    """Cuts the launch order into segments: at every change of stream, and then either where ``group``
    changes, or (no groups) after every node another stream reads (its event is recorded right there) and
    before a node that needs a wait the open segment did not start with. Every value a segment reads
    from another stream was made by a segment launched before it (launch order is topological), so waits go
    at a segment's start; waits already implied by others are dropped. A side stream's first segment with
    nothing to wait for waits on the main stream anyway (a fork: CUDA graph capture needs every side stream
    to follow the capturing stream)."""
    out: list[Segment] = []
    segment_of: dict[fx.Node, int] = {}
    before: list[int] = []
    last_of: dict[int, int] = {}
    for node in launch:
        s = stream_of[node]
        needs = {segment_of[p] for p in dag.predecessors(node) if stream_of[p] != s}
        seg = out[-1] if out and out[-1].stream == s else None
        if group is not None:
            if seg is not None and group.get(seg.nodes[-1], -1) != group.get(node, -2):
                seg = None
        elif seg is not None and (any(stream_of[x] != s for x in dag.successors(seg.nodes[-1]))
                                  or any(not (before[seg.id] >> w) & 1 for w in needs)):
            seg = None
        if seg is not None and any(not (before[seg.id] >> w) & 1 for w in needs):
            waits = [*seg.waits, *(w for w in needs if not (before[seg.id] >> w) & 1)]
            waits = [w for w in waits if not any(w >= 0 and (before[v] >> w) & 1 for v in waits if v >= 0 and v != w)]
            for w in waits:
                if w >= 0:
                    before[seg.id] |= before[w] | (1 << w)
                    out[w].recorded = True
            seg.waits = sorted(set(waits))
        if seg is None:
            seg = Segment(len(out), s, [])
            bits = before[last_of[s]] | (1 << last_of[s]) if s in last_of else 0
            waits = [w for w in needs if not (bits >> w) & 1]
            waits = [w for w in waits if not any((before[v] >> w) & 1 for v in waits if v != w)]
            if s != 0 and s not in last_of and not waits:
                waits = [last_of.get(0, -1)]
            for w in waits:
                if w >= 0:
                    bits |= before[w] | (1 << w)
                    out[w].recorded = True
            seg.waits = sorted(waits)
            out.append(seg)
            before.append(bits)
            last_of[s] = seg.id
        seg.nodes.append(node)
        segment_of[node] = seg.id
    return out


def coarsen(dag: nx.DiGraph, launch: Sequence[fx.Node], stream_of: dict[fx.Node, int],
            seconds: dict[fx.Node, float], penalty: float) -> dict[fx.Node, int]:
    """Groups the finest segments into fewer: two segments next to each other in launch order on one stream
    become one (its waits hoisted to its start, its event recorded at its end) when the estimated time of the
    whole graph, plus ``penalty`` per segment (a region's launch and the fusion a boundary prevents), does
    not grow. Returns each node's group."""
    fine = segments(dag, launch, stream_of)
    group = {n: seg.id for seg in fine for n in seg.nodes}

    def objective() -> float:
        segs = segments(dag, launch, stream_of, group)
        return max((end for _, end in _simulate(segs, seconds)), default=0.0) + penalty * len(segs)

    best = objective()
    changed = True
    while changed:
        changed = False
        for a, b in zip(fine, fine[1:], strict=False):
            ga, gb = group[a.nodes[0]], group[b.nodes[0]]
            if a.stream != b.stream or ga == gb:
                continue
            moved = [n for n in launch if group[n] == gb]
            for n in moved:
                group[n] = ga
            trial = objective()
            if trial <= best:
                best, changed = trial, True
            else:
                for n in moved:
                    group[n] = gb
    return group


def happens_before(segs: Sequence[Segment]) -> list[int]:
    """For each segment, a bitset of the segments certain to have finished before it starts: earlier ones
    on its stream and, through events, those it waits on (-1, the call's start, is left out)."""
    before: list[int] = []
    previous: dict[int, int] = {}
    for seg in segs:
        bits = 0
        sources = ([previous[seg.stream]] if seg.stream in previous else []) + [w for w in seg.waits if w >= 0]
        for w in sources:
            bits |= before[w] | (1 << w)
        before.append(bits)
        previous[seg.stream] = seg.id
    return before


def unordered_edges(dag: nx.DiGraph, segs: Sequence[Segment]) -> list[tuple[fx.Node, fx.Node]]:
    """The dependencies the segments and events fail to order (empty for a correct schedule): edges whose
    producer's segment is not certain to finish before the consumer's segment starts."""
    segment_of = {n: seg.id for seg in segs for n in seg.nodes}
    before = happens_before(segs)
    bad = []
    for u, v in dag.edges:
        su, sv = segment_of[u], segment_of[v]
        if su != sv and not (before[sv] >> su) & 1:
            bad.append((u, v))
        elif su == sv and segs[su].nodes.index(u) > segs[sv].nodes.index(v):
            bad.append((u, v))
    return bad


# ---------------------------------------------------------------------------------------------- the plan
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


def _simulate(segs: Sequence[Segment], seconds: dict[fx.Node, float]) -> list[tuple[float, float]]:
    """Estimated (start, end) of each segment: a segment starts when its stream is free and its waits ended."""
    free: dict[int, float] = defaultdict(float)
    spans: list[tuple[float, float]] = []
    for seg in segs:
        start = max([free[seg.stream]] + [spans[w][1] for w in seg.waits if w >= 0])
        end = start + sum(seconds[n] for n in seg.nodes)
        spans.append((start, end))
        free[seg.stream] = end
    return spans


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
    spans = _simulate(segs, seconds)
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
