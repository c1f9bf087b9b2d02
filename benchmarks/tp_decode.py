"""Tensor-parallel decode benchmark: tp=N logits against tp=1 on the same weights, and the decode step time.

Run from the repository root with one process per GPU (NCCL), or on CPU with gloo:

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/tp_decode.py --models tiny --batch 1,16
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/tp_decode.py --models flash-slice --batch 1,16
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/tp_decode.py --device cpu --models tiny --batch 2

Every rank builds the single-process model with random weights (seed 0) and takes its shard with
``model.shard(rank, N)``: the tensors a seeded ``DeepSeekV4(config, seed=0, tp_rank=rank, tp_size=N)`` holds.
It prefills ``--context`` random tokens into both models' caches (eager, in chunks), checks the tp=N logits
against tp=1 on the prefill and on ``--check-steps`` decode steps of the optimized tp=N model (golden tolerance:
cosine median >= 0.99, mean >= 0.97, argmax agreement >= 0.80; the max abs diff is reported), then times
``--steps`` decode steps of ``v4compile.optimize(model, tp=N)`` and of the optimized tp=1 model, launched from
the host and (on CUDA) replayed from a CUDA graph with the collectives captured in it. Each (model,
batch) compiles two decode graphs (tp=1 and tp=N). Without compilation (the default on CPU, where a compile
takes minutes) the eager models are timed instead.

``flash-slice`` has V4-Flash dimensions (dim 4096, 64 x 512 heads, 8 output groups, 64 indexer heads, FP8 weights,
FP4 experts, vocabulary 129280), its first ``--layers`` layers (SWA, SWA, C4, C128, ...) and ``--experts`` routed
experts: the reference MoE runs every expert on every token, so all 256 would time that dense dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from headline import timed  # benchmarks/headline.py: median CUDA-event time of a callable
from kernels import graphed  # benchmarks/kernels.py: the CUDA-graph capture the kernel table uses

import v4compile

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off: on a shared GPU host it can take the GPUs out of service."""


