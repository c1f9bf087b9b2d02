"""FP8 (e4m3) and FP4 (e2m1) numerics: exact rounding, simulated quantization, weight formats.

Rounding is round-to-nearest-even onto the target grid with saturation, computed with exact
float32 arithmetic (powers of two only), so it matches a hardware cast bit for bit and runs the
same in eager PyTorch, under torch.compile and on any device.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_ACT_BLOCK = 128
FP8_KV_BLOCK = 64
FP4_BLOCK = 32
FP8_WEIGHT_BLOCK = 128
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126

# e2m1 code -> value; codes 8..15 are the negatives of 0..7.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(|x|)) of finite nonzero float32 values, from the exponent bits."""
    bits = x.float().abs().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127


def _exp2i(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e for integer tensors e in the normal float32 range."""
    return ((e + 127).to(torch.int32) << 23).view(torch.float32)


def round_to_grid(x: torch.Tensor, mantissa_bits: int, min_exponent: int, max_value: float) -> torch.Tensor:
    """Rounds float32 values to a small float format (nearest, ties to even, saturating).

    ``min_exponent`` is the exponent of the smallest normal; below it the spacing is constant
    (subnormals). Values past ``max_value`` saturate to it, as a ``satfinite`` cast does.
    """
    x = x.float().clamp(-max_value, max_value)
    safe = torch.where(x == 0, torch.ones_like(x), x)
    exponent = torch.clamp(_floor_log2(safe), min=min_exponent)
    quantum = _exp2i(exponent - mantissa_bits)
    rounded = torch.round(x / quantum) * quantum
    return rounded.clamp(-max_value, max_value)


def round_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Rounds to the float8 e4m3fn grid (3 mantissa bits, smallest normal 2^-6, max 448)."""
    return round_to_grid(x, 3, -6, FP8_MAX)


def round_fp4_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Rounds to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} and negatives (saturating at 6)."""
    return round_to_grid(x, 1, 0, FP4_MAX)


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device. CUDA computes a division by a Python scalar as a
    multiplication by its rounded reciprocal, one bit off for some x: enough to move a non-power-of-two
    scale and with it the e4m3 ties that scale decides, so the GPU would disagree with the CPU and the spec."""
    return x / x.new_full((), divisor)


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """Exact smallest power of two >= x, for positive finite float32 x."""
    x = x.float()
    e = _floor_log2(x)
    return torch.where(_exp2i(e) == x, x, _exp2i(e + 1))


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def fp8_simulate(x: torch.Tensor, block: int, pow2_scale: bool) -> torch.Tensor:
    """Quantizes to e4m3 with one scale per ``block`` along the last dim, then dequantizes.

    Scale = amax / 448 (amax floored at 1e-4), rounded up to a power of two when ``pow2_scale``.
    Returns the input dtype.
    """
    xb = _blocked(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    scale = exact_div(amax, FP8_MAX)
    if pow2_scale:
        scale = ceil_pow2(scale)
    return (round_fp8_e4m3(xb / scale) * scale).flatten(-2).to(x.dtype)


def fp4_simulate(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Quantizes to e2m1 with a power-of-two scale per ``block`` (amax/6 rounded up), then dequantizes."""
    xb = _blocked(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_AMAX_FLOOR)
    scale = ceil_pow2(exact_div(amax, FP4_MAX))
    return (round_fp4_e2m1(xb / scale) * scale).flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------- weight formats
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decodes e8m0 scale bytes (``float8_e8m0fnu`` or uint8): byte u means 2^(u-127)."""
    u = (scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale).to(torch.int32)
    return torch.where(u == 0, torch.full_like(u, 0, dtype=torch.float32) + 2.0**-127, _exp2i(u - 127))


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encodes power-of-two float32 scales as ``float8_e8m0fnu``."""
    u = (_floor_log2(scale) + 127).clamp(0, 254).to(torch.uint8)
    return u.view(torch.float8_e8m0fnu)


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 ``[..., out, in]`` weight times its per-128x128-block e8m0 scale ``[..., out/128, in/128]``
    (rounded up), as float32."""
    out_f, in_f = weight.shape[-2:]
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(FP8_WEIGHT_BLOCK, -2)[..., :out_f, :].repeat_interleave(FP8_WEIGHT_BLOCK, -1)[..., :in_f]
    return weight.float() * s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpacks int8 ``[out, in/2]`` (two e2m1 codes a byte, low nibble = even column) to codes ``[out, in]``."""
    u = packed.view(torch.uint8)
    return torch.stack((u & 0xF, u >> 4), dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Packs e2m1 codes ``[out, in]`` (values 0..15) into int8 ``[out, in/2]``, low nibble first."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Maps e2m1 codes to their float32 values (``FP4_VALUES[code]``), decoded from the bits rather than looked
    up, so no host-made table is copied to the device per call (which a CUDA graph capture cannot hold)."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).to(torch.float32)
    normal = torch.exp2((exponent - 1).to(torch.float32)) * (1 + 0.5 * mantissa)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def float_to_fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """Maps values already on the e2m1 grid to their codes (sign bit 3)."""
    mag = values.abs()
    table = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=values.device)
    code = (mag.unsqueeze(-1) == table).int().argmax(-1)
    return (code + 8 * (values < 0).int()).to(torch.uint8)


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed FP4 ``[..., out, in/2]`` weight times its per-32 e8m0 scale ``[..., out, in/32]``, as float32."""
    values = fp4_codes_to_float(unpack_fp4(packed))
    return values * e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, -1)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a float ``[out, in]`` weight to e4m3 with power-of-two 128x128 block scales."""
    out_f, in_f = w.shape
    b = FP8_WEIGHT_BLOCK
    pad = torch.zeros(-(-out_f // b) * b, -(-in_f // b) * b, dtype=torch.float32, device=w.device)
    pad[:out_f, :in_f] = w.float()
    blocks = pad.unflatten(0, (-1, b)).unflatten(2, (-1, b))
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR)
    scale = ceil_pow2(exact_div(amax, FP8_MAX))
    full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:out_f, :in_f]
    q = round_fp8_e4m3(w.float() / full).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(scale)


def quantize_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a float ``[out, in]`` weight to packed e2m1 with power-of-two per-32 scales."""
    wb = _blocked(w, FP4_BLOCK)
    amax = wb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_AMAX_FLOOR)
    scale = ceil_pow2(exact_div(amax, FP4_MAX))
    codes = float_to_fp4_codes(round_fp4_e2m1(wb / scale)).flatten(-2)
    return pack_fp4(codes), float_to_e8m0(scale.squeeze(-1))
