"""Prefix-cache benchmark: a multi-turn agentic workload (shared system prompt, growing conversations,
branches) served by the engine with ShadowRadix, against a baseline prefix cache that keeps every cached
token's window KV. Prints hit rates, prefill tokens saved, recompute per hit and bytes per cached token.

    python benchmarks/prefix_cache.py [--preset tiny] [--conversations 4] [--turns 4] [--out report.json]

The hit rates come from running the model (tiny preset by default, on CPU in a minute or two); the bytes
per token are the engine's pool bytes over the tokens its tree holds. A second table gives the same
per-token arithmetic at V4-Flash and V4-Pro dimensions (compressed entries only; tails add per node).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

import v4compile
from v4compile.runtime.engine import Engine
from v4compile.runtime.workload import Workload, run_workload


def per_token_bytes(config: v4compile.V4Config) -> tuple[float, float]:
    """(compressed bytes per token, baseline bytes per token) for ``config`` with bf16 entries."""
    ratios = config.layer_ratios
    d, di = config.head_dim, config.index_head_dim
    compressed = sum(d * 2 / r + (di * 2 / r if r == 4 else 0) for r in ratios if r)
    return compressed, compressed + len(ratios) * d * 2


def main() -> None:
    """Runs the workload and prints the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--budget-mb", type=float, default=None, help="engine memory budget (default: ample)")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    config = v4compile.V4Config.preset(args.preset, max_seq_len=4096)
    model = v4compile.DeepSeekV4(config, seed=0).eval()
    budget = int(args.budget_mb * 2**20) if args.budget_mb else None
    workload = Workload(conversations=args.conversations, turns=args.turns)
    rows, reports = [], {}
    for tail_every in (0, 4, 1):
        engine = Engine(model, max_batch=args.conversations + 2, memory_budget=budget, tail_every=tail_every)
        report = reports[tail_every] = run_workload(engine, workload)
        stats = engine.stats()
        pools = ", ".join(f"{k} {v:.0f}" for k, v in report.bytes_per_token.items() if k != "all")
        rows.append(f"| ShadowRadix, tails {'at prompt ends' if not tail_every else f'every {tail_every} chunks'} | "
                    f"{report.hit_rate:.3f} | {report.cached_tokens} | {report.recomputed_tokens} "
                    f"({report.max_recompute_per_hit}) | {report.bytes_per_token['all']:.0f} ({pools}) | "
                    f"{report.baseline_bytes_per_token / report.bytes_per_token['all']:.1f}x |")
    print(f"preset {args.preset}: {report.requests} requests, {report.prompt_tokens} prompt tokens, "
          f"tree {stats['tree']}")
    print("| cache | hit rate | prefill tokens saved | recomputed tokens (max per hit) | bytes per cached token "
          "(by pool) | baseline bytes / ours |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"| baseline: full window KV per token | {report.baseline_hit_rate:.3f} | {report.baseline_cached_tokens}"
          f" | 0 (0) | {report.baseline_bytes_per_token:.0f} | 1.0x |")
    print("| dims | compressed B/token | baseline B/token | ratio (before tails) |")
    print("|---|---|---|---|")
    for name in ("tiny", "flash", "pro"):
        compressed, base = per_token_bytes(v4compile.V4Config.preset(name))
        print(f"| {name} | {compressed:.0f} | {base:.0f} | {base / compressed:.1f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(k): asdict(r) | {"hit_rate": r.hit_rate, "baseline_hit_rate": r.baseline_hit_rate}
                       for k, r in reports.items()}, f, indent=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
