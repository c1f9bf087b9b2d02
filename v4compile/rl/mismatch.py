"""How far the trainer's log-probabilities are from the rollout engine's for the same tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class MismatchReport:
    """Absolute log-prob differences: over all tokens (``mean``, ``max``) and per sequence."""

    mean: float
    max: float
    per_sequence_mean: list[float]
    per_sequence_max: list[float]
    tokens: int


def logprob_mismatch(engine: Sequence[Sequence[float]] | torch.Tensor,
                     trainer: Sequence[Sequence[float]] | torch.Tensor,
                     mask: torch.Tensor | None = None) -> MismatchReport:
    """Compares per-token log-probs of the same sampled tokens from the rollout engine and the trainer.

    Takes ragged lists (one list per sequence) or padded [N, T] tensors with a ``mask`` of valid tokens.
    A mismatch here is what makes an on-policy RL update silently off-policy."""
    a, b, valid = _padded(engine, trainer, mask)
    diff = (a - b).abs().masked_fill(~valid, 0.0)
    counts = valid.sum(dim=1)
    if int(counts.sum()) == 0:
        raise ValueError("no tokens to compare: every sequence is empty or masked out")
    per_mean = (diff.sum(dim=1) / counts.clamp(min=1)).tolist()
    per_max = diff.amax(dim=1).tolist()
    return MismatchReport(float(diff.sum() / counts.sum()), float(diff.max()), per_mean, per_max, int(counts.sum()))


def _padded(engine: Sequence[Sequence[float]] | torch.Tensor, trainer: Sequence[Sequence[float]] | torch.Tensor,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(engine, torch.Tensor) != isinstance(trainer, torch.Tensor):
        raise TypeError("pass both log-prob sets as tensors or both as lists of lists")
    if isinstance(engine, torch.Tensor) and isinstance(trainer, torch.Tensor):
        if engine.shape != trainer.shape or engine.dim() != 2:
            raise ValueError(f"log-prob tensors must both be [N, T]; got {tuple(engine.shape)} and "
                             f"{tuple(trainer.shape)}")
        valid = torch.ones_like(engine, dtype=torch.bool) if mask is None else mask.bool()
        if valid.shape != engine.shape:
            raise ValueError(f"mask shape {tuple(valid.shape)} does not match log-probs {tuple(engine.shape)}")
        return engine.double(), trainer.double(), valid
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine sequences but {len(trainer)} trainer sequences")
    for i, (x, y) in enumerate(zip(engine, trainer, strict=True)):
        if len(x) != len(y):
            raise ValueError(f"sequence {i}: {len(x)} engine log-probs but {len(y)} trainer log-probs")
    width = max((len(x) for x in engine), default=0)
    a = torch.zeros(len(engine), width, dtype=torch.float64)
    b = torch.zeros_like(a)
    valid = torch.zeros_like(a, dtype=torch.bool)
    for i, (x, y) in enumerate(zip(engine, trainer, strict=True)):
        a[i, : len(x)] = torch.tensor(list(x), dtype=torch.float64)
        b[i, : len(y)] = torch.tensor(list(y), dtype=torch.float64)
        valid[i, : len(x)] = True
    return a, b, valid
