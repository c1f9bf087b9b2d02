"""The launch order cut into segments (one stream's run, compiled as one region) with the events they wait on,
adjacent segments merged while the simulated time does not grow, and the check that the events order every
dependency."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
from torch import fx


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
        return max((end for _, end in simulate(segs, seconds)), default=0.0) + penalty * len(segs)

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


def simulate(segs: Sequence[Segment], seconds: dict[fx.Node, float]) -> list[tuple[float, float]]:
    """Estimated (start, end) of each segment: a segment starts when its stream is free and its waits ended."""
    free: dict[int, float] = defaultdict(float)
    spans: list[tuple[float, float]] = []
    for seg in segs:
        start = max([free[seg.stream]] + [spans[w][1] for w in seg.waits if w >= 0])
        end = start + sum(seconds[n] for n in seg.nodes)
        spans.append((start, end))
        free[seg.stream] = end
    return spans
