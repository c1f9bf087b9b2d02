"""Chunked prefill, as the engine runs it: a prompt in pieces of ``--piece`` tokens, each ``extend_hidden`` at its
start position continuing the cache, eager against ``v4compile.optimize`` (compiled regions, the start and the
piece length dynamic).

One row per variant: seconds of the first two pieces (they compile: start 0, then any other start), of the first
short piece (a prompt's remainder), and per piece afterwards (the median of the later pieces), the prefill's
tokens/s from there, how many graphs the optimized model compiled, and the largest difference of its last-position
streams from eager's over eager's largest value (each variant runs the same pieces on a cache of its own).

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/chunked_prefill.py --tokens 4096 --piece 128   # H200
    python benchmarks/chunked_prefill.py --small --device cpu --tokens 512                               # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from headline import build_slice

import v4compile


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(fn: Any, model: v4compile.DeepSeekV4, ids: torch.Tensor, piece: int, device: str,
        ) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds per piece and the streams of each piece's last position: ``ids`` [1, T] in whole pieces, then its
    last ``piece // 2 + 1`` tokens as a remainder piece."""
    remainder = piece // 2 + 1
    cache = model.new_cache(1, ids.shape[1])
    times, outs = [], []
    bounds = [(s, s + piece) for s in range(0, ids.shape[1] - remainder, piece)]
    bounds.append((ids.shape[1] - remainder, ids.shape[1]))
    for start, stop in bounds:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hidden = fn.extend_hidden(ids[:, start:stop], start, cache)
        _sync(device)
        times.append(time.perf_counter() - t0)
        outs.append(hidden[:, -1].float().cpu())
    return times, outs


def main() -> None:
    """Prints the eager and optimized rows and writes them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small dims (a smoke run)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default: Flash's 256)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens before the remainder piece")
    parser.add_argument("--piece", type=int, default=128, help="tokens a piece (the engine's largest is 128)")
    parser.add_argument("--variants", default="eager,optimized", help="comma-separated: eager, optimized")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.piece < 2 or args.tokens % args.piece or args.tokens < 3 * args.piece:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --piece ({args.piece}), at least three pieces")
    length = args.tokens + args.piece // 2 + 1
    model = build_slice(args.layers, length + 64, args.small, args.experts, args.device)
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))
    optimized = v4compile.optimize(model)
    rows, reference = [], None
    print(f"{args.layers}-layer slice, {model.config.n_routed_experts} routed experts, {args.tokens} tokens in "
          f"pieces of {args.piece} on {args.device}")
    print("| variant | first piece s | second piece s | remainder piece s | later pieces ms (median) | tokens/s |"
          " graphs | max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name, fn in (("eager", model), ("optimized", optimized)):
        if name not in args.variants.split(","):
            continue
        times, outs = run(fn, model, ids, args.piece, args.device)
        later = statistics.median(times[2:-1])
        diff = None if reference is None else max((a - b).abs().max().item() / b.abs().max().item()
                                                  for a, b in zip(outs, reference, strict=True))
        if reference is None:
            reference = outs
        graphs = len(optimized.reports()) if name == "optimized" else 0
        row = {"variant": name, "first_s": times[0], "second_s": times[1], "remainder_s": times[-1],
               "later_ms": later * 1e3, "tokens_per_s": args.piece / later, "graphs": graphs, "max_diff": diff,
               "piece_s": times}
        rows.append(row)
        print(f"| {name} | {times[0]:.2f} | {times[1]:.2f} | {times[-1]:.2f} | {later * 1e3:.2f} | "
              f"{args.piece / later:.0f} | {graphs} | {'-' if diff is None else f'{diff:.3g}'} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
                                        "graphs": [r.graph for r in optimized.reports()], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
