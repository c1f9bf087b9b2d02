"""The mHC pre and post kernels against the model's hc_pre / hc_post on random inputs (Triton interpreter).

Tolerances: post and comb (fp32) within 1e-5 of the reference. y and the new streams are rounded to bf16 like
the reference; the fp32 sums before that rounding differ from PyTorch's in their last bits (split-K order), so a
value next to a rounding boundary may land one bf16 step away: at most 2^-7 relative, and rarely.
"""

from __future__ import annotations

import math

import pytest
import torch

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import REGISTRY
from v4compile.codegen.triton import mhc

BF16_STEP = 2.0**-7


def _inputs(lead: tuple[int, ...], n: int, dim: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, n, dim, generator=gen) * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * dim, generator=gen) / math.sqrt(n * dim) * 4
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn((2 + n) * n, generator=gen)
    return x, fn, scale, base


def _close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=1e-6)
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("lead", "n", "dim", "iters"), [
    ((1,), 4, 128, 20), ((4,), 4, 128, 20), ((2, 3), 4, 64, 7), ((64,), 4, 128, 20), ((70,), 4, 32, 1),
    ((5,), 3, 48, 20), ((2, 1), 2, 16, 3),
])
def test_mhc_pre_matches_hc_pre(lead: tuple[int, ...], n: int, dim: int, iters: int) -> None:
    x, fn, scale, base = _inputs(lead, n, dim, seed=sum(lead) + n + dim)
    y, post, comb = ops.mhc_pre(x, fn, scale, base, iters, 1e-6, 1e-6, "triton")
    want_y, want_post, want_comb = reference.mhc_pre(x, fn, scale, base, iters, 1e-6, 1e-6)
    _close_bf16(y, want_y)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-6)
    assert REGISTRY.records[f"mhc_pre.n{n}.d{dim}.triton"].error is None


@pytest.mark.parametrize(("tiles", "splits"), [
    ((16, 64, 1, 32, 2), (1, 512)), ((16, 32, 4, 128, 2), (5, 128)), ((32, 128, 8, 64, 1), (4, 128)),
])
def test_mhc_pre_split_k_and_tiles(tiles: tuple[int, ...], splits: tuple[int, int]) -> None:
    """Uneven split-K (the last split short or empty of whole blocks), several row and D tiles and warps."""
    block_m, block_k, rows, block_d, warps = tiles
    config = {"BLOCK_M": block_m, "BLOCK_K": block_k, "SPLITS": splits[0], "PER_SPLIT": splits[1], "ROWS": rows,
              "BLOCK_D": block_d, "num_warps": 4, "FINISH_WARPS": warps}
    x, fn, scale, base = _inputs((19,), 4, 128, torch.float32, seed=3)
    y, post, comb = mhc.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, config)
    want_y, want_post, want_comb = reference.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("lead", "n", "dim", "dtype"), [
    ((1,), 4, 128, torch.bfloat16), ((16,), 4, 128, torch.bfloat16), ((2, 3), 4, 64, torch.float32),
    ((5,), 3, 48, torch.bfloat16),
])
def test_mhc_post_matches_hc_post(lead: tuple[int, ...], n: int, dim: int, dtype: torch.dtype) -> None:
    x, fn, scale, base = _inputs(lead, n, dim, dtype, seed=7)
    _, post, comb = reference.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    y = torch.randn(*lead, dim).to(dtype)
    got = ops.mhc_post(y, x, post, comb, "triton")
    _close_bf16(got, reference.mhc_post(y, x, post, comb))


def test_launch_config_splits_small_batches_over_k() -> None:
    """A one-row decode on the GPU splits vec(X) (V4-Flash: 16384 wide) over many programs; prefill does not."""
    small = mhc.pre_launch_config(1, 4, 4096, cuda=False)
    assert small["SPLITS"] == 4 and small["SPLITS"] * small["PER_SPLIT"] >= 4 * 4096
    assert mhc.pre_launch_config(4096, 4, 4096, cuda=False)["SPLITS"] == 1
    x, fn, scale, base = _inputs((3,), 4, 128)
    ops.mhc_pre(x, fn, scale, base, 20, 1e-6, 1e-6, "triton")
    record = REGISTRY.records["mhc_pre.n4.d128.triton"]
    assert "def mhc_mixes" in record.source and record.launch["SPLITS"] >= 1 and record.launches >= 1


def test_gradients_through_the_ops_equal_the_model_code() -> None:
    x, fn, scale, base = _inputs((2, 3), 4, 32, torch.float32, seed=11)
    leaves = [t.clone().requires_grad_() for t in (x, fn, scale, base)]
    weights = [torch.randn(2, 3, 32), torch.randn(2, 3, 4), torch.randn(2, 3, 4, 4)]

    def loss(outputs) -> torch.Tensor:
        return sum((o * w).sum() for o, w in zip(outputs, weights, strict=True))

    got = torch.autograd.grad(loss(ops.mhc_pre(*leaves, 5, 1e-6, 1e-6, "triton")), leaves)
    want = torch.autograd.grad(loss(reference.mhc_pre(*leaves, 5, 1e-6, 1e-6)), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    y, post, comb = (torch.randn(2, 32, requires_grad=True), torch.rand(2, 4, requires_grad=True),
                     torch.rand(2, 4, 4, requires_grad=True))
    streams = torch.randn(2, 4, 32, requires_grad=True)
    got = torch.autograd.grad(ops.mhc_post(y, streams, post, comb, "triton").square().sum(), (y, streams, post, comb))
    want = torch.autograd.grad(reference.mhc_post(y, streams, post, comb).square().sum(), (y, streams, post, comb))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
