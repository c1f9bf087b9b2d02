"""The ``v4compile`` torch.compile backend: Dynamo capture -> ATen graph -> our passes -> Inductor.

Dynamo hands over a torch-level graph; it is retraced into a pre-dispatch ATen graph (autograd not yet
applied, so a rewrite into a custom op with an autograd formula is valid for training), rewritten by
the pass manager, then compiled by Inductor, which runs AOTAutograd (forward and backward graphs)
and compiles everything the passes did not claim. With ``inductor=False`` or a numerics check the
rewritten graph runs as is (eagerly), which is what the debugging tools use. A CUDA inference graph the
``stream_schedule`` pass annotated runs as regions on side streams (the executor: :mod:`v4compile.stream_runner`).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from . import progress
from .codegen.ops import reference_decompositions
from .passes import build_passes
from .passes.manager import GraphReport, PassManager, summarize
from .passes.summary import PassSummary
from .stream_runner import as_is, scheduled


def to_aten(gm: fx.GraphModule, example_inputs: list[Any]) -> fx.GraphModule:
    """Retraces a Dynamo graph into pre-dispatch ATen ops, keeping source locations in node metadata."""
    return _retrace(gm, example_inputs, pre_dispatch=True)


def inline_reference_bodies(gm: fx.GraphModule, example_inputs: list[Any]) -> fx.GraphModule:
    """``gm`` retraced with each custom op replaced by its reference body's ATen ops, so that Inductor compiles
    the ops' math into its own code with its default decompositions: a custom table handed to ``compile_fx``
    would be part of its FX graph cache key and, being unpicklable, turn that cache off (no warm starts)."""
    table = reference_decompositions()
    if not any(n.op == "call_function" and n.target in table for n in gm.graph.nodes):
        return gm
    return _retrace(gm, example_inputs, pre_dispatch=False, decompositions=table)


def _retrace(gm: fx.GraphModule, example_inputs: list[Any], pre_dispatch: bool,
             decompositions: dict[Any, Callable[..., Any]] | None = None) -> fx.GraphModule:
    example_inputs = _symbolic_examples(gm, example_inputs)
    # the inputs' own mode: a backend's tracing context may hold another, and values of two modes do not mix
    fake_mode = next((x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)), None)
    fake_mode = fake_mode or detect_fake_mode(example_inputs)
    runner = lambda *args: fx.Interpreter(gm).run(*args)  # noqa: E731
    trace = {"pre_dispatch": pre_dispatch, "decomposition_table": decompositions}
    if fake_mode is None:
        with fx_traceback.preserve_node_meta():
            return make_fx(runner, tracing_mode="fake", **trace)(*example_inputs)
    previous = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode, fx_traceback.preserve_node_meta():
            return make_fx(runner, **trace)(*example_inputs)
    finally:
        fake_mode.allow_non_fake_inputs = previous


def _symbolic_examples(gm: fx.GraphModule, example_inputs: list[Any]) -> list[Any]:
    """Dynamo's own fake values of the graph inputs when some size is symbolic (a dynamic batch or sequence): the
    retrace then keeps those sizes symbolic, where tracing the real example inputs would pin them to this call's
    sizes."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    if len(values) != len(example_inputs) or not any(_is_symbolic(v) for v in values):
        return example_inputs
    return values


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and not all(is_concrete_int(s) for s in value.shape)


def make_backend(manager: PassManager, inductor: bool = True,
                 captured: list[fx.GraphModule] | None = None) -> Callable[..., Any]:
    """A torch.compile backend running ``manager``; ``captured`` collects the pre-pass ATen graphs."""

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        progress.log(f"Dynamo captured a graph of {len(gm.graph.nodes)} nodes")
        with progress.step("retracing to ATen"):
            aten_gm = to_aten(gm, example_inputs)
        if captured is not None:
            captured.append(_copy(aten_gm))
        rewritten, _ = manager.run(aten_gm)
        if manager.check:
            return rewritten
        # regions compile as the whole graph would (eager's bf16 rounding emulated, e8m0 inputs on the CPU as
        # bytes), so streamed and unstreamed code round alike
        streamed = scheduled(rewritten, example_inputs, inductor_compile if inductor else as_is)
        if streamed is not None:
            return streamed
        if not inductor:
            return rewritten
        with progress.step("Inductor compiling the rewritten graph"):
            return inductor_compile(rewritten, example_inputs, inline_reference=manager.backend == "reference")

    return backend


