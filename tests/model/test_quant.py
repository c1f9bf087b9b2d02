"""FP8/FP4 numerics: rounding equals a hardware cast (ties included), formats round-trip."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from v4compile.model import quant
from v4compile.model.hadamard import hadamard_rotate

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _all_e4m3_values() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()].unique()


def _reference_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid value, ties to the even code, saturating at 6 (an independent formulation)."""
    mag = x.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - E2M1_GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = (dist == best).int() * (torch.arange(8) % 2 == 0).int() * 2 + (dist == best).int()
    code = candidates.argmax(dim=-1)
    return torch.copysign(E2M1_GRID[code], x)


def test_fp8_rounding_matches_hardware_cast_on_every_midpoint_and_value() -> None:
    grid = _all_e4m3_values()
    mids = (grid[1:] + grid[:-1]) / 2
    probes = torch.cat([grid, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
    expected = probes.to(torch.float8_e4m3fn).float()
    assert torch.equal(quant.round_fp8_e4m3(probes), expected)


def test_fp8_rounding_saturates() -> None:
    x = torch.tensor([448.0, 464.0, 1e6, -500.0, -1e30])
    assert quant.round_fp8_e4m3(x).tolist() == [448.0, 448.0, 448.0, -448.0, -448.0]


def test_fp4_rounding_ties_to_even_and_saturates() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0, 0.26, -2.6])
    assert quant.round_fp4_e2m1(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0, 0.5, -3.0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=64))
def test_fp4_rounding_matches_independent_reference(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(quant.round_fp4_e2m1(x), _reference_e2m1(x))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=64))
def test_fp8_rounding_matches_cast_on_random_values(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(quant.round_fp8_e4m3(x), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_fp8_simulation_uses_power_of_two_scales_when_asked() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 256) * 3
    y = quant.fp8_simulate(x, 64, pow2_scale=True)
    blocks_x, blocks_y = x.view(4, 4, 64), y.view(4, 4, 64)
    amax = blocks_x.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    assert torch.equal(blocks_y, (blocks_x / scale).to(torch.float8_e4m3fn).float() * scale)
    y_free = quant.fp8_simulate(x, 64, pow2_scale=False)
    scale = amax / 448
    assert torch.equal(y_free.view(4, 4, 64), (blocks_x / scale).to(torch.float8_e4m3fn).float() * scale)


def test_fp4_simulation_values_lie_on_scaled_grid() -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 64)
    y = quant.fp4_simulate(x).view(8, 2, 32)
    amax = x.view(8, 2, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    assert torch.equal(y, _reference_e2m1(x.view(8, 2, 32) / scale) * scale)


def test_fp4_pack_unpack_round_trip() -> None:
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = quant.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (7, 32)
    assert torch.equal(quant.unpack_fp4(packed), codes)
    assert torch.equal(packed.view(torch.uint8)[:, 0] & 0xF, codes[:, 0])


def test_fp4_weight_quantize_dequantize_is_exact_on_grid_values() -> None:
    torch.manual_seed(2)
    scales = torch.exp2(torch.randint(-4, 4, (5, 2, 1)).float())
    values = E2M1_GRID[torch.randint(0, 8, (5, 2, 32))] * torch.where(torch.rand(5, 2, 32) < 0.5, -1, 1)
    values[..., 0] = 6.0
    w = (values * scales).flatten(-2)
    packed, scale = quant.quantize_fp4_weight(w)
    assert torch.equal(quant.dequant_fp4_weight(packed, scale), w)


def test_fp8_weight_quantize_dequantize_close() -> None:
    torch.manual_seed(3)
    w = torch.randn(300, 200)
    q, s = quant.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    subnormal_step = 2**-9 * float(quant.e8m0_to_float(s).max())
    assert torch.allclose(quant.dequant_fp8_weight(q, s), w, rtol=2**-4, atol=subnormal_step)


def test_e8m0_decoding() -> None:
    u = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    assert quant.e8m0_to_float(u).tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]


def test_hadamard_matches_sylvester_matrix_and_is_orthogonal() -> None:
    n = 64
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(5, n)
    assert torch.allclose(hadamard_rotate(x), x @ h.T / math.sqrt(n), atol=1e-5)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-5)
