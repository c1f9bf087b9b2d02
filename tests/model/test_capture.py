"""The model is written for capture: torch.compile(fullgraph=True) takes the full forward and a decode step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import v4compile


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    cos = F.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1)
    assert cos.median() > 0.999 and cos.min() > 0.9, cos


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_full_forward_and_decode_step_capture_without_graph_breaks(tiny_model: v4compile.DeepSeekV4,
                                                                   backend: str) -> None:
    torch._dynamo.reset()
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 37))
    with torch.no_grad():
        eager = tiny_model(ids)
        compiled = torch.compile(tiny_model, fullgraph=True, backend=backend)(ids)
        _close(compiled, eager)

        eager_cache, compiled_cache = tiny_model.new_cache(2), tiny_model.new_cache(2)
        tiny_model(ids, cache=eager_cache)
        tiny_model(ids, cache=compiled_cache)
        step = torch.compile(tiny_model.decode_step, fullgraph=True, backend=backend)
        token = ids[:, -1:]
        for pos in range(37, 45):
            positions = torch.full((2,), pos)
            want = tiny_model.decode_step(token, positions, eager_cache)
            got = step(token, positions, compiled_cache)
            _close(got, want)
            token = want.argmax(-1)
        for a, b in zip(eager_cache.layers, compiled_cache.layers, strict=True):
            assert torch.equal(a.window, b.window)


@pytest.mark.slow
def test_decode_step_compiles_with_inductor(tiny_model: v4compile.DeepSeekV4) -> None:
    torch._dynamo.reset()
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 20))
    cache_a, cache_b = tiny_model.new_cache(1), tiny_model.new_cache(1)
    with torch.no_grad():
        tiny_model(ids, cache=cache_a)
        tiny_model(ids, cache=cache_b)
        step = torch.compile(tiny_model.decode_step, fullgraph=True)
        positions = torch.tensor([20])
        _close(step(ids[:, -1:], positions, cache_b), tiny_model.decode_step(ids[:, -1:], positions, cache_a))
