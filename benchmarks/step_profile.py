"""The optimized whole step against its floor, with a per-category profile.

One phase per process (``--phase "decode b16"`` or ``--phase "prefill 8192"``) on the slice of ``headline.py``:
compiles ``v4compile.optimize``, replays decode from a CUDA graph, profiles ``--reps`` steps with torch.profiler and
sorts the GPU kernel time into categories (dense GEMM, MoE, attention, compressor, top-k, mHC, indexer, other);
``ms`` is the sum of kernel times, ``wall_ms`` the step's elapsed time (streams overlap kernels), and ``--kernels
N`` lists the N longest kernels. The floor: decode reads every non-routed weight byte, the routed experts that
``batch`` tokens are expected to choose (``E * (1 - (1 - k/E)^batch)`` per layer) and the KV the step attends to,
over the copy rate; prefill is its matmul FLOPs over the FP8 tensor-core rate; both rates are measured on the card
at hand before the timing (``copy_tb_s``, ``fp8_tflop_s``), and ``x_floor`` is ``wall_ms`` over the floor. A prefill
computes the head at its last position only (``--logits last``, as the runtime samples; ``all`` for scoring).
``--turn`` / ``--turns`` / ``--of`` let several phases compile at once and profile one at a time: each profiles once
every phase has warmed up (so no compilation shares the GPU with a profile) and the phase before it has finished.
``--inductor KEY=VALUE ...`` sets Inductor options for the run (e.g. ``combo_kernels=True``, which launches
independent small kernels as one), recorded in the row::

    PYTHONPATH=$PWD python3 benchmarks/step_profile.py --phase "decode b1" --experts 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gemm import fp8_rate
from headline import build_slice, fill_cache
from kernels import ceilings, graphed

import v4compile
from v4compile.model.cache import PAGE_TOKENS, V4Cache
from v4compile.model.pages import EntryPages
from v4compile.runtime.cache_manager import pages_for

H200_COPY_RATE = 4.25e12  # bytes/s, device-to-device copy measured on the H200 (shared/device/README.md)
H200_FP8_RATE = 1256e12  # FLOP/s, FP8 torch._scaled_mm at 8192^3 measured there (benchmarks/gemm.py)
CATEGORIES = (("MoE", ("moe",)), ("attention", ("sparse_attention", "attention")), ("compressor", ("compressor",)),
              ("top-k", ("radix", "topk", "sort")), ("mHC", ("mhc",)), ("indexer", ("indexer",)),
              ("dense GEMM", ("gemm", "gemv", "matmul", "_mm", "cutlass", "xmma", "nvjet", "splitk", "fp8_quant",
                                "split_sum")))


def category(kernel: str) -> str:
    """The category of a GPU kernel by its name."""
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def _expert_bytes(model: v4compile.DeepSeekV4) -> tuple[int, int]:
    """(bytes of every routed expert of the model, bytes of the other weights a step reads: all but the
    embedding, of which a step reads only its tokens' rows)."""
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items() if not n.startswith("embed")}
    routed = sum(b for n, b in sizes.items() if ".experts." in n)
    return routed, sum(sizes.values()) - routed


def measured_rates(device: str) -> tuple[float, float]:
    """(device-to-device copy rate in bytes/s counting bytes read and written, FP8 ``torch._scaled_mm`` rate at
    8192^3 in FLOP/s) of this card (``kernels.ceilings``, ``gemm.fp8_rate``): the floors' denominators, measured
    where the step runs (the H200's figures elsewhere)."""
    if not device.startswith("cuda"):
        return H200_COPY_RATE, H200_FP8_RATE
    return ceilings(quick=True)["copy_bytes_per_s"], fp8_rate()


