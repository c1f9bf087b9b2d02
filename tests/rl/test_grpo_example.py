"""The GRPO example raises its reward, and updated weights reach the engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from v4compile import DeepSeekV4, V4Config
from v4compile.runtime.engine import Engine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_grpo.py"


def _example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("rl_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_raises_the_mean_reward() -> None:
    history = _example().train(steps=12, group=8, prompts=2, lr=1e-2, log=False)
    assert sum(history[-3:]) / 3 > sum(history[:3]) / 3 + 0.2, history


def test_updated_weights_reach_the_engine_and_drop_its_cached_prefixes() -> None:
    model = DeepSeekV4(V4Config.preset("tiny", max_seq_len=512), seed=1)
    engine = Engine(model, max_batch=2)
    prompt = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    before = engine.generate([prompt], 3)[0]
    with torch.no_grad():
        model.head.weight.mul_(1.5)
    engine.weights_updated()
    after = engine.generate([prompt], 3)[0]
    assert after.cache.cached_tokens == 0 and after.logprobs != before.logprobs
