"""The compiler's commands: ``passes`` (the pipeline), ``explain`` (matches and near-misses), ``schedule`` (the
stream plan), ``dump`` (graphs per pass), ``kernels`` (generated kernels), ``bisect`` (the first rewrite that
breaks numerics)."""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

from rich.syntax import Syntax
from rich.table import Table

from .common import add_model_arguments, console, entries, model_from_args, spinner


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Registers the compiler's commands."""
    pas = sub.add_parser("passes", help="list the passes, what they match and their options")
    pas.add_argument("--json", action="store_true", help="print the pass table as JSON")
    pas.set_defaults(func=_passes)

    exp = sub.add_parser("explain", help="every match with its location and every near-miss with its reason")
    add_model_arguments(exp)
    exp.add_argument("--no-near-misses", dest="near_misses", action="store_false")
    exp.add_argument("--json", action="store_true", help="print the reports as JSON")
    exp.set_defaults(func=_explain)

    sch = sub.add_parser("schedule", help="the stream schedule per layer: branches, costs, streams, fork/join events")
    add_model_arguments(sch)
    sch.set_defaults(func=_schedule, entry="decode")
    sch.add_argument("--target", default="sm90", help="the target to plan for (v4compile/targets.py; default sm90)")
    sch.add_argument("--min-branch-us", type=float, default=10.0,
                     help="estimated microseconds a branch must cost to get a stream (default 10)")
    sch.add_argument("--json", action="store_true", help="print the plans as JSON")

    dump = sub.add_parser("dump", help="write the graphs before and after each pass into a folder")
    add_model_arguments(dump)
    dump.add_argument("out", help="output folder")
    dump.set_defaults(func=_dump)

    ker = sub.add_parser("kernels", help="list generated kernels; --show NAME prints source and launch config")
    add_model_arguments(ker)
    ker.add_argument("--show", metavar="NAME")
    ker.add_argument("--json", action="store_true", help="print the kernel records as JSON")
    ker.set_defaults(func=_kernels)

    bis = sub.add_parser("bisect", help="find the first rewrite that breaks numerics beyond a tolerance")
    add_model_arguments(bis)
    bis.add_argument("--tolerance", type=float, default=1e-2, help="mean per-row relative error allowed")
    bis.add_argument("--graph", dest="bisect_entry", choices=["forward", "decode"], default="forward",
                     help="which graph to bisect")
    bis.set_defaults(func=_bisect)


def _passes(args: argparse.Namespace) -> int:
    from ..passes import PASS_ORDER

    if args.json:
        print(json.dumps([{"order": i, "pass": cls.name, "on_by_default": cls.on_by_default, "summary": cls.summary,
                           "matches": cls.matches, "options": dict(cls.option_help), "tolerance": cls.tolerance}
                          for i, cls in enumerate(PASS_ORDER, start=1)], indent=1))
        return 0
    table = Table(title="v4compile passes, in pipeline order")
    table.add_column("#")
    table.add_column("pass", no_wrap=True, min_width=max(len(c.name) for c in PASS_ORDER) + len(" (opt-in)"))
    for col in ("what it does", "what it matches", "options", "tolerance"):
        table.add_column(col, overflow="fold")
    for i, cls in enumerate(PASS_ORDER, start=1):
        options = "\n".join(f"{k}: {v}" for k, v in cls.option_help.items()) or "-"
        name = cls.name if cls.on_by_default else f"{cls.name} (opt-in)"
        table.add_row(str(i), name, cls.summary, cls.matches, options, f"{cls.tolerance:g}")
    console.print(table)
    return 0


def _explain(args: argparse.Namespace) -> int:
    from ..debugging import explain

    model = model_from_args(args)
    with spinner("capturing forward, prefill and decode and running the passes"):
        optimized = explain(model, backend=args.backend, entries=entries(args))
    reports = optimized.reports()
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1, default=str))
        return 0
    for report in reports:
        title = report.graph
        matches = Table(title=f"{title}: {len(report.matches)} rewrites ({report.nodes_before} -> "
                              f"{report.nodes_after} nodes)")
        for col in ("pass", "location", "kernel"):
            matches.add_column(col, no_wrap=True)
        matches.add_column("details", overflow="fold")
        for m in report.matches:
            matches.add_row(m.pass_name, str(m.location), m.kernel,
                            ", ".join(f"{k}={v}" for k, v in m.details.items() if k != "replaced"))
        console.print(matches)
        if args.near_misses:
            misses = Table(title=f"{title}: near-misses")
            for col in ("pass", "location", "why it did not match"):
                misses.add_column(col, overflow="fold")
            for p in report.passes:
                for miss in p.near_misses:
                    misses.add_row(miss.pass_name, str(miss.location), miss.reason)
            console.print(misses)
    if not any(r.matches for r in reports):
        console.print("[yellow]no pass matched: this model runs on Inductor alone[/yellow]")
    return 0


