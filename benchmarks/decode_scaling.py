"""Decode step time against context length on a slice with V4-Flash dimensions (the runtime issue's table).

For each context length the cache is sized to that context (so the indexer scores, the top-k selects and
the C128 attention reads what that context holds) and filled with random KV; the decode step of
``v4compile.optimize`` is replayed from a CUDA graph, as the runtime's decode buckets run it. "model code"
is the model's own decode step replayed from a CUDA graph (no passes, no Inductor): the same work without
our kernels. Each (variant, context, batch) compiles in a process of its own, all at once; then they time
one at a time.

    PYTHONPATH=. python3 benchmarks/decode_scaling.py                      # H200
    PYTHONPATH=. python3 benchmarks/decode_scaling.py --device cpu --small --contexts 512,2048 --batches 1
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from headline import build_slice, fill_cache, timed
from kernels import graphed  # benchmarks/kernels.py: the CUDA-graph capture the kernel table uses
from prepared import run_prepared, save_rows

import v4compile

VARIANTS = ("v4compile", "model code")


def run_job(args: argparse.Namespace, job: dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    """Builds the slice, sizes and fills a cache for ``job["context"]``, prepares the variant's step (capture,
    passes, compile, CUDA graph), then times it when told to."""
    try:
        context, batch, variant = job["context"], job["batch"], job["variant"]
        model = build_slice(args.layers, max(contexts(args)), args.small, args.experts, args.device)
        cache = model.new_cache(batch, context + 64)
        fill_cache(cache, batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=args.device)
        positions = torch.full((batch,), context, device=args.device)
        with torch.no_grad():
            step = model.decode_step if variant == "model code" else v4compile.optimize(model).decode_step
            run = lambda: step(ids, positions, cache)  # noqa: E731
            run()
            fn = graphed(run) if args.device == "cuda" else run
            ready.set()
            go.wait()
            ms = timed(fn, args.reps, args.device == "cuda")
        results.put({**job, "ms": ms, "cache_mib": cache.nbytes() / 2**20})
    except Exception as exc:  # reported as the job's row; the other jobs still run
        results.put({**job, "error": f"{type(exc).__name__}: {exc}"})
        ready.set()
    results.put({"done": True})


def contexts(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.contexts.split(",") if c]


def main() -> None:
    """Measures every context, batch and variant, prints the table (step ms and growth over the shortest
    context) and writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small dims (a smoke run)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", default="4096,16384,65536,131072,262144")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--experts", type=int, default=16, help="routed experts (Flash has 256)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--prepare-s", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    jobs = [{"variant": v, "batch": int(b), "context": c}
            for v in variants for b in args.batches.split(",") if b for c in contexts(args)]
    rows = run_prepared(run_job, args, jobs, args.prepare_s, on_row=lambda r: save_rows(args, r))
    save_rows(args, rows)
    print(f"\n{'variant':<12} {'batch':>5} {'context':>8} {'step ms':>9} {'vs shortest':>11} {'cache MiB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} {r['batch']:>5} {r['context']:>8} {r['error']}")
            continue
        base = next(b["ms"] for b in rows if "ms" in b and b["variant"] == r["variant"] and b["batch"] == r["batch"])
        print(f"{r['variant']:<12} {r['batch']:>5} {r['context']:>8} {r['ms']:>9.3f} {r['ms'] / base - 1:>+10.1%} "
              f"{r['cache_mib']:>10.1f}")


if __name__ == "__main__":
    main()
