"""The weight-streaming kernels' issue cost, without a GPU: each kernel's main loop in SASS for sm_90 (lowered on this
machine with Triton's compiler and the ``ptxas`` it bundles, with the launch's tile and alignment), as instructions
per weight against what the byte rate allows.

A decode GEMM reads each weight once, so it keeps up with the copy rate only if its SMs issue the loop's instructions
for a weight in the time the weight's bytes take to arrive: 132 SMs x 4 schedulers x 32 lanes x ~1.75 GHz = about
29.6 thread-instructions per ns, against 2 weights a byte (FP4) or 1 (FP8) at the copy rate. Below that budget a
kernel can be bandwidth-bound; above it, it is issue-bound at about budget / count of the byte rate (less in
practice: stalls). The proxy leaves out latency, occupancy and cache effects; GPU timings (``moe.py``, ``gemm.py``)
are what count. The MoE rows hold for every decode batch up to about 340 tokens (8 pairs an expert or fewer share
the one-token tile; up to 16, the same tile with 16 columns); prefill tiles reuse each weight for many rows, so this
budget does not apply to them.

    python benchmarks/sass_mix.py [--out results-sass-mix.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass

from v4compile.codegen.tilelang.common import sm90_sass as tilelang_sass
from v4compile.codegen.triton import fp8_linear, moe
from v4compile.codegen.triton.hopper import main_loop, mma_loop, sm90_ptx, sm90_sass, unpredicated

ISSUE_RATE = 132 * 4 * 32 * 1.75e9
"""Thread-instructions per second an H100 or H200 issues at most (SMs x schedulers x lanes x clock)."""
COPY_RATES = {"H100": 3.0e12, "H200": 4.25e12}
"""Measured device-to-device copy rates, bytes per second (RESULTS.md, Machines)."""
PREFILL_TOKENS = (2048, 8192)
"""Prefill batches whose MoE tiles are listed too: the widened 64-row tier and the 256-row ``tl.dot_scaled`` tier
(no byte budget: each weight serves many rows; what matters there is whether widening overlaps the MMA, which the
``wgmma drains`` column shows: waits for every in-flight ``wgmma`` inside the loop)."""
DIVISIBLE_INTS = ("N", "K", "k_part", "s_a", "s_o", "s_op", "s_w", "s_s", "s_we", "s_se", "M", "s_x", "s_c",
                  "s_ws", "s_part")


@dataclass
class Case:
    """One kernel at one launch configuration: what it streams an iteration of its main loop."""

    name: str
    source: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    weights: int
    """Weights the whole program reads per iteration."""
    weights_per_byte: int
    streams_weights: bool = True
    """Each weight read once (decode): the byte rate sets an issue budget. Prefill tiles reuse each weight for many
    rows, so no budget applies to them."""
    cuda_source: str | None = None
    """A TileLang kernel's generated CUDA (assembled with nvcc; its MMA loop is the consumer warp groups' loop, run
    by ``num_warps`` warps) instead of a Triton source."""


def _moe_case(tokens: int, gated: bool) -> Case:
    """``moe_gemm`` for FP4 experts at V4-Flash's shape (256 experts, top-6, dim 4096, inter 2048)."""
    from v4compile.codegen.triton.moe_kernels import SOURCE

    config = moe.launch_config(6 * tokens, 256, tokens, 4096, 2048, True, "fp4")
    bn = config["BN1"] if gated else config["BN2"]
    constexprs = {"GATED": gated, "CLAMP": True, "PARTIAL": False, "BM": config["BM"], "BN": bn, "BK": config["BK"],
                  "E_BLOCK": 256, "TL_DOT": True, "SWAP": config["swap"], "WIDEN": bool(config["widen"])}
    form = ", swapped" if config["swap"] else ", widened" if config["widen"] else ""
    return Case(f"moe_gemm {'w1+w3' if gated else 'w2'}, {tokens} tokens (BM {config['BM']}, BN {bn}{form})",
                SOURCE.format(fmt="fp4", dot="bfloat16"), "moe_gemm",
                moe.GEMM_SIGNATURE | dict.fromkeys(constexprs, "constexpr"), constexprs,
                config["num_warps"], (2 if gated else 1) * bn * config["BK"], 2, tokens not in PREFILL_TOKENS)


