"""Regional compilation: a model's repeated blocks compile once per kind, so compile time does not grow with depth.

A V4 of 43 layers has a handful of layer kinds (compress ratio, hash routing, weight formats); compiled as one
graph per entry point, Inductor would see every layer again. Here each block of ``model.layers`` is its own region
whose compiled code Dynamo shares among the blocks of a kind (a graph is reused wherever its guards hold: the
blocks' parameters are graph inputs, so only their shapes, dtypes and the blocks' settings decide), and the
head (``logits``) and the MTP steps (``_mtp``) are regions of their own. The glue between regions (embedding,
the loop over layers, input checks) runs as the model writes it, for every entry point alike. Regions are
installed on the model only while an optimized entry point runs, so the model itself stays eager.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from . import progress
from .model.cache import CompressorCache, LayerCache
from .model.routing import Routing

_SETTING_TYPES = (bool, int, float, str, type(None))
_FUNCTION_REGIONS = ("logits", "_mtp")


def has_regions(model: nn.Module) -> bool:
    """Whether ``model`` splits into regions: repeated blocks in ``model.layers`` and the head and MTP functions
    the model's entry points call around them (``logits``, ``_mtp``)."""
    layers = getattr(model, "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(
        callable(getattr(model, name, None)) for name in _FUNCTION_REGIONS)


def kind_of(block: nn.Module) -> tuple[Any, ...]:
    """What decides whether two blocks can share compiled code: their classes, every parameter's and buffer's
    name, shape and dtype, and every submodule's plain settings (ints, floats, flags, strings)."""
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in
                    (*block.named_parameters(), *block.named_buffers()))
    settings = tuple((name, type(m).__name__, tuple(sorted((k, v) for k, v in vars(m).items()
                                                           if not k.startswith("_") and isinstance(v, _SETTING_TYPES))))
                     for name, m in block.named_modules())
    return tensors, settings


def span(indices: list[int]) -> str:
    """A short name for a set of layer indices: ``1,3``, ``2,4,...,42`` for a longer arithmetic run."""
    steps = {b - a for a, b in zip(indices, indices[1:], strict=False)}
    if len(indices) > 3 and len(steps) == 1:
        return f"{indices[0]},{indices[1]},...,{indices[-1]}"
    return ",".join(str(i) for i in indices)


