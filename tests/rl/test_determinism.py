"""Deterministic mode: repeated runs are bitwise equal, and a sequence's log-probs do not depend on the
batch it runs in."""

from __future__ import annotations

import pytest
import torch

import v4compile
from v4compile import DeepSeekV4, V4Config, batch_invariant
from v4compile.runtime.engine import Engine


@pytest.fixture(autouse=True)
def _restore_determinism():  # type: ignore[no-untyped-def]
    yield
    torch.use_deterministic_algorithms(False)
    batch_invariant.disable()


def test_optimized_forward_and_gradients_repeat_bitwise() -> None:
    model = DeepSeekV4(V4Config.preset("tiny", max_seq_len=128), seed=0)
    optimized = v4compile.optimize(model, inductor=False, deterministic=True)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logprobs = optimized(ids).float().log_softmax(-1)
        logprobs.mean().backward()
        runs.append((logprobs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_engine_log_probs_do_not_depend_on_the_batch() -> None:
    model = DeepSeekV4(V4Config.preset("tiny", max_seq_len=512), seed=2)
    engine = Engine(model, max_batch=4, deterministic=True)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (20, 75, 140, 33)]
    reference = engine.generate(prompts[:1], 8)[0]
    for mix in ([2, 0], [3, 1, 0, 2], [0, 3, 1]):
        outs = engine.generate([prompts[i] for i in mix], 8)
        mine = outs[mix.index(0)]
        assert mine.tokens == reference.tokens and mine.logprobs == reference.logprobs, mix
