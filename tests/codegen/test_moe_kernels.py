"""The MoE dispatch kernel against the model's routed experts on random inputs (CPU: Triton interpreter).

Tolerance: the kernel's products are exact (e4m3/e2m1 times powers of two, and bf16, are exact in fp32) and it
rounds where the model rounds, so only the fp32 summation order of each dot differs. That noise flips a bf16
(or, on the hidden state, an e4m3) rounding now and then: nearly every element is bitwise equal and the worst
difference is a small fraction of the output's scale (``moe_dispatch``'s stated tolerance, 2e-2 of max|y|).
"""

from __future__ import annotations

import re

import pytest
import torch

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import REGISTRY
from v4compile.codegen.triton import moe
from v4compile.model import quant
from v4compile.model.init import random_tensors
from v4compile.model.moe import RoutedExperts

DIM, INTER, EXPERTS, TOP_K, LIMIT = 256, 128, 6, 2, 10.0


def make_experts(fmt: str, pow2: bool, n: int = EXPERTS, dim: int = DIM, inter: int = INTER, seed: int = 0,
                 first: int = 0) -> RoutedExperts:
    """``n`` of the model's routed experts with the model's seeded random init in format ``fmt``."""
    experts = RoutedExperts(n, first, dim, inter, fmt, pow2, LIMIT)
    state = experts.state_dict()
    with torch.no_grad():
        for name, value in random_tensors(experts, seed):
            e, rest = name.split(".", 1)
            state[rest][int(e)].copy_(value)
    return experts


def weights_of(experts: RoutedExperts) -> list[torch.Tensor | None]:
    """The op's w1, w3, w2, s1, s3, s2 (scales None for bf16)."""
    layers = (experts.w1, experts.w3, experts.w2)
    return [w.weight for w in layers] + [w.scale for w in layers]


def raise_scales(experts: RoutedExperts) -> None:
    """Every other expert's scale bytes up by 20: bytes above 128 (weights beyond 2^1 per unit)."""
    with torch.no_grad():
        for layer in (experts.w1, experts.w3, experts.w2):
            layer.scale.view(torch.uint8)[::2] += 20


def routing(tokens: int, n_experts: int, k: int, seed: int,
            allowed: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate-free top-k ids [T, k] among ``allowed`` experts and their routing weights [T, k]."""
    gen = torch.Generator().manual_seed(seed)
    allowed_t = torch.tensor(allowed if allowed is not None else range(n_experts))
    ids = allowed_t[torch.rand(tokens, len(allowed_t), generator=gen).argsort(-1)[:, :k]]
    return torch.rand(tokens, k, generator=gen) + 0.05, ids


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the stated tolerance: 2e-2 of max|want| everywhere, and 99% of the elements bitwise equal."""
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = want.abs().max().clamp_min(1e-30)
    assert (got - want).abs().max() <= 2e-2 * scale, ((got - want).abs().max(), scale)
    assert (got == want).float().mean() >= 0.99


def _run(experts: RoutedExperts, fmt: str, pow2: bool, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
         first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    args = (x, weights, ids, first, *weights_of(experts), fmt, pow2, LIMIT)
    with torch.no_grad():
        return ops.moe_experts(*args, "triton"), reference.moe_experts(*args)


@pytest.fixture(scope="module")
def expert_sets() -> dict[tuple[str, bool], RoutedExperts]:
    return {key: make_experts(*key) for key in (("fp4", True), ("fp8", False), ("bf16", False))}


@pytest.mark.parametrize(("fmt", "pow2", "tokens"), [
    ("fp4", True, 1), ("fp4", True, 33), ("fp8", False, 6), ("bf16", False, 1), ("bf16", False, 17),
])
def test_moe_kernel_matches_the_models_experts(expert_sets: dict, fmt: str, pow2: bool, tokens: int) -> None:
    x = (torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(tokens)) * 2).bfloat16()
    weights, ids = routing(tokens, EXPERTS, TOP_K, seed=tokens)
    got, want = _run(expert_sets[(fmt, pow2)], fmt, pow2, x, weights, ids)
    assert_matches(got, want)


def test_experts_without_tokens_and_another_ranks_experts(expert_sets: dict) -> None:
    """Only experts 1, 2 and 5 are chosen (the rest get no tokens); a rank holding experts 3..5 (first=3) sums
    its own experts' terms only, as the model's shard does before its all-reduce."""
    x = torch.randn(19, DIM, generator=torch.Generator().manual_seed(7)).bfloat16()
    weights, ids = routing(19, EXPERTS, TOP_K, seed=7, allowed=[1, 2, 5])
    experts = expert_sets[("fp4", True)]
    assert_matches(*_run(experts, "fp4", True, x, weights, ids))
    local = make_experts("fp4", True, n=3, first=3)
    got, want = _run(local, "fp4", True, x, weights, ids, first=3)
    assert_matches(got, want)
    assert (got[(ids >= 3).sum(-1) == 0] == 0).all()


def test_repeated_ids_count_once(expert_sets: dict) -> None:
    """A hash table may name an expert twice for a token; the model then runs it once."""
    x = torch.randn(9, DIM, generator=torch.Generator().manual_seed(3)).bfloat16()
    weights, ids = routing(9, EXPERTS, 3, seed=3)
    ids[::2, 2] = ids[::2, 0]
    weights[::2, 2] = weights[::2, 0]
    got, want = _run(expert_sets[("bf16", False)], "bf16", False, x, weights, ids)
    assert_matches(got, want)
    once, _ = _run(expert_sets[("bf16", False)], "bf16", False, x[::2], weights[::2, :2], ids[::2, :2])
    torch.testing.assert_close(got[::2], once, rtol=0, atol=0)


@pytest.mark.parametrize(("fmt", "pow2", "tokens", "swap"), [
    ("fp4", True, 1, False), ("fp4", False, 40, False), ("fp8", True, 9, False), ("bf16", False, 3, False),
    ("fp4", True, 1, True), ("fp4", False, 13, True), ("fp8", True, 9, True)])
def test_the_gpu_formulation_runs_under_the_interpreter(fmt: str, pow2: bool, tokens: int, swap: bool) -> None:
    """``tl_dot`` (the GPU's path: microscaled ``tl.dot_scaled`` for FP4/FP8, ``tl.dot`` for bf16) instead of the
    interpreter's broadcast product: the same results; ``swap`` (the decode tiles' transposed product, 8-row tiles,
    K blocks of 256) too."""
    experts = make_experts(fmt, pow2)
    x = (torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(tokens)) * 2).bfloat16()
    weights, ids = routing(tokens, EXPERTS, TOP_K, seed=tokens)
    config = {**moe.launch_config(tokens * TOP_K, EXPERTS, tokens, DIM, INTER, cuda=False), "tl_dot": True,
              "BM": 8 if swap else 16, "BK": 256 if swap else 128, "swap": swap}
    args = (x, weights, ids, 0, *weights_of(experts), fmt, pow2, LIMIT)
    with torch.no_grad():
        got = moe.moe_experts(*args, config=config)
        want = reference.moe_experts(*args)
    assert_matches(got, want)


