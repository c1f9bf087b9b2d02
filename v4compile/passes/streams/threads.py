"""The stream schedule's first phases: the DAG cut into threads (branches), the threads given streams, and a
launch order that keeps each stream's work together."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

import networkx as nx
from torch import fx


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
