"""The headline row: a slice of V4-Flash (C4 and C128 layers, FP4 experts, random weights) end to end.

Decode at batch 1, 16 and 64 with a filled 16K-token context, and a prefill of 8K tokens:
``v4compile.optimize`` (passes + Inductor; decode replayed from a CUDA graph, as the runtime runs it)
against the model's own PyTorch code in eager and under ``torch.compile`` modes. A compile mode's
time is measured as that mode runs it; ``default+graph`` additionally replays the default-mode step
from a CUDA graph, so the comparison does not hinge on launch overhead alone. Each variant and phase
compiles in a process of its own, all at once; then they time one after another, alone on the GPU and
the host.

    PYTHONPATH=. python3 benchmarks/headline.py            # H200
    PYTHONPATH=. python3 benchmarks/headline.py --device cpu --small   # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from kernels import graphed  # benchmarks/kernels.py: the CUDA-graph capture the kernel table uses
from prepared import run_prepared, save_rows
from stream_overlap import fill_random_  # random weights drawn on the device

import v4compile
from v4compile.model.cache import V4Cache
from v4compile.model.config import V4Config

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")


def slice_config(layers: int, context: int, small: bool, experts: int | None = None) -> V4Config:
    """V4-Flash dimensions, ``layers`` alternating C4 / C128 layers, no hash layers and no MTP block;
    ``experts`` overrides the routed expert count (the dense expert loop of the model code is what
    torch.compile compiles, and its compile time grows with it)."""
    ratios = [4 if i % 2 == 0 else 128 for i in range(layers)]
    overrides: dict[str, Any] = dict(n_layers=layers, compress_ratios=ratios, n_hash_layers=0, n_mtp_layers=0,
                                     max_seq_len=context + 64)
    if experts:
        overrides["n_routed_experts"] = experts
    if small:
        overrides.update(dim=256, moe_inter_dim=128, n_routed_experts=16, vocab_size=1024, n_heads=8,
                         q_lora_rank=128, o_groups=2, o_lora_rank=64, head_dim=128, index_n_heads=4,
                         index_head_dim=64, index_topk=16, dtype="bf16", scale_fmt=None, scale_dtype="fp32",
                         expert_dtype=None)
    return V4Config.preset("flash", **overrides)


def fill_cache(cache: V4Cache, seed: int) -> None:
    """Random KV entries and compressor states: decode cost does not depend on their values."""
    gen = torch.Generator(device=cache.layers[0].window.device).manual_seed(seed)
    for layer in cache.all_layers:
        layer.window.normal_(generator=gen)
        for comp in (layer.compressor, layer.indexer):
            if comp is not None:
                comp.pool.normal_(generator=gen)
                comp.kv_state.normal_(generator=gen)
                comp.score_state.normal_(generator=gen)


def timed(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


VARIANTS = ("eager", *(f"torch.compile {m}" for m in MODES), "v4compile")
"""Every variant of the table; each is prepared (compiled and warmed up) in a process of its own."""

Step = Callable[[], Any]


def decode_steps(model: v4compile.DeepSeekV4, variant: str, batch: int, context: int,
                 disable: tuple[str, ...]) -> list[tuple[str, Step, float | None]]:
    """(variant, step, compile seconds) for a decode step at ``batch`` with a ``context``-token cache;
    on CUDA, default mode is also replayed from a CUDA graph and v4compile runs only that way (as the
    runtime runs it)."""
    cuda = next(model.parameters()).is_cuda
    cache = model.new_cache(batch, context + 64)
    fill_cache(cache, batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=cache.layers[0].window.device)
    positions = torch.full((batch,), context, device=ids.device)
    if variant == "eager":
        return [(variant, lambda: model.decode_step(ids, positions, cache), None)]
    if variant == "v4compile":
        step = v4compile.optimize(model, disable=disable).decode_step
    else:
        step = torch.compile(model.decode_step, mode=variant.split()[-1], dynamic=False)
    t0 = time.perf_counter()
    step(ids, positions, cache)
    seconds = time.perf_counter() - t0
    run = lambda: step(ids, positions, cache)  # noqa: E731
    if variant == "v4compile":
        return [(variant, graphed(run) if cuda else run, seconds)]
    steps = [(variant, run, seconds)]
    if variant.endswith(" default") and cuda:
        steps.append((f"{variant}+graph", graphed(run), None))
    return steps


def prefill_step(model: v4compile.DeepSeekV4, variant: str, tokens: int,
                 disable: tuple[str, ...]) -> tuple[str, Step, float | None]:
    """(variant, step, compile seconds) for a prefill of ``tokens`` tokens into an empty cache (batch 1)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    cache = model.new_cache(1, tokens + 64)
    if variant == "eager":
        return variant, lambda: model(ids, cache=cache), None
    fn = (v4compile.optimize(model, disable=disable) if variant == "v4compile"
          else torch.compile(model, mode=variant.split()[-1], dynamic=False))
    t0 = time.perf_counter()
    fn(ids, cache=cache)
    return variant, lambda: fn(ids, cache=cache), time.perf_counter() - t0