class Regions:
    """The compiled regions of one model: ``compile_fn(fn)`` compiles a callable (the same backend for all, so
    Dynamo's cache can share code among blocks of a kind). ``kinds`` maps each region name (``layers.1,3``) to
    the layer indices it serves."""

    def __init__(self, model: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if not has_regions(model):
            raise ValueError(f"{type(model).__name__} has no repeated blocks in `layers` with `logits` and `_mtp` "
                             "around them; compile it as whole graphs (regions=False)")
        self.model = model
        self._lock = threading.RLock()
        self._depth = 0
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, block in enumerate(model.layers):
            groups.setdefault(kind_of(block), []).append(i)
        self.kinds = {f"layers.{span(indices)}": indices for indices in groups.values()}
        name_of = {i: name for name, indices in self.kinds.items() for i in indices}
        self._sequence = False
        self.blocks = [self._named(f"compiled {name_of[i]}", name_of[i], compile_fn(block._call_impl), scoped=True)
                       for i, block in enumerate(model.layers)]
        self.head = self._named("compiled head", "head", compile_fn(model.logits), scoped=False)
        mtp = compile_fn(model._mtp)

        def mtp_region(hidden: torch.Tensor, next_ids: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
            unbacked = not self._sequence and unbacked_batch((hidden,))
            if unbacked:
                (hidden, next_ids, *args), kwargs = decode_args((hidden, next_ids, *args), kwargs)
            mark_dynamic_dims((hidden, next_ids, *args), kwargs, self._sequence)
            with progress.region(f"mtp.{k}"), _dynamic_settings(self._sequence, unbacked):
                return mtp(hidden, next_ids, k, *args, **kwargs)

        self.mtp = mtp_region

    @contextmanager
    def installed(self, sequence: bool = False) -> Iterator[None]:
        """While inside, the model's blocks, head and MTP steps run their compiled regions (re-entrant; one thread
        at a time: a call of the plain model from another thread meanwhile would run them too). ``sequence``: the
        regions compile with the sequence length dynamic and, where the call continues a cache from a start
        position (``extend``, ``mtp_step(start=...)``), the start too (``mark_dynamic_dims``)."""
        with self._lock:
            self._depth += 1
            model = self.model
            outer, self._sequence = self._sequence, sequence
            if self._depth == 1:
                for block, compiled in zip(model.layers, self.blocks, strict=True):
                    block._compiled_call_impl = compiled
                model.logits, model._mtp = self.head, self.mtp
            try:
                yield
            finally:
                self._sequence = outer
                self._depth -= 1
                if self._depth == 0:
                    for block in model.layers:
                        block._compiled_call_impl = None
                    del model.logits, model._mtp

    def _named(self, what: str, region: str, compiled: Callable[..., Any], scoped: bool) -> Callable[..., Any]:
        """``compiled`` run inside ``progress.region(region, scoped)``, so its graphs are named (and located) by
        it, with the dims ``mark_dynamic_dims`` picks dynamic."""

        def call(*args: Any, **kwargs: Any) -> Any:
            unbacked = not self._sequence and unbacked_batch(args)
            if unbacked:
                args, kwargs = decode_args(args, kwargs)
            mark_dynamic_dims(args, kwargs, self._sequence)
            with progress.region(region, scoped), _dynamic_settings(self._sequence, unbacked):
                return compiled(*args, **kwargs)

        call.__qualname__ = call.__name__ = what
        return call


def mark_dynamic_dims(args: tuple[Any, ...], kwargs: dict[str, Any], sequence: bool = False) -> None:
    """Marks the dims of a region call that vary in serving dynamic, replacing what earlier calls marked on the
    same tensors (a cache serves prefill and decode; Dynamo guards on the marks, so a stale one would recompile).
    The batch: dim 0 of every tensor argument (inside caches, routing records and lists too) whose first size is
    the first argument's. A decode call (``sequence`` False) marks it unbacked under one name from batch 1 on (where
    ``unbacked_batch`` says so), so the first decode compiles the graph that every later batch, 1 included, reuses. A
    sequence call marks it backed when above 1 (batch 1 is its own graph: Dynamo specialises sizes of 1), and also
    the sequence: dim 1 of the leading tensor arguments (the streams and the ids) and of the replayed routing
    records (experts and indexer entries per position), so one graph serves every length. Shared entry pages
    (``EntryPages``) are never batch-sized: their page count is marked dynamic instead, so engines of any pool
    size share graphs. A tensor already marked so (a cache, step after step) is left as it is: marking costs
    microseconds a tensor on every region call."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return
    batch = first.shape[0]
    unbacked = not sequence and unbacked_batch(args)
    kind = "unbacked" if unbacked else "dynamic" if batch > 1 else None
    hint = batch if batch > 1 else BATCH_HINT
    lengths: set[int] = set()
    if sequence:
        lengths = {id(v) for v in args[:2] if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] > 1}
        for routing in (*args, *kwargs.values()):
            if isinstance(routing, Routing) and routing.replay:
                lengths.update(id(v) for v in (*routing.experts, *routing.indexer)
                               if isinstance(v, torch.Tensor) and v.shape[1] == first.shape[1] > 1)

    shared_pools: set[int] = set()

    def mark(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            batch_dim = value.dim() and value.shape[0] == batch and id(value) not in shared_pools
            want = ("pages" if id(value) in shared_pools else kind if batch_dim else None, id(value) in lengths)
            if value.__dict__.get(_MARKED, (None, False)) == want:
                return
            for attr in _MARKS:
                if attr in value.__dict__:
                    delattr(value, attr)
            if want[0] == "unbacked":
                torch._dynamo.decorators.mark_unbacked(value, 0, hint_override=hint, shape_id="batch")
            elif want[0] in ("dynamic", "pages"):
                torch._dynamo.maybe_mark_dynamic(value, 0)
            if want[1]:
                torch._dynamo.maybe_mark_dynamic(value, 1)
            setattr(value, _MARKED, want)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            if isinstance(value, CompressorCache) and value.shared:
                shared_pools.add(id(value.pool))
            for f in dataclasses.fields(value):
                mark(getattr(value, f.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                mark(item)

    mark(args)
    mark(list(kwargs.values()))


def decode_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A decode region call's arguments in the form its unbacked batch asks for. A layer cache holding more rows
    than the batch becomes a view of its first rows (the rows the model reads and writes): a graph compiled with
    a cache's batch dim marked would take a larger cache unguarded and fail its run-time check that the batch
    sizes agree. A top-level tensor (streams, ids, positions: read, never written) that is a strided or offset
    view (``ids[:, -1:]``) becomes a contiguous copy: with the batch unbacked Dynamo makes such a stride and
    offset symbols of their own, guarded to be at least 2, so the next call with plain ids would compile
    again."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return args, kwargs
    batch = first.shape[0]

    def canonical(value: Any) -> Any:
        if isinstance(value, LayerCache) and value.window.shape[0] > batch:
            return value.rows(0, batch)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and (
                value.storage_offset() or value.stride() != _contiguous_strides(value.shape)):
            return value.clone(memory_format=torch.contiguous_format)
        return value

    return tuple(canonical(a) for a in args), {k: canonical(v) for k, v in kwargs.items()}


def _contiguous_strides(sizes: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``sizes`` (a size-1 dim's too, which ``is_contiguous`` ignores)."""
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@contextmanager
def _dynamic_settings(sequence: bool, unbacked: bool = False) -> Iterator[None]:
    """Dynamo's settings for a region call: only the marked dims are dynamic (no automatic dynamic shapes on a
    recompile, which would make whatever size differed from an earlier compile symbolic, a cache's too, and give
    the passes sizes they cannot rewrite for). With the sequence dynamic also a chunk's start position, a Python
    int Dynamo otherwise specialises on (the blocks take it as a keyword, the MTP step as a parameter); a start of
    0 stays its own graph (Dynamo specialises 0 and 1), so every other start shares one. A decode call also
    captures ops whose output size depends on data (``x[mask]``: HiSparse's CPU row copy) instead of breaking the
    graph there: the frame resumed after a break would lose the unbacked batch (torch raises
    ``PendingUnbackedSymbolNotFound``)."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                    capture_dynamic_output_shape_ops=unbacked):
        if not sequence:
            yield
            return
        with torch.compiler.config.patch(dynamic_sources=CHUNK_START_SOURCES):
            yield


CHUNK_START_SOURCES = "L['kwargs']['start'],L['start']"
"""Dynamo's names for a chunk's start int in the frames regions compile: a block's ``_call_impl(*args, **kwargs)``
and the MTP step's ``_mtp(..., start=...)``."""


def unbacked_batch(args: tuple[Any, ...]) -> bool:
    """Whether a decode call with these arguments marks its batch unbacked: where torch can (``UNBACKED_BATCH``) and
    on the devices this was validated on (``UNBACKED_DEVICES``, read from the first argument)."""
    first = args[0] if args else None
    return UNBACKED_BATCH and isinstance(first, torch.Tensor) and first.device.type in UNBACKED_DEVICES


UNBACKED_DEVICES = {"cpu"}
"""Devices whose decode marks the batch unbacked. CUDA joins once tests/gpu/test_regions_gpu.py::
test_decode_at_batch_1_compiles_the_graphs_every_batch_reuses_on_cuda has passed on a GPU (not yet run): with an
unbacked batch a graph break inside a decode region raises instead of specialising, so until then CUDA decode keeps
batch 1 a graph of its own, as before."""

UNBACKED_BATCH = {"hint_override", "shape_id"} <= set(
    inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters)
"""Whether decode marks its batch unbacked (one graph for batch 1 and every later batch); a torch whose
``mark_unbacked`` lacks ``hint_override`` or ``shape_id`` compiles batch 1 apart, as sequence calls do."""

BATCH_HINT = 2
"""The batch that the passes' templates and Inductor's size hints take for an unbacked batch first compiled at
batch 1 (a template traced at size 1 would specialise it)."""

_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
          "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_dynamo_shape_ids", "_dynamo_hint_overrides",
          "_dynamo_unbacked_bounds", "_specialize_on", "_has_dynamo_dim_marking")
"""The attributes torch's ``mark_dynamic`` / ``maybe_mark_dynamic`` / ``mark_unbacked`` set on a tensor."""

_MARKED = "_v4compile_marked"
"""A tensor's attribute saying how ``mark_dynamic_dims`` last marked it: (dim 0's kind, dim 1 marked)."""
