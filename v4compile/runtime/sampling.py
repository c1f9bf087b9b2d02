"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
           ) -> tuple[int, float]:
    """The next token of one sequence from its fp32 ``logits`` [vocab] and that token's log-probability
    under the model's own distribution (temperature 1, no top-p), which is what RL and mismatch checks use.

    ``temperature == 0`` is greedy (ties to the lowest id); otherwise the tempered distribution is cut to
    the smallest set of tokens whose probability reaches ``top_p`` and sampled with ``generator``."""
    logits = logits.float()
    if temperature == 0:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:
            sorted_probs, order = probs.sort(descending=True, stable=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(torch.log_softmax(logits, dim=-1)[token])
