"""MoE benchmark at V4-Flash dims: one layer's routed experts (256 FP4 experts, top-6, dim 4096, inter 2048).

Per token count one row: ours (``v4compile::moe_experts``, CUDA-graph replay), the model's routed experts in
eager PyTorch (pairs sorted by expert, grouped bf16 matmuls over all 256 experts' dequantized weights: what the
``moe_dispatch`` pass replaces), the same module under torch.compile (one graph whatever the expert count,
dynamic in the token count), and the floor: for decode the bytes of the FP4 weights and scales of the experts
the batch touches over the measured copy bandwidth, for prefill the expert flops at the measured bf16 matmul
rate.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/moe.py [--tokens 1 16 64 8192] [--out results.json]
    PYTHONPATH=. python3 benchmarks/moe.py --tokens 1 16 64 --ours-only --tiles BN1=32,BN2=32 BN1=64,BN2=64
    PYTHONPATH=/tmp/site:. python3 benchmarks/moe.py --tokens 4096 8192 --ours-only --backend tilelang \
        --tiles BM1=128,BM2=128 BM1=128,BM2=256,S2=2   # TileLang unpacked to /tmp/site (shared/device/README.md)

``--tiles`` times ours once per launch-table override (each ``KEY=VALUE,...`` over ``moe.launch_config``'s entries),
the way a tile choice is swept; ``--ours-only`` leaves out the eager and compiled columns.

Weights follow the model's init scheme (normal with std 1/sqrt(in), then ``quant.quantize_fp4_weight``) but are
drawn on the GPU: ``model.init.random_tensors`` draws on the CPU, which takes minutes for 768 matrices.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from kernels import bench, ceilings, graphed  # benchmarks/kernels.py: timing helpers and measured ceilings

from v4compile.codegen import ops
from v4compile.codegen.registry import REGISTRY, KernelBuildError
from v4compile.codegen.triton import moe
from v4compile.model import V4Config, quant
from v4compile.model.linear import GroupedLinear, Linear
from v4compile.model.moe import MoE


def flash_moe(config: V4Config, seed: int = 0) -> MoE:
    """One V4-Flash MoE layer on the GPU, filled with the model's init scheme (drawn on the GPU)."""
    with torch.device("cuda"):
        layer = MoE(config, hashed=False)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, (Linear, GroupedLinear)):
                for e in range(module.n) if isinstance(module, GroupedLinear) else (None,):
                    w = torch.randn(module.out_features, module.in_features, device="cuda", generator=gen)
                    w /= module.in_features**0.5
                    q, s = (quant.quantize_fp4_weight if module.fmt == "fp4" else quant.quantize_fp8_weight)(w)
                    (module.weight if e is None else module.weight[e]).copy_(q)
                    (module.scale if e is None else module.scale[e]).copy_(s)
        layer.gate.weight.copy_(torch.randn(layer.gate.weight.shape, device="cuda", generator=gen) / config.dim**0.5)
    return layer.eval()


def tilelang_moe() -> object:
    """``codegen.tilelang.moe`` (imported only when asked: TileLang is optional)."""
    from v4compile.codegen.tilelang import moe as body

    return body