@pytest.mark.parametrize(("pow2", "tokens", "bk", "big_scales"), [(True, 1, 128, False), (False, 37, 256, False),
                                                           (True, 20, 128, True)])
def test_fp4_weights_widened_in_the_kernel_match_the_models_experts(pow2: bool, tokens: int, bk: int,
                                                                     big_scales: bool) -> None:
    """``widen`` (the prefill tiles' formulation: the kernel widens the packed FP4 weights itself, 4 bytes at a
    time, for tensor cores fed from shared memory) gives the model's results; scale bytes above 128 (weights
    beyond 2^1 per unit, taking the second power-of-two product) too."""
    experts = make_experts("fp4", pow2)
    if big_scales:
        raise_scales(experts)
    x = (torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(tokens)) * 2).bfloat16()
    weights, ids = routing(tokens, EXPERTS, TOP_K, seed=tokens)
    config = {**moe.launch_config(tokens * TOP_K, EXPERTS, tokens, DIM, INTER, cuda=False), "tl_dot": True,
              "widen": True, "BM": 16, "BK": bk}
    args = (x, weights, ids, 0, *weights_of(experts), "fp4", pow2, LIMIT)
    with torch.no_grad():
        got = moe.moe_experts(*args, config=config)
        want = reference.moe_experts(*args)
    if big_scales:
        assert int(experts.w1.scale.view(torch.uint8).max()) > 128
    assert_matches(got, want)


@pytest.mark.parametrize(("fmt", "pow2", "tokens", "tl_dot"), [("fp4", True, 1, True), ("fp4", False, 7, False),
                                                         ("fp8", True, 5, True), ("bf16", False, 4, False)])
def test_k_split_gemms_match_the_models_experts(fmt: str, pow2: bool, tokens: int, tl_dot: bool) -> None:
    """Few pairs split each GEMM's K among programs (the decode path: more loads in flight); the parts' fp32 sums
    are added in a fixed order by the finishing kernels, so results repeat bitwise and stay in the model's band."""
    experts = make_experts(fmt, pow2)
    x = (torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(tokens)) * 2).bfloat16()
    weights, ids = routing(tokens, EXPERTS, TOP_K, seed=tokens)
    base = {**moe.launch_config(tokens * TOP_K, EXPERTS, tokens, DIM, INTER, cuda=False), "tl_dot": tl_dot,
            "BK": 128}
    args = (x, weights, ids, 0, *weights_of(experts), fmt, pow2, LIMIT)
    with torch.no_grad():
        whole = moe.moe_experts(*args, config=base)
        split = moe.moe_experts(*args, config={**base, "programs": 10**6})
        again = moe.moe_experts(*args, config={**base, "programs": 10**6})
        want = reference.moe_experts(*args)
    parts = REGISTRY.records[moe.kernel_name(fmt)].launch["k_parts"]
    assert parts == (2, 1), parts
    assert_matches(split, want)
    assert_matches(split, whole)
    assert torch.equal(split, again)


