"""What every pass shares: matches, near-misses, locations, and the Inductor-compatible pass interface.

A pass is data in, data out: it finds anchor nodes, analyzes each (raising ``NoMatch`` with a reason
for a near-miss), and rewrites what matched into a custom-op call. It is individually switchable and
its ``uuid()`` hashes its source and options so compile caches never serve stale code.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import operator
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true
from torch.utils import _pytree as pytree


class NoMatch(Exception):
    """Raised by ``analyze`` with the reason a candidate is a near-miss."""


@dataclass
class Location:
    """Where a node came from: graph node name, model module path, and model source line."""

    node: str
    module: str
    source: str

    def __str__(self) -> str:
        return f"{self.module} ({self.source}) [{self.node}]"


def locate(node: fx.Node) -> Location:
    """The model-level location of ``node`` from its trace metadata."""
    stack = node.meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        module = list(stack.values())[-1][0]
        module = module.replace("L['self'].", "").replace("L['self']", "model")
        module = module.replace("._modules['", ".").replace("']", "")
    source = ""
    trace = node.meta.get("stack_trace") or ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith("File ") and "/v4compile/" in line:
            path, _, rest = line[len("File "):].replace('"', "").partition(", line ")
            lineno, _, func = rest.partition(", in ")
            source = f"{path.split('/v4compile/')[-1]}:{lineno} {func}"
    return Location(node.name, module or "-", source or "-")


@dataclass
class Rewrite:
    """A matched region: its sink (whose users get the replacement), the nodes it removes, and the call."""

    sink: fx.Node
    op: Any
    args: tuple[Any, ...]
    kernel: str
    details: dict[str, Any]
    outputs: dict[int, fx.Node] = field(default_factory=dict)
    annotate: Callable[[fx.Graph], None] | None = None
    """A plan, not a rewrite (the stream schedule): the manager calls it instead of inserting ``op``."""


@dataclass
class Match:
    """One rewrite that was applied."""

    pass_name: str
    location: Location
    op: str
    kernel: str
    details: dict[str, Any]
    worst_rel_error: float | None = None
    checked_calls: int = 0


@dataclass
class NearMiss:
    """A candidate that looked like the pattern but was not rewritten, and why."""

    pass_name: str
    location: Location
    reason: str


@dataclass
class RewriteContext:
    """What a pass needs to emit calls: the kernel backend and whether to keep regions for checking."""

    backend: str = "reference"


class GraphPass(CustomGraphPass):
    """Base class of every rewrite pass; subclasses set the class attributes and implement the hooks."""

    name: ClassVar[str]
    summary: ClassVar[str]
    matches: ClassVar[str]
    option_help: ClassVar[dict[str, str]] = {}
    on_by_default: ClassVar[bool] = True
    """False for an opt-in pass: it runs only when named in ``passes`` (or given options)."""
    tolerance: ClassVar[float] = 1e-5
    """Worst relative error per rewritten region that this pass's kernels may introduce (check mode's bar)."""

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - set(self.option_help)
        if unknown:
            raise ValueError(f"pass {self.name} has no options {sorted(unknown)}; options: {sorted(self.option_help)}")
        self.options = options

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        """Anchor nodes worth analyzing."""
        raise NotImplementedError

    def analyze(self, node: fx.Node, ctx: RewriteContext) -> Rewrite:
        """The rewrite for an anchor, or ``NoMatch`` with the reason it is a near-miss."""
        raise NotImplementedError

    def __call__(self, graph: fx.Graph) -> None:
        """Inductor's custom-pass entry point: rewrites every match in place with the reference backend."""
        from .manager import apply_rewrite

        for node in list(self.candidates(graph.owning_module)):
            if node.graph is not graph:
                continue
            try:
                apply_rewrite(graph, self.analyze(node, RewriteContext()))
            except NoMatch:
                continue

    def uuid(self) -> bytes:
        """Hash of this pass's source and options (Inductor compile-cache key)."""
        source = inspect.getsource(sys.modules[type(self).__module__])
        payload = source + json.dumps(self.options, sort_keys=True, default=str) + torch.__version__
        return hashlib.sha256(payload.encode()).digest()


