"""``v4compile.optimize(model)``: the model's API, compiled through the v4compile pass pipeline."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import batch_invariant, progress
from .backend import make_backend
from .codegen.ops import KERNEL_BACKENDS
from .passes import PASSES, build_passes
from .passes.manager import GraphReport, PassManager, summarize
from .passes.summary import PassSummary
from .regions import Regions, has_regions

BACKENDS = ("auto", *KERNEL_BACKENDS)


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """The kernel backend for ``backend`` on ``device`` (None: CUDA when available). "auto" is the fastest
    correct path there: on CUDA it stays "auto", each op's fastest measured kernel (``ops.AUTO_TILELANG``'s in
    TileLang on a Hopper GPU where TileLang works, the rest in Triton); elsewhere the ops' reference bodies
    compiled by Inductor into its CPU code (the Triton interpreter is for testing kernel sources, not for
    running)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return "auto" if kind == "cuda" else "reference"


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _never_fall_back_to_eager() -> None:
    """Each optimized model and input shape is its own Dynamo cache entry: allow many, and make hitting the
    limit an error rather than a silent fall back to eager execution."""
    config = torch._dynamo.config
    for key, limit in (("recompile_limit", 256), ("cache_size_limit", 256), ("accumulated_recompile_limit", 4096)):
        if hasattr(config, key):
            setattr(config, key, max(getattr(config, key), limit))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Checks that ``model`` can run at tensor-parallel degree ``tp``: built or loaded for that degree and,
    above 1, inside an initialised process group of ``tp`` ranks whose rank matches the model's shard.
    Binds the model's collectives to that group, so the compiled graph names it."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    shard = getattr(model, "tp", None)
    built = shard.size if shard is not None else 1
    if built != tp:
        raise ValueError(f"the model was built for tensor-parallel degree {built} (tp_size) but optimize was asked "
                         f"for tp={tp}; build or load it with tp_size={tp}, tp_rank=<this rank>")
    if tp == 1:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"optimize(model, tp={tp}) must run inside an initialised process group of {tp} ranks: "
                           "start it with torchrun and call torch.distributed.init_process_group first")
    if dist.get_world_size() != tp:
        raise ValueError(f"optimize(model, tp={tp}) runs in a process group of world size {dist.get_world_size()}; "
                         f"they must be equal")
    if shard.rank != dist.get_rank():
        raise ValueError(f"this process is rank {dist.get_rank()} but the model holds the shard of tp_rank "
                         f"{shard.rank}")
    shard.bind()


def _logged(entry: str, compiled: Any, manager: PassManager) -> Any:
    """``compiled`` timing each call for the compile progress log, which closes a call that compiled a graph
    with its total time."""

    def call(*args: Any, **kwargs: Any) -> Any:
        graphs = len(manager.reports)
        with progress.call("prefill" if entry == "forward" and kwargs.get("cache") is not None else entry):
            out = compiled(*args, **kwargs)
            if len(manager.reports) != graphs:
                progress.log("compiled and ran: later calls with these shapes reuse the compiled code")
        return out

    return call


ENTRY_POINTS = ("forward", "hidden_states", "extend", "extend_hidden", "decode_step", "decode_tokens", "mtp_step",
                "mtp_logits", "logits")
"""The model methods an optimized model runs (with regions, compiled)."""
CHUNK_CALLS = ("extend", "extend_hidden")
"""Calls that continue a cache from a start position, like ``mtp_step(start=...)``: their regions compile with the
start and the chunk length dynamic (``Regions.installed(sequence=True)``), so a serving prefill's many pieces share
a few graphs per region (start 0, other starts, and a piece that closes no C128 block or starts off a block
boundary)."""
SEQUENCE_CALLS = ("forward", "hidden_states", "mtp_logits", "logits")
"""Full-sequence calls (a prefill from position 0, logits for training or scoring): their regions compile with the
sequence length dynamic from the first call on, so a new prompt length compiles only when the model's code tells its
shape apart from every earlier one (a remainder of 1 or 0 after the compressor's blocks, no complete C128 block yet,
fewer entries than the indexer's top-k, ...). The dynamic graphs run every kernel a length's own graphs would (the
compressor's block count and the indexer's k are run-time values) at their speed (benchmarks/NOTES.md); a length of
1 has its own graphs (Dynamo specialises sizes of 1). Replayed routing records share the graphs (their length is
marked too)."""
WHOLE_GRAPH_ENTRIES = ("forward", "decode_step", "hidden_states", "mtp_logits")
"""The entry points compiled as whole graphs (``regions=False``); the others then run eagerly."""