@pytest.mark.parametrize("pow2", [True, False])
def test_activation_quantization_is_the_models_bit_for_bit(pow2: bool) -> None:
    """e4m3 ties (odd multiples of half a quantum), subnormals, saturation, zero rows and the amax floor."""
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randn(256, generator=gen) * 10.0 ** torch.randint(-6, 4, (256,), generator=gen)]
    ties = (torch.arange(256) % 8 * 2 + 17.0) * 2.0 ** torch.randint(-12, 4, (256,), generator=gen)
    rows += [ties * torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0), torch.zeros(256),
             torch.full((256,), 3e-5), torch.linspace(-1e-3, 1e-3, 256), torch.randn(256, generator=gen) * 1e4]
    x = torch.stack(rows).bfloat16()
    got = moe.simulate_fp8(x, pow2)
    assert torch.equal(got.view(torch.int16), quant.fp8_simulate(x, 128, pow2).view(torch.int16))


@pytest.mark.parametrize(("fmt", "broken", "needle"), [
    ("fp4", "s3", "scale of w3 must be (6, 128, 8)"),
    ("fp8", "s2", "scale of w2 must be (6, 2, 1)"),
    ("fp4", "w2", "expert weight w2 must be torch.int8 (6, 256, 64)"),
    ("fp8", "w3", "expert weight w3 must be torch.float8_e4m3fn (6, 128, 256)"),
    ("bf16", "w1", "expert weight w1 must be torch.bfloat16 (6, 128, 256)"),
])
def test_misshapen_expert_tensors_are_named(expert_sets: dict, fmt: str, broken: str, needle: str) -> None:
    """A scale or weight that does not fit its experts' blocks is a clear error naming it, before any kernel runs."""
    experts = expert_sets[(fmt, fmt == "fp4")]
    tensors = dict(zip(("w1", "w3", "w2", "s1", "s3", "s2"), weights_of(experts), strict=True))
    tensors[broken] = tensors[broken][..., 1:]
    x = torch.randn(3, DIM).bfloat16()
    weights, ids = routing(3, EXPERTS, TOP_K, seed=1)
    with pytest.raises(ValueError, match=re.escape(needle)):
        ops.moe_experts(x, weights, ids, 0, *tensors.values(), fmt, fmt == "fp4", LIMIT, "triton")


@pytest.mark.parametrize(("fmt", "pow2"), [("fp4", True), ("bf16", False)])
def test_halves_of_a_fused_gate_up_weight_are_read_in_place(expert_sets: dict, fmt: str, pow2: bool) -> None:
    """w1 and w3 as the two halves of one [E, 2I, ...] tensor (transformers' fused ``gate_up_proj``): the same
    results as separate tensors, bitwise."""
    experts = expert_sets[(fmt, pow2)]
    w1, w3, w2, s1, s3, s2 = weights_of(experts)
    fused = torch.cat((w1, w3), dim=1)
    scales = torch.cat((s1, s3), dim=1) if s1 is not None else None
    halves = (fused[:, :INTER], fused[:, INTER:], w2) + ((scales[:, :INTER], scales[:, INTER:], s2) if s1 is not None
                                                           else (None, None, None))
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(5)).bfloat16()
    weights, ids = routing(5, EXPERTS, TOP_K, seed=5)
    with torch.no_grad():
        got = ops.moe_experts(x, weights, ids, 0, *halves, fmt, pow2, LIMIT, "triton")
        want = ops.moe_experts(x, weights, ids, 0, w1, w3, w2, s1, s3, s2, fmt, pow2, LIMIT, "triton")
    assert not halves[0].is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize(("pow2", "tokens", "allowed", "big_scales"), [
    (True, 37, None, False), (False, 8, [0, 3, 4], False), (True, 21, None, True)])
def test_the_tilelang_fp4_gemms_match_the_models_experts(pow2: bool, tokens: int, allowed: list[int] | None,
                                                        big_scales: bool) -> None:
    """TileLang's FP4 expert GEMMs (the ``c`` target: the same source's widening and fragment column order, loops
    for the tensor cores): the model's results with partial and empty row tiles, experts without tokens and scale
    bytes above 128."""
    pytest.importorskip("tilelang")
    experts = make_experts("fp4", pow2)
    if big_scales:
        raise_scales(experts)
    x = (torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(tokens)) * 2).bfloat16()
    weights, ids = routing(tokens, EXPERTS, TOP_K, seed=tokens, allowed=allowed)
    args = (x, weights, ids, 0, *weights_of(experts), "fp4", pow2, LIMIT)
    with torch.no_grad():
        got, want = ops.moe_experts(*args, "tilelang"), reference.moe_experts(*args)
    assert_matches(got, want)
    record = REGISTRY.records["moe_experts.fp4.tilelang"]
    assert record.error is None and record.launch["target"] == "c" and record.launch["pairs"] == tokens * TOP_K


