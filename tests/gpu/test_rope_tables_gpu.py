"""The RoPE tables on CUDA: ``normalize`` rewrites the model's ``torch.polar`` tables to ``cos``/``sin`` there, which
must change no value (CUDA's polar computes the same cos and sin) and no rewrite."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import v4compile
from v4compile.model.config import V4Config
from v4compile.model.transformer import DeepSeekV4
from v4compile.passes import normalize

pytestmark = pytest.mark.gpu

RULE = "unit polar -> cos, sin (CUDA)"


def _optimized_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, Counter[str], int]:
    with torch.no_grad():
        optimized = v4compile.optimize(model, inductor=False)
        logits = optimized(ids)
    reports = optimized.reports()
    return (logits, Counter(m.kernel for r in reports for m in r.matches),
            sum(r.normalized.get(RULE, 0) for r in reports))


def test_polar_tables_as_cos_and_sin_change_nothing_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    model = DeepSeekV4(V4Config.preset("tiny"), seed=0).eval().cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    logits, kernels, fired = _optimized_logits(model, ids)
    assert fired > 0
    monkeypatch.setattr(normalize, "_unit_polar_to_cos_sin", lambda node: 0)
    kept, kept_kernels, _ = _optimized_logits(model, ids)
    assert kernels == kept_kernels
    assert torch.equal(logits, kept)
