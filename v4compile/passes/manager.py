"""The pass manager: a fixed, named order of passes with instruments.

Instruments: dump a graph only when a pass changed it, per-pass time and match count, optional
numerics check of every rewritten region against the original region (worst relative error per
region, measured while the graph runs), optimization fuel (stop after N rewrites) and switching
any pass off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import logs, progress
from ..codegen.registry import REGISTRY
from .base import GraphPass, Location, Match, NearMiss, NoMatch, Rewrite, RewriteContext, SymDim, fake_value, locate
from .normalize import normalize
from .summary import PassSummary, summary_rows

_PASSES = logs.logger("passes")
_GRAPHS = logs.logger("graphs")


@dataclass
class PassStats:
    """What one pass did on one graph."""

    name: str
    enabled: bool
    tolerance: float = 1e-5
    seconds: float = 0.0
    matches: list[Match] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    skipped_for_fuel: int = 0


@dataclass
class GraphReport:
    """The pipeline's report for one captured graph."""

    graph: str
    nodes_before: int
    nodes_after: int = 0
    passes: list[PassStats] = field(default_factory=list)
    normalized: dict[str, int] = field(default_factory=dict)
    """What the normalisation before the passes rewrote (``passes/normalize.py``): nodes per rule."""

    @property
    def matches(self) -> list[Match]:
        """Every match of every pass, in order."""
        return [m for p in self.passes for m in p.matches]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form."""
        return asdict(self)


class CheckRecorder:
    """Compares a rewritten region's output with the original region's while the graph runs."""

    def __init__(self, match: Match) -> None:
        self.match = match
        self.__name__ = f"check_{match.pass_name}"

    def __call__(self, new: Any, old: Any) -> Any:
        pairs = list(zip(new, old, strict=True)) if isinstance(new, (tuple, list)) else [(new, old)]
        worst = 0.0
        for a, b in pairs:
            if a.is_floating_point():
                a64, b64 = a.detach().double(), b.detach().double()
                finite = torch.isfinite(b64)
                same_inf = torch.equal(torch.isinf(a64), torch.isinf(b64))
                diff = (a64 - b64)[finite].abs().max().item() if finite.any() else 0.0
                scale = b64[finite].abs().max().item() if finite.any() else 1.0
                worst = max(worst, diff / max(scale, 1e-30), 0.0 if same_inf else float("inf"))
            else:
                worst = max(worst, 0.0 if torch.equal(a, b) else float("inf"))
        m = self.match
        m.worst_rel_error = worst if m.worst_rel_error is None else max(m.worst_rel_error, worst)
        m.checked_calls += 1
        return new


def _without_sizes(rewrite: Rewrite) -> Rewrite:
    """``rewrite`` with any dynamic size in its details as its expression; a dynamic size among the op's arguments
    is a near-miss (the call would bake one size into a graph compiled for every size)."""
    for arg in rewrite.args:
        if isinstance(arg, SymDim):
            raise NoMatch(f"the rewrite takes the dynamic size {arg} as a constant")
    rewrite.details = {k: str(v) if isinstance(v, SymDim) else v for k, v in rewrite.details.items()}
    return rewrite


def apply_rewrite(graph: fx.Graph, rewrite: Rewrite, check: Match | None = None) -> fx.Node:
    """Inserts the custom-op call, reroutes the region's outputs to it and removes the dead region (an
    annotation-only rewrite just annotates the graph: no value changes, so a checked one's error is 0)."""
    if rewrite.annotate is not None:
        rewrite.annotate(graph)
        if check is not None:
            check.worst_rel_error = 0.0
        return rewrite.sink
    op = rewrite.op._opoverload if hasattr(rewrite.op, "_opoverload") else rewrite.op
    with graph.inserting_before(rewrite.sink):
        new = graph.call_function(op, rewrite.args)
        new.meta.update({k: v for k, v in rewrite.sink.meta.items() if k != "val"})
        value = fake_value(op, rewrite.args)
        if value is not None:
            new.meta["val"] = value
        outputs: dict[Any, fx.Node] = {}
        if rewrite.outputs:
            for index in rewrite.outputs:
                outputs[index] = graph.call_function(operator.getitem, (new, index))
                if value is not None:
                    outputs[index].meta["val"] = value[index]
        if check is not None:
            recorder = CheckRecorder(check)
            if rewrite.outputs:
                for index, old in rewrite.outputs.items():
                    with graph.inserting_after(old):
                        checked = graph.call_function(recorder, (outputs[index], old))
                    old.replace_all_uses_with(checked, delete_user_cb=lambda u, c=checked: u is not c)
            else:
                with graph.inserting_after(rewrite.sink):
                    checked = graph.call_function(recorder, (new, rewrite.sink))
                rewrite.sink.replace_all_uses_with(checked, delete_user_cb=lambda u, c=checked: u is not c)
            return new
    if rewrite.outputs:
        for index, old in rewrite.outputs.items():
            old.replace_all_uses_with(outputs[index])
    else:
        rewrite.sink.replace_all_uses_with(new)
    graph.eliminate_dead_code()
    return new


