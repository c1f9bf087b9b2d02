"""slice_update on CUDA: Inductor's Triton code rotates the queries inside the projection's buffer, and the tiny
model's logits are bitwise the same with the pass as without it."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import v4compile
from v4compile.model.config import V4Config
from v4compile.model.transformer import DeepSeekV4

pytestmark = pytest.mark.gpu

TOKENS, HEADS, DIM, ROPE = 512, 8, 512, 64


class Queries(torch.nn.Module):
    """Heads whose last ROPE columns are rotated, as the model's queries are."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, HEADS * DIM, bias=False, dtype=torch.bfloat16, device="cuda")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from v4compile.model.rope import apply_rope

        return apply_rope(self.proj(x).view(x.shape[0], HEADS, DIM), cos, sin)


def test_ropes_cat_is_written_in_place_cuda() -> None:
    angles = torch.rand(TOKENS, 1, ROPE // 2, device="cuda") * 6
    args = torch.randn(TOKENS, DIM, device="cuda").bfloat16(), angles.cos(), angles.sin()
    module = Queries().eval()
    optimized = v4compile.optimize(module, passes=["slice_update"])
    with torch.no_grad():
        got, code = run_and_get_code(optimized, *args)
        want = module(*args)
    assert torch.equal(got, want)
    buffers = sum(c.count(f"empty_strided_cuda(({TOKENS}, {HEADS * DIM})") +
                  c.count(f"empty_strided_cuda(({TOKENS}, {HEADS}, {DIM})") for c in code)
    assert buffers == 1


def test_the_tiny_models_logits_are_unchanged_by_it_cuda() -> None:
    model = DeepSeekV4(V4Config.preset("tiny"), seed=0).eval().cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        with_pass = v4compile.optimize(model)(ids)
        without = v4compile.optimize(model, disable=("slice_update",))(ids)
    assert torch.equal(with_pass, without)
