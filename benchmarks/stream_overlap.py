"""Stream overlap benchmark: the decode step with and without the stream schedule, under CUDA graphs.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/stream_overlap.py [--models tiny flash4] [--batches 1 4 16 64]
        [--inductor] [--min-branch-us 10] [--out results.json]

For each model and batch the decode step is captured once (Dynamo, then every v4compile pass, the stream
schedule last). Three callables are built from that one rewritten graph and each is captured in a CUDA graph:

- ``one stream``: the whole graph (run as captured, or compiled as one by Inductor with ``--inductor``);
- ``scheduled``: the schedule's regions on the target's streams, forked and joined with events;
- ``regions, one stream``: the same regions on one stream (what splitting costs without the overlap).

Without ``--inductor`` every region runs its ATen ops as the captured graph does, so all three launch the
same kernels; their logits, from a plain call and from a CUDA-graph replay, are checked bitwise equal. The time
is the median CUDA-graph replay (device time of one decode step). Models: ``tiny`` (the tiny preset, 256
cached tokens) and ``flash4`` (V4-Flash dimensions, 4 layers: two window-only, one C4, one C128; FP8
weights, FP4 experts; 8 routed experts instead of 256, since the reference MoE runs every expert on every
token; 4096 cached tokens of random KV).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from kernels import capture_graph  # benchmarks/kernels.py: the CUDA-graph capture the kernel table uses
from torch import fx

import v4compile
from v4compile.backend import inductor_compile, to_aten
from v4compile.model import quant
from v4compile.optimize import resolve_backend
from v4compile.passes import build_passes
from v4compile.passes.manager import PassManager
from v4compile.stream_runner import StreamRunner, as_is, executable_segments

MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "tiny": (dict(name="tiny"), 256),
    "flash4": (dict(name="flash", n_layers=4, n_routed_experts=8, max_seq_len=8192), 4096),
}


def model_and_cache(name: str, batch: int, device: str = "cuda") -> tuple[v4compile.DeepSeekV4, v4compile.V4Cache, int]:
    """The model and a cache of ``batch`` rows whose first ``context`` positions hold random KV."""
    overrides, context = MODELS[name]
    overrides = dict(overrides)
    config = v4compile.V4Config.preset(overrides.pop("name"), **overrides)
    model = v4compile.DeepSeekV4(config, seed=None, device=device).eval()
    gen = torch.Generator(device=device).manual_seed(1)
    fill_random_(model, gen)
    cache = model.new_cache(batch)
    for t in cache.tensors():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, device=device, generator=gen) * 0.5)
    return model, cache, context


@torch.no_grad()
def fill_random_(model: v4compile.DeepSeekV4, gen: torch.Generator) -> None:
    """Random weights of sensible scale drawn on the model's device (the model's own seeded init draws on
    the CPU, minutes at V4-Flash dimensions): FP8 weights N(0, 0.5) with block scales 2^-6, packed FP4
    bytes uniform, norms 1, biases and sinks 0, other matrices N(0, 1/fan_in)."""
    device = model.embed.weight.device

    def randn(t: torch.Tensor, std: float) -> torch.Tensor:
        return torch.randn(t.shape, device=device, generator=gen) * std

    buffers = dict(model.named_buffers())
    for name, t in [*model.named_parameters(), *buffers.items()]:
        leaf = name.rsplit(".", 1)[-1]
        if t.dtype == torch.float8_e8m0fnu:
            t.copy_(quant.float_to_e8m0(torch.full(t.shape, 2.0**-6, device=device)))
        elif t.dtype == torch.float8_e4m3fn:
            t.copy_(randn(t, 0.5))
        elif t.dtype == torch.int8:
            t.copy_(torch.randint(-128, 128, t.shape, device=device, generator=gen))
        elif leaf == "tid2eid":
            t.copy_(torch.randint(0, model.config.n_routed_experts, t.shape, device=device, generator=gen))
        elif not t.is_floating_point() or name in buffers:
            continue
        elif leaf.endswith(("_base", "bias", "attn_sink")):
            t.zero_()
        elif t.dim() == 1:
            t.fill_(1.0)
        elif leaf.endswith("_fn"):
            t.copy_(randn(t, 0.1 / t.shape[-1] ** 0.5))
        else:
            t.copy_(randn(t, 0.1 if leaf == "ape" else t.shape[-1] ** -0.5))




def capture(model: v4compile.DeepSeekV4, cache: v4compile.V4Cache, batch: int, context: int,
            min_branch_us: float, backend: str = "auto") -> tuple[fx.GraphModule, list[Any], list[Any]]:
    """The decode step's graph after every pass (annotated by the schedule), its fake and its real inputs."""
    got: dict[str, Any] = {}
    manager = PassManager(build_passes(options={"stream_schedule": {"min_branch_us": min_branch_us}}),
                          backend=resolve_backend(backend))

    def record_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        rewritten, _ = manager.run(to_aten(gm, example_inputs))
        got.update(gm=rewritten, fakes=list(example_inputs))

        def record(*args: Any) -> Any:
            got.setdefault("args", list(args))
            return rewritten(*args)

        return record

    torch._dynamo.reset()
    device = model.embed.weight.device
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    positions = torch.full((batch,), context, device=device)
    with torch.no_grad():
        torch.compile(model.decode_step, backend=record_backend, dynamic=False)(ids, positions, cache)
    return got["gm"], got["fakes"], got["args"]


