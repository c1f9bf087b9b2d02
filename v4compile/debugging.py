"""Pass debugging: run the optimized entry points on sample inputs, bisect rewrites with fuel, compare
against eager and golden vectors. The CLI is a thin layer over these functions."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from .backend import make_backend
from .golden import Agreement, GoldenFolder
from .model import DeepSeekV4, V4Config
from .optimize import OptimizedModel, model_device, optimize, resolve_backend
from .passes import build_passes
from .passes.base import Match
from .passes.manager import PassManager

ENTRIES = ("forward", "prefill", "decode")


def sample_ids(model: torch.nn.Module, batch: int = 2, length: int | None = None, seed: int = 0) -> torch.Tensor:
    """Random prompt ids long enough to fill every compressed-layer kind of a ``DeepSeekV4`` at least once; for
    another model (a transformers V4), ``length`` (default 160: past one C128 block) ids below its
    ``config.vocab_size``."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(f"cannot make sample ids for {type(model).__name__}: it has no config.vocab_size")
    if isinstance(config, V4Config):
        longest = max([r for r in config.layer_ratios if r] or [4])
        length = length or min(config.max_seq_len - 4, max(2 * config.window_size, longest + 8))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length or 160), generator=gen)


def run_entries(optimized: OptimizedModel, ids: torch.Tensor, entries: tuple[str, ...] = ENTRIES,
                decode_steps: int = 2) -> dict[str, torch.Tensor]:
    """Runs the chosen entry points once (compiling them); returns their logits."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if "forward" in entries:
            out["forward"] = optimized(ids)
        if "prefill" in entries or "decode" in entries:
            cache = optimized.new_cache(ids.shape[0])
            prefill = optimized if "prefill" in entries else optimized.model
            out["prefill"] = prefill(ids, cache=cache)
            if "decode" in entries:
                token, steps = out["prefill"][:, -1:].argmax(-1), []
                for i in range(decode_steps):
                    positions = torch.full((ids.shape[0],), ids.shape[1] + i, device=ids.device)
                    steps.append(optimized.decode_step(token, positions, cache))
                    token = steps[-1].argmax(-1)
                out["decode"] = torch.cat(steps, dim=1)
    return out


def explain(model: torch.nn.Module, *, backend: str = "reference", entries: tuple[str, ...] = ENTRIES,
            debug_dir: str | Path | None = None, passes: list[str] | None = None,
            disable: tuple[str, ...] = ()) -> OptimizedModel:
    """Compiles the entry points (without Inductor) as whole graphs so their reports list every layer's matches
    and near-misses. Any other model than a ``DeepSeekV4`` (a transformers V4, say) has its forward explained
    only: prefill and decode are v4compile's cache API."""
    optimized = optimize(model, backend=backend, passes=passes, disable=disable, debug_dir=debug_dir,
                         inductor=False, regions=False)
    if not isinstance(model, DeepSeekV4):
        entries = ("forward",)
    run_entries(optimized, sample_ids(model).to(next(model.parameters()).device), entries)
    return optimized


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each logit row."""
    got, want = got.flatten(0, -2).double(), want.flatten(0, -2).double()
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)


@dataclass
class BisectResult:
    """The first rewrite (1-based, in rewrite order) whose region is out of its pass's tolerance, with the logits'
    mean row error before and at it; ``logits_error`` is that error with every rewrite, ``worst_region`` the
    largest region error relative to its pass's tolerance (an in-tolerance pipeline's logits may still move,
    through the model's own amplification: a routing or top-k choice flipped by one rounding)."""

    total_rewrites: int
    culprit_index: int | None
    culprit: Match | None
    error_before: float
    error_at: float | None
    probes: list[tuple[int, float]]
    logits_error: float = 0.0
    worst_region: tuple[Match, float] | None = None


