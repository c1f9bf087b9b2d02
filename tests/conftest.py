"""Shared fixtures: golden checkpoint locations and models loaded once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import v4compile

GOLDEN_ROOT = Path(os.environ.get("V4_GOLDEN", Path(__file__).resolve().parents[1].parent / "shared" / "golden"))
GOLDEN_FOLDERS = ("tiny-bf16", "tiny-fp8-fp4")


TEST_CACHE = Path(__file__).resolve().parents[1] / ".test-cache"


def pytest_configure(config: pytest.Config) -> None:
    """Compiled artifacts (the kernel registry's sources, Inductor's and Triton's caches) go to the project's own
    ``.test-cache``, never the user's caches."""
    for variable, folder in (("V4COMPILE_CACHE", "kernels"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                             ("TRITON_CACHE_DIR", "triton")):
        os.environ[variable] = str(TEST_CACHE / folder)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips ``gpu``-marked tests where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sm90_ptx() -> Callable[..., str]:
    """``codegen.triton.hopper.sm90_ptx``: a generated kernel's PTX for an sm_90 GPU from Triton's own compiler (no
    GPU needed): what the GPU would run, checked on the CPU (the interpreter accepts code the compiler rejects)."""
    pytest.importorskip("triton.backends.nvidia")
    from v4compile.codegen.triton.hopper import sm90_ptx as lower

    return lower


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


def _fp4_neighbours(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Whether each pair is one e2m1 step apart: both on the grid times a power-of-two scale s (the larger of the
    two is 0.5 to 6 scales, so s = 2**(floor(log2 larger) - f) for f in -1..2), or on the grids of s and s / 2
    (one each: their blocks' scales differ where the block maximum crossed a power of two) within one step of
    the coarser grid."""
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), dtype=torch.float64)
    g, w = got.double().cpu(), want.double().cpu()
    top = torch.maximum(g.abs(), w.abs())
    base = torch.floor(torch.log2(top))
    ok = torch.zeros_like(g, dtype=torch.bool)
    for f in (-1, 0, 1, 2):
        scale = torch.exp2(base - f)
        at_g, at_w = (g.abs() / scale)[:, None] == grid, (w.abs() / scale)[:, None] == grid
        apart = (at_g.float().argmax(1) - at_w.float().argmax(1)).abs() == 1
        fine_g, fine_w = (2 * g.abs() / scale)[:, None] == grid, (2 * w.abs() / scale)[:, None] == grid
        step = torch.where(top / scale <= 2, 0.5, torch.where(top / scale <= 4, 1.0, 2.0)) * scale
        one_each = at_g.any(1) & fine_w.any(1) | fine_g.any(1) & at_w.any(1)
        mixed = one_each & ((g - w).abs() <= step)
        ok |= (at_g.any(1) & at_w.any(1) & apart | mixed) & (g * w >= 0)
    return ok


@pytest.fixture(scope="session")
def assert_finished_entries() -> Callable[[torch.Tensor, torch.Tensor, bool, float], None]:
    """Checks fused compressor entries against the model's: bitwise but for a fraction (``1 - min_equal``) where
    the pooling's fp32 rounding, in another summation order, moves a value across a bf16 rounding boundary, which
    the finish's quantization can turn into one grid step: FP8 (at most 1/8 of the value, up to the subnormal
    spacing), or for the rotated branch's FP4 one step of the e2m1 grid (0.5 to 0 is all of it)."""

    def check(got: torch.Tensor, want: torch.Tensor, rotate: bool, min_equal: float = 0.99) -> None:
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
        unequal = int((got != want).sum())
        assert unequal <= max((1 - min_equal) * got.numel(), 2), (unequal, got.numel())  # a crossing or two
        differ = (got != want) & ~(got.isnan() & want.isnan())
        if rotate:
            assert _fp4_neighbours(got[differ], want[differ]).all(), (got[differ], want[differ])
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=0.13, atol=1e-2, equal_nan=True)

    return check


TINY_HF_V4 = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=128, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=16,
    index_n_heads=2, index_head_dim=64, index_topk=4, sliding_window=8, partial_rotary_factor=0.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1024, tie_word_embeddings=False,
)
"""A tiny transformers ``DeepseekV4Config`` with every layer kind: window-only, C4 (indexer) and C128 attention;
hash-routed (window and C4) and score-routed MoE."""


@pytest.fixture(scope="session")
def tiny_hf_v4_settings() -> dict[str, object]:
    """``TINY_HF_V4``, a copy per test session."""
    return dict(TINY_HF_V4)


def _randomize_hf_v4(model: torch.nn.Module) -> None:
    """transformers initialises a V4's sinks, biases, position biases and norms to constants and its hash table to
    zeros; random values make every tensor matter (hash rows are distinct experts, which both models count alike)."""
    config = model.config
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif name.endswith("tid2eid"):
                experts, k = config.n_routed_experts, config.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(config.vocab_size)]))


def _save_tiny_hf_v4(settings: dict[str, object], folder: Path) -> torch.nn.Module:
    """A tiny random fp32 transformers ``DeepseekV4ForCausalLM`` of ``settings`` (its config keys) reloaded in bf16
    (transformers then keeps its fp32 modules fp32, as in a real checkpoint) and saved in its module names in
    ``folder``; returns the bf16 model."""
    import transformers

    config = transformers.DeepseekV4Config(**settings)
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config)
    _randomize_hf_v4(model)
    fp32 = folder.with_name(folder.name + "-fp32")
    model.save_pretrained(fp32, save_original_format=False)
    bf16 = transformers.DeepseekV4ForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16)
    bf16.save_pretrained(folder, save_original_format=False)
    return bf16


@pytest.fixture(scope="session")
def save_tiny_hf_v4() -> Callable[[dict[str, object], Path], torch.nn.Module]:
    """``(settings, folder) -> bf16 model``: a tiny random transformers V4 saved as transformers saves it."""
    return _save_tiny_hf_v4

