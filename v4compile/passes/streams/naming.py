"""Names for the stream schedule's report: the model module a node came from, the repeated unit (layer) it belongs
to, the code place of a unit's own nodes, and a branch's name from its nodes."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Sequence

from torch import fx


def module_path(node: fx.Node) -> str:
    """The model module that produced ``node`` (``layers.1.attn.wq_a``), from ``nn_module_stack``; "" if none."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("._modules['", ".").replace("']", "").replace("_modules['", "").strip(".")


def unit_of(path: str) -> str:
    """The repeated unit a module path belongs to: up to its first numeric part (``layers.1``), else its
    first part (``embed``), else ``model``."""
    parts = [p for p in path.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else "model"


def code_label(node: fx.Node) -> str:
    """Where in the model's code a node was made, for nodes of a unit's own code (no submodule): the function
    two calls below the unit's module (``attention._window_kv``, ``compressor.forward_decode``), from the
    trace's stack; "" if unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    owner = list(stack.values())[-1][1] if stack else None
    try:
        owner_file = inspect.getsourcefile(owner) if isinstance(owner, type) else None
    except TypeError:
        owner_file = None
    frames = []
    for line in (node.meta.get("stack_trace") or "").splitlines():
        line = line.strip()
        if line.startswith("File ") and ", in " in line:
            path = line[len("File "):].split(",")[0].strip('"')
            frames.append((path, line.rsplit(", in ", 1)[1]))
    last = max((i for i, (path, _) in enumerate(frames) if path == owner_file), default=-1)
    rest = frames[last + 1:]
    if not rest:
        return ""
    path, func = rest[1] if len(rest) > 1 else rest[0]
    return f"{path.rsplit('/', 1)[-1].removesuffix('.py')}.{func}"


def branch_name(nodes: Sequence[fx.Node], unit: str) -> str:
    """A branch's name from its nodes' modules relative to ``unit``: their common module when it is below the
    unit's direct children (``attn.compressor``), else the children it touches (``attn.{wq_a,q_norm,wq_b}``);
    when a third or more of its nodes are the unit's own code, the commonest code place follows
    (``attn.{wq_a,q_norm,wq_b} + indexer.forward_decode``), or names it alone (``attention._window_kv``)."""
    seen: list[list[str]] = []
    plain: list[fx.Node] = []
    for node in nodes:
        path = module_path(node)
        rel = path[len(unit) + 1:] if path.startswith(unit + ".") else ("" if path == unit else path)
        parts = rel.split(".") if rel else []
        if not parts:
            plain.append(node)
        elif parts not in seen:
            seen.append(parts)
    code = ""
    if 3 * len(plain) >= len(nodes):
        counts = Counter(label for label in map(code_label, plain) if label)
        code = counts.most_common(1)[0][0] if counts else ""
    if not seen:
        return code or unit
    common: list[str] = []
    for column in zip(*seen, strict=False):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    if len(common) >= 2 or (common and len(seen) == 1):
        modules = ".".join(common)
    else:
        rest = []
        for parts in seen:
            tail = ".".join(parts[len(common):])
            if tail and tail not in rest:
                rest.append(tail)
        prefix = ".".join(common) + "." if common else ""
        shown = rest[:4] + ([f"+{len(rest) - 4}"] if len(rest) > 4 else [])
        modules = prefix + "{" + ",".join(shown) + "}"
    return f"{modules} + {code}" if code else modules