def bisect(model: DeepSeekV4, *, backend: str = "auto", tolerance: float = 1e-2, entry: str = "forward",
           passes: list[str] | None = None, progress: Callable[[int, float], None] | None = None) -> BisectResult:
    """Finds the first rewrite that breaks numerics in ``entry``'s graph. Every rewritten region runs in check
    mode beside the model code it replaced, on the same inputs, so a region out of its pass's tolerance is
    blamed whatever the rest of the graph does, and an in-tolerance pipeline never is, however far the random
    model amplifies its roundings. When no region is out of tolerance but the logits' mean per-row relative error
    exceeds ``tolerance`` (a rewrite check mode cannot see, such as a stream annotation), the first such rewrite
    is found by binary search over optimization fuel and returned with ``worst_region`` None."""
    if entry not in ("forward", "decode"):
        raise ValueError(f"bisect entry must be 'forward' or 'decode', got {entry!r}")
    device = model_device(model)
    kernel_backend = resolve_backend(backend, device)
    ids = sample_ids(model).to(device)
    captured: list[fx.GraphModule] = []
    inputs: list[list[Any]] = []
    recorder = PassManager([], backend=kernel_backend)
    inner = make_backend(recorder, inductor=False, captured=captured)

    def capture(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        inputs.append(list(example_inputs))
        return inner(gm, example_inputs)

    with torch.no_grad():
        if entry == "forward":
            fn = torch.compile(model, backend=capture, dynamic=False)
            reference, args = model(ids), (ids,)
            fn(*args)
        else:
            cache = model.new_cache(ids.shape[0])
            model(ids, cache=cache)
            token, positions = ids[:, -1:], torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
            snapshot = copy.deepcopy(cache)
            reference = model.decode_step(token, positions, copy.deepcopy(snapshot))
            fn = torch.compile(model.decode_step, backend=capture, dynamic=False)
            fn(token, positions, copy.deepcopy(snapshot))
    graph, example = captured[0], inputs[0]

    def error(fuel: int, check: bool = False) -> tuple[float, PassManager]:
        manager = PassManager(build_passes(passes), backend=kernel_backend, fuel=fuel, check=check)
        gm = fx.GraphModule(graph, copy.deepcopy(graph.graph))
        manager.run(gm)
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in example]
        with torch.no_grad():
            out = gm(*args)
        outs = out if isinstance(out, (tuple, list)) else [out]
        logits = next(o for o in outs if isinstance(o, torch.Tensor) and o.shape == reference.shape)
        value = row_errors(logits, reference).mean().item()
        if progress:
            progress(fuel, value)
        return value, manager

    full_error, full_manager = error(10**9, check=True)
    report = full_manager.reports[0]
    tolerances = {p.name: p.tolerance for p in report.passes}
    matches = report.matches
    total = len(matches)
    ratios = [(m.worst_rel_error or 0.0) / tolerances[m.pass_name] for m in matches]
    worst = max(range(total), key=ratios.__getitem__) if total else None
    worst_region = None if worst is None else (matches[worst], ratios[worst])
    probes = [(total, full_error)]
    bad = next((i for i, r in enumerate(ratios) if r > 1), None)
    if bad is not None:
        before, _ = error(bad)
        at, _ = error(bad + 1)
        probes += [(bad, before), (bad + 1, at)]
        return BisectResult(total, bad + 1, matches[bad], before, at, probes, full_error, worst_region)
    base_error, _ = error(0)
    probes.append((0, base_error))
    if full_error <= tolerance or all(m.checked_calls for m in matches):
        return BisectResult(total, None, None, base_error, full_error, probes, full_error, worst_region)
    lo, hi, hi_error = 0, total, full_error
    while hi - lo > 1:
        mid = (lo + hi) // 2
        value, _ = error(mid)
        probes.append((mid, value))
        if value > tolerance:
            hi, hi_error = mid, value
        else:
            lo = mid
    lo_error = dict(probes).get(lo, base_error)
    return BisectResult(total, hi, matches[hi - 1], lo_error, hi_error, probes, full_error, None)


def golden_check(optimized: OptimizedModel, golden_dir: str | Path) -> dict[str, Agreement]:
    """Eager vs golden, optimized vs golden and optimized vs eager on a golden folder's cases: the full-sequence
    logits at the golden rows (one compile per case length; ``golden.score`` scores one prefill per row)."""
    model = optimized.model
    device = model_device(model)
    eager, fast, golden = [], [], []
    with torch.no_grad():
        for case in GoldenFolder.read(golden_dir).cases:
            length, n, ids = case.prefill_len, case.prefill_logits.shape[1], case.ids.to(device)
            eager.append(model(ids)[:, length - 1 : length - 1 + n].flatten(0, 1).cpu())
            fast.append(optimized(ids)[:, length - 1 : length - 1 + n].flatten(0, 1).cpu())
            golden.append(case.prefill_logits.flatten(0, 1))
    e, f, g = torch.cat(eager), torch.cat(fast), torch.cat(golden)
    return {"eager vs golden": Agreement.of(e, g), "optimized vs golden": Agreement.of(f, g),
            "optimized vs eager": Agreement.of(f, e)}
