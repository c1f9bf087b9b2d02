"""mHC in TileLang (``cuda`` target on GPU, ``c`` target on CPU): the pre step and the post step of a sub-layer's
hyper-connections over n streams, the same plan as the Triton kernels (``codegen/triton/mhc.py``).

Pre, two kernels. ``mhc_mixes`` projects vec(X) [rows, n*D] onto the (2+n)n mixes with the n*D reduction split
over blocks (split-K: decode batches have 1..64 rows, so rows alone leave the GPU idle), one column of the
partials holding the sum of squares. ``mhc_pre_finish``: per row, blocks 0..nD-1 add up the partials of the pre
mixes, apply the RMS scale and the sigmoids and write one D block of the weighted stream sum y; the last block
computes post and runs Sinkhorn on the n x n matrix in registers. Post, one kernel: ``out_k = post_k * y +
sum_j comb[j, k] X_j`` in one pass over X. Everything accumulates in fp32 (fp64 for fp64 inputs) in the
reference's order of steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import REGISTRY
from .common import DTYPES, compute_dtypes, load_kernels

THREADS = 128
"""Threads per block on cuda: 4 rows x 32 mix columns in the projection, one D element each in the others."""

_HEADER = '''
import tilelang
import tilelang.language as T

N = {n}
NN = {n} * {n}
DIM = {dim}
WIDTH = {n} * {dim}
MIX = (2 + {n}) * {n}
MIXP = {mixp}
IN = "{in_dtype}"
OUT = "{out_dtype}"
ACC = "{acc_dtype}"
BLOCK_M = {block_m}
PER_SPLIT = {per_split}
BLOCK_D = {block_d}
D_BLOCKS = ({dim} + {block_d} - 1) // {block_d}
THREADS = {threads}


def compile_kernel(fn, target):
    # the C codegen cannot vectorize exp; every load sits under the kernel's own bounds checks
    configs = {{"tirx.disable_vectorize": target == "c", "tl.disable_safe_memory_legalize": True}}
    return tilelang.compile(fn, target=target, pass_configs=configs)
'''

_PRE = _HEADER + '''
ITERS = {iters}
HC_EPS = {hc_eps!r}
NORM_EPS = {norm_eps!r}


@T.macro
def normalize(cm, tmp, major, minor):
    # one Sinkhorn step: each row (major N, minor 1) or column (major 1, minor N) divided by (its sum + eps)
    for a in T.serial(N):
        tmp[0] = 0.0
        for b in T.serial(N):
            tmp[0] += cm[a * major + b * minor]
        for b in T.serial(N):
            cm[a * major + b * minor] = cm[a * major + b * minor] / (tmp[0] + HC_EPS)


def build(target):
    rows, splits = T.dynamic("rows"), T.dynamic("splits")

    @T.prim_func
    def mhc_mixes(x: T.Tensor((rows, WIDTH), IN), fn: T.Tensor((MIX, WIDTH), ACC),
                  part: T.Tensor((rows, MIXP, splits), ACC)):
        # block (s, m): rows [m BLOCK_M, +BLOCK_M) against columns [s PER_SPLIT, +PER_SPLIT); column MIX of the
        # partials is the rows' sum of squares over those columns
        with T.Kernel(splits, T.ceildiv(rows, BLOCK_M), threads=THREADS) as (s, bm):
            acc = T.alloc_fragment((BLOCK_M, MIXP), ACC)
            for m, c in T.Parallel(BLOCK_M, MIXP):
                acc[m, c] = 0.0
                row = bm * BLOCK_M + m
                for kk in T.serial(PER_SPLIT):
                    col = s * PER_SPLIT + kk
                    if row < rows and col < WIDTH:
                        if c < MIX:
                            acc[m, c] += T.cast(x[row, col], ACC) * fn[c, col]
                        if c == MIX:
                            acc[m, c] += T.cast(x[row, col], ACC) * T.cast(x[row, col], ACC)
                if row < rows:
                    part[row, c, s] = acc[m, c]

    @T.prim_func
    def mhc_pre_finish(x: T.Tensor((rows, WIDTH), IN), part: T.Tensor((rows, MIXP, splits), ACC),
                       scale: T.Tensor((3,), ACC), base: T.Tensor((MIX,), ACC), y: T.Tensor((rows, DIM), OUT),
                       post: T.Tensor((rows, N), ACC), comb: T.Tensor((rows, NN), ACC)):
        # blocks (0..D_BLOCKS-1, r): one D block of y; block (D_BLOCKS, r): post and Sinkhorn
        with T.Kernel(D_BLOCKS + 1, rows, threads=THREADS) as (bd, r):
            mix = T.alloc_shared((MIXP,), ACC)
            total = T.alloc_fragment((MIXP,), ACC)
            for c in T.Parallel(MIXP):
                total[c] = 0.0
                for s in T.serial(splits):
                    total[c] += part[r, c, s]
                mix[c] = total[c]
            inv = T.alloc_local((1,), ACC)
            inv[0] = T.rsqrt(mix[MIX] / WIDTH + NORM_EPS)
            if bd < D_BLOCKS:
                ysum = T.alloc_fragment((BLOCK_D,), ACC)
                for d in T.Parallel(BLOCK_D):
                    ysum[d] = 0.0
                    if bd * BLOCK_D + d < DIM:
                        for j in T.serial(N):
                            ysum[d] += (T.sigmoid(mix[j] * inv[0] * scale[0] + base[j]) + HC_EPS) * T.cast(
                                x[r, j * DIM + bd * BLOCK_D + d], ACC)
                        y[r, bd * BLOCK_D + d] = T.cast(ysum[d], OUT)
            else:
                cm = T.alloc_local((NN,), ACC)
                tmp = T.alloc_local((1,), ACC)
                for i in T.serial(N):
                    post[r, i] = 2.0 * T.sigmoid(mix[N + i] * inv[0] * scale[1] + base[N + i])
                for i in T.serial(NN):
                    cm[i] = mix[2 * N + i] * inv[0] * scale[2] + base[2 * N + i]
                for i in T.serial(N):
                    # row softmax, then + eps
                    tmp[0] = cm[i * N]
                    for j in T.serial(N):
                        tmp[0] = T.max(tmp[0], cm[i * N + j])
                    for j in T.serial(N):
                        cm[i * N + j] = T.exp(cm[i * N + j] - tmp[0])
                    tmp[0] = 0.0
                    for j in T.serial(N):
                        tmp[0] += cm[i * N + j]
                    for j in T.serial(N):
                        cm[i * N + j] = cm[i * N + j] / tmp[0] + HC_EPS
                normalize(cm, tmp, 1, N)
                for _ in T.serial(ITERS - 1):
                    normalize(cm, tmp, N, 1)
                    normalize(cm, tmp, 1, N)
                for i in T.serial(NN):
                    comb[r, i] = cm[i]

    return compile_kernel(mhc_mixes, target), compile_kernel(mhc_pre_finish, target)
'''

_POST = _HEADER + '''


def build(target):
    rows = T.dynamic("rows")

    @T.prim_func
    def mhc_post(y: T.Tensor((rows, DIM), IN), x: T.Tensor((rows, WIDTH), IN), post: T.Tensor((rows, N), ACC),
                 comb: T.Tensor((rows, NN), ACC), out: T.Tensor((rows, WIDTH), OUT)):
        with T.Kernel(D_BLOCKS, rows, threads=THREADS) as (bd, r):
            mixed = T.alloc_fragment((N, BLOCK_D), ACC)
            for k, d in T.Parallel(N, BLOCK_D):
                mixed[k, d] = 0.0
                if bd * BLOCK_D + d < DIM:
                    for j in T.serial(N):
                        mixed[k, d] += comb[r, j * N + k] * T.cast(x[r, j * DIM + bd * BLOCK_D + d], ACC)
                    out[r, k * DIM + bd * BLOCK_D + d] = T.cast(
                        post[r, k] * T.cast(y[r, bd * BLOCK_D + d], ACC) + mixed[k, d], OUT)

    return compile_kernel(mhc_post, target)
'''


def launch_config(n: int, dim: int) -> dict[str, int]:
    """Mix columns padded to a power of two with room for the sum of squares; 4 rows x 32 columns per projection
    block and splits of 128 columns (128 splits at V4-Flash dims); D blocks of 128."""
    mixp = 1 << ((2 + n) * n).bit_length()
    return {"mixp": mixp, "block_m": max(1, THREADS // mixp), "per_split": 128, "block_d": 128, "threads": THREADS}


def kernel_name(step: str, n: int, dim: int) -> str:
    """Stable kernel name, e.g. ``mhc_pre.n4.d4096.tilelang``."""
    return f"{step}.n{n}.d{dim}.tilelang"


def _build(step: str, n: int, dim: int, device: torch.device, dtype: torch.dtype, wide: torch.dtype,
           extra: dict[str, Any]) -> tuple[str, Any, torch.dtype, torch.dtype, torch.dtype, dict[str, int], str]:
    """Builds (once per specialisation) a step's kernels for streams of ``dtype`` (also the output's), accumulating
    in fp64 when ``wide`` is fp64; returns name, kernels, input, output and accumulation dtypes, launch config and
    target."""
    target, in_dtype, _ = compute_dtypes(dtype, device)
    acc = torch.float64 if wide == torch.float64 else torch.float32
    out = dtype if target == "cuda" else acc
    name = kernel_name(step, n, dim)
    config = launch_config(n, dim)

    def source() -> str:
        return (_PRE if step == "mhc_pre" else _POST).format(
            n=n, dim=dim, in_dtype=DTYPES[in_dtype], out_dtype=DTYPES[out], acc_dtype=DTYPES[acc], **config, **extra)

    kernels = REGISTRY.build(name, "tilelang", f"v4compile::{step}", source,
                             lambda path: load_kernels(path, target, name),
                             key=(target, in_dtype, out, tuple(sorted(extra.items()))))
    return name, kernels, in_dtype, out, acc, config, target


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, hc_eps: float,
            norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TileLang body of ``v4compile::mhc_pre``: streams x [..., n, D] -> (y [..., D] in x's dtype, post [..., n],
    comb [..., n, n]) in fp32 (fp64 for fp64 streams)."""
    *lead, n, dim = x.shape
    rows = x.numel() // (n * dim) if x.numel() else 0
    name, (mixes, finish), in_dtype, out, acc, config, target = _build(
        "mhc_pre", n, dim, x.device, x.dtype, x.dtype, {"iters": iters, "hc_eps": hc_eps, "norm_eps": norm_eps})
    y = torch.empty(rows, dim, dtype=out, device=x.device)
    post = torch.empty(rows, n, dtype=acc, device=x.device)
    comb = torch.empty(rows, n * n, dtype=acc, device=x.device)
    if rows:
        splits = -(-(n * dim) // config["per_split"])
        part = torch.empty(rows, config["mixp"], splits, dtype=acc, device=x.device)
        flat = x.reshape(rows, n * dim).to(in_dtype).contiguous()

        def run() -> None:
            mixes(flat, fn.to(acc).contiguous(), part)
            finish(flat, part, scale.to(acc).contiguous(), base.to(acc).contiguous(), y, post, comb)

        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, grid=(splits, -(-rows // config["block_m"])),
                             finish_grid=(-(-dim // config["block_d"]) + 1, rows), rows=rows, target=target, **config)
    return y.to(x.dtype).view(*lead, dim), post.view(*lead, n), comb.view(*lead, n, n)


def mhc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """TileLang body of ``v4compile::mhc_post``: ``out_k = post_k * y + sum_j comb[j, k] x_j`` for streams x
    [..., n, D], returned in y's dtype."""
    *lead, n, dim = x.shape
    rows = x.numel() // (n * dim) if x.numel() else 0
    wide = torch.promote_types(torch.promote_types(y.dtype, x.dtype), torch.promote_types(post.dtype, comb.dtype))
    name, kernel, in_dtype, out, acc, config, target = _build("mhc_post", n, dim, x.device, y.dtype, wide, {})
    result = torch.empty(rows, n * dim, dtype=out, device=x.device)
    if rows:
        args = (y.reshape(rows, dim).to(in_dtype).contiguous(), x.reshape(rows, n * dim).to(in_dtype).contiguous(),
                post.reshape(rows, n).to(acc).contiguous(), comb.reshape(rows, n * n).to(acc).contiguous(), result)
        REGISTRY.launch(name, lambda: kernel(*args))
        REGISTRY.note_launch(name, grid=(-(-dim // config["block_d"]), rows), rows=rows, target=target, **config)
    return result.to(y.dtype).view(*lead, n, dim)
