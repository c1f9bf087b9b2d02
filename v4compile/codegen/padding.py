"""Kernel inputs padded up to a kernel's tile, shared by the custom op (``sparse_attention_padded``) and the
kernel bodies that pad for themselves (TileLang's sparse attention): a module of its own so that kernel modules
need not import the custom ops that import them."""

from __future__ import annotations

from collections.abc import Callable

import torch


def with_padded_heads(attention: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], q: torch.Tensor,
                      sink: torch.Tensor, multiple: int) -> torch.Tensor:
    """``attention(q, sink)`` on queries [B,S,H,d] and sinks [H] padded with zero heads (sink 0) up to a
    multiple of ``multiple``, keeping the real heads: for kernels whose head tile is ``multiple``."""
    heads = q.shape[2]
    extra = -heads % multiple
    padded_q = torch.nn.functional.pad(q, (0, 0, 0, extra))
    return attention(padded_q, torch.nn.functional.pad(sink, (0, extra)))[:, :, :heads].contiguous()