def run_variant(args: argparse.Namespace, job: dict[str, str], ready: Any, go: Any, results: Any) -> None:
    """One variant and phase in a process of its own (``prepared.run_prepared``): builds the slice, prepares
    the phase, signals ``ready``, waits for ``go`` and sends its rows to ``results``."""
    variant, phase = job["variant"], job["phase"]
    try:
        model = build_slice(args.layers, max(args.context, args.prefill), args.small, args.experts, args.device)
        disable = tuple(d for d in args.disable.split(",") if d)
        with torch.no_grad():
            if phase.startswith("decode"):
                steps = decode_steps(model, variant, int(phase.removeprefix("decode b")), args.context, disable)
            else:
                steps = [prefill_step(model, variant, args.prefill, disable)]
            ready.set()
            go.wait()
            for name, fn, seconds in steps:
                reps = args.eager_reps if name == "eager" else args.reps if phase.startswith("decode") \
                    else max(3, args.reps // 5)
                results.put({"phase": phase, "variant": name, "ms": timed(fn, reps, args.device == "cuda"),
                             "compile_s": seconds})
    except Exception as exc:  # reported as the variant's row; the other variants still run
        results.put({"phase": phase, "variant": variant, "error": f"{type(exc).__name__}: {exc}"})
        ready.set()
    results.put({"done": True})


def build_slice(layers: int, context: int, small: bool, experts: int | None, device: str) -> v4compile.DeepSeekV4:
    """The slice of ``slice_config`` with random weights drawn on the device (seed 0)."""
    model = v4compile.DeepSeekV4(slice_config(layers, context, small, experts), seed=None, device=device).eval()
    fill_random_(model, torch.Generator(device).manual_seed(0))
    return model


def batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.batches.split(",") if b]


def measure(args: argparse.Namespace, variants: list[str]) -> list[dict[str, Any]]:
    """Every variant and phase prepared in a process of its own, all at once, then timed one at a time."""
    phases = [f"decode b{b}" for b in batches(args)] + ([f"prefill {args.prefill}"] if args.prefill else [])
    jobs = [{"phase": phase, "variant": variant} for phase in phases for variant in variants]
    return run_prepared(run_variant, args, jobs, args.prepare_s, on_row=lambda rows: save_rows(args, rows))


def main() -> None:
    """Measures every phase and variant, prints the table and writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small dims (a smoke run)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prefill", type=int, default=8192, help="prefill tokens (0: skip)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--eager-reps", type=int, default=3)
    parser.add_argument("--disable", default="", help="v4compile passes to switch off, comma-separated")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default: Flash's 256)")
    parser.add_argument("--prepare-s", type=float, default=420.0, help="compile time allowed per variant")
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows = measure(args, [v for v in args.variants.split(",") if v])
    print(f"\n{'phase':<14} {'variant':<38} {'ms':>10} {'compile s':>10} {'vs best compile':>16}")
    timed_rows = [r for r in rows if "ms" in r]
    for phase in dict.fromkeys(r["phase"] for r in timed_rows):
        group = [r for r in timed_rows if r["phase"] == phase]
        best = min((r["ms"] for r in group if r["variant"].startswith("torch.compile")), default=float("nan"))
        for r in group:
            compile_s = "" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
            print(f"{phase:<14} {r['variant']:<38} {r['ms']:>10.3f} {compile_s:>10} {best / r['ms']:>15.2f}x")
    for r in rows:
        if "error" in r:
            print(f"{r['phase']}, {r['variant']}: {r['error']}")
    save_rows(args, rows)


if __name__ == "__main__":
    main()
