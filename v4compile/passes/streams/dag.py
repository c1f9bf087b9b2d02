"""The stream schedule's dependency DAG: the scheduled nodes of an FX graph, data edges and the alias/memory-ordering
edges in-place writes impose, and each node's cost estimated from its fake-tensor metadata."""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from ..base import size_hint

META_KEY = "stream_schedule"
"""``node.meta`` key holding a node's ``(stream, thread)``, and ``gm.meta`` key holding the plan."""


# ---------------------------------------------------------------------------------------------- the DAG
def _schema(node: fx.Node) -> Any:
    return getattr(node.target, "_schema", None)


def _argument_nodes(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.map_arg(value, found.append)
    return found


def _effects(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """``(aliased input, written inputs)`` of a call: the input whose storage the output shares (views and
    in-place ops), and the inputs it writes. Ops without a schema are taken to write every input."""
    if node.target is operator.getitem:
        return node.args[0], []
    schema = _schema(node)
    if schema is None:
        return None, list(node.all_input_nodes)
    aliased, writes = None, []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        nodes = _argument_nodes(value)
        if argument.alias_info.is_write:
            writes.extend(nodes)
        if aliased is None and nodes and any(r.alias_info is not None for r in schema.returns):
            aliased = nodes[0]
    return aliased, writes


def is_compute(node: fx.Node) -> bool:
    """Whether ``node`` is a call (placeholders, attributes and the output are not scheduled)."""
    return node.op in ("call_function", "call_method", "call_module")


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` only makes an alias of an input (a view, a no-op cast, a tuple item): no kernel, so the
    schedule does not place it; every segment that reads it remakes it from its base."""
    if not is_compute(node):
        return False
    aliased, writes = _effects(node)
    return aliased is not None and not writes


def written_input(node: fx.Node) -> fx.Node | None:
    """The input an in-place or ``out=`` op writes and returns as its result (``index_put_(x, ...)`` returns
    ``x`` itself), else None. Code reading such a result elsewhere can read the written tensor instead: the
    same tensor, without handing a compiled region two inputs that alias each other."""
    schema = _schema(node)
    if schema is None or len(schema.returns) != 1:
        return None
    returned = schema.returns[0].alias_info
    if returned is None or not returned.is_write:
        return None
    for i, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write and info.before_set == returned.before_set:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, fx.Node) else None
    return None


def bases(node: fx.Node) -> list[fx.Node]:
    """The scheduled nodes whose values ``node`` reads, looking through views to the nodes that made their
    bases (graph inputs and attributes are not scheduled and are left out)."""
    found: list[fx.Node] = []
    stack = list(node.all_input_nodes)
    seen: set[fx.Node] = set()
    while stack:
        source = stack.pop()
        if source in seen:
            continue
        seen.add(source)
        if is_view(source):
            stack.extend(source.all_input_nodes)
        elif is_compute(source):
            found.append(source)
    return found


def dependency_graph(graph: fx.Graph) -> nx.DiGraph:
    """The DAG of ``graph``'s scheduled nodes (calls that are not views, and the output): an edge ``u -> v``
    when ``v`` reads ``u``'s value, directly or through views (kind "data"), or must follow ``u`` because one
    of them writes storage the other reads or writes (kind "memory": read-after-write, write-after-read,
    write-after-write on the same base storage)."""
    dag = nx.DiGraph()
    root: dict[fx.Node, fx.Node] = {}
    written: set[fx.Node] = set()
    effects: dict[fx.Node, tuple[list[fx.Node], list[fx.Node]]] = {}
    for node in graph.nodes:
        if not is_compute(node):
            root[node] = node
            if node.op != "output":
                continue
        aliased = None
        writes: list[fx.Node] = []
        if node.op != "output":
            aliased, writes = _effects(node)
        root[node] = root.get(aliased, aliased) if aliased is not None else node
        if is_view(node):
            continue
        dag.add_node(node)
        for source in bases(node):
            dag.add_edge(source, node, kind="data")
        stores = [root.get(n, n) for n in writes]
        effects[node] = ([root.get(n, n) for n in node.all_input_nodes], stores)
        written.update(stores)
    last_write: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = defaultdict(list)

    def order(before: fx.Node, after: fx.Node) -> None:
        if before is not after and not dag.has_edge(before, after):
            dag.add_edge(before, after, kind="memory")

    for node, (reads, stores) in effects.items():
        for storage in reads:
            if storage in written:
                if storage in last_write:
                    order(last_write[storage], node)
                readers[storage].append(node)
        for storage in stores:
            if storage in last_write:
                order(last_write[storage], node)
            for reader in readers[storage]:
                order(reader, node)
            last_write[storage] = node
            readers[storage] = []
    return dag


# ---------------------------------------------------------------------------------------------- costs
@dataclass
class Cost:
    """Estimated work of some nodes: kernels (ops that are not views), bytes read + written, FLOPs, seconds."""

    kernels: int = 0
    bytes: int = 0
    flops: int = 0
    seconds: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.kernels + other.kernels, self.bytes + other.bytes, self.flops + other.flops,
                    self.seconds + other.seconds)

    @property
    def us(self) -> float:
        """Estimated microseconds."""
        return self.seconds * 1e6


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    torch.utils._pytree.tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) else None, value)
    return found


def _hint(size: Any) -> int:
    """A count as an int for an estimate: a dynamic one (a SymInt) at the size the graph was traced for, read
    without a guard (``int()`` would pin the graph to that size); 1 when it depends on data."""
    if isinstance(size, torch.SymInt):
        hint = size_hint(size)
        return 1 if hint is None else hint
    return int(size)


def _nbytes(t: torch.Tensor) -> int:
    return _hint(t.numel()) * t.element_size()


def _flops(node: fx.Node, values: dict[fx.Node, Any]) -> int:
    """FLOPs of the matrix products (``linear``, ``einsum``, and whatever torch's flop counter knows)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    args = fx.map_arg(node.args, lambda n: values.get(n))
    kwargs = fx.map_arg(node.kwargs, lambda n: values.get(n))
    out = values.get(node)
    if packet is torch.ops.aten.linear and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
        return 2 * _hint(out.numel()) * _hint(args[0].shape[-1])
    if packet is torch.ops.aten.einsum and isinstance(args[0], str):
        sizes: dict[str, Any] = {}
        for letters, operand in zip(args[0].split("->")[0].split(","), args[1], strict=False):
            if isinstance(operand, torch.Tensor):
                sizes.update(zip(letters.strip(), operand.shape, strict=False))
        total = 2
        for size in sizes.values():
            total *= _hint(size)
        return total
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    def hinted(v: Any) -> Any:
        return torch.Size(_hint(s) for s in v.shape) if isinstance(v, torch.Tensor) else v

    shapes = torch.utils._pytree.tree_map(hinted, (args, kwargs))
    try:
        return int(formula(*shapes[0], **shapes[1], out_shape=hinted(out) if isinstance(out, torch.Tensor) else None))
    except Exception:  # noqa: BLE001 - a formula that does not fit this call: no FLOPs counted
        return 0


def node_values(gm: fx.GraphModule) -> dict[fx.Node, Any]:
    """Every node's fake value: the trace's ``meta["val"]``, or for nodes a pass inserted without one, the op
    run on fake inputs (custom ops have fake implementations)."""
    values: dict[fx.Node, Any] = {}
    fallback = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    for node in gm.graph.nodes:
        if "val" in node.meta:
            values[node] = node.meta["val"]
        elif node.op == "call_function":
            args = fx.map_arg(node.args, lambda n: values.get(n))
            kwargs = fx.map_arg(node.kwargs, lambda n: values.get(n))
            fake_mode = next((t.fake_mode for t in _tensors((args, kwargs)) if isinstance(t, FakeTensor)), fallback)
            if fake_mode is None:
                continue
            try:
                with fake_mode:
                    values[node] = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - unknown value: the node is costed as a launch only
                values[node] = None
    return values


def node_cost(node: fx.Node, values: dict[fx.Node, Any], facts: dict[str, Any]) -> Cost:
    """The estimate for one node: views cost nothing; a kernel costs a launch plus the larger of its bytes
    over the copy rate and its FLOPs over the matmul rate (bytes: inputs and outputs, less written inputs)."""
    if not is_compute(node):
        return Cost()
    aliased, writes = _effects(node)
    if aliased is not None and not writes:
        return Cost()
    skip = set(writes)
    moved = sum(_nbytes(t) for n in node.all_input_nodes if n not in skip for t in _tensors(values.get(n)))
    if not writes:
        moved += sum(_nbytes(t) for t in _tensors(values.get(node)))
    flops = _flops(node, values)
    seconds = facts["launch_s"] + max(moved / facts["copy_bytes_per_s"], flops / facts["bf16_flop_per_s"])
    return Cost(1, moved, flops, seconds)