def decode_floor(model: v4compile.DeepSeekV4, batch: int, context: int, copy_rate: float) -> float:
    """Seconds: the bytes a decode step must read over the copy rate."""
    c = model.config
    routed, rest = _expert_bytes(model)
    chosen = c.n_routed_experts * (1 - (1 - c.n_activated_experts / c.n_routed_experts) ** batch)
    experts = routed * chosen / c.n_routed_experts
    kv = 0
    for ratio in c.layer_ratios:
        kv += c.window_size * c.head_dim * 2
        if ratio == 4:
            kv += min(c.index_topk, context // 4) * c.head_dim * 2 + context // 4 * c.index_head_dim * 2
        elif ratio == 128:
            kv += context // 128 * c.head_dim * 2
    return (rest + experts + batch * kv) / copy_rate


def prefill_floor(model: v4compile.DeepSeekV4, tokens: int, last: bool, fp8_rate: float) -> float:
    """Seconds: the prefill's matmul FLOPs (weights once per token, the output head once per token or, ``last``,
    once; routed experts k times, attention over the window and the selected entries) over the measured FP8
    tensor-core rate."""
    c = model.config
    routed, _ = _expert_bytes(model)
    params = sum(p.numel() * (2 if p.dtype == torch.int8 else 1) for n, p in model.state_dict().items()
                 if n.endswith("weight") and ".experts." not in n and "embed" not in n
                 and not (last and n == "head.weight"))
    expert_params = sum(p.numel() * (2 if p.dtype == torch.int8 else 1) for n, p in model.state_dict().items()
                        if ".experts." in n and n.endswith("weight"))
    flops = 2 * tokens * (params + expert_params * c.n_activated_experts / c.n_routed_experts)
    flops += 2 * model.head.weight.numel() if last else 0
    for ratio in c.layer_ratios:
        keys = c.window_size + (min(c.index_topk, tokens // 4) if ratio == 4 else tokens // 128 if ratio else 0)
        flops += 4 * tokens * keys * c.n_heads * c.head_dim
    return flops / fp8_rate


def paged_cache(model: torch.nn.Module, rows: int, tokens: int, seed: int) -> V4Cache:
    """A cache of ``rows`` rows of ``tokens`` tokens on shared entry pages, as the serving engine keeps them, each
    row's pages scattered over the pool in a random order."""
    per_row, device = pages_for(tokens), model.embed.weight.device
    cache = V4Cache(model.config, rows, per_row * PAGE_TOKENS, device, EntryPages(model.config, rows * per_row + 1,
                                                                                     device))
    order = torch.randperm(rows * per_row, generator=torch.Generator().manual_seed(seed)) + 1
    assert cache.table is not None
    cache.table.copy_(order.view(rows, per_row))
    return cache


def inductor_settings(items: list[str]) -> dict[str, object]:
    """``["combo_kernels=True", ...]`` -> {"combo_kernels": True}; a clear error naming an unknown setting or a
    malformed item."""
    import ast

    import torch._inductor.config

    settings: dict[str, object] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--inductor: {item!r} is not KEY=VALUE")
        if key not in torch._inductor.config._config:
            raise SystemExit(f"--inductor: {key!r} is not an Inductor setting (torch._inductor.config)")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


def main() -> None:
    """Profiles one phase and prints one JSON row."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", default="decode b1")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--logits", choices=("last", "all"), default="last",
                        help="prefill: the head on the last position (serving, as the runtime samples) or on all "
                             "(scoring)")
    parser.add_argument("--streams", action="store_true", help="turn the opt-in stream_schedule pass on")
    parser.add_argument("--backend", default="auto", help="optimize(backend=...): auto, triton, tilelang")
    parser.add_argument("--whole-graph", action="store_true",
                        help="compile each entry point as one graph instead of regions (optimize(regions=False))")
    parser.add_argument("--kernels", type=int, default=0, help="also list this many of the step's longest kernels")
    parser.add_argument("--pages", action="store_true",
                        help="decode on shared entry pages (the engine's layout), each row's pages scattered")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                        help="Inductor settings for this run, e.g. combo_kernels=True (torch._inductor.config)")
    parser.add_argument("--turn", type=int, default=0)
    parser.add_argument("--turns", default="", help="folder of turn files (empty: profile at once)")
    parser.add_argument("--of", type=int, default=1, help="how many phases share the turn folder")
    args = parser.parse_args()
    settings = inductor_settings(args.inductor)
    for key, value in settings.items():
        setattr(torch._inductor.config, key, value)
    decode = args.phase.startswith("decode")
    size = int(args.phase.split()[-1].removeprefix("b"))
    model = build_slice(args.layers, max(args.context, size) + 64, args.small, args.experts, args.device)
    optimized = v4compile.optimize(model, backend=args.backend,
                                   options={"stream_schedule": {}} if args.streams else None,
                                   regions=not args.whole_graph)
    with torch.no_grad():
        if decode:
            cache = (paged_cache(model, size, args.context + 64, size) if args.pages
                     else model.new_cache(size, args.context + 64))
            fill_cache(cache, size)
            ids = torch.randint(0, model.config.vocab_size, (size, 1), device=args.device)
            positions = torch.full((size,), args.context, device=args.device)
            optimized.decode_step(ids, positions, cache)
            step = graphed(lambda: optimized.decode_step(ids, positions, cache))
        else:
            ids = torch.randint(0, model.config.vocab_size, (1, size), device=args.device)
            cache = model.new_cache(1, size + 64)
            if args.logits == "all":
                step = lambda: optimized(ids, cache=cache)  # noqa: E731
            else:
                step = lambda: optimized.logits(optimized.hidden_states(ids, cache)[:, -1:])  # noqa: E731
            step()
        if args.turns:
            turns = Path(args.turns)
            (turns / f"ready{args.turn}").touch()
            while not ((args.turn == 0 or (turns / f"turn{args.turn}").exists())
                       and all((turns / f"ready{i}").exists() for i in range(args.of))):
                time.sleep(0.5)
        copy_rate, fp8_rate = measured_rates(args.device)
        floor = (decode_floor(model, size, args.context, copy_rate) if decode
                 else prefill_floor(model, size, args.logits == "last", fp8_rate))
        step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            step()
        end.record()
        torch.cuda.synchronize()
        wall_ms = start.elapsed_time(end) / args.reps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                step()
            torch.cuda.synchronize()
    per_category: dict[str, float] = {}
    per_kernel: list[tuple[float, int, str]] = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0))
        if us and event.key and not event.key.startswith(("ProfilerStep", "cudaGraph")):
            per_category[category(event.key)] = per_category.get(category(event.key), 0.0) + us / args.reps
            per_kernel.append((us / args.reps, event.count // args.reps, event.key))
    ms = sum(per_category.values()) / 1e3
    row = {"phase": args.phase + (" streams" if args.streams else ""), "backend": args.backend, "inductor": settings,
           "ms": round(ms, 3), "wall_ms": round(wall_ms, 3),
           "floor_ms": round(floor * 1e3, 3), "x_floor": round(wall_ms / (floor * 1e3), 2),
           "copy_tb_s": round(copy_rate / 1e12, 2), "fp8_tflop_s": round(fp8_rate / 1e12),
           "tokens_per_s": round(size / (wall_ms / 1e3), 1),
           "categories_ms": {k: round(v / 1e3, 3) for k, v in sorted(per_category.items(), key=lambda kv: -kv[1])}}
    if args.kernels:
        row["kernels"] = [{"us": round(us, 1), "calls": calls, "category": category(name), "name": name[:160]}
                          for us, calls, name in sorted(per_kernel, reverse=True)[:args.kernels]]
    print(json.dumps(row))
    if args.turns:
        (Path(args.turns) / f"turn{args.turn + 1}").touch()


if __name__ == "__main__":
    main()
