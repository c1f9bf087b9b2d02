"""The first call of an optimized entry point says what it is doing, with elapsed time, and later calls are
silent."""

from __future__ import annotations

import logging

import pytest
import torch

import v4compile
from v4compile import progress


def test_first_call_logs_capture_each_pass_and_its_end(caplog: pytest.LogCaptureFixture,
                                                        tiny_model: v4compile.DeepSeekV4) -> None:
    progress.LOGGER.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="v4compile.compile"):
            optimized = v4compile.optimize(tiny_model, backend="reference", inductor=False,
                                           passes=["mhc_tiling", "moe_dispatch"])
            ids = torch.randint(0, tiny_model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                optimized(ids)
            first = [r.getMessage() for r in caplog.records]
            caplog.clear()
            with torch.no_grad():
                optimized(ids)
            again = [r.getMessage() for r in caplog.records]
    finally:
        progress.LOGGER.removeHandler(caplog.handler)
    assert first[0].startswith("forward [") and "Dynamo captured a graph of" in first[0]
    assert any("retracing to ATen: done in" in line for line in first)
    assert any("pass mhc_tiling: 16 rewrites" in line for line in first)
    assert any("pass moe_dispatch: 4 rewrites" in line for line in first)
    assert "compiled and ran" in first[-1]
    assert again == []
