"""Rotary position embedding on the last ``rope_head_dim`` dims, interleaved pairs, with YaRN."""

from __future__ import annotations

import math

import torch


def rope_frequencies(
    rope_dim: int, base: float, original_seq_len: int, factor: float, beta_fast: int, beta_slow: int
) -> torch.Tensor:
    """Per-pair inverse frequencies ``[rope_dim/2]`` (fp32), YaRN-corrected when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:

        def corr(n_rot: float) -> float:
            return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[*positions.shape, rope_dim/2]`` of the angles ``position * freq`` (fp32).

    Built with ``torch.polar`` as the official model builds its table: ``torch.cos``/``torch.sin`` round
    differently in places (1 fp32 ulp), which the FP8/FP4 simulation downstream can amplify."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    unit = torch.polar(torch.ones_like(angles), angles)
    return unit.real.contiguous(), unit.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotates the last ``2*cos.shape[-1]`` dims of ``x`` as interleaved (even, odd) pairs.

    ``cos``/``sin`` broadcast against ``x[..., :1]`` with the pair axis last, e.g. ``[B, S, 1, r/2]``
    for ``x`` of ``[B, S, H, d]``. ``inverse`` applies the conjugate rotation. Returns x's dtype.
    """
    r = 2 * cos.shape[-1]
    rest, rot = x[..., :-r], x[..., -r:].float().unflatten(-1, (-1, 2))
    a, b = rot[..., 0], rot[..., 1]
    if inverse:
        sin = -sin
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((rest, out.to(x.dtype)), dim=-1)
