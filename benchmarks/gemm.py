"""GEMM table: every FP8 projection (N, K) of the V4-Flash slice at the decode and prefill row counts, ours
(``v4compile::fp8_linear``, activation quantisation included; its FP8 tensor-core dot and, as "bf16 dot", its
exact variant) against its floor, ``torch._scaled_mm`` and the
path the compiled model took before the FP8 pass (Inductor: dequantize the weight, fp32 GEMM).

"ours" writes bf16, as the compiled model's ``Linear.forward`` does (at prefill rows with K of 2048+ that is our
activation quantisation and torch's block-scaled cuBLAS GEMM, where torch has it; ``torch._scaled_mm`` is then that
GEMM alone). Floor: the larger of the bytes the call must
move (weight codes + scales, activations in, bf16 out) over the measured copy rate and its FLOPs over the
measured FP8 tensor-core rate. Every time is a CUDA-graph replay (a decode row: per call inside a 20-call graph);
"ours" cycles through copies of the weight filling 160 MB, so its weight reads come from HBM, not from L2.
Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/gemm.py [--rows 1,16,64,8192] [--ours-only] [--out results.json]
    PYTHONPATH=/tmp/site:. python3 benchmarks/gemm.py --rows 8192 --ours-only --backend tilelang
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass

import torch
from headline import slice_config
from kernels import bench, ceilings, graphed, in_graph_us

import v4compile
from v4compile.codegen import ops
from v4compile.codegen.registry import REGISTRY
from v4compile.codegen.triton.fp8_linear import blockwise_scaled_mm, fp8_linear, launch_config
from v4compile.model import quant
from v4compile.model.linear import Linear


@dataclass
class Row:
    layer: str
    m: int
    n: int
    k: int
    ours_us: float
    exact_us: float | None
    floor_us: float
    scaled_mm_us: float | None
    inductor_us: float | None
    config: str
    rel_err: float

    @property
    def pct_of_floor(self) -> float:
        return 100.0 * self.floor_us / self.ours_us


def fp8_shapes(experts: int) -> dict[tuple[int, int], list[str]]:
    """(N, K) of every FP8 linear of the 4-layer slice -> the layer names that have it."""
    model = v4compile.DeepSeekV4(slice_config(4, 1024, False, experts), seed=None, device="meta")
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.fmt == "fp8":
            short = ".".join(p for p in name.split(".")[2:] if not p.isdigit())
            names = shapes.setdefault((module.out_features, module.in_features), [])
            if short not in names:
                names.append(short)
    return shapes


def fp8_rate() -> float:
    """Measured FP8 tensor-core FLOP/s: ``torch._scaled_mm`` at 8192^3 with per-tensor scales."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return 2 * n**3 / (bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), False) * 1e-6)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> tuple[str, object] | None:
    """A ``torch._scaled_mm`` call for the layer: the model's block scales (1x128 activation, 128x128 weight)
    where this torch supports them, else per-row scales (not the model's numerics: a speed reference); None if
    neither runs."""
    m, k = x.shape
    codes = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    wt = weight.t()
    sa = torch.ones(m, k // 128, device="cuda")
    sw = scale.float()
    blockwise = blockwise_scaled_mm()
    if blockwise is not None and m % 16 == 0:
        return "blockwise", lambda: blockwise(codes, sa.t().contiguous().t(), weight, scale, torch.bfloat16)
    attempts = [("blockwise", lambda: torch._scaled_mm(codes, wt, sa.t().contiguous().t(), sw.t().contiguous(),
                                                      out_dtype=torch.bfloat16)),
                ("blockwise", lambda: torch._scaled_mm(codes, wt, sa.t().contiguous().t(), sw,
                                                      out_dtype=torch.bfloat16)),
                ("rowwise", lambda: torch._scaled_mm(codes, wt, torch.ones(m, 1, device="cuda"),
                                                    torch.ones(1, weight.shape[0], device="cuda"),
                                                    out_dtype=torch.bfloat16))]
    for kind, call in attempts:
        try:
            call()
            return kind, call
        except (RuntimeError, ValueError):
            continue
    return None


def row(layer: str, m: int, n: int, k: int, ceil: dict[str, float], ours_only: bool = False,
        backend: str = "triton") -> tuple[Row, str]:
    """One (M, N, K): checked against the model's simulation, then timed (``ours_only``: our kernel alone;
    ``backend``: whose ``fp8_linear`` body is ours)."""
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    weight, scale = quant.quantize_fp8_weight(torch.randn(n, k, generator=gen, device="cuda") / k**0.5)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 3).bfloat16()
    model = Linear(k, n, "fp8", True).cuda()
    with torch.no_grad():
        model.weight.copy_(weight)
        model.scale.copy_(scale)
        want = model.unrounded(x)
        got = ops.fp8_linear(x, weight, scale, True, torch.float32, backend)
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        if not err < 5e-4:
            raise AssertionError(f"fp8_linear {m}x{n}x{k}: relative error {err:.2e}")
        timer = (lambda f: in_graph_us(f, False)) if m <= 64 else (lambda f: bench(graphed(f), False))
        copies = itertools.cycle([(weight.clone(), scale.clone()) for _ in range(-(-(160 << 20) // (n * k)))])
        ours = timer(lambda: ops.fp8_linear(x, *next(copies), True, torch.bfloat16, backend))
        if ours_only:
            exact = inductor = theirs = found = None
        else:
            exact_config = launch_config(m, n, k, True) | {"FP8_DOT": 0}
            exact = timer(lambda: fp8_linear(x, weight, scale, True, config=exact_config))
            compiled = torch.compile(model.unrounded, dynamic=False)
            compiled(x)
            inductor = timer(lambda: compiled(x))
            found = scaled_mm(x, weight, scale)
            theirs = timer(found[1]) if found else None
    moved = n * k + scale.numel() + m * k * 2 + m * n * 2
    floor = 1e6 * max(moved / ceil["copy_bytes_per_s"], 2 * m * n * k / ceil["fp8_flop_per_s"])
    launch = REGISTRY.records[f"fp8_linear.{backend}"].launch if backend == "tilelang" and m > 64 else \
        launch_config(m, n, k, True)
    config = ",".join(f"{a}={b}" for a, b in launch.items() if a not in ("rows", "n", "k"))
    timed = Row(layer, m, n, k, round(ours, 1), None if exact is None else round(exact, 1), round(floor, 1),
                None if theirs is None else round(theirs, 1), None if inductor is None else round(inductor, 1),
                config, err)
    return timed, found[0] if found else "none"


def main() -> None:
    """Measures every shape and prints the table last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,8192")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ours-only", action="store_true", help="time our kernel alone (no other columns)")
    parser.add_argument("--backend", choices=("triton", "tilelang"), default="triton",
                        help="whose fp8_linear body is ours (tilelang: its FP8 GEMM above 64 rows)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    ceil = ceilings(quick=False) | {"fp8_flop_per_s": fp8_rate()}
    rows, kinds = [], set()
    for (n, k), names in fp8_shapes(args.experts).items():
        for m in (int(r) for r in args.rows.split(",")):
            r, kind = row("/".join(names), m, n, k, ceil, args.ours_only, args.backend)
            rows.append(r)
            kinds.add(kind)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceilings": ceil, "scaled_mm": sorted(kinds),
                       "rows": [asdict(r) | {"pct_of_floor": r.pct_of_floor} for r in rows]}, f, indent=1)
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, FP8 {ceil['fp8_flop_per_s'] / 1e12:.0f} TFLOP/s; "
          f"torch._scaled_mm scaling used: {sorted(kinds)}")
    print(f"{'layer':<28} {'M':>5} {'N':>6} {'K':>5} {'ours us':>9} {'bf16 dot':>9} {'floor us':>9} {'% floor':>8} "
          f"{'scaled_mm':>10} {'inductor':>9}  config")
    def cell(us: float | None, width: int) -> str:
        return f"{us:>{width}.1f}" if us is not None else f"{'-':>{width}}"

    for r in rows:
        print(f"{r.layer[:28]:<28} {r.m:>5} {r.n:>6} {r.k:>5} {r.ours_us:>9.1f} {cell(r.exact_us, 9)} "
              f"{r.floor_us:>9.1f} {r.pct_of_floor:>7.0f}% {cell(r.scaled_mm_us, 10)} {cell(r.inductor_us, 9)}  "
              f"{r.config}")


if __name__ == "__main__":
    main()
