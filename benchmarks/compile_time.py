"""Compile time: ``v4compile.optimize`` to the first decoded token, cold and warm cache.

Each row runs in fresh processes: the first with empty cache directories (Inductor's, Triton's and the kernel
registry's, all under one temporary directory: cold), the second with the directories the first left (warm). A
process builds the model (random weights drawn on the device), optimizes it, and times the first decode step at
batch 1 over a ``--context``-token cache (optimize is lazy, so this is capture + passes + Inductor + kernel
builds + the step), then the first step of a second decode bucket (batch 16) and of a further one (batch 64): on
the CPU the first step's graphs have the batch unbacked and serve both, so neither compiles a graph (on CUDA, until
``regions.UNBACKED_DEVICES`` names it, batch 16 compiles the graph every batch of 2 and more shares). Then the first
prefill
at each of ``--lengths`` prompt lengths (batch 1): the graphs have the sequence dynamic, so a length compiles only
when the model's code tells its shape apart from the earlier ones (a remainder of 0, 1 or more after the
compressor's blocks, fewer blocks than the top-k, ...).

    PYTHONPATH=$PWD python3 benchmarks/compile_time.py --experts 16 64 256            # H200: the 4-layer slice
    PYTHONPATH=$PWD python3 benchmarks/compile_time.py --full --experts 256 --inter 512    # all 43 layers + MTP
    PYTHONPATH=$PWD python3 benchmarks/compile_time.py --tiny                          # the tiny preset, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from headline import fill_cache, slice_config
from stream_overlap import fill_random_

import v4compile


def build(args: argparse.Namespace) -> v4compile.DeepSeekV4:
    """The model of one row: the tiny preset (seeded init) or the Flash slice with random weights on the device."""
    if args.tiny:
        return v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0, device=args.device).eval()
    config = slice_config(args.layers, args.context, small=False, experts=args.experts[0])
    overrides = {"moe_inter_dim": args.inter} if args.inter else {}
    if args.full:
        config = v4compile.V4Config.preset("flash", max_seq_len=args.context + 64, n_routed_experts=args.experts[0])
    elif args.mtp:
        overrides.update(n_mtp_layers=1, compress_ratios=[*config.compress_ratios[: args.layers], 0])
    if overrides:
        config = v4compile.V4Config.from_dict({**config.to_dict(), **overrides})
    with torch.no_grad():
        model = v4compile.DeepSeekV4(config, seed=None, device=args.device).eval()
        fill_random_(model, torch.Generator(args.device).manual_seed(0))
    return model


def worker(args: argparse.Namespace) -> dict[str, float]:
    """One process's measurement: seconds to build, to the first token, and to a second and a third bucket's first
    step."""
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    model = build(args)
    built = time.perf_counter() - t0
    optimized = v4compile.optimize(model, regions=not args.whole_graph)
    result = {"build_s": built}
    for batch, key in ((1, "first_token_s"), (16, "next_bucket_s"), (64, "further_bucket_s")):
        cache = model.new_cache(batch, args.context + 64)
        fill_cache(cache, batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=args.device)
        positions = torch.full((batch,), args.context, device=args.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            optimized.decode_step(ids, positions, cache)
        if cuda:
            torch.cuda.synchronize()
        result[key] = time.perf_counter() - t0
        del cache
    result["prefill_s"] = []
    for length in args.lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device)
        cache = model.new_cache(1, max(args.lengths) + 64)
        t0 = time.perf_counter()
        with torch.no_grad():
            optimized(ids, cache=cache)
        if cuda:
            torch.cuda.synchronize()
        result["prefill_s"].append(time.perf_counter() - t0)
    return result


def run_row(args: argparse.Namespace, experts: int) -> dict[str, object]:
    """Cold then warm worker processes for one expert count, sharing one set of fresh cache directories."""
    with tempfile.TemporaryDirectory(prefix="v4compile-compile-time-") as root:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor", "TRITON_CACHE_DIR": f"{root}/triton",
               "V4COMPILE_CACHE": f"{root}/kernels"}
        argv = [sys.executable, __file__, "--worker", "--experts", str(experts), "--layers", str(args.layers),
                "--context", str(args.context), "--device", args.device, "--inter", str(args.inter or 0),
                "--lengths", *map(str, args.lengths)]
        argv += ["--mtp"] * args.mtp + ["--tiny"] * args.tiny + ["--whole-graph"] * args.whole_graph
        argv += ["--full"] * args.full
        row: dict[str, object] = {"experts": experts}
        for run in ("cold", "warm"):
            try:
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                row[run] = {"error": f"timed out after {args.timeout:.0f} s"}
                break
            if done.returncode:
                row[run] = {"error": done.stderr[-2000:]}
                break
            row[run] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    """Prints one table row per expert count (cold and warm) and writes the rows as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mtp", action="store_true", help="add the MTP block (the full Flash layer pattern)")
    parser.add_argument("--inter", type=int, default=0, help="moe_inter_dim override (0: Flash's 2048)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths to prefill after decode, in order "
                        "(default 1024 1500 1777 2900; tiny: 200 301 333 450)")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset instead of the Flash slice")
    parser.add_argument("--full", action="store_true",
                        help="the full Flash layer pattern (43 layers, its 3 hash layers, MTP) instead of the slice")
    parser.add_argument("--whole-graph", action="store_true",
                        help="one graph per entry point instead of regions (optimize(regions=False))")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.lengths:
        args.lengths = [200, 301, 333, 450] if args.tiny else [1024, 1500, 1777, 2900]
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.tiny:
        args.experts, args.context = [8], 64
    what = "tiny preset" if args.tiny else f"{args.layers}-layer Flash slice{' + MTP' if args.mtp else ''}"
    if args.full:
        what = "full Flash layer pattern (43 layers + MTP)"
    what += ", whole graphs" if args.whole_graph else ", regions"
    print(f"{what}, decode at {args.context} context on {args.device}; inter dim {args.inter or 'as config'}")
    print("| experts | cold: first token s | cold: next bucket s | cold: further bucket s | warm: first token s"
          " | warm: next bucket s | warm: further bucket s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for experts in args.experts:
        row = run_row(args, experts)
        rows.append(row)
        cells = []
        for run in ("cold", "warm"):
            r = row.get(run, {})
            ok = "first_token_s" in r
            keys = ("first_token_s", "next_bucket_s", "further_bucket_s")
            cells += [f"{r[k]:.1f}" for k in keys] if ok else ["error"] * 3
        print(f"| {experts} | " + " | ".join(cells) + " |", flush=True)
        for run in ("cold", "warm"):
            if "prefill_s" in row.get(run, {}):
                seconds = ", ".join(f"{length}: {t:.1f}" for length, t in zip(args.lengths, row[run]["prefill_s"],
                                                                             strict=True))
                print(f"  {run}, first prefill at each prompt length (tokens: s): {seconds}", flush=True)
        for run in ("cold", "warm"):
            if "error" in row.get(run, {}):
                print(f"{run} error: {row[run]['error']}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "args": vars(args) | {"out": str(args.out)},
                                        "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