class PassManager(CustomGraphPass):
    """Runs the enabled passes in the fixed order ``PASS_ORDER`` with the instruments above."""

    def __init__(self, passes: list[GraphPass], *, backend: str, disable: tuple[str, ...] = (),
                 debug_dir: str | Path | None = None, check: bool = False, fuel: int | None = None) -> None:
        self.passes = passes
        self.disabled = set(disable)
        self.backend = backend
        self.debug_dir = Path(debug_dir) if debug_dir else None
        self.check = check
        self.fuel = fuel
        self.reports: list[GraphReport] = []

    def uuid(self) -> bytes:
        """Hash of every enabled pass's uuid, the kernel backend and the instrument settings."""
        h = hashlib.sha256()
        for p in self.passes:
            if p.name not in self.disabled:
                h.update(p.uuid())
        h.update(json.dumps([self.backend, self.check, self.fuel]).encode())
        return h.digest()

    def __call__(self, graph: fx.Graph) -> None:
        """Inductor's custom-pass entry point."""
        self.run(graph.owning_module)

    def _graph_name(self) -> str:
        # named by the entry point being compiled and its region; a second graph of it (a new shape) gets -1, -2, ...
        base = progress.current_entry() or "graph"
        if progress.current_region():
            base = f"{base}.{progress.current_region()}"
        taken = {r.graph for r in self.reports}
        if base not in taken:
            return base
        return next(f"{base}-{i}" for i in range(1, len(taken) + 2) if f"{base}-{i}" not in taken)

    @staticmethod
    def _locate(node: fx.Node) -> Location:
        """``locate(node)``, its module path prefixed with the compiled block's region (the layers it serves)."""
        where, region = locate(node), progress.region_scope()
        if region is None:
            return where
        return Location(where.node, region if where.module in ("-", "model") else f"{region}.{where.module}",
                        where.source)

    def run(self, gm: fx.GraphModule, name: str | None = None) -> tuple[fx.GraphModule, GraphReport]:
        """Rewrites ``gm`` in place and returns it with its report."""
        name = name or self._graph_name()
        report = GraphReport(name, len(gm.graph.nodes))
        ctx = RewriteContext(backend=self.backend)
        folder = self.debug_dir / name if self.debug_dir else None
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "00-captured.txt").write_text(gm.print_readable(print_output=False))
        report.normalized = normalize(gm)
        _PASSES.info("%s: normalised %s", name, report.normalized or "nothing")
        for index, graph_pass in enumerate(self.passes, start=1):
            stats = PassStats(graph_pass.name, graph_pass.name not in self.disabled, graph_pass.tolerance)
            report.passes.append(stats)
            if not stats.enabled:
                continue
            start = time.perf_counter()
            for node in list(graph_pass.candidates(gm)):
                if node.graph is not gm.graph:
                    continue
                try:
                    rewrite = _without_sizes(graph_pass.analyze(node, ctx))
                except NoMatch as miss:
                    location = self._locate(node)
                    stats.near_misses.append(NearMiss(graph_pass.name, location, str(miss)))
                    _PASSES.debug("%s: %s near-miss at %s: %s", name, graph_pass.name, location, miss)
                    continue
                location = self._locate(node)
                if self.fuel is not None and self.fuel <= 0:
                    stats.skipped_for_fuel += 1
                    stats.near_misses.append(NearMiss(graph_pass.name, location, "out of optimization fuel"))
                    continue
                match = Match(graph_pass.name, location, str(getattr(rewrite.op, "_qualname", rewrite.op)),
                              rewrite.kernel, rewrite.details)
                apply_rewrite(gm.graph, rewrite, check=match if self.check else None)
                stats.matches.append(match)
                _PASSES.info("%s: %s rewrote %s -> %s", name, graph_pass.name, location, rewrite.kernel)
                if rewrite.annotate is None:
                    REGISTRY.note_region(rewrite.kernel, f"{graph_pass.name} @ {location}")
                if self.fuel is not None:
                    self.fuel -= 1
            gm.graph.lint()
            gm.recompile()
            stats.seconds = time.perf_counter() - start
            progress.log(f"pass {graph_pass.name}: {len(stats.matches)} rewrites, {len(stats.near_misses)} near-misses "
                         f"({stats.seconds:.2f} s)")
            if folder and stats.matches:
                text = gm.print_readable(print_output=False)
                (folder / f"{index:02d}-after-{graph_pass.name}.txt").write_text(text)
        report.nodes_after = len(gm.graph.nodes)
        _GRAPHS.info("%s: %d -> %d nodes, %d rewrites", name, report.nodes_before, report.nodes_after,
                     len(report.matches))
        if _GRAPHS.isEnabledFor(logging.DEBUG):
            _GRAPHS.debug("%s after the passes:\n%s", name, gm.print_readable(print_output=False))
        self.reports.append(report)
        if folder:
            (folder / "report.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
        return gm, report


def summarize(reports: list[GraphReport]) -> PassSummary:
    """Per-pass totals over all graphs: matches, near-misses, seconds, kernels, worst numerics error and the
    pass's stated tolerance (rows of plain JSON values that print as the report table)."""
    rows: dict[str, dict[str, Any]] = {}
    for report in reports:
        for stats in report.passes:
            row = rows.setdefault(stats.name, {"pass": stats.name, "enabled": stats.enabled, "matches": 0,
                                               "near_misses": 0, "seconds": 0.0, "kernels": set(),
                                               "worst_rel_error": None, "tolerance": stats.tolerance})
            row["matches"] += len(stats.matches)
            row["near_misses"] += len(stats.near_misses)
            row["seconds"] += stats.seconds
            for m in stats.matches:
                row["kernels"].add(m.kernel)
                if m.worst_rel_error is not None:
                    row["worst_rel_error"] = max(row["worst_rel_error"] or 0.0, m.worst_rel_error)
    return summary_rows(list(rows.values()))


__all__ = ["GraphReport", "Location", "PassManager", "PassStats", "apply_rewrite", "summarize"]