def parse_tile(spec: str) -> dict[str, int]:
    """``BN1=64,num_warps=2`` -> {"BN1": 64, "num_warps": 2}; a clear error naming a malformed entry."""
    tile = {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if not eq or not value.strip().isdigit():
            raise SystemExit(f"--tiles: {item!r} in {spec!r} is not KEY=INTEGER")
        tile[key.strip()] = int(value)
    return tile


def row(layer: MoE, config: V4Config, tokens: int, ceil: dict[str, float], compiled_experts: Callable | None,
        tile: dict[str, int] | None = None, backend: str = "triton", kernels: bool = False) -> dict:
    """Times ours (``backend``'s body, with ``tile`` over its launch table), the model's eager experts and the same
    compiled (unless ``compiled_experts`` is None) and the floor at ``tokens`` tokens; ``kernels``: also each of
    ours' kernels' device time (torch.profiler)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, config.dim, device="cuda", generator=gen).bfloat16()
    input_ids = torch.zeros(1, tokens, dtype=torch.long, device="cuda")
    with torch.no_grad():
        weights, ids = layer.route(x.view(1, tokens, -1), input_ids)
    routed = layer.experts
    projections = (routed.w1, routed.w3, routed.w2)
    args = (x, weights, ids, 0, *(w.weight for w in projections), *(w.scale for w in projections), "fp4",
            config.pow2_scales, config.swiglu_limit)

    tilelang = backend == "tilelang"
    body = tilelang_moe() if tilelang else moe
    launch_table = (body.launch_config(ids.numel(), config.n_routed_experts, True) if tilelang else
                    moe.launch_config(ids.numel(), config.n_routed_experts, tokens, config.dim, config.moe_inter_dim,
                                      True, "fp4")) or {}
    unknown = set(tile or {}) - set(launch_table)
    if unknown:
        raise SystemExit(f"--tiles: {sorted(unknown)} are not launch-table entries ({sorted(launch_table)})")

    def ours() -> torch.Tensor:
        if tile:
            return body.moe_experts(*args, config={**launch_table, **tile})
        return ops.moe_experts(*args, backend)

    def eager() -> torch.Tensor:
        return routed(x, weights, ids)

    def compiled() -> torch.Tensor:
        return compiled_experts(x, weights, ids)

    prefill = tokens >= 1024
    with torch.no_grad():
        got, want = ours(), eager()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err <= 2e-2:
            raise AssertionError(f"{tokens} tokens: worst difference {err:.2e} of max|y| exceeds 2e-2")
        records = [r for n, r in REGISTRY.records.items() if n.startswith("moe_experts.")]
        name = "moe_experts.fp4.tilelang" if tilelang and launch_table else "moe_experts.fp4.triton"
        if any(r.error for r in records):
            raise AssertionError(f"the MoE kernel fell back: {[r.error for r in records]}")
        ours_us = bench(graphed(ours), quick=True)
        host_us = bench(ours, quick=True)
        eager_us = bench(eager, quick=True) if compiled_experts is not None else None
        compiled_us = bench(compiled, quick=True) if compiled_experts is not None else None
    touched = int(ids.unique().numel())
    matrix = config.moe_inter_dim * config.dim
    weight_bytes = touched * 3 * (matrix // 2 + matrix // quant.FP4_BLOCK)
    flops = 6 * ids.numel() * matrix
    floor_us = 1e6 * (flops / ceil["bf16_flop_per_s"] if prefill else weight_bytes / ceil["copy_bytes_per_s"])
    launch = REGISTRY.records[name].launch
    tiles = (f"TileLang BM={launch['BM1']}/{launch['BM2']} BN={launch['BN']}" if "BM1" in launch else
             f"BM={launch['BM']} BN={launch['BN1']}/{launch['BN2']} warps={launch['num_warps']}")
    note = (f"{touched} experts touched, {weight_bytes / 2**20:.0f} MiB of weights, {flops / 1e12:.2f} TFLOP; "
            f"{tiles}; host call {host_us:.0f} us; max diff {err:.1e} of max|y|")
    return {"tokens": tokens, "ours_us": ours_us, "eager_us": eager_us,
            "compiled_us": compiled_us, "floor_us": floor_us, "floor": "bf16 flops" if prefill else "weight bytes",
            "note": note, "kernels": kernel_times(ours) if kernels else None}


def kernel_times(fn: Callable[[], torch.Tensor], calls: int = 5) -> dict[str, float]:
    """Microseconds of device time a call of ``fn`` spends in each kernel (by name), longest first."""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total:
            times[e.key[:80]] = times.get(e.key[:80], 0.0) + e.device_time_total / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> None:
    """Builds the layer, measures the ceilings, prints one row per token count as it is measured."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 8192])
    parser.add_argument("--out", help="write the rows and ceilings as JSON here")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=[None],
                        help="launch-table overrides to time ours with, each KEY=VALUE,...")
    parser.add_argument("--ours-only", action="store_true", help="leave out the eager and compiled columns")
    parser.add_argument("--backend", choices=("triton", "tilelang"), default="triton",
                        help="whose moe_experts body is ours (tilelang: its FP4 GEMMs at prefill sizes)")
    parser.add_argument("--kernels", action="store_true", help="also print each of ours' kernels' device time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe.py needs a CUDA GPU")
    config = V4Config.preset("flash")
    layer = flash_moe(config)
    ceil = ceilings(quick=True)
    compiled_experts = None if args.ours_only else torch.compile(layer.experts, dynamic=True)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; copy "
          f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")
    print("| tokens | tile | ours us | eager us | torch.compile us | floor us | % of floor | note |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for tokens in args.tokens:
        for tile in args.tiles:
            try:
                r = row(layer, config, tokens, ceil, compiled_experts, tile, args.backend, args.kernels)
            except KernelBuildError as exc:  # a swept tile that does not fit (shared memory): say so, go on
                if tile is None:
                    raise
                print(f"| {tokens} | {tile} | - | - | - | - | - | not built: {str(exc)[-160:]} |", flush=True)
                continue
            r["tile"] = tile
            rows.append(r)
            eager = "-" if r["eager_us"] is None else f"{r['eager_us']:.0f}"
            compiled = "-" if r["compiled_us"] is None else f"{r['compiled_us']:.0f}"
            print(f"| {tokens} | {tile or 'default'} | {r['ours_us']:.1f} | {eager} | {compiled} | {r['floor_us']:.1f} "
                  f"({r['floor']}) | {100 * r['floor_us'] / r['ours_us']:.0f}% | {r['note']} |", flush=True)
            for name, us in (r["kernels"] or {}).items():
                print(f"|   | kernel | {us:.1f} | {name} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
