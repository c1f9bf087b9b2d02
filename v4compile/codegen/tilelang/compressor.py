"""Fused compressor pooling in TileLang (``cuda`` target on GPU, ``c`` target on CPU): positional bias, per-dim
online softmax over a block's tokens (plus, for C4, the previous block's), weighted sum and write, reading kv and
score once. Prefill form ``compressor_pool`` and decode-state form ``compressor_pool_state``."""

from __future__ import annotations

from typing import Any

import torch

from ..registry import REGISTRY
from .common import DTYPES, compute_dtypes, load_kernels

THREADS = 128
"""Threads of a prefill block on cuda, over which its [BLOCK_J, BLOCK_D] accumulator tile is spread; a decode block
has one thread per dim. The c target runs the same tiles serially."""

_HEADER = '''
import tilelang
import tilelang.language as T

RATIO = {ratio}
WIDTH = {width}
OVERLAP = {overlap}
COLS = 2 * WIDTH if OVERLAP else WIDTH
SLOTS = 2 * RATIO if OVERLAP else RATIO
IN = "{in_dtype}"
ACC = "{acc_dtype}"
BLOCK_J = {block_j}
BLOCK_D = {block_d}
THREADS = {threads}
# Masked scores are -inf and the C target builds with fast-math: scores are clamped to a finite floor.
FLOOR = -3.0e38


@T.macro
def tile(dtype):
    # a [BLOCK_J entries, BLOCK_D dims] tile spread over the block's threads
    return T.alloc_fragment((BLOCK_J, BLOCK_D), dtype)


@T.macro
def quiet_nan(dtype):
    # NaN from its bits (the c target's fast math may fold a NaN literal)
    return T.cast(T.reinterpret(T.uint32(0x7FC00000), "float32"), dtype)


@T.macro
def init(m, s, acc):
    for j, d in T.Parallel(BLOCK_J, BLOCK_D):
        m[j, d] = FLOOR
        s[j, d] = 0.0
        acc[j, d] = 0.0


@T.macro
def absorb(m, s, acc, j, d, z, v):
    # online softmax with one exp per token: the smaller of (running max, z) is weighted exp(-|z - max|)
    e = T.exp(T.min(z - m[j, d], m[j, d] - z))
    up = z > m[j, d]
    s[j, d] = T.if_then_else(up, s[j, d] * e + 1.0, s[j, d] + e)
    acc[j, d] = T.if_then_else(up, acc[j, d] * e + v, acc[j, d] + e * v)
    m[j, d] = T.max(m[j, d], z)


@T.macro
def pool_blocks(kv, score, ape, m, s, acc, b, j0, d0, n_blocks):
    # entries j0 .. j0 + BLOCK_J x dims d0 .. d0 + BLOCK_D of sequence b: their RATIO tokens (and, overlapping, block
    # j-1's left half), each token's score and value staged so that loads are plain vector copies
    z, v, z_prev, v_prev = tile(IN), tile(IN), tile(IN), tile(IN)
    init(m, s, acc)
    for r in T.serial(RATIO):
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            jj = j0 + j
            dd = d0 + d
            if jj < n_blocks and dd < WIDTH:
                z[j, d] = score[b, jj * RATIO + r, COLS - WIDTH + dd]
                v[j, d] = kv[b, jj * RATIO + r, COLS - WIDTH + dd]
                if OVERLAP and jj > 0:
                    z_prev[j, d] = score[b, (jj - 1) * RATIO + r, dd]
                    v_prev[j, d] = kv[b, (jj - 1) * RATIO + r, dd]
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            jj = j0 + j
            dd = d0 + d
            if jj < n_blocks and dd < WIDTH:
                col = COLS - WIDTH + dd
                absorb(m, s, acc, j, d, T.cast(z[j, d], ACC) + ape[r, col], T.cast(v[j, d], ACC))
                if OVERLAP and jj > 0:
                    # block j-1's left half; for j = 0 it is absent (weight 0)
                    absorb(m, s, acc, j, d, T.cast(z_prev[j, d], ACC) + ape[r, dd], T.cast(v_prev[j, d], ACC))


@T.macro
def pool_state(kv, score, m, s, acc, b, d0):
    # one decode state's open block (and, overlapping, the previous block's slot) over dims d0 .. d0 + BLOCK_D;
    # its scores already hold the bias and may be -inf
    z, v, z_prev, v_prev = tile(IN), tile(IN), tile(IN), tile(IN)
    init(m, s, acc)
    for r in T.serial(RATIO):
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            dd = d0 + d
            if dd < WIDTH:
                z[j, d] = score[b, SLOTS - RATIO + r, COLS - WIDTH + dd]
                v[j, d] = kv[b, SLOTS - RATIO + r, COLS - WIDTH + dd]
                if OVERLAP:
                    z_prev[j, d] = score[b, r, dd]
                    v_prev[j, d] = kv[b, r, dd]
        for j, d in T.Parallel(BLOCK_J, BLOCK_D):
            if d0 + d < WIDTH:
                absorb(m, s, acc, j, d, T.max(T.cast(z[j, d], ACC), FLOOR), T.cast(v[j, d], ACC))
                if OVERLAP:
                    absorb(m, s, acc, j, d, T.max(T.cast(z_prev[j, d], ACC), FLOOR), T.cast(v_prev[j, d], ACC))


def compile_kernel(fn, target):
    # the C codegen cannot vectorize exp: its loops stay scalar. Every load sits under the kernel's own bounds
    # checks, so TileLang's extra per-load guards are left out.
    configs = {{"tirx.disable_vectorize": target == "c", "tl.disable_safe_memory_legalize": True}}
    return tilelang.compile(fn, target=target, pass_configs=configs)
'''