def init_distributed(device_kind: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process, with the default process group initialised (NCCL on CUDA,
    gloo on CPU); without torchrun it is a group of one."""
    for var, value in NO_MULTICAST.items():
        os.environ.setdefault(var, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, device


def model_config(name: str, args: argparse.Namespace) -> v4compile.V4Config:
    """The benchmarked configuration, with caches sized for the context, the checked and the timed steps (in
    whole 128-token blocks: a C128 cache holds max_seq_len // 128 entries)."""
    max_len = -(-(args.context + args.check_steps + args.warmup + args.steps + 1) // 128) * 128
    if name == "tiny":
        return v4compile.V4Config.preset("tiny", max_seq_len=max_len)
    if name == "flash-slice":
        return v4compile.V4Config.preset("flash", n_layers=args.layers, n_mtp_layers=0, n_hash_layers=1,
                                         n_routed_experts=args.experts, max_seq_len=max_len)
    raise ValueError(f"unknown model {name!r}; choose tiny or flash-slice")


def agreement(ours: torch.Tensor, single: torch.Tensor) -> dict[str, float]:
    """Per logit row cosine similarity (median, mean, min), argmax agreement and the max abs difference."""
    ours, single = ours.float().flatten(0, -2), single.float().flatten(0, -2)
    cos = F.cosine_similarity(ours, single, dim=-1)
    return {"median_cos": cos.median().item(), "mean_cos": cos.mean().item(), "min_cos": cos.min().item(),
            "argmax_agreement": (ours.argmax(-1) == single.argmax(-1)).float().mean().item(),
            "max_abs_diff": (ours - single).abs().max().item()}


def within_tolerance(stats: dict[str, float]) -> bool:
    """The golden README's band."""
    return stats["median_cos"] >= 0.99 and stats["mean_cos"] >= 0.97 and stats["argmax_agreement"] >= 0.80


def step_ms(step: Callable[[int], object], first: int, count: int, device: torch.device) -> float:
    """Mean wall time in ms of ``step(position)`` over ``count`` consecutive positions from ``first``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in range(count):
        step(first + i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / count * 1e3


def bench(name: str, batch: int, args: argparse.Namespace, rank: int, world: int,
          device: torch.device) -> dict[str, object]:
    """One row: the tp=N vs tp=1 check and the decode step times for ``name`` at ``batch``."""
    config = model_config(name, args)
    single = v4compile.DeepSeekV4(config, seed=0, device=device).eval()
    shard = single.shard(rank, world).eval()
    steps_total = args.check_steps + args.warmup + args.steps
    gen = torch.Generator().manual_seed(1)  # the same ids on every rank
    ids = torch.randint(0, config.vocab_size, (batch, args.context + steps_total), generator=gen).to(device)
    caches = single.new_cache(batch), shard.new_cache(batch)
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    fast_single = v4compile.optimize(single, backend=args.backend) if compiled else single
    fast_shard = v4compile.optimize(shard, backend=args.backend, tp=world) if compiled else shard

    def decode(model: object, cache: v4compile.V4Cache) -> Callable[[int], torch.Tensor]:
        return lambda pos: model.decode_step(ids[:, pos : pos + 1], torch.full((batch,), pos, device=device), cache)

    def prefill(model: v4compile.DeepSeekV4, cache: v4compile.V4Cache) -> torch.Tensor:
        """Chunked prefill of the context (bounded memory at V4-Flash dims); the logits of each chunk's last
        8 positions."""
        chunk = args.prefill_chunk
        kept = [model(ids[:, :chunk], cache=cache)[:, -8:]]
        for start in range(chunk, args.context, chunk):
            kept.append(model.extend(ids[:, start : min(start + chunk, args.context)], start, cache)[:, -8:])
        return torch.cat(kept, dim=1)

    with torch.no_grad():
        prefilled = agreement(prefill(shard, caches[1]), prefill(single, caches[0]))
        positions = range(args.context, args.context + args.check_steps)
        ours = torch.cat([decode(fast_shard, caches[1])(p) for p in positions], dim=1)
        want = torch.cat([decode(single, caches[0])(p) for p in positions], dim=1)
        checked = agreement(ours, want)
        first = args.context + args.check_steps
        step_ms(decode(fast_single, caches[0]), first, args.warmup, device)
        step_ms(decode(fast_shard, caches[1]), first, args.warmup, device)
        first += args.warmup
        single_ms = step_ms(decode(fast_single, caches[0]), first, args.steps, device)
        shard_ms = step_ms(decode(fast_shard, caches[1]), first, args.steps, device)
        graphs = graph_step_ms({"tp1": decode(fast_single, caches[0]), "tpN": decode(fast_shard, caches[1])},
                               first + args.steps, args.steps) if device.type == "cuda" else {}
    return {"model": name, "batch": batch, "context": args.context, "tp": world, "compiled": compiled,
            "tp1_step_ms": single_ms, "tpN_step_ms": shard_ms, **graphs, "prefill_check": prefilled,
            "decode_check": checked, "ok": within_tolerance(prefilled) and within_tolerance(checked)}


def graph_step_ms(steps: dict[str, Callable[[int], object]], position: int, count: int) -> dict[str, object]:
    """Median ms of each step at ``position`` replayed from a CUDA graph (collectives captured with it), as the
    engine runs decode; a capture that fails is reported as the row's error instead of ending the run."""
    out: dict[str, object] = {}
    for name, step in steps.items():
        try:
            out[f"{name}_graph_ms"] = timed(graphed(lambda step=step: step(position)), count, cuda=True)
        except Exception as exc:  # the host-launched figures stand; say why the graph has none
            out[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> None:
    """Runs every (model, batch) row and prints the table on rank 0; exits 1 when a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="tiny,flash-slice", help="comma-separated: tiny, flash-slice")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=1024, help="prefilled tokens before decoding")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="prefill chunk (eager, extend)")
    parser.add_argument("--check-steps", type=int, default=8, help="decode steps compared with tp=1")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps (compilation happens here)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--layers", type=int, default=4, help="flash-slice: layers")
    parser.add_argument("--experts", type=int, default=16, help="flash-slice: routed experts")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="time v4compile.optimize models (default: on CUDA yes, on CPU no)")
    parser.add_argument("--backend", default="auto",
                        help="kernel backend of the optimized models (on CPU use 'reference': Triton is interpreted)")
    parser.add_argument("--out", help="rank 0 writes the rows as JSON here")
    args = parser.parse_args()
    rank, world, device = init_distributed(args.device)
    rows = []
    try:
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                row = bench(name, batch, args, rank, world, device)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        what = "optimized" if rows and rows[0]["compiled"] else "eager"
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
        print(f"\n{what} decode step, {world} x {where}")
        print(f"| model | batch | context | tp=1 ms/step | tp={world} ms/step | tp=1 graph ms | tp={world} graph ms "
              f"| tp={world} vs tp=1 decode logits (median cos, mean cos, argmax agree, max abs diff) | ok |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            c = r["decode_check"]
            graph = [f"{r[k]:.2f}" if k in r else "-" for k in ("tp1_graph_ms", "tpN_graph_ms")]
            print(f"| {r['model']} | {r['batch']} | {r['context']} | {r['tp1_step_ms']:.2f} | {r['tpN_step_ms']:.2f} "
                  f"| {graph[0]} | {graph[1]} | {c['median_cos']:.4f}, {c['mean_cos']:.4f}, "
                  f"{c['argmax_agreement']:.2f}, {c['max_abs_diff']:.3g} | {'yes' if r['ok'] else 'NO'} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=1)
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