def bench_us(replay: Callable[[], None]) -> float:
    """Median microseconds of one replay (CUDA events via triton.testing.do_bench)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(replay, warmup=50, rep=300, return_mode="median")


def row(name: str, batch: int, inductor: bool, min_branch_us: float) -> dict[str, Any]:
    """One table row: the three variants' replay times, and whether their logits, from a plain call and from a
    CUDA-graph replay, are bitwise equal (to the whole graph's, and scheduled to regions on one stream)."""
    model, cache, context = model_and_cache(name, batch)
    gm, fakes, args = capture(model, cache, batch, context, min_branch_us)
    found = executable_segments(gm)
    if found is None:
        raise RuntimeError(f"{name} b{batch}: the schedule put nothing on a side stream")
    _, segs = found
    region = inductor_compile if inductor else as_is
    with torch.no_grad():
        streamed = StreamRunner(gm, segs, fakes, region)
        whole = inductor_compile(gm, fakes) if inductor else gm

    def one_stream(*inputs: Any) -> Any:
        streamed.overlap = False
        try:
            return streamed(*inputs)
        finally:
            streamed.overlap = True

    variants = {"one stream": whole, "scheduled": streamed, "regions, one stream": one_stream}
    outputs, replayed, times = {}, {}, {}
    with torch.no_grad():
        for key, fn in variants.items():
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            outputs[key] = fn(*fresh)[0]
        for key, fn in variants.items():
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            replay, out = capture_graph(lambda fn=fn, fresh=fresh: fn(*fresh))
            replay()
            torch.cuda.synchronize()
            replayed[key] = out[0].clone()
            times[key] = bench_us(replay)
    reference = outputs["one stream"]
    bitwise = all(torch.equal(reference, t) for t in [*outputs.values(), *replayed.values()])
    regions_equal = torch.equal(outputs["scheduled"], outputs["regions, one stream"]) and torch.equal(
        replayed["scheduled"], replayed["regions, one stream"])
    del model, cache, args, variants
    torch.cuda.empty_cache()
    return {"model": name, "batch": batch, "inductor": inductor, "regions": len(segs),
            "streams": len({s.stream for s in segs}), "one_stream_us": times["one stream"],
            "scheduled_us": times["scheduled"], "regions_one_stream_us": times["regions, one stream"],
            "gain_pct": 100.0 * (times["one stream"] - times["scheduled"]) / times["one stream"],
            "bitwise_vs_regions": regions_equal, "bitwise_vs_whole": bitwise}


def main() -> None:
    """Runs the rows, printing each as it finishes, then the table (and JSON with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "flash4"], choices=sorted(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--inductor", action="store_true", help="compile the graph and the regions with Inductor")
    parser.add_argument("--min-branch-us", type=float, default=10.0)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for name in args.models:
        for batch in args.batches:
            rows.append(row(name, batch, args.inductor, args.min_branch_us))
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    mode = "Inductor" if args.inductor else "captured ATen ops"
    print(f"\ndecode step, CUDA-graph replay, {mode}, min_branch_us={args.min_branch_us:g}")
    print("| model | batch | regions | one stream (us) | scheduled (us) | gain | regions, one stream (us) | "
          "bitwise |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        same = "yes" if r["bitwise_vs_whole"] else "vs regions only" if r["bitwise_vs_regions"] else "NO"
        print(f"| {r['model']} | {r['batch']} | {r['regions']} | {r['one_stream_us']:.1f} | {r['scheduled_us']:.1f} "
              f"| {r['gain_pct']:+.1f}% | {r['regions_one_stream_us']:.1f} | {same} |")


if __name__ == "__main__":
    main()