_POOL = _HEADER + '''

def build(target):
    batch, seq, n_blocks = T.dynamic("batch"), T.dynamic("seq"), T.dynamic("n_blocks")

    @T.prim_func
    def {fn}(kv: T.Tensor((batch, seq, COLS), IN), score: T.Tensor((batch, seq, COLS), IN),
             ape: T.Tensor((RATIO, COLS), ACC), out: T.Tensor((batch, n_blocks, WIDTH), ACC)):
        # one block: BLOCK_J consecutive entries x BLOCK_D dims of one sequence; threads run along dims
        with T.Kernel(T.ceildiv(WIDTH, BLOCK_D), T.ceildiv(n_blocks, BLOCK_J), batch, threads=THREADS) as (bd, bj, b):
            m, s, acc = tile(ACC), tile(ACC), tile(ACC)  # running max, sum of weights, weighted sum
            pool_blocks(kv, score, ape, m, s, acc, b, bj * BLOCK_J, bd * BLOCK_D, n_blocks)
            for j, d in T.Parallel(BLOCK_J, BLOCK_D):
                jj = bj * BLOCK_J + j
                dd = bd * BLOCK_D + d
                if jj < n_blocks and dd < WIDTH:
                    out[b, jj, dd] = acc[j, d] / s[j, d]

    return compile_kernel({fn}, target)
'''

_POOL_STATE = _HEADER + '''

def build(target):
    batch = T.dynamic("batch")

    @T.prim_func
    def {fn}(kv: T.Tensor((batch, SLOTS, COLS), IN), score: T.Tensor((batch, SLOTS, COLS), IN),
             out: T.Tensor((batch, WIDTH), ACC)):
        # one block: one row's whole width (BLOCK_J = 1); scores already hold the bias and may be -inf
        with T.Kernel(T.ceildiv(WIDTH, BLOCK_D), batch, threads=THREADS) as (bd, b):
            m, s, acc = tile(ACC), tile(ACC), tile(ACC)  # running max, sum of weights, weighted sum
            pool_state(kv, score, m, s, acc, b, bd * BLOCK_D)
            for j, d in T.Parallel(BLOCK_J, BLOCK_D):
                dd = bd * BLOCK_D + d
                if dd < WIDTH:
                    # a dim with no slot written (every score -inf) is NaN, as in the model's softmax
                    out[b, dd] = T.if_then_else(m[j, d] <= FLOOR, quiet_nan(ACC), acc[j, d] / s[j, d])

    return compile_kernel({fn}, target)
'''

