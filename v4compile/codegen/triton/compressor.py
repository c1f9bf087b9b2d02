"""Fused compressor pooling in Triton: positional bias, per-dim softmax over a block's tokens, weighted
sum, write, in one pass that reads kv and score once (prefill form and decode-state form)."""

from __future__ import annotations

import torch
import triton

from ..reference import accumulation_dtype
from ..registry import REGISTRY
from .launch import load_triton_module, lowered_text

_HEADER = '''
import triton
import triton.language as tl

RATIO = tl.constexpr({ratio})
WIDTH = tl.constexpr({width})
OVERLAP = tl.constexpr({overlap})
ACC = tl.constexpr({acc})
'''

POOL_TILE = '''

@triton.jit
def _absorb(m, s, acc, kv, z):
    # online softmax over axis 1 of [BLOCK_J, CHUNK, BLOCK_D] tiles; a chunk of -inf scores (empty state
    # slots) before any finite one adds nothing (the shift stays finite, so no -inf - -inf)
    m_new = tl.maximum(m, tl.max(z, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - shift)
    e = tl.exp(z - shift[:, None, :])
    return m_new, s * scale + tl.sum(e, axis=1), acc * scale + tl.sum(e * kv, axis=1)


@triton.jit
def _program_tile(KV, SCORE, OUT, n_blocks, s_kb, s_ob, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (b * entry groups, dim tiles): sequence b's rows (64-bit base pointers: a batch may exceed 2**31
    # elements; in-row offsets stay 32-bit), its BLOCK_J entries jj and BLOCK_D dims d. The in-place pointer
    # updates and, in _pool_tile, the score loaded before the bias are the forms Triton 3.6 schedules best
    # for the finishing kernel (H200: C4 entries 156 us vs 165 us with one shared 64-bit row offset)
    per_b = tl.cdiv(n_blocks, BLOCK_J)
    b = tl.program_id(0) // per_b
    KV += b.to(tl.int64) * s_kb
    SCORE += b.to(tl.int64) * s_kb
    OUT += b.to(tl.int64) * s_ob
    jj = (tl.program_id(0) % per_b) * BLOCK_J + tl.arange(0, BLOCK_J)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return KV, SCORE, OUT, b, jj, d


@triton.jit
def _pool_tile(KV, SCORE, APE, block, lane, d, s_ks, BIAS: tl.constexpr, BLOCK_J: tl.constexpr,
               CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    # the softmax-weighted sums of entries ``block`` [BLOCK_J] over dims ``d`` [BLOCK_D] (KV, SCORE at the
    # sequence's first row); kv and score read once, RATIO rows CHUNK at a time, then (overlapping) block - 1's
    # first half. BIAS adds the positional bias (a decode state's scores already hold it).
    cols = (2 if OVERLAP else 1) * WIDTH
    m = tl.full([BLOCK_J, BLOCK_D], float("-inf"), ACC)
    s = tl.zeros([BLOCK_J, BLOCK_D], ACC)
    acc = tl.zeros([BLOCK_J, BLOCK_D], ACC)
    cur = (WIDTH if OVERLAP else 0) + d
    for r0 in tl.static_range(0, RATIO, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        ptr = (block[:, None, None] * RATIO + r[None, :, None]) * s_ks + cur[None, None, :]
        kv = tl.load(KV + ptr, mask=lane, other=0.0).to(ACC)
        z = tl.load(SCORE + ptr, mask=lane, other=0.0).to(ACC)
        if BIAS:
            z += tl.load(APE + r[None, :, None] * cols + cur[None, None, :], mask=lane, other=0.0).to(ACC)
        m, s, acc = _absorb(m, s, acc, kv, z)
    if OVERLAP:
        r = tl.arange(0, RATIO)
        rows = (block[:, None, None] - 1) * RATIO + r[None, :, None]
        prev = lane & (rows >= 0)
        ptr = rows * s_ks + d[None, None, :]
        kv = tl.load(KV + ptr, mask=prev, other=0.0).to(ACC)
        z = tl.load(SCORE + ptr, mask=prev, other=float("-inf")).to(ACC)
        if BIAS:
            z += tl.load(APE + r[None, :, None] * cols + d[None, None, :], mask=lane, other=0.0).to(ACC)
        m, s, acc = _absorb(m, s, acc, kv, z)
    return acc / s
'''
"""A program's tile and the pooling of its entries, shared by the pooling kernel and the finishing one
(``compressor_finish.py``); the module defines RATIO, WIDTH, OVERLAP and ACC."""

_POOL = _HEADER + POOL_TILE + '''


@triton.jit
def {fn}(KV, SCORE, APE, OUT, n_blocks, s_kb, s_ks, s_ob, s_on,
         BLOCK_J: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program: BLOCK_J consecutive entries x BLOCK_D dims
    KV, SCORE, OUT, b, jj, d = _program_tile(KV, SCORE, OUT, n_blocks, s_kb, s_ob, BLOCK_J, BLOCK_D)
    lane = (jj < n_blocks)[:, None, None] & (d < WIDTH)[None, None, :]
    pooled = _pool_tile(KV, SCORE, APE, jj, lane, d, s_ks, True, BLOCK_J, CHUNK, BLOCK_D)
    out = OUT + jj[:, None] * s_on + d[None, :]
    tl.store(out, pooled, mask=(jj < n_blocks)[:, None] & (d < WIDTH)[None, :])
'''


