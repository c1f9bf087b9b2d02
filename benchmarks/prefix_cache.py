"""Prefix-cache benchmark: a multi-turn agentic workload (shared system prompt, growing conversations,
branches) served by the engine with ShadowRadix, against a baseline prefix cache that keeps every cached
token's window KV. Prints hit rates, prefill tokens saved, recompute per hit and bytes per cached token.

    python benchmarks/prefix_cache.py [--preset tiny] [--conversations 4] [--turns 4] [--out report.json]

The hit rates come from running the model (tiny preset by default, on CPU in a minute or two); the bytes
per token are the engine's pool bytes over the tokens its tree holds. A second table gives the same
per-token arithmetic at V4-Flash and V4-Pro dimensions (compressed entries only; tails add per node).

``--frontier`` measures the footprint frontier on a longer agentic workload (a 4000-token system prompt, tool
results and messages of 200-1500 tokens, six turns, a branch a turn): the engine's window tails capped at 5 (one
per request of a turn; fewer thrash: a cap of 1 gave no hit at all), 6, 8 and 16, and kept at prompt ends or every
8 chunks, each run priced at V4-Flash dimensions (the tree's cached
tokens at Flash's compressed bytes per token plus its live tails at Flash's tail bytes; which tails live does not
depend on the dims), against the baseline that keeps every cached token's window KV, with the hit rates and the
tokens recomputed per hit. The tiny model serves the workload (its tokens only decide the short answers).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

import v4compile
from v4compile.runtime.engine import Engine
from v4compile.runtime.prefix_pools import tail_bytes
from v4compile.runtime.workload import ServeReport, Workload, run_workload

AGENTIC = Workload(conversations=4, turns=6, system_len=4000, message_len=(200, 1500), answer_len=12, branches=1)
"""The frontier's workload: long shared context, long tool results, one branch per turn."""


def per_token_bytes(config: v4compile.V4Config) -> tuple[float, float]:
    """(compressed bytes per token, baseline bytes per token) for ``config`` with bf16 entries."""
    ratios = config.layer_ratios
    d, di = config.head_dim, config.index_head_dim
    compressed = sum(d * 2 / r + (di * 2 / r if r == 4 else 0) for r in ratios if r)
    return compressed, compressed + len(ratios) * d * 2


def flash_bytes(engine: Engine, dims: v4compile.V4Config) -> tuple[float, float, int, int]:
    """(bytes per cached token, baseline bytes per cached token, cached tokens, live tails) of the engine's tree
    after a run, priced at ``dims``."""
    assert engine.store is not None
    tree = engine.store.tree.stats()
    tokens, tails = max(tree["cached_tokens"], 1), tree["nodes"] - tree["tombstones"]
    compressed, baseline = per_token_bytes(dims)
    return compressed + tails * tail_bytes(dims) / tokens, baseline, tree["cached_tokens"], tails


def frontier(model: v4compile.DeepSeekV4) -> list[dict[str, float]]:
    """Runs AGENTIC under each tail cap and spacing; prints and returns one row per run."""
    dims = v4compile.V4Config.preset("flash")
    rows = []
    print(f"footprint frontier, AGENTIC workload ({AGENTIC}), bytes at V4-Flash dims")
    print("| tails kept | at most | hit rate (baseline) | conversation prompts (baseline) | branches (baseline) | "
          "recomputed per hit (max) | cached tokens | live tails | B/cached token | baseline B/token | "
          "baseline / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tail_every in (0, 8):
        for cap in (5, 6, 8, 16):
            engine = Engine(model, max_batch=AGENTIC.conversations + AGENTIC.branches, tail_every=tail_every,
                            prefix_tails=cap)
            report: ServeReport = run_workload(engine, AGENTIC)
            ours, base, tokens, tails = flash_bytes(engine, dims)
            row = {"tail_every": tail_every, "cap": cap, "hit_rate": report.hit_rate,
                   "baseline_hit_rate": report.baseline_hit_rate,
                   "conversation_hit_rates": report.kind_hit_rates(branches=False),
                   "branch_hit_rates": report.kind_hit_rates(branches=True),
                   "recompute_per_hit": report.recompute_per_hit,
                   "max_recompute": report.max_recompute_per_hit, "cached_tokens": tokens, "tails": tails,
                   "bytes_per_token": ours, "baseline_bytes_per_token": base, "ratio": base / ours}
            rows.append(row)
            where = "at prompt ends" if not tail_every else f"every {tail_every} chunks"
            (cont, cont_base), (branch, branch_base) = row["conversation_hit_rates"], row["branch_hit_rates"]
            print(f"| {where} | {cap} | {report.hit_rate:.3f} ({report.baseline_hit_rate:.3f}) | "
                  f"{cont:.3f} ({cont_base:.3f}) | {branch:.3f} ({branch_base:.3f}) | "
                  f"{report.recompute_per_hit:.0f} ({report.max_recompute_per_hit}) | {tokens} | {tails} | "
                  f"{ours:.0f} | {base:.0f} | {base / ours:.2f}x |", flush=True)
    return rows


def main() -> None:
    """Runs the workload and prints the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--budget-mb", type=float, default=None, help="engine memory budget (default: ample)")
    parser.add_argument("--frontier", action="store_true", help="the footprint frontier on the agentic workload")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    if args.frontier:
        model = v4compile.DeepSeekV4(v4compile.V4Config.preset(args.preset, max_seq_len=16384), seed=0).eval()
        rows = frontier(model)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
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
