"""transformers' DeepSeek-V4 optimized on the GPU with the default backend (Triton kernels, Inductor): the tiny random
model of tests/passes/test_hf_model.py runs the kernels its report lists (mHC pre/post, the attention of every layer
read through its mask, the indexer's scoring and top-k, the MoE of every layer, the compressors' pooling with their
bf16 finish), and its logits stay within the CPU test's bounds of transformers' eager output."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import v4compile
from v4compile.codegen.registry import REGISTRY

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed here")

EXPECTED = {"mhc_pre": 8, "mhc_post": 8, "sparse_attention": 4, "indexer_scores": 2, "moe_experts": 4,
            "compressor_entries": 5, "radix_topk": 2}
"""Rewrites per kernel family, as on the CPU, and the indexer's top-k, which only CUDA rewrites (its torch.topk takes
tied scores by lowest index, as the kernel does); counted by the pass that introduces the op (on CUDA
``head_padding`` also reports each attention call it pads, under the same kernel name)."""


def _cpu_test() -> ModuleType:
    """tests/passes/test_hf_model.py (its config and weight randomisation: one fixture for both tests)."""
    path = Path(__file__).resolve().parents[1] / "passes" / "test_hf_model.py"
    spec = importlib.util.spec_from_file_location("_hf_model_cpu_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launches(family: str) -> int:
    return sum(r.launches for name, r in REGISTRY.records.items() if name.startswith(f"{family}."))


def test_transformers_v4_runs_our_kernels_on_cuda(tmp_path: Path, save_tiny_hf_v4: Callable,
                                                   tiny_hf_v4_settings: dict) -> None:
    cpu = _cpu_test()
    hf = save_tiny_hf_v4(tiny_hf_v4_settings, tmp_path / "bf16").cuda().eval()
    config = hf.config
    ids = torch.randint(0, config.vocab_size, (1, cpu.SEQ), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        try:
            want = hf(ids).logits.float()[0]
        except RuntimeError as exc:  # seen on an H100 (2026-12-06): a dtype mismatch inside an nn.Linear
            raise AssertionError(f"transformers {transformers.__version__}'s own eager forward failed on CUDA, "
                                 f"before v4compile ran: {exc}") from exc
        optimized = v4compile.optimize(hf)
        optimized(ids)  # compiles
        before = {family: _launches(family) for family in EXPECTED}
        got = optimized(ids).logits.float()[0]
    kernels = [m.kernel for r in optimized.reports() for m in r.matches if m.pass_name != "head_padding"]
    for family, count in EXPECTED.items():
        names = [k for k in kernels if k.startswith(f"{family}.")]
        assert len(names) == count and all(k.endswith(".triton") for k in names), (family, names)
        assert _launches(family) > before[family], f"{family} is in the report but did not run"
    assert F.cosine_similarity(got, want, dim=-1).median() > 0.9995
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
