"""HiSparse benchmark: one device memory budget for KV caches, long-context decode with HiSparse off and on.
Reports the concurrent requests each admits, decode tokens/s at those batches, per-step latency at equal batch,
the hot buffer's hit rate and bytes moved per step, and on GPU the lookup time hidden on the side stream.

    python benchmarks/hisparse.py --device cpu                  # tiny preset, 8K context, eager steps
    PYTHONPATH=. python3 benchmarks/hisparse.py --device cuda   # V4-Flash dims, 4 layers, 128K, CUDA graphs

The GPU model is a V4-Flash-dim slice (dim 4096, 64 heads x 512, indexer 64 x 128 with top-k 512, window 128)
with four layers C4, C128, C4, C128 (the pattern of 41 of Flash's 43 layers), 8 routed experts instead of 256
and bf16 weights (neither touches the KV path), random weights drawn on the device. The caches are filled
with seeded random state at the context length instead of prefilling it (the admission arithmetic is the
engine's, ``plan_rows``); the same rows hold the same data with HiSparse off and on, so the runs at equal
batch must give identical logits, which is checked step by step (inside CUDA graphs on GPU). Every step
feeds back the greedy token and advances the position (inside the graph), so the indexer chooses anew
each step. Three decode paths at equal batch: "off" is the model's reference path (attention reads the
whole entry store concatenated after the window), "resident gather" reads fully resident entries the way
HiSparse reads its hot buffer (only the chosen ones), which isolates HiSparse's own cost, and "on".
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import v4compile
from v4compile.model.cache import LayerCache, V4Cache
from v4compile.model.linear import Linear
from v4compile.runtime.cache_manager import plan_rows
from v4compile.runtime.hisparse import (
    HiSparse,
    HiSparseCache,
    copy_rows,
    device_row_bytes,
    min_hot_entries,
    slot_bytes,
)


class GatherLayerCache(LayerCache):
    """Resident C4 entries read like HiSparse reads its hot buffer: only the chosen ones, gathered."""

    def sparse_entries(self, chosen: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen entries gathered [B, S*K, d] and their indices 0..S*K-1 (-1 kept)."""
        bsz, steps, k = chosen.shape
        entries = self.compressor.read(bsz)
        index = chosen.clamp(min=0).view(bsz, -1, 1).expand(-1, -1, entries.shape[-1])
        ids = torch.arange(steps * k, device=chosen.device).view(1, steps, k)
        return entries.gather(1, index), torch.where(chosen >= 0, ids, -1)


def slice_config(device: str, context: int) -> v4compile.V4Config:
    """The tiny preset on CPU; on GPU a V4-Flash-dim slice (see the module docstring)."""
    length = context + 256
    if device == "cpu":
        return v4compile.V4Config.preset("tiny", max_seq_len=length)
    return v4compile.V4Config.preset("flash", n_layers=4, compress_ratios=[4, 128, 4, 128, 0], n_routed_experts=8,
                                     dtype="bf16", scale_fmt=None, scale_dtype="fp32", expert_dtype=None,
                                     max_seq_len=length)


@torch.no_grad()
def random_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights drawn on the model's device with the scales of ``model/init.py`` (bf16/fp32
    formats only): the CPU draw of that module takes minutes at Flash dims."""
    gen = torch.Generator(model.embed.weight.device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.normal_(0, module.in_features**-0.5, generator=gen)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed.weight"):
            p.normal_(0, 1, generator=gen)
        elif leaf.endswith("_fn"):
            p.normal_(0, 0.1 / math.sqrt(p.shape[-1]), generator=gen)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "bias"):
            p.zero_()
        elif leaf.endswith("_scale"):
            p.fill_(1)
        elif leaf == "ape":
            p.normal_(0, 0.1, generator=gen)
        elif name.endswith("ffn.gate.weight"):
            p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            draw = torch.rand(b.shape[0], model.config.n_routed_experts, generator=gen, device=b.device)
            b.copy_(draw.argsort(-1)[:, : b.shape[1]])


@torch.no_grad()
def fill_rows(model: v4compile.DeepSeekV4, caches: list[V4Cache], rows: int) -> None:
    """Seeded random state for rows 0..rows-1 of each cache (a cache shorter than ``rows`` gets its rows):
    row r gets the same data everywhere, through the engine's ``copy_row`` from a one-row staging cache."""
    device = model.embed.weight.device
    staging = model.new_cache(1, caches[0].max_seq_len)
    for row in range(rows):
        gen = torch.Generator(device).manual_seed(1000 + row)
        for layer in staging.all_layers:
            layer.window.normal_(generator=gen)
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    for t in (c.pool, c.kv_state, c.score_state):
                        t.normal_(generator=gen)
        for cache in caches:
            if row < cache.batch_size:
                cache.copy_row(row, staging, 0)