def test_the_tilelang_body_leaves_what_it_does_not_take_to_triton(expert_sets: dict) -> None:
    """FP8 experts and the halves of a fused gate/up tensor (read in place by the Triton kernels, which TileLang's
    contiguous tensors cannot) run the Triton body, with its results."""
    pytest.importorskip("tilelang")
    from v4compile.codegen.tilelang import moe as tilelang_moe

    x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(6)).bfloat16()
    weights, ids = routing(6, EXPERTS, TOP_K, seed=6)
    w1, w3, w2, s1, s3, s2 = weights_of(expert_sets[("fp4", True)])
    fused, scales = torch.cat((w1, w3), dim=1), torch.cat((s1, s3), dim=1)
    halves = (fused[:, :INTER], fused[:, INTER:], w2, scales[:, :INTER], scales[:, INTER:], s2)
    fp8 = (x, weights, ids, 0, *weights_of(expert_sets[("fp8", False)]), "fp8", False, LIMIT)
    with torch.no_grad():
        for args in (fp8, (x, weights, ids, 0, *halves, "fp4", True, LIMIT)):
            assert torch.equal(tilelang_moe.moe_experts(*args), moe.moe_experts(*args))


@pytest.mark.parametrize("columns", ["natural", "fragment"])
def test_quantized_rows_gathered_by_pair_in_either_column_order(columns: str) -> None:
    """``quantize`` with a gather: row r of the output is the quantized row of the token of sorted pair r, only
    for the local experts' pairs, each 128-block's columns in the order asked for."""
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [0, 1], [2, 1], [5, 0]])
    counts, order, slots = moe.routing_buffers(ids.numel(), 3, x.device)
    moe.route(ids, 0, "fp4", counts, order, slots)
    out = torch.full((ids.numel(), 256), float("nan")).bfloat16()
    moe.quantize(x, out, counts, True, "fp4", columns, gather=(order, 2))
    valid = int(counts.sum())
    want = quant.fp8_simulate(x, 128, True)[order[:valid].long() // 2]
    if columns == "fragment":
        # column 32w + 16a + 8b + 2c + v of a block holds 32c + 8w + 4v + 2b + a
        want = want.view(valid, 2, 4, 4, 2, 2, 2).permute(0, 1, 3, 6, 5, 2, 4).reshape(valid, 256)
    assert valid == 13 and torch.equal(out[:valid].view(torch.int16), want.view(torch.int16))
    assert out[valid:].isnan().all()


def test_row_tiles_cover_each_experts_pairs_once() -> None:
    """``tile_map``: each expert's pairs in whole tiles of 4 rows, experts in order, the tiles past the last -1."""
    counts = torch.tensor([5, 0, 4, 1], dtype=torch.int32)
    tile_e, tile_row, tile_end = moe.tile_map(counts, 4, int(counts.sum()), "fp4")
    assert tile_e.tolist() == [0, 0, 2, 3, -1, -1, -1]  # at most pairs / 4 + experts tiles
    assert tile_row[:4].tolist() == [0, 4, 5, 9] and tile_end[:4].tolist() == [5, 5, 9, 10]


def test_auto_runs_the_triton_kernel_where_tilelangs_cannot_be_built(expert_sets: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" takes TileLang's MoE GEMMs on Hopper; a build that fails there (a TileLang or compiler problem of
    that machine) runs the Triton kernel, with a warning naming both, not the far slower reference body."""
    pytest.importorskip("tilelang")
    from v4compile.codegen import tilelang
    from v4compile.codegen.registry import KernelBuildError

    def broken(*args: object, **kwargs: object) -> None:
        raise KernelBuildError("moe_experts.fp4.tilelang: no TileLang build here (test)")

    monkeypatch.setattr(ops, "auto_takes_tilelang", lambda: True)
    monkeypatch.setitem(tilelang.IMPLEMENTATIONS, "moe_experts", broken)
    x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(6)).bfloat16()
    weights, ids = routing(6, EXPERTS, TOP_K, seed=6)
    args = (x, weights, ids, 0, *weights_of(expert_sets[("fp4", True)]), "fp4", True, LIMIT)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="no TileLang build here.*using the Triton kernel"):
        got = ops.moe_experts(*args, "auto")
    assert torch.equal(got, ops.moe_experts(*args, "triton"))