class OptimizedModel:
    """The optimized callable: same API as the model (every method of ``ENTRY_POINTS``), compiled through the pass
    pipeline: as regions (each kind of repeated block once, the head, the MTP steps; ``v4compile.regions``) or,
    with ``regions=False``, one whole graph per entry point. ``report()`` tells what every pass did."""

    def __init__(self, model: nn.Module, manager: PassManager, inductor: bool, regions: bool = False) -> None:
        _never_fall_back_to_eager()
        self.model = model
        self.manager = manager
        self.inductor = inductor
        self._compiled: dict[str, Any] = {}
        self.regions: Regions | None = None
        if regions:
            backend = make_backend(manager, inductor=inductor)
            self.regions = Regions(model, lambda fn: torch.compile(fn, backend=backend, dynamic=None))

    def _entry(self, name: str) -> Any:
        if name in ("decode_step", "decode_tokens") and \
                getattr(getattr(self.model, "config", None), "index_ties", None) == "official":
            raise ValueError("index_ties='official' decodes eagerly only (its top-k length follows each row's "
                             f"position); call model.{name}, or build the model with index_ties='lowest'")
        if name not in self._compiled:
            if self.regions is not None:
                self._compiled[name] = _logged(name, self._regional(name), self.manager)
            else:
                fn = self.model if name == "forward" else getattr(self.model, name)
                backend = make_backend(self.manager, inductor=self.inductor)
                self._compiled[name] = _logged(name, torch.compile(fn, backend=backend, dynamic=False), self.manager)
        return self._compiled[name]

    def _regional(self, name: str) -> Any:
        """The model's own ``name`` run with its compiled regions installed."""
        regions = self.regions

        def method() -> Any:
            return self.model if name == "forward" else getattr(self.model, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            sequence = name in CHUNK_CALLS or kwargs.get("start") is not None or _is_sequence_call(name, args, kwargs)
            with regions.installed(sequence=sequence):
                return method()(*args, **kwargs)

        return call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (logits; with ``cache=`` a prefill)."""
        return self._entry("forward")(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        attr = getattr(model, name)
        if name in (ENTRY_POINTS if self.regions is not None else WHOLE_GRAPH_ENTRIES) and name != "forward":
            return self._entry(name)
        if name == "generate":
            warnings.warn("generate() runs the model's own eager forward: v4compile compiles the optimized model's "
                          "calls (a prefill: optimized(ids)), and a cache that grows by one token a step would "
                          "compile a graph per token; to decode compiled, load the folder with v4compile.load and "
                          "serve it with v4compile's engine", UserWarning, stacklevel=2)
        return attr

    def reports(self) -> list[GraphReport]:
        """One report per compiled graph, in compile order."""
        return self.manager.reports

    def report(self) -> PassSummary:
        """Per-pass totals: matches, near-misses, time, kernels, worst numerics error (when checked); prints as
        the report table, ``to_json()`` for scripts."""
        return summarize(self.manager.reports)


def _is_sequence_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this is a full-sequence call (``SEQUENCE_CALLS``) of more than one position (dim 1 of the ids or
    streams that lead its arguments)."""
    lead = args[0] if args else kwargs.get("input_ids", kwargs.get("hidden", kwargs.get("streams")))
    return name in SEQUENCE_CALLS and isinstance(lead, torch.Tensor) and lead.dim() >= 2 and lead.shape[1] > 1


def optimize(model: nn.Module, *, backend: str = "auto", passes: list[str] | None = None,
             disable: tuple[str, ...] | list[str] = (), debug_dir: str | Path | None = None, check: bool = False,
             fuel: int | None = None, inductor: bool = True, options: dict[str, dict] | None = None,
             deterministic: bool = False, tp: int = 1, regions: bool | None = None) -> OptimizedModel:
    """Compiles ``model`` with the v4compile passes and kernels.

    ``backend``: "auto" (on CUDA each op's fastest measured kernel, see ``resolve_backend``; reference bodies
    compiled by Inductor elsewhere) | "triton" |
    "tilelang" | "reference" (kernel bodies). ``passes``: pass names to
    run (default all), ``disable``: names to switch off, ``options``: per-pass options. ``debug_dir``:
    dump each graph when a pass changed it. ``check``: compare every rewritten region with the original
    while running (the graph then runs eagerly). ``fuel``: stop after that many rewrites (bisecting).
    ``inductor=False`` runs the rewritten graph eagerly instead of through Inductor. ``deterministic``:
    bitwise-repeatable and batch-invariant results (RL training): switches torch to deterministic algorithms
    and batch-invariant matrix products (``v4compile.batch_invariant``) for the whole process and runs the
    rewritten graph on aten kernels (Inductor's generated code would bypass the batch-invariant products);
    the v4compile kernels reduce in a fixed order already (the top-k's atomics only pick slots, ranks fix
    the order).
    A model with ``config.index_ties == "official"`` keeps its indexer's ``torch.topk`` (``radix_topk`` declines
    plain top-k), and its decode runs eagerly only (see ``V4Config``).
    ``tp``: the tensor-parallel degree the model was built or loaded for (``tp_size``); above 1 this must run
    inside an initialised process group of that many ranks (torchrun; gloo on CPU, NCCL on GPU), and the
    collectives are captured into each compiled graph.
    ``regions``: compile each kind of repeated block once, the head and the MTP steps apart, and run every entry
    point's glue as the model writes it (compile time then does not grow with the layer count); False: one whole
    graph per entry point (what ``bisect`` and ``dump`` read); None: regions wherever the model has them.
    """
    check_tensor_parallel(model, tp)
    if fuel is not None and (not isinstance(fuel, int) or isinstance(fuel, bool) or fuel < 0):
        raise ValueError(f"fuel must be None or a non-negative integer (rewrites to allow), got {fuel!r}")
    if deterministic:
        torch.use_deterministic_algorithms(True)
        batch_invariant.enable()
        inductor = False
    kernel_backend = resolve_backend(backend, model_device(model))
    unknown = [n for n in disable if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; valid passes: {', '.join(PASSES)}")
    options = dict(options or {})
    config = getattr(model, "config", None)
    if getattr(config, "index_ties", "lowest") == "official":
        options["radix_topk"] = {**options.get("radix_topk", {}), "official_ties": True}
    manager = PassManager(build_passes(passes, options), backend=kernel_backend, disable=tuple(disable),
                          debug_dir=debug_dir, check=check, fuel=fuel)
    if regions is None:
        regions = has_regions(model)
    return OptimizedModel(model, manager, inductor, regions)
