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
    # one region per kind of layer (0; 1 and 3; 2), then the head: the lines name the region being compiled
    assert first[0].startswith("forward.layers.0 [") and "Dynamo captured a graph of" in first[0]
    assert any(line.startswith("forward.layers.1,3 [") for line in first)
    assert any("retracing to ATen: done in" in line for line in first)
    rewrites = {name: sum(int(line.split(f"pass {name}: ")[1].split()[0]) for line in set(first)
                          if f"pass {name}:" in line) for name in ("mhc_tiling", "moe_dispatch")}
    assert rewrites == {"mhc_tiling": 12, "moe_dispatch": 3}
    assert "compiled and ran" in first[-1]
    assert again == []
