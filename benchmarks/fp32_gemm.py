"""fp32 GEMM table: every fp32 product (N, K) of the V4-Flash slice (output head, compressor wkv / wgate, the
router's widened bf16 weight, the mHC head mix) at the decode and prefill row counts: ours
(``v4compile::fp32_linear``, three TF32 products) against its floor and cuBLAS's fp32 ``F.linear`` (what the compiled
model ran before the pass), with both errors from an fp64 product.

Floor: the larger of the bytes the call must move (weight as stored, fp32 activations in and out) over the measured
copy rate and its three TF32 products' FLOPs over the measured TF32 tensor-core rate. Every time is a CUDA-graph
replay (decode rows: per call inside a 20-call graph); the weight cycles through copies filling 256 MB, so its reads
come from HBM, not L2. ``--sweep`` also times other launch configurations and prints the fastest. Run on the GPU
machine from the repository root::

    PYTHONPATH=.:benchmarks python3 benchmarks/fp32_gemm.py [--rows 1,16,64,8192] [--sweep] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from headline import slice_config
from kernels import bench, ceilings, graphed, in_graph_us

import v4compile
from v4compile.codegen.triton.fp32_linear import fp32_linear, launch_config


def fp32_shapes(experts: int) -> dict[tuple[int, int, torch.dtype], list[str]]:
    """(N, K, weight dtype) of every fp32 product's weight in the 4-layer slice -> the parameter names."""
    model = v4compile.DeepSeekV4(slice_config(4, 1024, False, experts), seed=None, device="meta")
    shapes: dict[tuple[int, int, torch.dtype], list[str]] = {}
    for name, p in model.named_parameters():
        fp32 = p.dtype == torch.float32 and name.endswith(("weight", "head_fn"))
        if p.dim() == 2 and (fp32 or name.endswith("gate.weight")) and "hc_attn" not in name and "hc_ffn" not in name:
            short = ".".join(s for s in name.split(".") if not s.isdigit())
            names = shapes.setdefault((p.shape[0], p.shape[1], p.dtype), [])
            if short not in names:
                names.append(short)
    return shapes


def tf32_rate(quick: bool) -> float:
    """Measured TF32 tensor-core FLOP/s (cuBLAS at 8192^3 with TF32 allowed)."""
    a, b = torch.randn(8192, 8192, device="cuda"), torch.randn(8192, 8192, device="cuda")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        us = bench(lambda: a @ b, quick)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * 8192**3 / (us * 1e-6)


def _configs(m: int, n: int, k: int) -> list[dict[str, int]]:
    base = launch_config(m, n, k, True)
    if m > 64:
        tiles = [(128, 64, 32, 4, 4), (128, 128, 32, 8, 3), (128, 128, 32, 4, 4), (64, 128, 32, 4, 4),
                 (128, 256, 32, 8, 3)]
        return [base | {"BM": bm, "BN": bn, "BK": bk, "num_warps": w, "num_stages": s} for bm, bn, bk, w, s in tiles]
    out = []
    for bn, bk, split, warps in itertools.product((64, 128), (32, 64), (1, 2, 4, 8, 16), (4,)):
        if k // bk < 4 * split:
            continue
        out.append(base | {"BN": bn, "BK": bk, "SPLIT": split, "num_warps": warps})
    return out


def row(names: list[str], m: int, n: int, k: int, w_dtype: torch.dtype, ceil: dict[str, float], sweep: bool) -> dict:
    """One (M, N, K): errors against fp64, then ours, cuBLAS and the floor timed."""
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(w_dtype)
    x = torch.randn(m, k, generator=gen, device="cuda")
    want = x.double() @ weight.double().T
    scale = want.abs().max().item()
    ours_out = fp32_linear(x, weight)
    cublas_out = F.linear(x, weight.float())
    timer = (lambda f: in_graph_us(f, False)) if m <= 64 else (lambda f: bench(graphed(f), False))
    copies = itertools.cycle([weight.clone() for _ in range(max(1, -(-(256 << 20) // weight.nbytes)))])
    ours = timer(lambda: fp32_linear(x, next(copies)))
    cublas = timer(lambda: F.linear(x, next(copies).float()))
    moved = weight.nbytes + x.nbytes + m * n * 4
    floor = 1e6 * max(moved / ceil["copy_bytes_per_s"], 3 * 2 * m * n * k / ceil["tf32_flop_per_s"])
    result = {"layers": ", ".join(names), "m": m, "n": n, "k": k, "weight_dtype": str(w_dtype).removeprefix("torch."),
              "ours_us": round(ours, 1), "cublas_us": round(cublas, 1), "floor_us": round(floor, 1),
              "ours_err": (ours_out.double() - want).abs().max().item() / scale,
              "cublas_err": (cublas_out.double() - want).abs().max().item() / scale,
              "config": launch_config(m, n, k, True)}
    if sweep:
        timed = []
        for config in _configs(m, n, k):
            try:
                timed.append((timer(lambda c=config: fp32_linear(x, next(copies), config=c)), config))
            except Exception as error:  # noqa: BLE001 - a configuration that does not compile is skipped
                print(f"skip {config}: {type(error).__name__}")
        best = min(timed, key=lambda t: t[0])
        result.update(best_us=round(best[0], 1), best_config=best[1])
    return result


def main() -> None:
    """Prints the table (and writes it as JSON with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,8192")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceil = ceilings(False) | {"tf32_flop_per_s": tf32_rate(False)}
    rows = [row(names, m, n, k, dt, ceil, args.sweep) for (n, k, dt), names in fp32_shapes(args.experts).items()
            for m in (int(r) for r in args.rows.split(","))]
    print("| weights | M | N | K | ours us | cuBLAS fp32 us | floor us | % of floor | ours err | cuBLAS err |"
          + (" best us | best config |" if args.sweep else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.sweep else ""))
    for r in rows:
        line = (f"| {r['layers']} ({r['weight_dtype']}) | {r['m']} | {r['n']} | {r['k']} | {r['ours_us']} | "
                f"{r['cublas_us']} | {r['floor_us']} | {100 * r['floor_us'] / r['ours_us']:.0f}% | "
                f"{r['ours_err']:.1e} | {r['cublas_err']:.1e} |")
        if args.sweep:
            line += f" {r['best_us']} | {r['best_config']} |"
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
