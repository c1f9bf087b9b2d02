"""MoE benchmark at V4-Flash dims: one layer's routed experts (256 FP4 experts, top-6, dim 4096, inter 2048).

Per token count one row: ours (``v4compile::moe_experts``, CUDA-graph replay), the model's dense expert loop
in eager PyTorch (every expert on every token, what the ``moe_dispatch`` pass replaces), the same loop with
each expert under torch.compile (one graph, dynamic in the token count, shared by all 256 experts: compiling
the whole 256-expert loop as one graph takes minutes), and the floor: for decode the bytes of the FP4 weights
and scales of the experts the batch touches over the measured copy bandwidth, for prefill the expert flops
at the measured bf16 matmul rate. The dense loop at 8192 tokens is timed with one repetition.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/moe.py [--tokens 1 16 64 8192] [--out results.json]

Weights follow the model's init scheme (normal with std 1/sqrt(in), then ``quant.quantize_fp4_weight``) but are
drawn on the GPU: ``model.init.random_tensors`` draws on the CPU, which takes minutes for 768 matrices.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from kernels import bench, ceilings, graphed  # benchmarks/kernels.py: timing helpers and measured ceilings
from torch.func import functional_call

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import REGISTRY
from v4compile.model import V4Config, quant
from v4compile.model.linear import Linear
from v4compile.model.moe import Expert, MoE


def flash_moe(config: V4Config, seed: int = 0) -> MoE:
    """One V4-Flash MoE layer on the GPU, filled with the model's init scheme (drawn on the GPU)."""
    with torch.device("cuda"):
        layer = MoE(config, hashed=False)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, Linear):
                w = torch.randn(module.out_features, module.in_features, device="cuda", generator=gen)
                w /= module.in_features**0.5
                q, s = (quant.quantize_fp4_weight if module.fmt == "fp4" else quant.quantize_fp8_weight)(w)
                module.weight.copy_(q)
                module.scale.copy_(s)
        layer.gate.weight.copy_(torch.randn(layer.gate.weight.shape, device="cuda", generator=gen) / config.dim**0.5)
    return layer.eval()


def timed_once(fn: Callable[[], object]) -> float:
    """Microseconds of one call (after one warm-up call), for the slow dense loop at prefill size."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start)


def row(layer: MoE, config: V4Config, tokens: int, ceil: dict[str, float], compiled_expert: Callable) -> dict:
    """Times ours, the eager dense loop, the per-expert compiled loop and the floor at ``tokens`` tokens."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, config.dim, device="cuda", generator=gen).bfloat16()
    input_ids = torch.zeros(1, tokens, dtype=torch.long, device="cuda")
    with torch.no_grad():
        weights, ids = layer.route(x.view(1, tokens, -1), input_ids)
    combine = torch.zeros(tokens, config.n_routed_experts, device="cuda").scatter(1, ids, weights)
    names = ("w1", "w3", "w2")
    lists = [[getattr(e, w).weight for e in layer.experts] for w in names]
    scales = [[getattr(e, w).scale for e in layer.experts] for w in names]
    args = (x, combine, ids, 0, *lists, *scales, "fp4", config.pow2_scales, config.swiglu_limit)

    def ours() -> torch.Tensor:
        return ops.moe_experts(*args, "triton")

    def eager() -> torch.Tensor:
        return reference.moe_experts(*args)

    # the scales as their uint8 bytes (which the model's e8m0 decoding accepts): Inductor has no e8m0 dtype
    scale_bytes = [[s.view(torch.uint8) for s in group] for group in scales]

    def compiled() -> torch.Tensor:
        y = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
        for i in range(len(lists[0])):
            params = [t[i] for t in (*lists, *scale_bytes)]
            y = y + compiled_expert(x, combine[:, i : i + 1], *params).float()
        return y

    prefill = tokens >= 1024
    with torch.no_grad():
        got, want = ours(), eager()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err <= 2e-2:
            raise AssertionError(f"{tokens} tokens: worst difference {err:.2e} of max|y| exceeds 2e-2")
        records = [r for n, r in REGISTRY.records.items() if n.startswith("moe_experts.")]
        if any(r.error for r in records):
            raise AssertionError(f"the MoE kernel fell back: {[r.error for r in records]}")
        ours_us = bench(graphed(ours), quick=True)
        host_us = bench(ours, quick=True)
        slow = timed_once if prefill else (lambda fn: bench(fn, quick=True))
        eager_us = slow(eager)
        compiled_us = slow(compiled)
    touched = int(ids.unique().numel())
    matrix = config.moe_inter_dim * config.dim
    weight_bytes = touched * 3 * (matrix // 2 + matrix // quant.FP4_BLOCK)
    flops = 6 * ids.numel() * matrix
    floor_us = 1e6 * (flops / ceil["bf16_flop_per_s"] if prefill else weight_bytes / ceil["copy_bytes_per_s"])
    launch = REGISTRY.records["moe_experts.fp4.triton"].launch
    note = (f"{touched} experts touched, {weight_bytes / 2**20:.0f} MiB of weights, {flops / 1e12:.2f} TFLOP; "
            f"BM={launch['BM']} BN={launch['BN1']}/{launch['BN2']} warps={launch['num_warps']}; host call "
            f"{host_us:.0f} us; max diff {err:.1e} of max|y|" + ("; dense loops: one repetition" if prefill else ""))
    return {"tokens": tokens, "ours_us": ours_us, "eager_us": eager_us, "compiled_us": compiled_us,
            "floor_us": floor_us, "floor": "bf16 flops" if prefill else "weight bytes", "note": note}


def main() -> None:
    """Builds the layer, measures the ceilings, prints one row per token count as it is measured."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 8192])
    parser.add_argument("--out", help="write the rows and ceilings as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe.py needs a CUDA GPU")
    config = V4Config.preset("flash")
    layer = flash_moe(config)
    ceil = ceilings(quick=True)
    with torch.device("meta"):
        template = Expert(config.dim, config.moe_inter_dim, "fp4", config.pow2_scales, config.swiglu_limit)

    def expert(x: torch.Tensor, column: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        """The model's expert on one set of weights (w1, w3, w2 weights, then their scales)."""
        keys = [f"{w}.{p}" for p in ("weight", "scale") for w in ("w1", "w3", "w2")]
        return functional_call(template, dict(zip(keys, params, strict=True)), (x, column))

    compiled_expert = torch.compile(expert, dynamic=True)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; copy "
          f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")
    print("| tokens | ours us | eager us | torch.compile us | floor us | % of floor | note |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for tokens in args.tokens:
        r = row(layer, config, tokens, ceil, compiled_expert)
        rows.append(r)
        print(f"| {tokens} | {r['ours_us']:.1f} | {r['eager_us']:.0f} | {r['compiled_us']:.0f} | {r['floor_us']:.1f} "
              f"({r['floor']}) | {100 * r['floor_us'] / r['ours_us']:.0f}% | {r['note']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
