"""Where two models first part ways: every component's output, layer by layer in the order they ran, and every
discrete choice (the indexer's selected entries, the router's experts), compared between two runs on the same
input; the first component that is not bitwise equal is the first divergence.

Two models with the same module names (the same checkpoint with another setting, the reference against a
modified copy) are run once each; each module's ``forward`` and ``forward_full`` / ``forward_chunk`` /
``forward_decode`` methods are recorded, so a compressor's entries, an indexer's chosen ids and a gate's
experts show up as their own rows beside the layer outputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

RECORDED_METHODS = ("forward", "forward_full", "forward_chunk", "forward_decode")


@dataclass
class Component:
    """One recorded output of both runs: ``name`` is ``module.method`` (``#k`` for the k-th call after the first,
    ``[i]`` for a tuple's element). Floats: ``max_abs`` and ``cosine``; ids (discrete choices): ``rows_differ``,
    the share of rows (last dim) whose set of ids differs, and ``order_differs``, whose order differs."""

    name: str
    kind: str
    shape: tuple[int, ...]
    equal: bool
    max_abs: float = 0.0
    cosine: float = 1.0
    rows_differ: float = 0.0
    order_differs: float = 0.0

    def line(self) -> str:
        """One readable line."""
        if not self.shape and not self.equal:
            return f"{self.name:58s} {self.kind:8s} shapes differ"
        if self.kind == "choices":
            what = f"rows with other ids {self.rows_differ:.3f}, other order {self.order_differs:.3f}"
        else:
            what = f"max |a-b| {self.max_abs:.3e}  cos {self.cosine:.6f}"
        return f"{self.name:58s} {self.kind:8s} {'equal' if self.equal else 'DIFFERS':8s} {what}"


@dataclass
class DivergenceReport:
    """The components in the order the first model produced them."""

    components: list[Component]

    @property
    def first_divergence(self) -> Component | None:
        """The first component whose outputs are not bitwise equal (None when the runs agree everywhere)."""
        return next((c for c in self.components if not c.equal), None)

    @property
    def first_choice_divergence(self) -> Component | None:
        """The first discrete choice (selected entries, experts) that differs."""
        return next((c for c in self.components if c.kind == "choices" and not c.equal), None)

    def lines(self, around: int = 3) -> list[str]:
        """The first divergence first, then the components up to ``around`` rows past it, then every other
        differing choice."""
        first = self.first_divergence
        if first is None:
            return [f"all {len(self.components)} components are bitwise equal"]
        at = self.components.index(first)
        out = [f"first divergence: {first.line()}", f"{at} components before it are bitwise equal", ""]
        out += [c.line() for c in self.components[max(0, at - 1) : at + around + 1]]
        later = [c for c in self.components[at + around + 1 :] if c.kind == "choices" and not c.equal]
        if later:
            out += ["", "later discrete choices that differ:"] + [c.line() for c in later]
        return out


@contextmanager
def recording(model: nn.Module) -> Iterator[list[tuple[str, object]]]:
    """Records (name, a copy of the output) of every module method in ``RECORDED_METHODS`` called inside the
    block."""
    records: list[tuple[str, object]] = []
    calls: Counter[str] = Counter()
    patched: list[tuple[nn.Module, str]] = []

    def wrap(name: str, method: Callable[..., object]) -> Callable[..., object]:
        def recorded(*args: object, **kwargs: object) -> object:
            out = method(*args, **kwargs)
            calls[name] += 1
            records.append((name if calls[name] == 1 else f"{name}#{calls[name] - 1}", _snapshot(out)))
            return out
        return recorded

    for qualname, module in model.named_modules():
        for method in RECORDED_METHODS:
            if method in type(module).__dict__ or (method == "forward" and qualname):
                name = f"{qualname or 'model'}.{method}"
                setattr(module, method, wrap(name, getattr(module, method)))
                patched.append((module, method))
    try:
        yield records
    finally:
        for module, method in patched:
            delattr(module, method)


def _snapshot(out: object) -> object:
    """A copy of a method's output as it is now: outputs can be views of a cache that later calls update."""
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_snapshot(o) for o in out)
    return out


def _flatten(name: str, out: object) -> list[tuple[str, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [(name, out)]
    if isinstance(out, (tuple, list)):
        return [item for i, o in enumerate(out) for item in _flatten(f"{name}[{i}]", o)]
    return []


def _compare(name: str, a: torch.Tensor, b: torch.Tensor) -> Component:
    if a.shape != b.shape:
        return Component(name, "choices" if not a.is_floating_point() else "values", (), False)
    shape = tuple(a.shape)
    if not a.is_floating_point():
        equal = torch.equal(a, b)
        if a.dim() == 0 or a.numel() == 0:
            return Component(name, "choices", shape, equal)
        rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        sets = (rows_a.sort(-1).values != rows_b.sort(-1).values).any(-1).float().mean().item()
        order = (rows_a != rows_b).any(-1).float().mean().item()
        return Component(name, "choices", shape, equal, rows_differ=sets, order_differs=order)
    a64, b64 = a.double(), b.double()
    same = torch.equal(a, b) or bool(((a64 == b64) | (a64.isnan() & b64.isnan())).all())
    finite = a64.isfinite() & b64.isfinite()
    diff = (a64 - b64).abs()[finite]
    cos = torch.nn.functional.cosine_similarity(torch.where(finite, a64, 0).flatten(),
                                                torch.where(finite, b64, 0).flatten(), dim=0, eps=1e-30)
    return Component(name, "values", shape, same, diff.max().item() if diff.numel() else 0.0,
                     cos.item() if a64.numel() else 1.0)


def divergence(model_a: nn.Module, model_b: nn.Module, run: Callable[[nn.Module], object]) -> DivergenceReport:
    """Runs ``run(model_a)`` and ``run(model_b)`` (e.g. ``lambda m: m(ids)``) without gradients and compares every
    recorded component present in both, in the order ``model_a`` produced them."""
    outputs = []
    for model in (model_a, model_b):
        with recording(model) as records, torch.no_grad():
            run(model)
        outputs.append({n: t for name, out in records for n, t in _flatten(name, out)})
    first, second = outputs
    return DivergenceReport([_compare(name, t, second[name]) for name, t in first.items() if name in second])