def _tilelang_moe_case(tokens: int, gated: bool) -> Case:
    """TileLang's FP4 expert GEMM at V4-Flash's shape: its consumer loop (two warp groups) per 128-wide K block."""
    from v4compile.codegen.tilelang import moe as tilelang_moe

    config = tilelang_moe.launch_config(6 * tokens, 256, True)
    n, k, rows, stages = (2048, 4096, config["BM1"], config["S1"]) if gated else (4096, 2048, config["BM2"],
                                                                                   config["S2"])
    return Case(f"TileLang moe_gemm {'w1+w3' if gated else 'w2'}, {tokens} tokens (BM {rows}, BN {config['BN']}, "
                "widened into wgmma's registers)", "", "moe_gemm", {}, {}, 8, (2 if gated else 1) * config["BN"] * 128,
                2, False, tilelang_moe.hopper_source(n, k, rows, gated, stages, config))


def _tilelang_fp8_case(rows: int) -> Case:
    """TileLang's FP8 GEMM at prefill rows: its consumer loop (two warp groups) per 128-wide K block."""
    from v4compile.codegen.tilelang import fp8_linear as tilelang_fp8
    from v4compile.codegen.tilelang.common import hopper_cuda

    config = tilelang_fp8.launch_config(rows, True)
    return Case(f"TileLang fp8_gemm, {rows} rows (BM {config['bm']}, BN {config['bn']}, FP8 wgmma, per-block "
                "promotion)", "", "fp8_gemm", {}, {}, 8, config["bn"] * 128, 1, False,
                hopper_cuda(tilelang_fp8.source(config, True)))


def _fp8_case(rows: int, n: int, k: int) -> Case:
    """``fp8_gemm`` of the FP8 linear at its decode configuration."""
    config = fp8_linear.launch_config(rows, n, k, True)
    quant = bool(config["QUANT"])
    constexprs = {"POW2": True, "FP8_DOT": True, "TL_DOT": True, "QUANT": quant, "HW_CAST": True, "BM": config["BM"],
                  "BN": config["BN"], "GROUP": 1, "SPLIT": config["SPLIT"], "OUT_BF16": True}
    return Case(f"fp8_gemm, {rows} rows, N {n}, K {k} (BN {config['BN']}, split {config['SPLIT']})",
                fp8_linear._SOURCE.format(dot="bfloat16"), "fp8_gemm",
                fp8_linear.GEMM_SIGNATURE | dict.fromkeys(constexprs, "constexpr"), constexprs,
                config["num_warps"], config["BN"] * 128, 1)


def measure(case: Case) -> dict[str, object]:
    """The case's main loop: instructions a thread issues per iteration, per weight, and the budgets."""
    if case.cuda_source is not None:
        loop = mma_loop(tilelang_sass(case.cuda_source))
    else:
        divisible = [n for n, t in case.signature.items() if t.startswith("*") or n in DIVISIBLE_INTS]
        loop = main_loop(sm90_sass(sm90_ptx(case.source, case.kernel, case.signature, case.constexprs, divisible,
                                            case.num_warps)))
    threads = 32 * case.num_warps
    budget = ({card: round(ISSUE_RATE / (rate * case.weights_per_byte), 2) for card, rate in COPY_RATES.items()}
              if case.streams_weights else None)
    waits = sum(1 for t in loop.text if re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", unpredicated(t)))
    barriers = sum(1 for t in loop.text if unpredicated(t).startswith("BAR.SYNC"))
    return {"case": case.name, "loop_instructions": loop.instructions,
            "per_weight": round(loop.per(case.weights, threads), 2), "budget": budget,
            "opcodes": dict(loop.opcodes.most_common(8)), "wgmma_drains": waits, "block_barriers": barriers}


def main() -> None:
    """Lowers every case and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    cases = [_moe_case(1, True), _moe_case(1, False), _fp8_case(1, 4096, 8192), _fp8_case(16, 32768, 1024),
             *(_moe_case(tokens, gated) for tokens in PREFILL_TOKENS for gated in (True, False)),
             *((*(_tilelang_moe_case(tokens, gated) for tokens in PREFILL_TOKENS for gated in (True, False)),
                _tilelang_fp8_case(8192)) if shutil.which("nvcc") else ())]
    rows = [measure(c) for c in cases]
    print("| kernel, launch | SASS a loop iteration (per thread) | per weight | budget H100 / H200 "
          "| wgmma drains a loop | block barriers a loop | top opcodes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:5])
        budget = f"{r['budget']['H100']} / {r['budget']['H200']}" if r["budget"] else "-"
        print(f"| {r['case']} | {r['loop_instructions']} | {r['per_weight']} | {budget} | {r['wgmma_drains']} "
              f"| {r['block_barriers']} | {top} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
