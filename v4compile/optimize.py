"""``v4compile.optimize(model)``: the model's API, compiled through the v4compile pass pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .backend import make_backend
from .codegen.ops import KERNEL_BACKENDS
from .passes import PASSES, build_passes
from .passes.manager import GraphReport, PassManager, summarize

BACKENDS = ("auto", *KERNEL_BACKENDS)


def resolve_backend(backend: str, device: torch.device | None = None) -> str:
    """The kernel backend for ``backend``: "auto" is Triton, compiled on CUDA and interpreted on CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    return "triton" if backend == "auto" else backend


def _never_fall_back_to_eager() -> None:
    """Each optimized model and input shape is its own Dynamo cache entry: allow many, and make hitting the
    limit an error rather than a silent fall back to eager execution."""
    config = torch._dynamo.config
    for key, limit in (("recompile_limit", 256), ("cache_size_limit", 256), ("accumulated_recompile_limit", 4096)):
        if hasattr(config, key):
            setattr(config, key, max(getattr(config, key), limit))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


class OptimizedModel:
    """The optimized callable: same API as the model (forward, decode_step, hidden_states, mtp_logits),
    each entry point compiled once through the pass pipeline. ``report()`` tells what every pass did."""

    def __init__(self, model: nn.Module, manager: PassManager, inductor: bool) -> None:
        _never_fall_back_to_eager()
        self.model = model
        self.manager = manager
        self.inductor = inductor
        self._compiled: dict[str, Any] = {}

    def _entry(self, name: str) -> Any:
        if name not in self._compiled:
            fn = self.model if name == "forward" else getattr(self.model, name)
            backend = make_backend(self.manager, inductor=self.inductor)
            self._compiled[name] = torch.compile(fn, backend=backend, dynamic=False)
        return self._compiled[name]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (logits; with ``cache=`` a prefill)."""
        return self._entry("forward")(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        attr = getattr(model, name)
        if name in ("decode_step", "hidden_states", "mtp_logits"):
            return self._entry(name)
        return attr

    def reports(self) -> list[GraphReport]:
        """One report per compiled graph, in compile order."""
        return self.manager.reports

    def report(self) -> list[dict[str, Any]]:
        """Per-pass totals: matches, near-misses, time, kernels, worst numerics error (when checked)."""
        return summarize(self.manager.reports)


def optimize(model: nn.Module, *, backend: str = "auto", passes: list[str] | None = None,
             disable: tuple[str, ...] | list[str] = (), debug_dir: str | Path | None = None, check: bool = False,
             fuel: int | None = None, inductor: bool = True, options: dict[str, dict] | None = None,
             deterministic: bool = False) -> OptimizedModel:
    """Compiles ``model`` with the v4compile passes and kernels.

    ``backend``: "auto" | "triton" | "tilelang" | "reference" (kernel bodies). ``passes``: pass names to
    run (default all), ``disable``: names to switch off, ``options``: per-pass options. ``debug_dir``:
    dump each graph when a pass changed it. ``check``: compare every rewritten region with the original
    while running (the graph then runs eagerly). ``fuel``: stop after that many rewrites (bisecting).
    ``inductor=False`` runs the rewritten graph eagerly instead of through Inductor. ``deterministic``:
    bitwise-repeatable results (RL training): switches torch to deterministic algorithms for the whole
    process (``torch.use_deterministic_algorithms``) and Inductor to deterministic codegen; the v4compile
    kernels reduce in a fixed order already (the top-k's atomics only pick slots, ranks fix the order).
    """
    if deterministic:
        import torch._inductor.config as inductor_config

        torch.use_deterministic_algorithms(True)
        if hasattr(inductor_config, "deterministic"):
            inductor_config.deterministic = True
    kernel_backend = resolve_backend(backend)
    unknown = [n for n in disable if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; valid passes: {', '.join(PASSES)}")
    manager = PassManager(build_passes(passes, options), backend=kernel_backend, disable=tuple(disable),
                          debug_dir=debug_dir, check=check, fuel=fuel)
    return OptimizedModel(model, manager, inductor)
