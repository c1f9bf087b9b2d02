"""The model's FP8 ``Linear`` in TileLang for prefill rows: e4m3 activation codes times the e4m3 weight as stored,
on the FP8 tensor cores, promoted to fp32 per 128-wide K block.

The activation is quantized by the Triton kernel (``triton.fp8_linear.quantize_activation``: e4m3 codes and one
power-of-two fp32 scale per row and K block, exactly ``quant.fp8_simulate``). Per (BM x BN tile, K block) the
kernel multiplies the codes on the tensor cores (``wgmma`` with both operands from shared memory, brought by TMA
from a producer warp group, STAGES blocks in flight), then adds that block's product times the activation row's
scale (the scales stored M-major, so a block's arrive by TMA with its codes) and the weight block's e8m0 scale to
an fp32 accumulator: the per-block promotion the official kernels do.
Products of e4m3 values are exact in fp32, but Hopper's FP8 MMA keeps about 14 mantissa bits while it sums a block,
so the result is within about 1e-4 normwise of the model's simulation (the Triton kernel's ``FP8_DOT`` path, the
same hardware numerics). Output: fp32, or rounded once to bf16, staged in shared memory and stored by TMA.

On the ``c`` target (CPU tests) the codes and weights arrive widened to fp32 (exact) and the block's product is a
loop; everything else is the same source. Rows of 64 or fewer (decode), non-power-of-two activation scales
(where the model's activation is bf16 ``q * scale``, not an e4m3 value) and output rows that are not a multiple of
16 bytes (the TMA store's stride) run the Triton body.
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import REGISTRY
from ..triton import fp8_linear as triton_fp8
from .common import load_kernels

_SOURCE = '''
import tilelang
import tilelang.language as T

BM = {bm}
BN = {bn}
STAGES = {stages}
THREADS = {threads}
OUT_BF16 = {out_bf16}


def build(target):
    cuda = target != "c"
    m, n, k, padded = (T.dynamic(v) for v in ("m", "n", "k", "padded"))
    CODE = "float8_e4m3" if cuda else "float32"
    OUT = "bfloat16" if cuda and OUT_BF16 else "float32"
    staged = T.alloc_shared if cuda else T.alloc_fragment

    @T.macro
    def product(a_s, b_s, part):
        # part = the K block's codes product: FP8 wgmma on CUDA, a loop on the c target
        if cuda:
            T.gemm(a_s, b_s, part, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
        else:
            for i, j in T.Parallel(BM, BN):
                part[i, j] = 0.0
                for kk in T.serial(128):
                    part[i, j] += a_s[i, kk] * b_s[j, kk]

    @T.macro
    def store(acc, out, mb, nb):
        # CUDA: through shared memory, whole rows of the tile at once (a TMA store, clipped at M and N)
        if cuda:
            o_s = T.alloc_shared((BM, BN), OUT)
            T.copy(acc, o_s)
            T.copy(o_s, out[mb * BM:(mb + 1) * BM, nb * BN:(nb + 1) * BN])
        else:
            for i, j in T.Parallel(BM, BN):
                if mb * BM + i < m and nb * BN + j < n:
                    out[mb * BM + i, nb * BN + j] = acc[i, j]

    @T.prim_func
    def fp8_gemm(codes: T.Tensor((padded, k), CODE), scales: T.Tensor((k // 128, padded), "float32"),
                 w: T.Tensor((n, k), CODE), w_scale: T.Tensor(((n + 127) // 128, k // 128), "uint8"),
                 out: T.Tensor((m, n), OUT)):
        # block (nb, mb): rows mb * BM.., columns nb * BN.. (inside one 128-row weight block: BN divides 128)
        with T.Kernel(T.ceildiv(n, BN), T.ceildiv(m, BM), threads=THREADS) as (nb, mb):
            a_s = staged((BM, 128), CODE)
            b_s = staged((BN, 128), CODE)
            sa_s = staged((BM,), "float32")
            part = T.alloc_fragment((BM, BN), "float32")
            acc = T.alloc_fragment((BM, BN), "float32")
            for i, j in T.Parallel(BM, BN):
                acc[i, j] = 0.0
            for kb in T.Pipelined(k // 128, num_stages=STAGES):
                T.copy(codes[mb * BM:(mb + 1) * BM, kb * 128:(kb + 1) * 128], a_s)
                T.copy(w[nb * BN:(nb + 1) * BN, kb * 128:(kb + 1) * 128], b_s)
                T.copy(scales[kb, mb * BM:(mb + 1) * BM], sa_s)
                product(a_s, b_s, part)
                # the e8m0 byte s as fp32 2^(s - 127) (byte 0: 2^-127, a subnormal)
                s = T.cast(w_scale[nb * BN // 128, kb], "int32")
                sw = T.reinterpret(T.if_then_else(s > 0, s << 23, 0x400000), "float32")
                for i, j in T.Parallel(BM, BN):
                    acc[i, j] += part[i, j] * (sa_s[i] * sw)
            store(acc, out, mb, nb)

    configs = {{"tirx.disable_vectorize": not cuda}}
    return tilelang.compile(fp8_gemm, target=target, pass_configs=configs)
'''


def kernel_name() -> str:
    """Stable kernel name of the TileLang FP8 GEMM."""
    return "fp8_linear.tilelang"


def launch_config(m: int, cuda: bool) -> dict[str, int] | None:
    """Tiles of 128 rows x 128 columns (two consumer warp groups of 64 rows), four K blocks in flight; None where
    the Triton body serves (64 rows or fewer on CUDA: decode). Small tiles on the ``c`` target."""
    if not cuda:
        return {"bm": 16, "bn": 32, "stages": 1, "threads": 128}
    if m <= 64:
        return None
    return {"bm": 128, "bn": 128, "stages": 4, "threads": 256}


def source(config: dict[str, int], out_bf16: bool) -> str:
    """The kernel's generated Python source for a launch configuration."""
    return _SOURCE.format(out_bf16=out_bf16, **config)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool,
               out_dtype: torch.dtype = torch.float32, config: dict[str, int] | None = None) -> torch.Tensor:
    """TileLang body of ``v4compile::fp8_linear``: x [..., K] times the e4m3 weight [N, K] with e8m0 block scales
    -> [..., N] fp32, or bf16 rounded once. Decode rows, non-power-of-two scales and, on CUDA, output rows that
    are not a multiple of 16 bytes run the Triton body.
    ``config`` overrides the launch configuration (benchmark sweeps)."""
    triton_fp8.check_fp8_weight("fp8_linear", x, weight, scale)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8_linear: out_dtype must be float32 or bfloat16, got {out_dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k).contiguous()
    cuda = x.device.type == "cuda"
    config = config or launch_config(rows.shape[0], cuda)
    aligned = n * (2 if out_dtype == torch.bfloat16 else 4) % 16 == 0  # the output's TMA store needs 16-byte rows
    if config is None or not pow2 or not rows.shape[0] or triton_fp8.BLOCK % config["bn"] or (cuda and not aligned):
        return triton_fp8.fp8_linear(x, weight, scale, pow2, out_dtype)
    target = "cuda" if cuda else "c"
    bf16 = out_dtype == torch.bfloat16
    kernel: Any = REGISTRY.build(kernel_name(), "tilelang", "v4compile::fp8_linear", lambda: source(config, bf16),
                                 lambda path: load_kernels(path, target, kernel_name()),
                                 key=(target, bf16, *sorted(config.items())))
    codes, scales = triton_fp8.activation_buffers(rows, config["bm"], m_major=True)  # a block's scales: one row
    out = torch.empty(rows.shape[0], n, dtype=out_dtype if cuda else torch.float32, device=x.device)
    w, s = weight.contiguous(), scale.contiguous().view(torch.uint8)

    def run() -> None:
        triton_fp8.quantize_activation(rows, codes, scales, pow2)
        if cuda:
            kernel(codes, scales.t(), w, s, out)
        else:  # the c target has no 8-bit floats: e4m3 widened to fp32, exactly
            kernel(codes.float(), scales.t(), w.float(), s, out)

    REGISTRY.launch(kernel_name(), run)
    REGISTRY.note_launch(kernel_name(), rows=rows.shape[0], n=n, k=k, target=target, **config)
    return out.to(out_dtype).reshape(*lead, n)
