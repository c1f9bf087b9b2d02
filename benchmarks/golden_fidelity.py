"""Fidelity to the official model on every golden folder, under both indexer tie rules (CPU, a minute).

Scores the eager model as the golden vectors were made (``v4compile.golden.score``: one prefill per golden row,
the decode path, the MTP block) and prints one table row per folder and rule, plus where the two rules first
part ways (``v4compile.divergence``). Run with ``MKL_CBWR=COMPATIBLE`` to see the bitwise-equal share with MKL
on its reproducible code path (how the newer golden folders were made)::

    python benchmarks/golden_fidelity.py [--golden ../shared/golden] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import v4compile
from v4compile.divergence import divergence
from v4compile.golden import GoldenFolder, score

FOLDERS = ("tiny-bf16", "tiny-fp8-fp4", "tiny-bf16-c4first", "tiny-fp8-deep")


def main() -> None:
    """Prints the fidelity table (and writes it as JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", default=str(Path(__file__).resolve().parents[2] / "shared" / "golden"))
    parser.add_argument("--json", help="write every measure to this file")
    args = parser.parse_args()
    rows, out = [], {}
    for name in FOLDERS:
        folder = Path(args.golden) / name
        for ties in ("official", "lowest"):
            start = time.perf_counter()
            result = score(v4compile.load(folder, index_ties=ties).eval(), folder)
            out[f"{name}/{ties}"] = asdict(result)
            p, d = result.prefill, result.decode
            rows.append(f"| {name} | {ties} | {p.median_cos:.4f} | {p.mean_cos:.4f} | {p.argmax_agreement:.3f} | "
                        f"{p.bitwise:.3f} | {d.median_cos:.4f} | {d.mean_cos:.4f} | {d.argmax_agreement:.3f} | "
                        f"{min(result.mtp_cos):.4f} | {'in' if result.in_band() else 'out'} | "
                        f"{time.perf_counter() - start:.1f} s |")
        models = [v4compile.load(folder, index_ties=t).eval() for t in ("lowest", "official")]
        ids = GoldenFolder.read(folder).cases[-1].ids
        first = divergence(*models, lambda m, ids=ids: m(ids)).first_divergence
        out[f"{name}/first divergence"] = None if first is None else asdict(first)
        print(f"{name}: lowest vs official first part at {first.line() if first else 'nowhere'}")
    print("\n| folder | ties | prefill median | prefill mean | prefill argmax | prefill bitwise | decode median | "
          "decode mean | decode argmax | MTP min cos | band | time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