def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pool_launch_config(ratio: int, width: int, state: bool) -> dict[str, int]:
    """Tile shape: BLOCK_J entries x BLOCK_D dims, at least THREADS elements. A decode block takes one row's
    whole width (up to 512 dims); a prefill block 128 dims of one C128 block or of 8 (small) C4 blocks."""
    if state:
        block_d = min(512, max(THREADS, _next_pow2(width)))
        return {"block_j": 1, "block_d": block_d, "threads": block_d}
    block_d = min(128, _next_pow2(width))
    entries = 8 if ratio < 64 else 1
    return {"block_j": max(entries, THREADS // block_d), "block_d": block_d, "threads": THREADS}


def kernel_name(ratio: int, width: int, state: bool, dtype: torch.dtype = torch.float32) -> str:
    """Stable kernel name, e.g. ``compressor_pool_state.c4.w512.tilelang`` (``.f64`` for fp64 accumulation)."""
    suffix = ".f64" if dtype == torch.float64 else ""
    return f"compressor_pool{'_state' if state else ''}.c{ratio}.w{width}{suffix}.tilelang"


def _kernel(ratio: int, width: int, overlap: bool, state: bool, device: torch.device,
            dtype: torch.dtype) -> tuple[str, Any, torch.dtype, torch.dtype, dict[str, int], str]:
    """Builds (once) the kernel; returns its name, the kernel, its input and output dtypes, its launch config and
    its target."""
    target, in_dtype, acc = compute_dtypes(dtype, device)
    name = kernel_name(ratio, width, state, acc)
    fn = name.split(".")[0]
    config = pool_launch_config(ratio, width, state)

    def source() -> str:
        template = _POOL_STATE if state else _POOL
        return template.format(ratio=ratio, width=width, overlap=overlap, fn=fn, in_dtype=DTYPES[in_dtype],
                               acc_dtype=DTYPES[acc], **config)

    kernel = REGISTRY.build(name, "tilelang", f"v4compile::{fn}", source, lambda path: load_kernels(path, target, name),
                            key=(overlap, target, in_dtype))
    return name, kernel, in_dtype, acc, config, target


def compressor_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                    n_blocks: int) -> torch.Tensor:
    """TileLang body of ``v4compile::compressor_pool``: [B, n_blocks, width] from kv/score [B, S, c*width]."""
    overlap = kv.shape[-1] == 2 * width
    name, kernel, in_dtype, acc, config, target = _kernel(ratio, width, overlap, False, kv.device, kv.dtype)
    kv, score = kv.to(in_dtype).contiguous(), score.to(in_dtype).contiguous()
    bsz = kv.shape[0]
    out = torch.empty(bsz, n_blocks, width, dtype=acc, device=kv.device)
    if bsz * n_blocks == 0:
        return out
    REGISTRY.launch(name, lambda: kernel(kv, score, ape.to(acc).contiguous(), out))
    grid = (-(-width // config["block_d"]), -(-n_blocks // config["block_j"]), bsz)
    REGISTRY.note_launch(name, grid=grid, tokens=kv.shape[1], target=target, **config)
    return out


def compressor_pool_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """TileLang body of ``v4compile::compressor_pool_state``: [B, width] from a decode state [B, c*ratio, c*width]."""
    overlap = kv_state.shape[-1] == 2 * width
    name, kernel, in_dtype, acc, config, target = _kernel(ratio, width, overlap, True, kv_state.device,
                                                          kv_state.dtype)
    kv_state, score_state = kv_state.to(in_dtype).contiguous(), score_state.to(in_dtype).contiguous()
    bsz = kv_state.shape[0]
    out = torch.empty(bsz, width, dtype=acc, device=kv_state.device)
    if bsz == 0:
        return out
    REGISTRY.launch(name, lambda: kernel(kv_state, score_state, out))
    REGISTRY.note_launch(name, grid=(-(-width // config["block_d"]), bsz), target=target, **config)
    return out
