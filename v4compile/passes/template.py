"""Matching a graph region against a model function traced to ATen: the model's own code is the pattern.

A template is a function (say ``Linear.forward`` for one weight format) traced with ``make_fx`` exactly as the
backend retraces Dynamo's graph (pre-dispatch ATen). ``bind`` walks the template from its output and the
graph from a candidate node in lockstep: the same op, the same constants, the same structure; each template
input binds to the graph node in its place. Casts to a tensor's own dtype are skipped on both sides (Dynamo
and ``make_fx`` record them where the source calls ``.to`` or ``.float()`` on a tensor that already has the
dtype), and so are whole-dimension slices (``x[:, j:j+1]`` keeps its ``:`` as a slice in a trace with a dynamic
first dim, and one side may have dropped it). A mismatch names the op the template expects and what the graph
has there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from .base import NoMatch, dtype, is_op, locate, size_hint, skip_noop_slices

aten = torch.ops.aten
_IGNORED_KWARGS = ("device",)
Variant = TypeVar("Variant")


@dataclass
class Template:
    """A traced function: its graph module, its inputs (placeholders in order) and its output node."""

    module: fx.GraphModule
    inputs: list[fx.Node]
    output: fx.Node


@dataclass
class Binding:
    """The result of ``bind``: the graph node bound to each template input (None when it did not match), the
    reason it did not, and how many template nodes matched before that (to rank failed alternatives)."""

    inputs: list[fx.Node] | None
    reason: str
    matched: int
    region: set[fx.Node] = field(default_factory=set)
    """The graph nodes the template's operations matched (no-op casts and slices between them included), without the
    inputs and constants they read: what a rewrite of the whole match replaces."""


def trace(fn: Callable[..., torch.Tensor], example: list[torch.Tensor],
          dynamic: list[tuple[int, ...]] | None = None) -> Template:
    """``fn`` traced to pre-dispatch ATen on fake copies of ``example`` (only shapes and dtypes are used), with
    static shapes even when called inside a torch.compile backend (whose tracing context would make them
    symbolic), but for ``dynamic[i]``, the dims of input i that are symbols (valued as in the example): the
    template of a dynamic graph, where the arguments the function computes from those sizes are nodes, which
    ``bind`` matches by their value."""
    with torch._guards.tracing(None), unset_fake_temporarily():
        if not dynamic or not any(dynamic):
            module = make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*example)
        else:
            mode = FakeTensorMode(shape_env=ShapeEnv())
            fakes = [mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(x.dim())]))
                for x, dims in zip(example, dynamic, strict=True)]
            with mode:
                module = make_fx(fn, pre_dispatch=True)(*fakes)
    inputs = [n for n in module.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in module.graph.nodes if n.op == "output"]
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        (result,) = result
    return Template(module, inputs, result)


def skip_noop_casts(node: Any) -> Any:
    """``node`` under any casts to the dtype its input already has."""
    while (is_op(node, aten.to, aten._to_copy, aten.alias) and isinstance(node.args[0], fx.Node)
           and dtype(node) is not None and dtype(node) == dtype(node.args[0])):
        node = node.args[0]
    return node


def _skip_noops(node: Any) -> Any:
    """``node`` under any no-op casts and whole-dimension slices, in any order."""
    while True:
        inner = skip_noop_slices(skip_noop_casts(node))
        if inner is node:
            return node
        node = inner


def _describe(node: fx.Node) -> str:
    what = str(node.target) if node.op == "call_function" else node.op
    return f"{what} at {locate(node)}"


class _Matcher:
    def __init__(self, template: Template) -> None:
        self.template = template
        self.pairs: dict[fx.Node, fx.Node] = {}
        self.noops: set[fx.Node] = set()
        self.reason = ""

    def fail(self, reason: str) -> bool:
        self.reason = self.reason or reason
        return False

    def node(self, p: fx.Node, g: Any) -> bool:
        p, skipped = _skip_noops(p), g
        g = _skip_noops(g)
        while isinstance(skipped, fx.Node) and skipped is not g:
            self.noops.add(skipped)
            skipped = skipped.args[0]
        if not isinstance(g, fx.Node):
            return self.fail(f"expected a tensor for {p.target if p.op == 'call_function' else p.name}, found {g!r}")
        if p in self.pairs:
            return self.pairs[p] is g or self.fail(
                f"one value of the template is two nodes of the graph ({self.pairs[p].name}, {g.name})")
        if p.op == "placeholder":
            self.pairs[p] = g
            return True
        if p.op == "get_attr":
            if g.op != "get_attr":
                return self.fail(f"expected a constant tensor, found {_describe(g)}")
            ours = getattr(self.template.module, p.target)
            theirs = getattr(g.graph.owning_module, g.target)
            if ours.shape != theirs.shape or not torch.equal(ours.cpu(), theirs.cpu()):
                return self.fail(f"the constant {g.target} differs from the model's")
        elif g.op != "call_function" or g.target != p.target:
            return self.fail(f"expected {p.target}, found {_describe(g)}")
        self.pairs[p] = g
        if not self.value(p.args, g.args, p):
            return False
        keys = (set(p.kwargs) | set(g.kwargs)) - set(_IGNORED_KWARGS)
        return all(self.value(p.kwargs.get(k), g.kwargs.get(k), p) for k in keys)

    def value(self, p: Any, g: Any, owner: fx.Node) -> bool:
        if isinstance(p, fx.Node) and _size_value(p) is not None:
            if _size_value(p) != _size_value(g):
                return self.fail(f"{owner.target} has a size {g!r} where the model's computes {p.name} = "
                                 f"{_size_value(p)} from its input sizes")
            return True
        if isinstance(g, fx.Node) and _size_value(g) is not None:
            return self.fail(f"{owner.target} has the dynamic size {g.name} where the model's has {p!r}")
        if isinstance(p, fx.Node):
            return self.node(p, g)
        if isinstance(p, (list, tuple)):
            if not isinstance(g, (list, tuple)) or len(p) != len(g):
                return self.fail(f"{owner.target} has arguments {g!r}, the model's has {p!r}")
            return all(self.value(a, b, owner) for a, b in zip(p, g, strict=True))
        if isinstance(g, fx.Node) or p != g:
            return self.fail(f"{owner.target} has argument {g!r} where the model's has {p!r}")
        return True


def _size_value(value: Any) -> int | None:
    """The value of a size in a graph: an int as is, a node computing a size (a symbolic template's, or a
    dynamic graph's) the size of the call it was traced for; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, fx.Node):
        return None
    val = value.meta.get("val", value.meta.get("example_value"))
    if isinstance(val, torch.SymInt):
        return size_hint(val)
    return None


def example_sizes(dims: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sizes to trace a template at for a graph value of shape ``dims`` (ints, ``SymDim`` for dynamic sizes):
    the sizes of the call the graph was traced for, and which dims are dynamic."""
    sizes = tuple(d if isinstance(d, int) else d.hint for d in dims)
    if any(s is None for s in sizes):
        raise NoMatch(f"a size of {dims} depends on data")
    return sizes, tuple(i for i, d in enumerate(dims) if not isinstance(d, int))


def bind(template: Template, node: fx.Node) -> Binding:
    """Matches ``template`` against the graph region ending at ``node``; see the module docstring."""
    matcher = _Matcher(template)
    if matcher.node(template.output, node):
        operations = {g for p, g in matcher.pairs.items() if p.op == "call_function"}
        return Binding([skip_noop_casts(matcher.pairs[p]) if p in matcher.pairs else None
                        for p in template.inputs], "", len(matcher.pairs), operations | matcher.noops)
    return Binding(None, matcher.reason, len(matcher.pairs))


def bind_first(variants: Iterable[Variant], template: Callable[[Variant], Template], node: fx.Node,
               what: str) -> tuple[Variant, Binding]:
    """The first of ``variants`` (a pass's alternative forms of one computation: scale rules, fused or separate
    weights) whose ``template(variant)`` binds at ``node``, with its binding; each template is traced only when
    the ones before it failed. When none binds: NoMatch(f"{what}: ...") with the reason of the variant that
    matched furthest."""
    best: Binding | None = None
    for variant in variants:
        binding = bind(template(variant), node)
        if binding.inputs is not None:
            return variant, binding
        if best is None or binding.matched > best.matched:
            best = binding
    raise NoMatch(f"{what}: {best.reason if best else 'no variant to try'}")
