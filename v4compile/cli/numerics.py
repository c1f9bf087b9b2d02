"""The numerics commands: ``check`` (optimized vs eager vs a golden folder) and ``diverge`` (two models on one
input, first divergence first)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from .common import console, spinner


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Registers the numerics commands."""
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


def _check(args: argparse.Namespace) -> int:
    import v4compile

    from ..debugging import golden_check
    from ..golden import score

    folder = Path(args.golden or args.checkpoint)
    model = v4compile.load(folder, index_ties=args.index_ties).eval()
    with spinner("scoring the eager model as the golden vectors were made (one prefill per row)"):
        eager = score(model, folder)
    if not args.json:
        for line in eager.lines():
            console.print(line, highlight=False, soft_wrap=True)
    optimized = v4compile.optimize(model, backend=args.backend, inductor=args.inductor, check=args.regions)
    with spinner("running eager and optimized on the golden cases"):
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

    from ..debugging import sample_ids
    from ..divergence import divergence
    from ..golden import GoldenFolder

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
