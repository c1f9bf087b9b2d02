"""The model's simulated quantization on the GPU equals the CPU's bit for bit (the spec's numerics on every
device): non-power-of-two FP8 scales included, whose amax / 448 CUDA would otherwise compute through a
rounded reciprocal, moving e4m3 ties in about one element in two thousand."""

from __future__ import annotations

import pytest
import torch

from v4compile.model import quant

pytestmark = pytest.mark.gpu


def bf16_rows(seed: int) -> torch.Tensor:
    """bf16 rows whose ratios to their block maxima often land on e4m3 ties: random magnitudes over a wide range,
    small-integer multiples of powers of two, and block maxima of 448 * 2^k and 6 * 2^k."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 512, generator=gen) * 10.0 ** torch.randint(-4, 4, (256, 1), generator=gen)
    x[::4] = torch.randint(-64, 65, (64, 512), generator=gen) * 2.0 ** torch.randint(-8, 4, (64, 1), generator=gen)
    x[1::8, ::128] = 448.0 * 2.0 ** torch.randint(-10, 2, (32, 1), generator=gen)
    x[3::8, ::32] = 6.0 * 2.0 ** torch.randint(-10, 2, (32, 1), generator=gen)
    return x.bfloat16()


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [quant.FP8_ACT_BLOCK, quant.FP8_KV_BLOCK])
def test_fp8_simulate_on_cuda_equals_cpu_bitwise(pow2: bool, block: int) -> None:
    x = bf16_rows(block + pow2)
    got = quant.fp8_simulate(x.cuda(), block, pow2).cpu()
    assert torch.equal(got.view(torch.int16), quant.fp8_simulate(x, block, pow2).view(torch.int16))


def test_fp4_simulate_and_weight_quantization_on_cuda_equal_cpu_bitwise() -> None:
    x = bf16_rows(7)
    assert torch.equal(quant.fp4_simulate(x.cuda()).cpu().view(torch.int16), quant.fp4_simulate(x).view(torch.int16))
    w = x.float()[:, :256]
    for quantize in (quant.quantize_fp8_weight, quant.quantize_fp4_weight):
        (q_gpu, s_gpu), (q_cpu, s_cpu) = quantize(w.cuda()), quantize(w)
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
        assert torch.equal(s_gpu.cpu().view(torch.uint8), s_cpu.view(torch.uint8))
