"""A linear layer whose weight keeps its checkpoint format (bf16, fp32, FP8 blocks, packed FP4).

Quantized weights stay quantized in memory and are dequantized per matmul; an FP8 or FP4 matmul
first quantizes its activation to e4m3 per 128 along K, as the official kernels do.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import quant

WeightFormat = Literal["bf16", "fp32", "fp8", "fp4"]

WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp4": torch.int8,
}


def weight_shapes(fmt: WeightFormat, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor shapes of a linear in this format (``weight`` and, if quantized, ``scale``)."""
    if fmt == "fp8":
        b = quant.FP8_WEIGHT_BLOCK
        return {"weight": (out_features, in_features), "scale": (-(-out_features // b), -(-in_features // b))}
    if fmt == "fp4":
        return {"weight": (out_features, in_features // 2), "scale": (out_features, in_features // quant.FP4_BLOCK)}
    return {"weight": (out_features, in_features)}


class Linear(nn.Module):
    """``y = x W^T`` with W in one of the checkpoint formats; fp32 weights give fp32 outputs, others bf16."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, pow2_scales: bool = False) -> None:
        super().__init__()
        if fmt == "fp4" and in_features % quant.FP4_BLOCK:
            raise ValueError(f"FP4 linear needs in_features divisible by {quant.FP4_BLOCK}, got {in_features}")
        self.in_features, self.out_features, self.fmt, self.pow2_scales = in_features, out_features, fmt, pow2_scales
        shapes = weight_shapes(fmt, in_features, out_features)
        dtype = WEIGHT_DTYPES[fmt]
        trainable = fmt in ("bf16", "fp32")
        self.weight = nn.Parameter(torch.zeros(shapes["weight"], dtype=dtype), requires_grad=trainable)
        if "scale" in shapes:
            self.register_buffer("scale", torch.zeros(shapes["scale"], dtype=torch.float8_e8m0fnu))
        else:
            self.scale = None

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as a float tensor (bf16/fp32 weights unchanged, quantized ones as fp32)."""
        if self.fmt == "fp8":
            return quant.dequant_fp8_weight(self.weight, self.scale)
        if self.fmt == "fp4":
            return quant.dequant_fp4_weight(self.weight, self.scale)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer; quantized formats simulate the FP8 activation quantization first."""
        if self.fmt == "fp32":
            return F.linear(x.float(), self.weight)
        if self.fmt == "bf16":
            return F.linear(x.to(torch.bfloat16), self.weight)
        xq = quant.fp8_simulate(x, quant.FP8_ACT_BLOCK, self.pow2_scales).float()
        return F.linear(xq, self.dequantized_weight()).to(torch.bfloat16)

    def unrounded(self, x: torch.Tensor) -> torch.Tensor:
        """The product before its final rounding to bf16, as fp32: a row-parallel layer sums these partial
        products over the ranks and rounds once, as the single-process ``forward`` does."""
        if self.fmt in ("fp32", "bf16"):
            return F.linear(x.to(self.weight.dtype).float(), self.weight.float())
        xq = quant.fp8_simulate(x, quant.FP8_ACT_BLOCK, self.pow2_scales).float()
        return F.linear(xq, self.dequantized_weight())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"


class GroupedLinear(nn.Module):
    """``n`` linear layers of one shape and format stacked (weight ``[n, ...]``, scale ``[n, ...]``): the routed
    experts' projections. ``forward`` multiplies each group of rows by its own layer's weight, so the work and
    the captured graph do not depend on how many layers there are."""

    def __init__(self, n: int, in_features: int, out_features: int, fmt: WeightFormat,
                 pow2_scales: bool = False) -> None:
        super().__init__()
        if fmt not in ("bf16", "fp8", "fp4"):
            raise ValueError(f"grouped linear layers are bf16, FP8 or FP4, got {fmt!r}")
        if fmt == "fp4" and in_features % quant.FP4_BLOCK:
            raise ValueError(f"FP4 linear needs in_features divisible by {quant.FP4_BLOCK}, got {in_features}")
        self.n, self.in_features, self.out_features = n, in_features, out_features
        self.fmt, self.pow2_scales = fmt, pow2_scales
        shapes = weight_shapes(fmt, in_features, out_features)
        self.weight = nn.Parameter(torch.zeros(n, *shapes["weight"], dtype=WEIGHT_DTYPES[fmt]),
                                   requires_grad=fmt == "bf16")
        if "scale" in shapes:
            self.register_buffer("scale", torch.zeros(n, *shapes["scale"], dtype=torch.float8_e8m0fnu))
        else:
            self.scale = None

    def dequantized_weight(self) -> torch.Tensor:
        """The weights ``[n, out, in]`` as bf16: exact, since e4m3 and e2m1 values times power-of-two scales have
        at most four significant bits."""
        if self.fmt == "fp8":
            return quant.dequant_fp8_weight(self.weight, self.scale).to(torch.bfloat16)
        if self.fmt == "fp4":
            return quant.dequant_fp4_weight(self.weight, self.scale).to(torch.bfloat16)
        return self.weight

    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows ``ends[e-1]:ends[e]`` of x [rows, in] through layer e (``ends`` [n] int32, ascending, the last
        equal to rows), as bf16. Quantized formats simulate the activation's FP8 quantization first (bf16 holds
        the result exactly); products are exact and accumulate in fp32, as the official FP8 kernels do."""
        if self.fmt != "bf16":
            x = quant.fp8_simulate(x, quant.FP8_ACT_BLOCK, self.pow2_scales)
        return torch._grouped_mm(x.to(torch.bfloat16), self.dequantized_weight().transpose(-2, -1), offs=ends)

    def extra_repr(self) -> str:
        return f"n={self.n}, in={self.in_features}, out={self.out_features}, fmt={self.fmt}"
