"""Graph normalisation before matching: value-identical spellings brought to one form, so the passes match the math
rather than one model's idioms.

Every rule here is exact (the normalised graph computes bitwise the same values, with the same aliasing):

- ``split`` / ``split_with_sizes`` read through ``getitem`` -> one ``slice`` per piece (``a, b, c = m.split(...)``
  is ``m[..., :n]``, ``m[..., n:2n]``, ``m[..., 2n:]``);
- ``unbind`` read through ``getitem`` -> ``select`` (``s0, s1, s2 = scale.unbind(0)`` is ``scale[0]`` ...);
- ``aten.to`` to the dtype and device its input already has -> the input (``x.float()`` on an fp32 tensor: ATen
  returns the input itself, so the aliasing is unchanged);
- ``dropout`` that drops nothing (p = 0 or not training) -> its input;
- ``pow(x, 2)`` -> ``square(x)`` (ATen computes ``square`` as that ``pow``);
- on CUDA, the real and imaginary parts of ``polar(ones_like(a), a)`` -> ``cos(a)`` and ``sin(a)`` (the RoPE
  tables' spelling; Inductor generates no code for complex values, so ``polar`` ran as its own kernel): CUDA's
  ``polar`` computes ``1 * cos(a)`` and ``1 * sin(a)``, bitwise what Inductor's ``cos``/``sin`` compute there
  (measured on the H100 over 4.8M angles: benchmarks/NOTES.md 33rd); on the CPU the two differ by an ulp in places,
  so the rule is CUDA's only;
- a fresh constant buffer filled by ``copy_`` into its slices, then read -> the ``cat`` of what was written
  (``passes/buffer_writes.py``).

Spellings that are the same math but not the same rounding (``linear(x * r, W)`` vs ``linear(x, W) * r``, a matmul
vs a broadcast product summed) are left to the passes, which match both and state the difference in their
tolerance.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx

from .base import is_op
from .buffer_writes import writes_to_cat

aten = torch.ops.aten


def normalize(gm: fx.GraphModule) -> dict[str, int]:
    """Rewrites ``gm`` in place to the normal form above; returns how many nodes each rule rewrote (for the report)."""
    counts: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if is_op(node, aten.split, aten.split_with_sizes):
            counts["split -> slice"] += _split_to_slices(node)
        elif is_op(node, aten.unbind):
            counts["unbind -> select"] += _unbind_to_selects(node)
        elif is_op(node, aten.to) and _noop_cast(node):
            node.replace_all_uses_with(node.args[0])
            counts["no-op cast removed"] += 1
        elif is_op(node, aten.dropout) and (node.args[1] == 0 or node.args[2] is False):
            node.replace_all_uses_with(node.args[0])
            counts["inactive dropout removed"] += 1
        elif is_op(node, aten.pow) and node.args[1:] == (2,) and not node.kwargs:
            with gm.graph.inserting_before(node):
                square = gm.graph.call_function(aten.square.default, (node.args[0],))
            square.meta.update(node.meta)
            node.replace_all_uses_with(square)
            counts["pow(x, 2) -> square"] += 1
        elif is_op(node, aten.polar):
            counts["unit polar -> cos, sin (CUDA)"] += _unit_polar_to_cos_sin(node)
    counts["slice writes -> cat"] += writes_to_cat(gm)
    counts = +counts
    if counts:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return dict(counts)


def _getters(node: fx.Node) -> list[fx.Node] | None:
    """The ``getitem`` users of a multi-output node, or None when it is used otherwise (whole, as a list)."""
    users = list(node.users)
    if not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in users):
        return None
    return users


def _split_to_slices(node: fx.Node) -> int:
    """``split(x, sizes, dim)[i]`` -> ``slice(x, dim, start_i, end_i)`` (int sizes); the number of pieces rewritten."""
    getters = _getters(node)
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if getters is None or not isinstance(val, torch.Tensor):
        return 0
    sizes = node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    total = val.shape[dim]
    if isinstance(sizes, int):
        if not isinstance(total, int):
            return 0
        sizes = [min(sizes, total - start) for start in range(0, total, sizes)]
    if not all(isinstance(s, int) for s in sizes):
        return 0
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    graph = node.graph
    for getter in getters:
        i = getter.args[1]
        with graph.inserting_before(getter):
            piece = graph.call_function(aten.slice.Tensor, (node.args[0], dim, starts[i], starts[i] + sizes[i]))
        piece.meta.update(getter.meta)
        getter.replace_all_uses_with(piece)
        graph.erase_node(getter)
    return len(getters)


def _unbind_to_selects(node: fx.Node) -> int:
    """``unbind(x, dim)[i]`` -> ``select(x, dim, i)``; the number of pieces rewritten."""
    getters = _getters(node)
    if getters is None:
        return 0
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    graph = node.graph
    for getter in getters:
        with graph.inserting_before(getter):
            piece = graph.call_function(aten.select.int, (node.args[0], dim, getter.args[1]))
        piece.meta.update(getter.meta)
        getter.replace_all_uses_with(piece)
        graph.erase_node(getter)
    return len(getters)


def _unit_polar_to_cos_sin(node: fx.Node) -> int:
    """The parts of ``polar(ones_like(a), a)`` (``real`` / ``imag``, or ``select(view_as_real(.), -1, 0 / 1)``) ->
    ``cos(a)`` / ``sin(a)`` on CUDA, when its parts are all the complex value is read as; 1 if rewritten, else 0."""
    magnitude, angle = node.args[:2]
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.device.type == "cuda" and is_op(magnitude, aten.ones_like)
            and magnitude.args[0] is angle and isinstance(angle, fx.Node)):
        return 0
    parts: list[tuple[fx.Node, bool]] = []
    for user in node.users:
        if is_op(user, aten.real, aten.imag):
            parts.append((user, is_op(user, aten.imag)))
            continue
        if not is_op(user, aten.view_as_real):
            return 0
        for part in user.users:
            last = is_op(part, aten.select) and part.args[1] % (val.dim() + 1) == val.dim()
            if not (last and part.args[2] in (0, 1)):
                return 0
            parts.append((part, part.args[2] == 1))
    graph, angle_val = node.graph, angle.meta.get("val")
    for part, imaginary in parts:
        with graph.inserting_before(part):
            value = graph.call_function(aten.sin.default if imaginary else aten.cos.default, (angle,))
        value.meta.update(part.meta)
        if isinstance(angle_val, torch.Tensor):
            value.meta["val"] = torch.empty_like(angle_val)
        part.replace_all_uses_with(value)
        graph.erase_node(part)
    return 1


def _noop_cast(node: fx.Node) -> bool:
    """Whether an ``aten.to`` returns its input itself: same dtype and device, no copy, no memory format asked."""
    source = node.args[0]
    out, val = node.meta.get("val"), source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
        return False
    if node.kwargs.get("copy") or node.kwargs.get("memory_format") is not None or True in node.args[2:]:
        return False
    return out.dtype == val.dtype and out.device == val.device
