"""slice_update: RoPE's cat written into the rotated tensor's own buffer, the same values bit for bit."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

import v4compile
from v4compile.model.rope import apply_rope
from v4compile.passes.manager import GraphReport

TOKENS, HEADS, DIM, ROPE = 64, 4, 128, 32


class Queries(torch.nn.Module):
    """A projection into heads whose last ROPE columns are rotated, as the model's queries are; ``keep`` also
    returns the unrotated heads (so they are read after the cat)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, HEADS * DIM, bias=False, dtype=torch.bfloat16)
        self.keep = keep

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], HEADS, DIM)
        rotated = apply_rope(q, cos, sin)
        return rotated + q if self.keep else rotated


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(TOKENS, 1, ROPE // 2, generator=g) * 6
    return torch.randn(TOKENS, DIM, generator=g).bfloat16(), angles.cos(), angles.sin()


def _outcomes(reports: list[GraphReport]) -> tuple[list[dict], list[str]]:
    passes = [p for r in reports for p in r.passes if p.name == "slice_update"]
    return [m.details for p in passes for m in p.matches], [n.reason for p in passes for n in p.near_misses]


def test_ropes_cat_becomes_an_in_place_update_with_the_same_values() -> None:
    """Compiled by Inductor, the rotated queries are bitwise eager's, and the generated code allocates one buffer of
    the heads' size (the projection's, rotated in place) where the cat needs two."""
    torch.manual_seed(0)
    module, args = Queries().eval(), _inputs()
    optimized = v4compile.optimize(module, passes=["slice_update"])
    with torch.no_grad():
        got, code = run_and_get_code(optimized, *args)
        want = module(*args)
    assert torch.equal(got, want)
    matches, misses = _outcomes(optimized.reports())
    assert matches == [{"dim": 2, "columns": f"{DIM - ROPE}:{DIM} of {DIM}"}] and not misses
    full = f"({TOKENS}, {HEADS}, {DIM})"
    assert sum(c.count(f"empty_strided_cpu({full}") for c in code) + \
        sum(c.count(f"empty_strided_cpu(({TOKENS}, {HEADS * DIM})") for c in code) == 1


def test_a_tensor_read_after_the_cat_is_a_near_miss_naming_the_reader() -> None:
    """Writing into heads still read afterwards would change what that read sees: no rewrite, and the near-miss says
    which node reads them."""
    module, args = Queries(keep=True).eval(), _inputs()
    optimized = v4compile.optimize(module, passes=["slice_update"], backend="reference", inductor=False)
    with torch.no_grad():
        assert torch.equal(optimized(*args), module(*args))
    matches, misses = _outcomes(optimized.reports())
    assert not matches and len(misses) == 1 and "is read after the cat (by add" in misses[0]


def test_pieces_that_do_not_tile_the_tensor_stay_a_cat() -> None:
    """A cat of a slice and a piece that together make a different shape, and a slice of a graph input, are
    near-misses with their reasons; the values are unchanged."""

    class Shorter(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = x * 2
            return torch.cat((z[:, :10], y), dim=1)

    class OfInput(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.cat((x[:, :16], y), dim=1)

    x, y = torch.randn(4, 32), torch.randn(4, 16)
    reasons = []
    for fn in (Shorter(), OfInput()):
        optimized = v4compile.optimize(fn, passes=["slice_update"], backend="reference", inductor=False)
        assert torch.equal(optimized(x, y), fn(x, y))
        matches, misses = _outcomes(optimized.reports())
        assert not matches
        reasons += misses
    assert "does not have the cat's shape" in reasons[0]
    assert "graph input or parameter" in reasons[1]


def test_the_tiny_model_is_bitwise_unchanged_and_every_rope_is_updated_in_place(
        tiny_model: v4compile.DeepSeekV4) -> None:
    """On the tiny preset (reference bodies, no Inductor) logits are eager's bit for bit with the pass on; each layer's
    query, key and output RoPE and its window keys' FP8 part are rewritten, and the C4 layers' indexer queries."""
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    optimized = v4compile.optimize(tiny_model, backend="reference", inductor=False, regions=False)
    with torch.no_grad():
        assert torch.equal(optimized(ids), tiny_model(ids))
    matches, misses = _outcomes(optimized.reports())
    layers = tiny_model.config.n_layers
    c4 = sum(r == 4 for r in tiny_model.config.compress_ratios[:layers])
    assert len(matches) == 4 * layers + c4 and not misses


def test_an_unbacked_size_is_declined_and_the_compiled_call_still_runs() -> None:
    """A token count known only at run time (as the CPU's decode batch is) is a near-miss saying so: Inductor's
    matmul lowering would have to guard on its value. The compiled call serves other token counts unchanged."""
    module, (x, cos, sin) = Queries().eval(), _inputs()
    torch._dynamo.decorators.mark_unbacked(x, 0)
    torch._dynamo.decorators.mark_unbacked(cos, 0)
    torch._dynamo.decorators.mark_unbacked(sin, 0)
    optimized = v4compile.optimize(module, passes=["slice_update"])
    with torch.no_grad():
        assert torch.equal(optimized(x, cos, sin), module(x, cos, sin))
        assert torch.equal(optimized(x[:5], cos[:5], sin[:5]), module(x[:5], cos[:5], sin[:5]))
    matches, misses = _outcomes(optimized.reports())
    assert not matches and len(misses) == 1 and "unbacked" in misses[0]