_POOL_STATE = _HEADER + '''

@triton.jit
def {fn}(KV, SCORE, OUT, s_kb, s_kr, s_ob, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < WIDTH
    r = tl.arange(0, RATIO)
    cur = (RATIO if OVERLAP else 0) + r
    col = (WIDTH if OVERLAP else 0) + d
    ptr = b * s_kb + cur[:, None] * s_kr + col[None, :]
    kv_c = tl.load(KV + ptr, mask=dmask[None, :], other=0.0).to(ACC)
    z_c = tl.load(SCORE + ptr, mask=dmask[None, :], other=0.0).to(ACC)
    m = tl.max(z_c, axis=0)
    if OVERLAP:
        pptr = b * s_kb + r[:, None] * s_kr + d[None, :]
        kv_p = tl.load(KV + pptr, mask=dmask[None, :], other=0.0).to(ACC)
        z_p = tl.load(SCORE + pptr, mask=dmask[None, :], other=float("-inf")).to(ACC)
        m = tl.maximum(m, tl.max(z_p, axis=0))
    e_c = tl.exp(z_c - m[None, :])
    total = tl.sum(e_c, axis=0)
    acc = tl.sum(e_c * kv_c, axis=0)
    if OVERLAP:
        e_p = tl.exp(z_p - m[None, :])
        total += tl.sum(e_p, axis=0)
        acc += tl.sum(e_p * kv_p, axis=0)
    tl.store(OUT + b * s_ob + d, acc / total, mask=dmask)
'''


def _block_d(width: int) -> int:
    return min(64, triton_next_pow2(width))


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def pool_kernel_name(ratio: int, width: int, state: bool, dtype: torch.dtype = torch.float32) -> str:
    """Stable kernel name, e.g. ``compressor_pool.c4.w512.triton`` (``.f64`` for fp64 accumulation)."""
    suffix = ".f64" if dtype == torch.float64 else ""
    return f"compressor_pool{'_state' if state else ''}.c{ratio}.w{width}{suffix}.triton"


def _kernel(ratio: int, width: int, overlap: bool, state: bool, interpret: bool, dtype: torch.dtype):
    name = pool_kernel_name(ratio, width, state, dtype)
    fn = name.split(".")[0]
    acc = "tl.float64" if dtype == torch.float64 else "tl.float32"

    def source() -> str:
        template = _POOL_STATE if state else _POOL
        return template.format(ratio=ratio, width=width, overlap=overlap, fn=fn, acc=acc)

    module = REGISTRY.build(name, "triton", f"v4compile::{fn}", source,
                            lambda path: load_triton_module(path, interpret), key=(overlap, interpret))
    return name, getattr(module, fn)


def pool_launch_config(ratio: int, width: int) -> dict[str, int]:
    """Tile shape: several small C4 blocks per program, one C128 block streamed in row chunks."""
    block_d = min(64, triton_next_pow2(width))
    if ratio >= 64:
        # measured on the H200 (65536 tokens, width 512): whole block at once beats 16/32/64-row chunks
        return {"BLOCK_J": 1, "CHUNK": ratio, "BLOCK_D": block_d, "num_warps": 4}
    return {"BLOCK_J": 16, "CHUNK": ratio, "BLOCK_D": block_d, "num_warps": 4}


def compressor_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                    n_blocks: int) -> torch.Tensor:
    """Triton body of ``v4compile::compressor_pool``."""
    acc = accumulation_dtype(kv)
    kv, score, ape = kv.contiguous(), score.contiguous(), ape.to(acc).contiguous()
    overlap = kv.shape[-1] == 2 * width
    name, kernel = _kernel(ratio, width, overlap, False, kv.device.type != "cuda", acc)
    bsz = kv.shape[0]
    out = torch.empty(bsz, n_blocks, width, dtype=acc, device=kv.device)
    if bsz * n_blocks == 0:
        return out
    config = pool_launch_config(ratio, width)
    grid = (bsz * triton.cdiv(n_blocks, config["BLOCK_J"]), triton.cdiv(width, config["BLOCK_D"]))
    REGISTRY.launch(name, lambda: kernel[grid](kv, score, ape, out, n_blocks, kv.stride(0), kv.stride(1),
                                               out.stride(0), out.stride(1), **config))
    REGISTRY.note_launch(name, grid=grid, tokens=kv.shape[1], **config)
    if kv.device.type == "cuda" and REGISTRY.records[name].lowered is None:
        REGISTRY.set_lowered(name, lowered_text(kernel) or "")
    return out


def compressor_pool_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """Triton body of ``v4compile::compressor_pool_state``."""
    acc = accumulation_dtype(kv_state)
    kv_state, score_state = kv_state.contiguous(), score_state.contiguous()
    overlap = kv_state.shape[-1] == 2 * width
    name, kernel = _kernel(ratio, width, overlap, True, kv_state.device.type != "cuda", acc)
    bsz = kv_state.shape[0]
    out = torch.empty(bsz, width, dtype=acc, device=kv_state.device)
    block_d = _block_d(width)
    grid = (bsz, -(-width // block_d))
    REGISTRY.launch(name, lambda: kernel[grid](kv_state, score_state, out, kv_state.stride(0), kv_state.stride(1),
                                               out.stride(0), BLOCK_D=block_d))
    REGISTRY.note_launch(name, grid=grid, BLOCK_D=block_d, num_warps=4)
    if kv_state.device.type == "cuda" and REGISTRY.records[name].lowered is None:
        REGISTRY.set_lowered(name, lowered_text(kernel) or "")
    return out