def _schedule_plans(args: argparse.Namespace) -> list[tuple[str, object]]:
    """Compiles the chosen entry points (no Inductor) and returns each graph's stream schedule."""
    from ..debugging import run_entries, sample_ids
    from ..optimize import optimize

    model = model_from_args(args)
    options = {"stream_schedule": {"target": args.target, "min_branch_us": args.min_branch_us}}
    optimized = optimize(model, backend=args.backend, inductor=False, options=options)
    with spinner("capturing and planning the streams"):
        run_entries(optimized, sample_ids(model).to(next(model.parameters()).device), entries(args))
    plans = next(p for p in optimized.manager.passes if p.name == "stream_schedule").plans
    return list(zip(entries(args), plans, strict=False))


def _schedule(args: argparse.Namespace) -> int:
    from ..targets import target

    facts = target(args.target)
    for name, plan in _schedule_plans(args):
        if args.json:
            print(json.dumps({"graph": name, **plan.to_dict()}, indent=1))
            continue
        serial = sum(s.serial_us for s in plan.sections)
        overlapped = sum(s.overlapped_us for s in plan.sections)
        console.rule(f"{name}: target {plan.target} ({facts['streams']} streams), {len(plan.sections)} sections, "
                     f"{len(plan.segments)} regions; sections est. {serial:.0f} us on one stream -> "
                     f"{overlapped:.0f} us overlapped")
        units: dict[str, list] = {}
        for section in plan.sections:
            units.setdefault(section.unit, []).append(section)
        for unit, sections in units.items():
            table = Table(title=unit, title_justify="left")
            for col in ("section", "branch", "stream", "nodes", "ops", "bytes", "MFLOP", "est. us"):
                table.add_column(col, overflow="fold", justify="left" if col in ("section", "branch") else "right")
            for section in sections:
                label = (f"#{section.index} fork after {section.fork.name}\n"
                         f"{section.serial_us:.0f} -> {section.overlapped_us:.0f} us")
                for i, branch in enumerate(section.branches):
                    table.add_row(label if i == 0 else "", branch.name + (" (main)" if branch.main else ""),
                                  f"s{branch.stream}", str(branch.nodes), str(branch.cost.kernels),
                                  f"{branch.cost.bytes:,}", f"{branch.cost.flops / 1e6:.2f}", f"{branch.cost.us:.1f}")
            console.print(table)
            for section in sections:
                events = "; ".join(f"{e.kind} s{e.recorder} after {e.after} -> s{e.waiter} before {e.before}"
                                   for e in section.events)
                console.print(f"  #{section.index} events: {events}", overflow="fold", markup=False)
    return 0


def _dump(args: argparse.Namespace) -> int:
    from ..debugging import explain

    out = Path(args.out)
    with spinner(f"dumping graphs into {out}"):
        explain(model_from_args(args), backend=args.backend, debug_dir=out, entries=entries(args))
    files = sorted(p.relative_to(out) for p in out.rglob("*.txt"))
    console.print(f"wrote {len(files)} graphs (captured, then after each pass that changed it) under {out}:")
    for f in files:
        console.print(f"  {f}")
    return 0


def _unknown_kernel(name: str, known: list[str], where: str) -> int:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    console.print(f"[red]no kernel named {name!r} {where}[/red]", highlight=False)
    console.print("close matches: " + (", ".join(close) if close else "none") + f"; all {len(known)}: "
                  + ", ".join(known), highlight=False, soft_wrap=True)
    return 2


def _could_be_built(name: str) -> bool:
    """Whether ``name`` is spelled like a kernel some op builds: ``<op>[.<variant>...].<backend>``."""
    from ..codegen.ops import KERNEL_BACKENDS, kernel_families

    family, _, rest = name.partition(".")
    return family in kernel_families() and rest.rsplit(".", 1)[-1] in KERNEL_BACKENDS