class Runner:
    """Decode steps of ``rows`` rows on ``cache`` with static inputs: greedy feedback and the position
    advance happen inside the step, so a CUDA graph of it replays consecutive steps."""

    def __init__(self, model: v4compile.DeepSeekV4, cache: V4Cache, rows: int, start: int) -> None:
        device = model.embed.weight.device
        self.model, self.cache = model, cache.rows(0, rows)
        self.ids = torch.full((rows, 1), 7, dtype=torch.long, device=device)
        self.positions = start + torch.arange(rows, device=device) % 4
        self.logits = torch.empty(0)
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self) -> None:
        """One decode step (the model's layers and head; the eager input checks sync, so they are skipped)."""
        self.logits = self.model.logits(self.model._run_layers(self.ids, self.cache, None, positions=self.positions))
        self.ids.copy_(self.logits[:, -1].argmax(-1, keepdim=True))
        self.positions.add_(1)

    def capture(self) -> None:
        """Records one step as a CUDA graph (after eager warm-up steps)."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def __call__(self) -> None:
        """One step: a graph replay when captured, else eager."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()


def timed(run: Callable[[], None], steps: int, cuda: bool) -> float:
    """Seconds per call over ``steps`` calls."""
    if cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(steps):
        run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / steps


@dataclass
class Setup:
    """Both caches at one budget: ``off`` (fully resident, ``rows_off`` rows) and ``on`` (HiSparse)."""

    model: v4compile.DeepSeekV4
    off: V4Cache
    on: HiSparseCache
    hisparse: HiSparse
    report: dict


