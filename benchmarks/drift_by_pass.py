"""Where the optimized model's logits part from eager's, pass by pass, on a golden checkpoint.

The golden folders' models amplify rounding (discrete top-k and routing choices): the official model disagrees with
itself when only the batch changes. So "optimized vs eager" is a distribution, and this says what moves it: the
full-sequence logits of the folder's longest case, eager against ``v4compile.optimize`` with every pass and Inductor,
with Inductor alone (no pass), with every pass run eagerly (``inductor=False``), and with each pass alone (eagerly);
then a ``check=True`` run, whose report gives each pass's worst region error with its inputs taken from the
rewritten graph (what the pass's kernels do, without the drift of the passes before it). Rows: the golden README's
measures (median / mean / min row cosine, argmax agreement)::

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/drift_by_pass.py --golden .golden/tiny-bf16   # GPU
    python benchmarks/drift_by_pass.py --device cpu --variants all,inductor                      # CPU, a minute
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import v4compile
from v4compile.golden import Agreement, GoldenFolder
from v4compile.passes import PASSES

VARIANTS = ("all", "inductor", "passes", "each", "check")
"""``all``: every pass + Inductor; ``inductor``: Inductor without passes; ``passes``: every pass, run eagerly;
``each``: each rewriting pass alone, eagerly; ``check``: every pass with the region checks (its report)."""
_EACH = [name for name in PASSES if name not in ("head_padding", "stream_schedule")]


def _settings(variant: str) -> list[tuple[str, dict[str, Any]]]:
    """(row name, optimize keyword arguments) of one variant."""
    if variant == "each":
        return [(f"only {name} (eager)", {"passes": [name], "inductor": False}) for name in _EACH]
    return [{"all": ("every pass + Inductor", {}), "inductor": ("Inductor, no pass", {"passes": []}),
             "passes": ("every pass (eager)", {"inductor": False}),
             "check": ("every pass, checked", {"check": True})}[variant]]


def main() -> None:
    """Prints one row per setting and writes them (and the checked report) as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "shared" / "golden" / "tiny-bf16"
    parser.add_argument("--golden", default=str(default), help="a golden folder (copy it into the tree for the GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    golden = GoldenFolder.read(args.golden)
    ids = golden.cases[-1].ids.to(args.device)
    model = v4compile.load(args.golden, device=args.device).eval()
    with torch.no_grad():
        eager = model(ids)
    rows: list[dict[str, Any]] = []
    report = None
    for variant in variants:
        for name, kwargs in _settings(variant):
            torch._dynamo.reset()
            start = time.perf_counter()
            optimized = v4compile.optimize(model, **kwargs)
            with torch.no_grad():
                agreement = Agreement.of(optimized(ids), eager)
            rows.append({"setting": name, **asdict(agreement), "seconds": time.perf_counter() - start})
            if variant == "check":
                report = optimized.report()
    if args.out:
        Path(args.out).write_text(json.dumps({"golden": args.golden, "device": args.device, "ids": list(ids.shape),
                                              "rows": rows, "check": report.to_json() if report else None}, indent=1))
    if report is not None:
        print(report)
    where = f"{Path(args.golden).name}, longest case {list(ids.shape)}, {args.device}"
    print(f"\n{where}: optimized logits against eager's")
    print("| setting | median cos | mean cos | min cos | argmax agreement | s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['median_cos']:.5f} | {r['mean_cos']:.5f} | {r['min_cos']:.4f} | "
              f"{r['argmax_agreement']:.3f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
