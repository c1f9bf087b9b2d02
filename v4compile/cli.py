"""The ``v4compile`` command: the demo, the pass-debugging tools, generation and the serving benchmark."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.syntax import Syntax
from rich.table import Table


def _console() -> Console:
    """The CLI's console: piped output gets lines wide enough that no table folds or cuts an identifier (so
    ``v4compile passes | grep compressor_fusion`` finds it); a terminal keeps its width."""
    return Console() if sys.stdout.isatty() else Console(width=200)


console = _console()


def _model(args: argparse.Namespace):
    import v4compile

    if getattr(args, "model", None):
        return _model_from_factory(args.model).eval()
    if getattr(args, "checkpoint", None):
        return v4compile.load(args.checkpoint).eval()
    return v4compile.DeepSeekV4(v4compile.V4Config.preset(args.preset), seed=0).eval()


def _model_from_factory(spec: str):
    """The model ``module:factory`` builds (``factory()``, a module-level callable), e.g. a transformers V4."""
    import importlib

    import torch

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model expects module:factory (a module-level function building the model), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: module {module_name!r} has no callable {attr!r}")
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec}: {attr}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _progress(message: str) -> Progress:
    progress = Progress(SpinnerColumn(), TextColumn("[progress.description]{task.description}"), TimeElapsedColumn(),
                        console=console, transient=True)
    progress.add_task(message, total=None)
    return progress


def _add_target(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", default="tiny", help="model preset with seeded random weights (default tiny)")
    group.add_argument("--checkpoint", help="checkpoint directory (config.json + *.safetensors)")
    group.add_argument("--model", help="module:factory building any model (e.g. a transformers V4); its forward "
                                       "is explained on random ids below config.vocab_size")
    parser.add_argument("--backend", default="auto", help="kernel backend: auto, triton, tilelang, reference")
    parser.add_argument("--entry", choices=["all", "forward", "prefill", "decode"], default="all",
                        help="which entry points to compile (default all)")


def _entries(args: argparse.Namespace) -> tuple[str, ...]:
    return ("forward", "prefill", "decode") if args.entry == "all" else (args.entry,)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(console, prompt_len=args.prompt_len, steps=args.steps, optimized=not args.no_optimize) else 1


def _passes(args: argparse.Namespace) -> int:
    from .passes import PASS_ORDER

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
    from .debugging import explain

    model = _model(args)
    with _progress("capturing forward, prefill and decode and running the passes"):
        optimized = explain(model, backend=args.backend, entries=_entries(args))
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
    from .debugging import run_entries, sample_ids
    from .optimize import optimize

    model = _model(args)
    options = {"stream_schedule": {"target": args.target, "min_branch_us": args.min_branch_us}}
    optimized = optimize(model, backend=args.backend, inductor=False, options=options)
    with _progress("capturing and planning the streams"):
        run_entries(optimized, sample_ids(model).to(next(model.parameters()).device), _entries(args))
    plans = next(p for p in optimized.manager.passes if p.name == "stream_schedule").plans
    return list(zip(_entries(args), plans, strict=False))


def _schedule(args: argparse.Namespace) -> int:
    from .targets import target

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
    from .debugging import explain

    out = Path(args.out)
    with _progress(f"dumping graphs into {out}"):
        explain(_model(args), backend=args.backend, debug_dir=out, entries=_entries(args))
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
    from .codegen.ops import KERNEL_BACKENDS, kernel_families

    family, _, rest = name.partition(".")
    return family in kernel_families() and rest.rsplit(".", 1)[-1] in KERNEL_BACKENDS


def _kernels(args: argparse.Namespace) -> int:
    from .codegen.ops import KERNEL_BACKENDS, kernel_families
    from .codegen.registry import REGISTRY, cache_dir, cached_names
    from .debugging import explain

    known = cached_names()
    if args.show and args.show not in known and not _could_be_built(args.show):
        families = [f"{f}.*.{b}" for f in kernel_families() for b in KERNEL_BACKENDS]
        return _unknown_kernel(args.show, known + families,
                               f"among those built before (disk cache {cache_dir()}) or that an op can build")
    with _progress("building the kernels the passes choose"):
        explain(_model(args), backend=args.backend, entries=_entries(args))
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
    from .debugging import bisect

    model = _model(args)
    with _progress("bisecting rewrites with optimization fuel") as progress:
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


def _check(args: argparse.Namespace) -> int:
    import v4compile

    from .debugging import golden_check
    from .golden import score

    folder = Path(args.golden or args.checkpoint)
    model = v4compile.load(folder, index_ties=args.index_ties).eval()
    with _progress("scoring the eager model as the golden vectors were made (one prefill per row)"):
        eager = score(model, folder)
    if not args.json:
        for line in eager.lines():
            console.print(line, highlight=False, soft_wrap=True)
    optimized = v4compile.optimize(model, backend=args.backend, inductor=args.inductor, check=args.regions)
    with _progress("running eager and optimized on the golden cases"):
        results = golden_check(optimized, folder)
    verdict = eager.in_band() and results["optimized vs golden"].in_band()
    if args.json:
        print(json.dumps({"golden": str(folder), "eager_in_band": eager.in_band(), "eager": eager.lines(),
                          "comparisons": {name: {**asdict(a), "in_band": a.in_band()} for name, a in results.items()},
                          "regions": json.loads(optimized.report().to_json()) if args.regions else None,
                          "verdict": verdict, "index_ties": model.config.index_ties}, indent=1))
        return 0 if verdict else 1
    table = Table(title=f"{folder.name}: full-sequence logits per row (golden band: median >= 0.99, mean >= 0.97, "
                        "agree >= 0.80)")
    for col in ("comparison", "median cos", "mean cos", "min cos", "argmax agree"):
        table.add_column(col)
    for name, a in results.items():
        table.add_row(name, f"{a.median_cos:.5f}", f"{a.mean_cos:.5f}", f"{a.min_cos:.5f}", f"{a.argmax_agreement:.3f}")
    console.print(table)
    if args.regions:
        for row in optimized.report():
            console.print(f"{row['pass']}: {row['matches']} regions, worst relative error {row['worst_rel_error']}")
    console.print(f"verdict: {'in band' if verdict else 'OUT OF BAND'} (index_ties={model.config.index_ties})")
    return 0 if verdict else 1


def _diverge(args: argparse.Namespace) -> int:
    import v4compile

    from .debugging import sample_ids
    from .divergence import divergence
    from .golden import GoldenFolder

    first = Path(args.a)
    second = Path(args.b or args.a)
    model_a = v4compile.load(first, index_ties=args.index_ties_a).eval()
    model_b = v4compile.load(second, index_ties=args.index_ties_b).eval()
    if (first / "cases.safetensors").is_file():
        cases = GoldenFolder.read(first).cases
        if not 0 <= args.case < len(cases):
            raise ValueError(f"--case {args.case} is not a case of {first} (it has {len(cases)})")
        ids = cases[args.case].ids
    else:
        ids = sample_ids(model_a)
    report = divergence(model_a, model_b, lambda m: m(ids))
    for line in report.lines():
        console.print(line, highlight=False, soft_wrap=True)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[list[int]] | list[str]:
    """Prompts from ``--text`` (one text prompt per argument), ``--ids`` (one prompt per argument, ids separated by
    spaces or commas) or ``--file`` (one prompt of ids per line)."""
    if args.text:
        if args.ids or args.file:
            raise ValueError("give prompts as --text or as --ids / --file, not both")
        return list(args.text)
    lines = list(args.ids or [])
    if args.file:
        lines += [line for line in Path(args.file).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError("give prompts with --text, --ids or --file")
    prompts = []
    for n, line in enumerate(lines, start=1):
        try:
            prompts.append([int(t) for t in line.replace(",", " ").split()])
        except ValueError as exc:
            raise ValueError(f"prompt {n}: token ids must be integers ({exc})") from None
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from .runtime.engine import Engine

    model = _model(args)
    prompts = _read_prompts(args)
    tokenizer = None
    if args.text:
        from .runtime.text import Tokenizer

        tokenizer = Tokenizer.from_folder(args.checkpoint) if args.checkpoint else Tokenizer.builtin()
    engine = Engine(model, max_batch=args.max_batch, prefix_cache=not args.no_prefix_cache, tokenizer=tokenizer)
    results = []
    for _ in range(args.repeat):
        results = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, mtp=args.mtp)
    if args.json:
        print(json.dumps([{"tokens": r.tokens, "text": r.text, "logprobs": r.logprobs, "finish_reason": r.finish_reason,
                           "error": r.error, "cache": vars(r.cache), "mtp_drafted": r.mtp_drafted,
                           "mtp_accepted": r.mtp_accepted} for r in results], indent=1))
        return _generate_status(results)
    table = Table(title="v4compile generate")
    for col in ("#", "prompt", "output text" if tokenizer else "output ids", "cached", "recomputed", "prefilled",
                "status"):
        table.add_column(col, overflow="fold")
    for r, prompt in zip(results, prompts, strict=True):
        shown = repr(r.text) if tokenizer else " ".join(map(str, r.tokens))
        table.add_row(str(r.index), repr(prompt) if tokenizer else f"{len(prompt)} ids", shown,
                      str(r.cache.cached_tokens), str(r.cache.recomputed_tokens), str(r.cache.prefill_tokens),
                      r.error or r.finish_reason)
    console.print(table)
    if engine.store is not None:
        console.print(f"prefix cache: {engine.stats()['tree']}")
    if args.mtp:
        drafted = sum(r.mtp_drafted for r in results)
        console.print(f"MTP drafts accepted: {sum(r.mtp_accepted for r in results)} of {drafted}")
    return _generate_status(results)


def _generate_status(results: list) -> int:
    """The exit status of ``generate``: 1 when every request failed (each one's error is in the output)."""
    if results and all(r.error for r in results):
        console.print(f"[red]error:[/red] every request failed, the first with: {results[0].error}", soft_wrap=True)
        return 1
    return 0


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _serve_bench(args: argparse.Namespace) -> int:
    from .runtime.engine import Engine
    from .runtime.workload import Workload, run_workload

    if args.server:
        return _client_bench(args)
    engine = Engine(_model(args), max_batch=args.conversations + 2)
    with _progress("serving the multi-turn workload"):
        report = run_workload(engine, Workload(conversations=args.conversations, turns=args.turns))
    if args.json:
        print(json.dumps({**asdict(report), "hit_rate": report.hit_rate,
                          "baseline_hit_rate": report.baseline_hit_rate}, indent=1))
        return 0
    table = Table(title=f"{report.requests} requests, {report.prompt_tokens} prompt tokens")
    for col in ("cache", "hit rate", "prefill tokens saved", "recomputed (max per hit)", "bytes per cached token"):
        table.add_column(col)
    table.add_row("ShadowRadix", f"{report.hit_rate:.3f}", str(report.cached_tokens),
                  f"{report.recomputed_tokens} ({report.max_recompute_per_hit})",
                  f"{report.bytes_per_token['all']:.0f}")
    table.add_row("baseline (full window KV)", f"{report.baseline_hit_rate:.3f}", str(report.baseline_cached_tokens),
                  "0 (0)", f"{report.baseline_bytes_per_token:.0f}")
    console.print(table)
    console.print("bytes per cached token by pool: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in report.bytes_per_token.items()))
    return 0


def _client_bench(args: argparse.Namespace) -> int:
    from .runtime.client_bench import drive

    model = args.name or f"v4compile-{args.preset}"
    with _progress(f"{args.requests} streamed requests from {args.clients} clients"):
        report = drive(args.server, model, args.clients, args.requests, args.max_tokens, args.prompt)
    summary = report.summary()
    if args.json:
        print(json.dumps({**summary, "errors": report.errors}, indent=1))
    else:
        table = Table(title=f"{args.server}: {args.clients} clients, {args.requests} requests of {args.max_tokens} "
                            "tokens")
        for key in summary:
            table.add_column(key)
        table.add_row(*(f"{v:.1f}" if isinstance(v, float) else str(v) for v in summary.values()))
        console.print(table)
        for error in report.errors[:3]:
            console.print(f"[red]error:[/red] {error}", soft_wrap=True)
    return 1 if report.failed == report.requests else 0


def _serve(args: argparse.Namespace) -> int:
    import v4compile

    from .runtime.engine import Engine
    from .runtime.server import Server
    from .runtime.text import Tokenizer

    model = _model(args)
    tokenizer = Tokenizer.from_folder(args.checkpoint) if args.checkpoint else Tokenizer.builtin()
    if args.optimize:
        with _progress("optimizing the model"):
            model = v4compile.optimize(model, backend=args.backend)
    name = args.name or (Path(args.checkpoint).name if args.checkpoint else f"v4compile-{args.preset}")
    engine = Engine(model, max_batch=args.max_batch, tokenizer=tokenizer)
    server = Server(engine, name, args.host, args.port)
    console.print(f"serving {name!r} at {server.url} (completions, chat completions; Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="v4compile", description="Compiler and runtime for DeepSeek-V4-class models.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the tiny preset end to end: prefill, cached decode, optimization report")
    demo.add_argument("--prompt-len", type=int, default=48)
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--no-optimize", action="store_true", help="skip the compiler part")
    demo.set_defaults(func=_demo)

    pas = sub.add_parser("passes", help="list the passes, what they match and their options")
    pas.add_argument("--json", action="store_true", help="print the pass table as JSON")
    pas.set_defaults(func=_passes)

    exp = sub.add_parser("explain", help="every match with its location and every near-miss with its reason")
    _add_target(exp)
    exp.add_argument("--no-near-misses", dest="near_misses", action="store_false")
    exp.add_argument("--json", action="store_true", help="print the reports as JSON")
    exp.set_defaults(func=_explain)

    sch = sub.add_parser("schedule", help="the stream schedule per layer: branches, costs, streams, fork/join events")
    _add_target(sch)
    sch.set_defaults(func=_schedule, entry="decode")
    sch.add_argument("--target", default="sm90", help="the target to plan for (v4compile/targets.py; default sm90)")
    sch.add_argument("--min-branch-us", type=float, default=10.0,
                     help="estimated microseconds a branch must cost to get a stream (default 10)")
    sch.add_argument("--json", action="store_true", help="print the plans as JSON")

    dump = sub.add_parser("dump", help="write the graphs before and after each pass into a folder")
    _add_target(dump)
    dump.add_argument("out", help="output folder")
    dump.set_defaults(func=_dump)

    ker = sub.add_parser("kernels", help="list generated kernels; --show NAME prints source and launch config")
    _add_target(ker)
    ker.add_argument("--show", metavar="NAME")
    ker.add_argument("--json", action="store_true", help="print the kernel records as JSON")
    ker.set_defaults(func=_kernels)

    bis = sub.add_parser("bisect", help="find the first rewrite that breaks numerics beyond a tolerance")
    _add_target(bis)
    bis.add_argument("--tolerance", type=float, default=1e-2, help="mean per-row relative error allowed")
    bis.add_argument("--graph", dest="bisect_entry", choices=["forward", "decode"], default="forward",
                     help="which graph to bisect")
    bis.set_defaults(func=_bisect)

    gen = sub.add_parser("generate", help="generate from text or token-id prompts with the engine (prefix cache on)")
    _add_target(gen)
    gen.add_argument("--text", nargs="*", help="text prompts, one argument each (the checkpoint's tokenizer.json; "
                                               "a built-in byte-level tokenizer for a preset)")
    gen.add_argument("--ids", nargs="*", help="prompts: one argument each, ids separated by spaces or commas")
    gen.add_argument("--file", help="a text file with one prompt of token ids per line")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-batch", type=_positive_int, default=4)
    gen.add_argument("--repeat", type=_positive_int, default=1,
                     help="serve the prompts this many times (shows cache hits)")
    gen.add_argument("--no-prefix-cache", action="store_true")
    gen.add_argument("--mtp", action="store_true", help="speculative decoding with the MTP block (greedy)")
    gen.add_argument("--json", action="store_true", help="print outputs, log-probs and cache stats as JSON")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions, "
                                       "streaming or not")
    _add_target(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--name", help="the model name clients send (default: the folder's name, or v4compile-PRESET)")
    srv.add_argument("--max-batch", type=_positive_int, default=8)
    srv.add_argument("--optimize", action="store_true", help="serve v4compile.optimize(model) (compiles on first use)")
    srv.set_defaults(func=_serve)

    sb = sub.add_parser("serve-bench", help="the multi-turn agentic workload: prefix-cache hit rate and bytes; or, "
                                            "with --server, concurrent clients against a running server")
    _add_target(sb)
    sb.add_argument("--conversations", type=int, default=4)
    sb.add_argument("--turns", type=int, default=4)
    sb.add_argument("--json", action="store_true", help="print the serving report as JSON")
    sb.add_argument("--server", help="drive a running `v4compile serve` at this URL (http://HOST:PORT/v1) with "
                                     "concurrent streaming clients: time to first token, chunk gaps, tokens/s")
    sb.add_argument("--name", help="with --server: the served model name (default v4compile-PRESET)")
    sb.add_argument("--clients", type=_positive_int, default=4)
    sb.add_argument("--requests", type=_positive_int, default=16)
    sb.add_argument("--max-tokens", type=_positive_int, default=64)
    sb.add_argument("--prompt", default="Explain compressed sparse attention in one paragraph.")
    sb.set_defaults(func=_serve_bench)

    chk = sub.add_parser("check", help="optimized vs eager vs a golden folder")
    chk.add_argument("golden", nargs="?", help="golden folder (config.json, model.safetensors, cases.safetensors)")
    chk.add_argument("--checkpoint", help=argparse.SUPPRESS)
    chk.add_argument("--backend", default="auto")
    chk.add_argument("--inductor", action="store_true", help="compile the rest with Inductor (slow on CPU)")
    chk.add_argument("--regions", action="store_true", help="also check every rewritten region numerically")
    chk.add_argument("--index-ties", choices=["lowest", "official"], default=None,
                     help="the indexer's tie rule (default: the config's, lowest)")
    chk.add_argument("--json", action="store_true", help="print the scores and the verdict as JSON")
    chk.set_defaults(func=_check)

    div = sub.add_parser("diverge", help="two models on one input: every component and discrete choice in order, "
                                         "first divergence first")
    div.add_argument("a", help="checkpoint folder of the first model (its golden case gives the input, if any)")
    div.add_argument("b", nargs="?", help="checkpoint folder of the second model (default: the first)")
    div.add_argument("--index-ties-a", choices=["lowest", "official"], default=None)
    div.add_argument("--index-ties-b", choices=["lowest", "official"], default="official")
    div.add_argument("--case", type=int, default=0, help="which golden case's ids to run (default 0)")
    div.set_defaults(func=_diverge)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``v4compile`` command; bad arguments print a clear error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check" and not (args.golden or args.checkpoint):
        parser.error("check needs a golden folder")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
