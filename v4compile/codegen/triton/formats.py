"""Exact FP8 (e4m3) and FP4 (e2m1) numerics inside Triton kernels, as a source fragment for generated kernels.

The same results as ``model/quant.py`` bit for bit, on the GPU and under the CPU interpreter alike: rounding
to the e4m3 grid is done on the integer significand (nearest, ties to even), and decoding builds each value's
float32 bits, so neither depends on a backend's float8 conversions (the interpreter has none, and its bf16
casts truncate). ``_e8m0`` maps a scale byte u to 2^(u-127) (u = 0 to 2^-127, as ``quant.e8m0_to_float``).
"""

FORMATS_SOURCE = '''

@triton.jit
def _exp2i(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    # nearest-even onto the e4m3 grid of v in [-448, 448]: keep the integer significand's bits above the
    # quantum 2^(max(e, -6) - 3), with the rounding done on integers (exact on every backend)
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(20 + tl.maximum(-6 - e, 0), 26)
    q = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    out = tl.where(mag < 0x800000, 0.0, q.to(tl.float32) * _exp2i(tl.maximum(e, -6) - 3))
    return tl.where(bits < 0, -out, out)


@triton.jit
def _e2m1(code):
    code = code.to(tl.int32)
    m = code & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 126 << 23, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    b = b.to(tl.int32)
    ex = (b >> 3) & 15
    man = b & 7
    normal = (((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _e8m0(u):
    u = u.to(tl.int32)
    return tl.where(u == 0, 0x400000, u << 23).to(tl.float32, bitcast=True)

@triton.jit
def _e4m3_code(v):
    # the e4m3 byte of a value already on the e4m3 grid (|v| <= 448)
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    sub = (mag.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    code = tl.where(e < -6, sub, ((e + 7) << 3) | ((mag >> 20) & 7))
    return code | tl.where(bits < 0, 128, 0)


@triton.jit
def _act_scale(x, POW2: tl.constexpr):
    # each row's e4m3 activation scale: amax (floored at 1e-4) over 448, rounded up to a power of two if POW2
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), 448.0)
    if POW2:
        floor = _exp2i(((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)
        scale = tl.where(floor == scale, scale, floor * 2.0)
    return scale
'''
