"""Shared fixtures: golden checkpoint locations and models loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import v4compile

GOLDEN_ROOT = Path(os.environ.get("V4_GOLDEN", Path(__file__).resolve().parents[1].parent / "shared" / "golden"))
GOLDEN_FOLDERS = ("tiny-bf16", "tiny-fp8-fp4")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips ``gpu``-marked tests where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def golden_root() -> Path:
    if not GOLDEN_ROOT.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN_ROOT}")
    return GOLDEN_ROOT


@pytest.fixture(scope="session")
def golden_models(golden_root: Path) -> dict[str, v4compile.DeepSeekV4]:
    return {name: v4compile.load(golden_root / name).eval() for name in GOLDEN_FOLDERS}


@pytest.fixture(scope="session")
def tiny_model() -> v4compile.DeepSeekV4:
    return v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0).eval()
