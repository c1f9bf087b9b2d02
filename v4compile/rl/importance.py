"""Importance weights that correct an RL update for the gap between the policy that sampled the rollout
(the engine) and the policy being trained: truncated (TIS) and masked (MIS), per token or per sequence."""

from __future__ import annotations

import torch

MODES = ("tis", "mis")
LEVELS = ("token", "sequence")


def importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "tis", level: str = "token", cap: float = 2.0,
                       floor: float = 0.0) -> torch.Tensor:
    """Weights [N, T] (zero where ``mask`` is false) to multiply into the per-token policy-gradient loss.

    The ratio is ``exp(trainer - engine)``, per token (``level="token"``) or as the geometric mean over the
    sequence's valid tokens (``level="sequence"``, one weight broadcast to its tokens). ``mode="tis"``
    truncates it at ``cap``; ``mode="mis"`` keeps it where ``floor <= ratio <= cap`` and zeroes it elsewhere
    (the token or sequence is dropped). Weights carry no gradient."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; levels: {', '.join(LEVELS)}")
    if not 0 <= floor < cap:
        raise ValueError(f"need 0 <= floor < cap, got floor={floor}, cap={cap}")
    if not trainer_logprobs.shape == engine_logprobs.shape == mask.shape or trainer_logprobs.dim() != 2:
        raise ValueError(f"trainer log-probs {tuple(trainer_logprobs.shape)}, engine log-probs "
                         f"{tuple(engine_logprobs.shape)} and mask {tuple(mask.shape)} must all be the same [N, T]")
    valid = mask.bool()
    log_ratio = (trainer_logprobs.detach().double() - engine_logprobs.detach().double()).masked_fill(~valid, 0.0)
    if level == "sequence":
        per_sequence = log_ratio.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = per_sequence.expand_as(log_ratio)
    ratio = log_ratio.exp()
    if mode == "tis":
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where((ratio >= floor) & (ratio <= cap), ratio, torch.zeros_like(ratio))
    return weights.masked_fill(~valid, 0.0).to(trainer_logprobs.dtype)
