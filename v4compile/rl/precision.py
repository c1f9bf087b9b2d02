"""Per-tensor precision report: how close two configurations of the same model are, activation by
activation and gradient by gradient (for example the eager model against the optimized one, bf16
against fp32 compressor math, or tp=1 against one tensor-parallel rank, whose parameters are parts of the
single-process ones)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..model.parallel import Placement


@dataclass
class TensorAgreement:
    """Cosine similarity and relative error of one named tensor between the two configurations."""

    name: str
    kind: str
    cosine: float
    rel_error: float


def precision_report(model_a: nn.Module, model_b: nn.Module, run_a: Callable[[], torch.Tensor],
                     run_b: Callable[[], torch.Tensor], modules: tuple[type[nn.Module], ...] = (nn.Module,),
                     placement: Callable[[str, tuple[int, ...]], Placement | None] | None = None,
                     ) -> list[TensorAgreement]:
    """Runs ``run_a`` (a forward of ``model_a`` returning a tensor) and ``run_b`` likewise, backpropagates
    the sum of each output's log-softmax mean, and compares every module output (of a type in ``modules``,
    by qualified name) and every parameter gradient present in both. ``placement`` maps a parameter of
    ``model_a`` (name, shape) to where ``model_b`` keeps its part, for a tensor-parallel rank
    (``lambda n, s: shard.tp.placement(n, s, shard.config)``); parameters it places nowhere (another rank's
    experts) are left out. Sorted worst cosine first."""
    acts_a, acts_b = _record(model_a, modules), _record(model_b, modules)
    try:
        for run, model in ((run_a, model_a), (run_b, model_b)):
            model.zero_grad(set_to_none=True)
            out = run()
            out.float().log_softmax(-1).mean().backward()
    finally:
        for hooks in (acts_a, acts_b):
            for handle in hooks.handles:
                handle.remove()
    rows = [_compare(name, "activation", acts_a.values[name], acts_b.values[name])
            for name in acts_a.values.keys() & acts_b.values.keys()]
    grads_b = {name: p.grad for name, p in model_b.named_parameters() if p.grad is not None}
    for name, p in model_a.named_parameters():
        place = Placement(name) if placement is None or p.grad is None else placement(name, tuple(p.grad.shape))
        if p.grad is not None and place is not None and place.name in grads_b:
            rows.append(_compare(place.name, "gradient", place.take(p.grad), grads_b[place.name]))
    return sorted(rows, key=lambda r: r.cosine)


@dataclass
class _Recorder:
    values: dict[str, torch.Tensor]
    handles: list[torch.utils.hooks.RemovableHandle]


def _record(model: nn.Module, modules: tuple[type[nn.Module], ...]) -> _Recorder:
    recorder = _Recorder({}, [])
    for name, module in model.named_modules():
        if name and isinstance(module, modules):
            def hook(_m: nn.Module, _i: object, out: object, name: str = name) -> None:
                if isinstance(out, torch.Tensor):
                    recorder.values[name] = out.detach().float()
            recorder.handles.append(module.register_forward_hook(hook))
    return recorder


def _compare(name: str, kind: str, a: torch.Tensor, b: torch.Tensor) -> TensorAgreement:
    a, b = a.double().flatten(), b.double().flatten()
    if a.shape != b.shape:
        return TensorAgreement(name, kind, float("nan"), float("nan"))
    if not a.any() and not b.any():
        return TensorAgreement(name, kind, 1.0, 0.0)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-30).item()
    rel = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
    return TensorAgreement(name, kind, cosine, rel)
