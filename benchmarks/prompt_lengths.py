"""Prefill at prompt lengths a server meets: the first length's compile, each new length's, and the warm time.

One process: the 4-layer Flash slice (or the tiny preset) is optimized, then prefilled (batch 1, one cache of
``--context`` tokens per length, every call prefilling it from position 0) at each of ``--lengths`` in order. The
graphs have the sequence dynamic: a length compiles only when its shape class is new (a remainder of 0, 1 or more
after the compressor's blocks, ...). Per length: seconds of the first call (compiles included), the median of the
warm calls, and how many graphs that length compiled; then the kernels each compiled graph runs, so a graph that
lost one of the first graph's kernels shows.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/prompt_lengths.py --experts 256 --out results.json   # GPU
    python benchmarks/prompt_lengths.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from compile_time import build

import v4compile


def timed(optimized: v4compile.OptimizedModel, model: v4compile.DeepSeekV4, length: int, calls: int,
          device: str) -> list[float]:
    """Seconds of ``calls`` prefills of one random prompt of ``length`` tokens into one cache."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    cache = model.new_cache(1)
    times = []
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            optimized(ids, cache=cache)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    """Prints one row per length as it is measured, then the kernels per compiled graph; writes both as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in order (default: 2048 1500 1777 "
                        "2048 3001 on the slice, 200 301 333 200 450 on the tiny preset)")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096, help="cache tokens (the slice's max_seq_len - 64)")
    parser.add_argument("--calls", type=int, default=4, help="calls per length: the first, then warm ones")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset instead of the Flash slice")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="write the rows and kernels as JSON here")
    args = parser.parse_args()
    if args.calls < 2:
        parser.error(f"--calls must be at least 2 (a first and a warm call), got {args.calls}")
    lengths = args.lengths or ([200, 301, 333, 200, 450] if args.tiny else [2048, 1500, 1777, 2048, 3001])
    if min(lengths) < 1 or max(lengths) > args.context:
        parser.error(f"--lengths must be between 1 and --context {args.context}, got {lengths}")
    build_args = argparse.Namespace(tiny=args.tiny, layers=args.layers, context=args.context, experts=[args.experts],
                                    inter=0, full=False, mtp=False, device=args.device)
    model = build(build_args)
    optimized = v4compile.optimize(model)
    counters = torch._dynamo.utils.counters["stats"]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {'tiny preset' if args.tiny else f'{args.layers}-layer Flash slice, '}"
          f"{'' if args.tiny else f'{args.experts} routed experts'}")
    print("| length | first call s | warm ms | graphs compiled |")
    print("|---|---|---|---|", flush=True)
    rows = []
    for length in lengths:
        before = counters["unique_graphs"]
        times = timed(optimized, model, length, args.calls, args.device)
        warm = sorted(times[1:])[len(times[1:]) // 2]
        row = {"length": length, "first_s": times[0], "warm_ms": 1e3 * warm,
               "graphs_compiled": counters["unique_graphs"] - before}
        rows.append(row)
        print(f"| {length} | {row['first_s']:.1f} | {row['warm_ms']:.1f} | {row['graphs_compiled']} |", flush=True)
    kernels = {r.graph: sorted({m.kernel for m in r.matches}) for r in optimized.reports()}
    for graph, found in kernels.items():
        print(f"{graph}: {len(found)} kernels: {', '.join(found) or '-'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows, "kernels": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