def build(device: str, context: int, budget_rows: int, hot_share: float) -> Setup:
    """The model, the budget (``budget_rows`` full decode rows plus one prefill row), what each setup admits by
    the engine's arithmetic, and both caches filled alike."""
    config = slice_config(device, context)
    if device == "cuda":
        model = v4compile.DeepSeekV4(config, seed=None, device="cuda").eval()
        random_weights(model, 0)
    else:
        model = v4compile.DeepSeekV4(config, seed=0).eval()
    length = config.max_seq_len
    full_row, hot_row = V4Cache(config, 1, length, "meta").nbytes(), device_row_bytes(config, length)
    budget = (budget_rows + 1) * full_row
    hot_bytes = int(budget * hot_share)
    rows_off = plan_rows(budget, full_row, full_row, 1, 1 << 20)[1]
    rows_on = plan_rows(budget - hot_bytes, full_row, hot_row, 1, 1 << 20)[1]
    hisparse = HiSparse(config, rows_on, length, hot_bytes // slot_bytes(config), device)
    off, on = model.new_cache(rows_off, length), HiSparseCache(config, hisparse, device)
    fill_rows(model, [off, on], rows_on)
    report = {"config": {"device": device, "context": context, "layers": config.layer_ratios, "dim": config.dim,
                         "head_dim": config.head_dim, "index_topk": config.index_topk},
              "budget_bytes": budget, "full_row_bytes": full_row, "hisparse_row_bytes": hot_row,
              "hot_bytes": hot_bytes, "hot_entries": hisparse.hot_entries, "host_tier_bytes": hisparse.host_bytes,
              "rows_off": rows_off, "rows_on": rows_on,
              "min_hot_entries": min_hot_entries(rows_on, config.index_topk)}
    return Setup(model, off, on, hisparse, report)


def measure(s: Setup, check_steps: int, steps: int, cuda: bool) -> None:
    """Equal logits off/on at equal batch (warm-up and, on GPU, graph replays), then step times of every path;
    fills ``s.report``."""
    model, rows_off, rows_on = s.model, s.report["rows_off"], s.report["rows_on"]
    start = s.report["config"]["context"] - 64
    gather = copy.copy(s.off)
    gather.layers = [GatherLayerCache(layer.window, layer.compressor, layer.indexer) if layer.indexer is not None
                     else layer for layer in s.off.layers]
    runners = {"off": Runner(model, s.off, rows_off, start), "on_equal": Runner(model, s.on, rows_off, start)}
    equal = 0
    for step in range(2 + check_steps):  # eager warm-up (compiles Triton's kernel), then graph replays
        if step == 2 and cuda:
            for runner in runners.values():
                runner.capture()
        for runner in runners.values():
            runner()
        equal += torch.equal(runners["off"].logits, runners["on_equal"].logits)
    runners["gather_equal"] = Runner(model, gather, rows_off, start)
    runners["on"] = Runner(model, s.on, rows_on, start)
    for runner in (runners["gather_equal"], runners["on"]):
        for _ in range(2):
            runner()
        if cuda:
            runner.capture()
    times = {}
    for name, runner in runners.items():
        s.hisparse.reset_stats()
        times[name] = timed(runner, steps, cuda)
    s.report.update(step_s=times, tokens_per_s={"off": rows_off / times["off"], "on": rows_on / times["on"]},
                    hisparse=s.hisparse.stats(), graphs=cuda, equal_steps=f"{equal}/{2 + check_steps}")
    s.hisparse.timing = cuda
    s.hisparse.reset_stats()
    eager = Runner(model, s.on, rows_on, start)
    for _ in range(4):
        eager()
    s.report["timing_split"] = s.hisparse.stats()
    if cuda:
        s.report["fetch_gb_per_s"] = fetch_bandwidth(s.hisparse)


def fetch_bandwidth(hisparse: HiSparse, rows: int = 16384, repeats: int = 10) -> float:
    """GB/s of the row-copy kernel pulling ``rows`` random host-tier entries into the hot buffer (run last: it
    overwrites hot slots behind the slot map's back)."""
    n = min(rows, hisparse.hot_entries)
    device = hisparse.hot.device
    dst = torch.arange(n, device=device)
    src = torch.randint(0, hisparse.trash_key, (n,), device=device)
    copy_rows(hisparse.hot, dst, hisparse.host_view, src)
    seconds = timed(lambda: copy_rows(hisparse.hot, dst, hisparse.host_view, src), repeats, True)
    return n * hisparse.width * 2 / seconds / 1e9


@torch.no_grad()
def main() -> None:
    """Builds both setups at one budget, checks, measures, prints the table (and writes the JSON report)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=None, help="tokens per request (default 8K CPU, 128K GPU)")
    parser.add_argument("--budget-rows", type=int, default=8, help="the budget holds this many full decode rows "
                        "plus one prefill row")
    parser.add_argument("--hot-share", type=float, default=0.1, help="share of the budget for the hot buffer")
    parser.add_argument("--check-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    setup = build(args.device, args.context or (131072 if cuda else 8192), args.budget_rows, args.hot_share)
    measure(setup, args.check_steps, args.steps, cuda)
    print_table(setup.report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(setup.report, f, indent=1)


def print_table(r: dict) -> None:
    """The markdown table of a report."""
    step, tps, hs = r["step_s"], r["tokens_per_s"], r["hisparse"]
    mib = 2**20
    print(f"{r['config']}; budget {r['budget_bytes'] / mib:.1f} MiB (full row {r['full_row_bytes'] / mib:.2f} MiB, "
          f"HiSparse row {r['hisparse_row_bytes'] / mib:.2f} MiB, hot buffer {r['hot_bytes'] / mib:.1f} MiB = "
          f"{r['hot_entries']} entries, lower bound {r['min_hot_entries']}); host tier "
          f"{r['host_tier_bytes'] / mib:.0f} MiB; CUDA graphs: {r['graphs']}; steps with logits equal off/on at equal "
          f"batch: {r['equal_steps']}")
    print("| HiSparse | requests admitted | decode tokens/s | step ms | hit rate | bytes moved per step |")
    print("|---|---|---|---|---|---|")
    print(f"| off | {r['rows_off']} | {tps['off']:.1f} | {step['off'] * 1e3:.2f} | - | - |")
    print(f"| on | {r['rows_on']} | {tps['on']:.1f} | {step['on'] * 1e3:.2f} | {hs['hit_rate']:.3f} | "
          f"{hs['bytes_per_step'] / mib:.2f} MiB |")
    print(f"ratios on/off: requests {r['rows_on'] / r['rows_off']:.2f}x, tokens/s {tps['on'] / tps['off']:.2f}x")
    print(f"equal batch {r['rows_off']}: off {step['off'] * 1e3:.2f} ms, resident gather "
          f"{step['gather_equal'] * 1e3:.2f} ms, on {step['on_equal'] * 1e3:.2f} ms: on vs off "
          f"{step['on_equal'] / step['off'] - 1:+.1%}, on vs resident gather "
          f"{step['on_equal'] / step['gather_equal'] - 1:+.1%}")
    split = r["timing_split"]
    if "exposed_ms" in split:
        steps = max(split["steps"], 1)
        print(f"eager lookup time per step at batch {r['rows_on']}: main stream {split['exposed_ms'] / steps:.3f} ms "
              f"(exposed, includes eager launch gaps), side stream backups {split['hidden_ms'] / steps:.3f} ms "
              f"(hidden); eager hit rate {split['hit_rate']:.3f}; zero-copy view {split['zero_copy_view']}; row-copy "
              f"kernel host->device {r['fetch_gb_per_s']:.1f} GB/s")
    else:
        counts = {k: split[k] for k in ("lookups", "hits", "fetched", "backed_up", "steps")}
        print(f"eager counts at batch {r['rows_on']} (CPU: no timing split): {counts}")


if __name__ == "__main__":
    main()