def is_op(node: Any, *targets: Any) -> bool:
    """Whether ``node`` is a call of one of the given ATen overloads or packets."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target or getattr(node.target, "overloadpacket", None) is target:
            return True
    return False


def size_hint(value: torch.SymInt) -> int | None:
    """The size a SymInt stands for in the call its graph was traced for: its hint, or for an unbacked size (a
    decode batch, ``regions.mark_dynamic_dims``) the hint the marking gave it; None for a size that depends on
    data."""
    hint = value.node.hint
    if hint is not None:
        return int(hint)
    expr = value.node.expr
    overrides = getattr(value.node.shape_env, "var_to_hint_override", None) or {}
    if expr.free_symbols and expr.free_symbols <= overrides.keys():
        return int(expr.xreplace(overrides))
    return None


class SymDim:
    """A dynamic size in a pass's view of a shape (a batch or sequence dimension compiled for every size). It
    compares equal to what it is provably equal to, without a guard (a guard would pin the compiled graph to
    this call's size); any other use (ordering, arithmetic, ``int``) is a near-miss naming the size, so a pass
    that needs the number declines instead of specialising the graph."""

    def __init__(self, value: torch.SymInt) -> None:
        self.value = value
        self.expr = value.node.expr

    def __repr__(self) -> str:
        return str(self.expr)

    @property
    def hint(self) -> int | None:
        """The size of the call this graph was first compiled for (None for a data-dependent size)."""
        return size_hint(self.value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SymDim):
            other = other.value
        if not isinstance(other, (int, torch.SymInt)) or isinstance(other, bool):
            return False
        return statically_known_true(self.value == other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(str(self.value.node.shape_env.simplify(self.expr)))

    def _dynamic(self, *_: Any) -> Any:
        raise NoMatch(f"the size {self} is dynamic (compiled for every size), and this rewrite needs its value")

    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __index__ = __bool__ = _dynamic
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _dynamic
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __truediv__ = __rtruediv__ = __neg__ = _dynamic


def shape(node: Any) -> tuple[int | SymDim, ...] | None:
    """The shape of a node's value (None when unknown): ints, and a ``SymDim`` for each dynamic size."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(_size(s) for s in val.shape)


def _size(s: int | torch.SymInt) -> int | SymDim:
    """An int for a size that is, or is provably, one constant in this graph (e.g. ``s // (s // 4)`` where s is
    known to be a multiple of 4); else a ``SymDim``."""
    if is_concrete_int(s):
        return int(s)
    hint = size_hint(s)
    if hint is not None and statically_known_true(s == hint):
        return hint
    return SymDim(s)


def size_node(node: fx.Node, dim: int, divisor: int = 1) -> fx.Node:
    """A node computing ``node``'s size along ``dim`` floor-divided by ``divisor``, inserted after ``node``: how a
    rewrite passes a dynamic size to its op as a run-time value (the op then serves every size the graph does)."""
    size = node.meta["val"].shape[dim]
    with node.graph.inserting_after(node):
        out = node.graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
        out.meta["val"] = size
    if divisor != 1:
        with node.graph.inserting_after(out):
            out = node.graph.call_function(operator.floordiv, (out, divisor))
            out.meta["val"] = size // divisor
    return out


def is_static(dims: tuple[int | SymDim, ...] | None) -> bool:
    """Whether ``dims`` is a known shape of plain ints."""
    return dims is not None and not any(isinstance(d, SymDim) for d in dims)


def numel(dims: tuple[int | SymDim, ...]) -> int | str:
    """The element count of ``dims`` for a report: an int, or the expression of a dynamic count."""
    if is_static(dims):
        return int(torch.Size(dims).numel())
    return "*".join(str(d) for d in dims)


def skip_noop_slices(node: Any) -> Any:
    """``node`` under any aliases and whole-dimension slices (``x[:, :]``, a no-op that a static trace drops
    and a dynamic one keeps)."""
    while is_op(node, torch.ops.aten.alias) or is_op(node, torch.ops.aten.slice) and _whole_slice(node):
        node = node.args[0]
    return node


def users_past_noop_slices(node: fx.Node) -> list[fx.Node]:
    """The users of ``node``, each whole-dimension slice or alias among them replaced by its own users."""
    found: list[fx.Node] = []
    for user in node.users:
        if skip_noop_slices(user) is node:
            found.extend(users_past_noop_slices(user))
        else:
            found.append(user)
    return found


def _whole_slice(node: fx.Node) -> bool:
    args = list(node.args) + [0, 0, None][len(node.args) - 1:]
    source, dim, start, end = args[0], args[1], args[2] or 0, args[3]
    if start != 0 or not isinstance(dim, int):
        return False
    if end is None or isinstance(end, int) and end >= 2**63 - 1:
        return True
    full = shape(source)
    return isinstance(end, int) and full is not None and isinstance(full[dim], int) and end >= full[dim]


def dtype(node: Any) -> torch.dtype | None:
    """The dtype of a node's traced value (None when unknown, e.g. an earlier rewrite's output)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def ancestors(node: fx.Node, limit: int = 400) -> list[fx.Node]:
    """The nodes ``node`` is computed from, nearest first (a walk bounded at ``limit`` nodes)."""
    seen, queue = {node}, [node]
    for n in queue:
        if len(queue) >= limit:
            break
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                queue.append(a)
    return queue[1:]


def only_user(node: fx.Node, why: str) -> fx.Node:
    """The single user of ``node``, or NoMatch(why)."""
    users = list(node.users)
    if len(users) != 1:
        raise NoMatch(why)
    return users[0]


# ------------------------------------------------------------------------- reading matched ops' arguments
_SLICE_END = 2**63 - 1


def reduction_dims(node: fx.Node, index: int, ndim: int) -> list[int]:
    """The reduction dims argument of ``node`` normalised to 0..ndim-1."""
    dims = node.args[index] if len(node.args) > index else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return [d % ndim for d in dims]


def keepdim(node: fx.Node, index: int) -> bool:
    """The keepdim argument of a reduction ``node``."""
    return bool(node.args[index] if len(node.args) > index else node.kwargs.get("keepdim", False))


def other_operand(node: fx.Node, one: fx.Node) -> object:
    """The operand of a binary ``node`` that is not ``one``."""
    a, b = node.args[:2]
    return b if a is one else a


class Region:
    """The nodes a match will remove; ``follow`` walks single-user chains and records them."""

    def __init__(self) -> None:
        self.nodes: set[fx.Node] = set()

    def add(self, *nodes: object) -> None:
        self.nodes.update(n for n in nodes if isinstance(n, fx.Node))

    def follow(self, node: fx.Node, targets: object, why: str) -> fx.Node:
        """``node``'s only user, which must be a call of ``targets`` (one op or a tuple; else NoMatch(why))."""
        users = list(node.users)
        if len(users) != 1 or not is_op(users[0], *(targets if isinstance(targets, tuple) else (targets,))):
            raise NoMatch(why)
        self.add(users[0])
        return users[0]

    def check_closed(self, outputs: Iterable[fx.Node], what: str) -> None:
        """Every node of the region but its outputs is used only inside it (so the whole region goes)."""
        outputs = set(outputs)
        for node in self.nodes - outputs:
            outside = [u.name for u in node.users if u not in self.nodes]
            if outside:
                raise NoMatch(f"{node.name} inside {what} is also used outside it (by {', '.join(outside)})")


def slice_bounds(node: fx.Node, size: int) -> tuple[int, int]:
    """(start, end) of an ``aten.slice`` over a dim of ``size``, the end clamped to it."""
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else _SLICE_END
    return start, min(end, size)


def scalar_operand(node: fx.Node, value: object, what: str) -> float:
    """The Python scalar operand of a binary op ``node`` whose tensor operand is ``value``."""
    other = other_operand(node, value)
    if isinstance(other, fx.Node) or other is None:
        raise NoMatch(f"{what} is not a constant")
    return float(other)


def fake_value(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, mode: Any = None) -> Any:
    """The op's output computed by its fake implementation on the arguments' traced values, so later passes see the
    shape and dtype of a new node as of any other node; None when an argument has no traced value. ``mode``: the
    fake mode for an op without tensor arguments (a factory)."""
    nodes: list[fx.Node] = []
    fx.node.map_arg(args, nodes.append)
    if any(n.meta.get("val") is None for n in nodes):
        return None
    values = fx.node.map_arg(args, lambda n: n.meta["val"])
    leaves = pytree.tree_leaves(values)
    modes = {id(v.fake_mode): v.fake_mode for v in leaves if isinstance(v, FakeTensor)}
    if len(modes) == 1:
        mode = next(iter(modes.values()))
    elif any(isinstance(v, torch.Tensor) for v in leaves):
        mode = FakeTensorMode()  # real tensors, or fakes of several modes (make_fx's factories): one mode's copies
        values = pytree.tree_map_only(torch.Tensor, mode.from_tensor, values)
    if mode is None:
        return None
    try:
        with mode:
            return op(*values, **(kwargs or {}))
    except Exception:  # an op whose fake rejects these values: the node keeps no value
        return None


def traced_call(graph: fx.Graph, op: Any, *args: Any, fake_mode: Any = None, **kwargs: Any) -> fx.Node:
    """A new ``op(*args, **kwargs)`` node at the graph's insertion point, with its traced value (``fake_value``)."""
    node = graph.call_function(op, args, kwargs)
    value = fake_value(op, args, kwargs, fake_mode)
    if value is not None:
        node.meta["val"] = value
    return node


def read_through_cast(node: fx.Node) -> None:
    """``node``'s users read it through a cast to its own dtype: a no-op until a rewrite puts an op of another output
    dtype (an fp32 sum where the graph summed in bf16) in ``node``'s place."""
    with node.graph.inserting_after(node):
        cast = node.graph.call_function(torch.ops.aten.to.dtype, (node, dtype(node)))
        cast.meta.update(node.meta)
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