def _kernels(args: argparse.Namespace) -> int:
    from ..codegen.ops import KERNEL_BACKENDS, kernel_families
    from ..codegen.registry import REGISTRY, cache_dir, cached_names
    from ..debugging import explain

    known = cached_names()
    if args.show and args.show not in known and not _could_be_built(args.show):
        families = [f"{f}.*.{b}" for f in kernel_families() for b in KERNEL_BACKENDS]
        return _unknown_kernel(args.show, known + families,
                               f"among those built before (disk cache {cache_dir()}) or that an op can build")
    with spinner("building the kernels the passes choose"):
        explain(model_from_args(args), backend=args.backend, entries=entries(args))
    if args.json:
        print(json.dumps([{"name": r.name, "backend": r.backend, "op": r.op, "source_hash": r.source_hash,
                           "path": r.path, "launches": r.launches, "last_launch": r.launch, "regions": r.regions,
                           "error": r.error} for r in (REGISTRY.records[n] for n in sorted(REGISTRY.records))],
                         indent=1, default=str))
        return 0
    if args.show:
        record = REGISTRY.records.get(args.show)
        if record is None:
            return _unknown_kernel(args.show, sorted(REGISTRY.records), "among the kernels this model's passes build")
        console.rule(f"{record.name}  ({record.backend}, {record.op})")
        console.print(Syntax(record.source, "python", line_numbers=True))
        console.print(f"source file: {record.path}")
        console.print(f"launch configuration (last launch, {record.launches} launches): {record.launch}")
        console.print("replaced regions:\n  " + "\n  ".join(record.regions or ["-"]))
        if record.lowered:
            console.rule("lowered code")
            console.print(record.lowered)
        if record.error:
            console.print(f"[red]build error: {record.error}[/red]")
        return 0
    if not REGISTRY.records:
        console.print(f"no generated kernels: backend {args.backend!r} runs the ops' reference bodies here (on the "
                      "CPU, 'auto' compiles them into Inductor's C++ code); pass --backend triton or --backend "
                      "tilelang to build the GPU kernels (interpreted on the CPU)")
        return 0
    table = Table(title=f"kernels (disk cache: {cache_dir()})")
    for col in ("name", "backend", "op", "source hash"):
        table.add_column(col, no_wrap=True)
    for col in ("launches", "last launch", "regions"):
        table.add_column(col, overflow="fold")
    for name in sorted(REGISTRY.records):
        r = REGISTRY.records[name]
        table.add_row(name, r.backend, r.op, r.source_hash, str(r.launches), str(r.launch), str(len(r.regions)))
    console.print(table)
    return 0


def _bisect(args: argparse.Namespace) -> int:
    from ..debugging import bisect

    model = model_from_args(args)
    with spinner("bisecting rewrites with optimization fuel") as progress:
        def tick(fuel: int, error: float) -> None:
            progress.console.print(f"  fuel {fuel:4d}: mean row error {error:.3e}")

        result = bisect(model, backend=args.backend, tolerance=args.tolerance, entry=args.bisect_entry, progress=tick)
    worst = ("" if result.worst_region is None else
             f"; worst region {result.worst_region[0].pass_name} at {result.worst_region[0].location}: "
             f"{result.worst_region[0].worst_rel_error:.2e}, {result.worst_region[1]:.2g}x its pass's tolerance")
    if result.culprit is None:
        console.print(f"[green]all {result.total_rewrites} rewritten regions are within their passes' tolerances, "
                      f"checked beside the model code on the same inputs{worst}[/green]", highlight=False)
        moved = "above" if result.logits_error > args.tolerance else "within"
        console.print(f"{args.bisect_entry} logits: mean row error {result.logits_error:.3e}, {moved} "
                      f"{args.tolerance:g}" + (" (the random model's amplification of in-tolerance roundings: a "
                                               "routing or top-k choice flipped, not a broken rewrite)"
                                               if moved == "above" else ""), highlight=False)
        return 0
    m = result.culprit
    region = ("its region is out of its pass's tolerance: relative error "
              f"{m.worst_rel_error:.2e}" if result.worst_region is not None else
              "no region check covers it (an annotation): found by the logits' error over fuel")
    console.print(f"[red]rewrite {result.culprit_index} of {result.total_rewrites} breaks numerics[/red]: "
                  f"{m.pass_name} at {m.location} -> kernel {m.kernel}; {region}", highlight=False)
    console.print(f"mean row error {result.error_before:.3e} with {result.culprit_index - 1} rewrites, "
                  f"{result.error_at:.3e} with {result.culprit_index}")
    return 1