def inductor_compile(gm: fx.GraphModule, example_inputs: list[Any],
                     inline_reference: bool = False) -> Callable[..., Any]:
    """Inductor's ``compile_fx`` (with ``inline_reference``, the custom ops' reference bodies compiled into
    Inductor's code rather than called eagerly; eager's bf16 rounding emulated either way), with e8m0 scale
    inputs on the CPU (FP8/FP4 checkpoints) handed over as their bytes: Inductor's C++ code generator has no
    e8m0 type, and the model decodes scales from bytes anyway. Uses that view the scales as bytes read the
    input directly; any other use gets an e8m0 view back. GPU inputs go unchanged: Triton code only sees the
    model's byte views, and re-viewed inputs there leave Inductor's 32-bit indexing guard on a size Dynamo
    cannot trace back to an input (torch 2.11, H200)."""
    e8m0 = torch.float8_e8m0fnu
    as_bytes = {i for i, x in enumerate(example_inputs)
                if isinstance(x, torch.Tensor) and x.dtype == e8m0 and x.device.type == "cpu"}
    if not as_bytes:
        return _compile_fx(gm, example_inputs, inline_reference)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in sorted(as_bytes):
        node = placeholders[i]
        val = node.meta.get("val")
        byte_views = [u for u in node.users if u.target is torch.ops.aten.view.dtype and u.args[1] == torch.uint8]
        others = [u for u in node.users if u not in byte_views]
        if others:
            with gm.graph.inserting_after(node):
                back = gm.graph.call_function(torch.ops.aten.view.dtype, (node, e8m0))
            back.meta["val"] = val
            for user in others:
                user.replace_input_with(node, back)
        for user in byte_views:
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        if val is not None:
            node.meta["val"] = val.view(torch.uint8)
    gm.graph.lint()
    gm.recompile()
    compiled = _compile_fx(gm, [x.view(torch.uint8) if i in as_bytes else x for i, x in enumerate(example_inputs)],
                           inline_reference)

    return lambda *args: compiled(*(a.view(torch.uint8) if i in as_bytes else a for i, a in enumerate(args)))


def op_definitions_source() -> str:
    """The source of the custom ops' definitions (schemas, fake kernels, autograd): what Inductor's compiled code
    assumes of an op it calls (e.g. its output's strides) but its compile cache does not see."""
    import inspect

    from .codegen import ops

    return inspect.getsource(ops)


class OpDefinitions(CustomGraphPass):
    """A post-grad pass that changes nothing; its ``uuid`` puts the ops' definitions into Inductor's FX graph cache
    key, so code compiled against an older definition (a stale fake's strides after an upgrade) is never served."""

    def __call__(self, graph: fx.Graph) -> None:
        """Leaves the graph as it is."""

    def uuid(self) -> bytes:
        """Hash of the ops' definitions and torch's version."""
        return hashlib.sha256((op_definitions_source() + torch.__version__).encode()).digest()


def _compile_fx(gm: fx.GraphModule, example_inputs: list[Any], inline_reference: bool) -> Callable[..., Any]:
    """``compile_fx`` without its warning that complex operators stay aten calls (the model's one complex op,
    ``torch.polar`` building the RoPE tables as the official model does, is such a call by design), keyed in
    Inductor's cache by the ops' definitions too (``OpDefinitions``)."""
    from torch._inductor.compile_fx import compile_fx

    if inline_reference:
        gm = inline_reference_bodies(gm, example_inputs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
        return compile_fx(gm, example_inputs, config_patches={"emulate_precision_casts": True,
                                                              "post_grad_custom_post_pass": OpDefinitions()})


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    import copy

    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


_BACKEND_REPORTS: list[GraphReport] = []


def last_report() -> PassSummary:
    """What the passes did in the last graph ``torch.compile(..., backend="v4compile")`` compiled (a model captured
    without graph breaks is one graph per entry point and input shape); prints as the report table. A ValueError
    before any graph was compiled."""
    if not _BACKEND_REPORTS:
        raise ValueError("no graph compiled with backend='v4compile' yet: call the torch.compile'd model first")
    return summarize(_BACKEND_REPORTS[-1:])


BACKEND_OPTIONS = ("passes", "backend", "disable", "debug_dir", "check", "inductor")


def _default_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                     options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """``torch.compile(fn, backend="v4compile", options={...})`` (torch hands the dict over as ``options``; keys
    ``BACKEND_OPTIONS``, as ``optimize``'s arguments): every pass and the auto kernel backend by default; each
    graph's report is kept for ``last_report()``. An unknown option or a mode is a ValueError naming it."""
    from .optimize import resolve_backend

    if mode is not None:
        raise ValueError(f"the v4compile backend has no modes (got mode={mode!r}); pass options={{...}} instead")
    options = dict(options or {})
    unknown = sorted(set(options) - set(BACKEND_OPTIONS))
    if unknown:
        raise ValueError(f"unknown v4compile backend option(s) {unknown}; options are {list(BACKEND_OPTIONS)}")
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    manager = PassManager(build_passes(options.get("passes")),
                          backend=resolve_backend(options.get("backend", "auto"), device),
                          disable=tuple(options.get("disable", ())), debug_dir=options.get("debug_dir"),
                          check=bool(options.get("check", False)))
    compiled = make_backend(manager, inductor=options.get("inductor", True))(gm, example_inputs)
    _BACKEND_REPORTS.extend(manager.reports)
    return compiled


torch._dynamo.register_backend(name="v4compile")(_default_backend)
