"""Fused compressor pooling in Triton: positional bias, per-dim softmax over a block's tokens, weighted
sum, write, in one pass that reads kv and score once (prefill form and decode-state form)."""

from __future__ import annotations

import torch

from ..reference import accumulation_dtype
from ..registry import REGISTRY
from .launch import load_triton_module, lowered_text

_POOL = '''
import triton
import triton.language as tl

RATIO = {ratio}
WIDTH = {width}
OVERLAP = {overlap}
ACC = {acc}


@triton.jit
def {fn}(KV, SCORE, APE, OUT, n_blocks, s_kb, s_ks, s_ob, s_on, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // n_blocks
    j = pid % n_blocks
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < WIDTH
    r = tl.arange(0, RATIO)
    rows = j * RATIO + r
    cur = (WIDTH if OVERLAP else 0) + d
    ptr = b * s_kb + rows[:, None] * s_ks + cur[None, :]
    kv_c = tl.load(KV + ptr, mask=dmask[None, :], other=0.0).to(ACC)
    ape_c = tl.load(APE + r[:, None] * ((2 if OVERLAP else 1) * WIDTH) + cur[None, :], mask=dmask[None, :], other=0.0)
    z_c = tl.load(SCORE + ptr, mask=dmask[None, :], other=0.0).to(ACC) + ape_c
    m = tl.max(z_c, axis=0)
    if OVERLAP:
        pmask = dmask[None, :] & (rows[:, None] >= RATIO)
        pptr = b * s_kb + (rows[:, None] - RATIO) * s_ks + d[None, :]
        kv_p = tl.load(KV + pptr, mask=pmask, other=0.0).to(ACC)
        ape_p = tl.load(APE + r[:, None] * (2 * WIDTH) + d[None, :], mask=dmask[None, :], other=0.0).to(ACC)
        z_p = tl.load(SCORE + pptr, mask=pmask, other=float("-inf")).to(ACC) + ape_p
        m = tl.maximum(m, tl.max(z_p, axis=0))
    e_c = tl.exp(z_c - m[None, :])
    total = tl.sum(e_c, axis=0)
    acc = tl.sum(e_c * kv_c, axis=0)
    if OVERLAP:
        e_p = tl.exp(z_p - m[None, :])
        total += tl.sum(e_p, axis=0)
        acc += tl.sum(e_p * kv_p, axis=0)
    tl.store(OUT + b * s_ob + j * s_on + d, acc / total, mask=dmask)
'''

_POOL_STATE = '''
import triton
import triton.language as tl

RATIO = {ratio}
WIDTH = {width}
OVERLAP = {overlap}
ACC = {acc}


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
    template = _POOL_STATE if state else _POOL
    acc = "tl.float64" if dtype == torch.float64 else "tl.float32"
    source = template.format(ratio=ratio, width=width, overlap=overlap, fn=fn, acc=acc)
    module = REGISTRY.build(name, "triton", f"v4compile::{fn}", source,
                            lambda path: load_triton_module(path, interpret))
    return name, getattr(module, fn)


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
    block_d = _block_d(width)
    grid = (bsz * n_blocks, -(-width // block_d))
    REGISTRY.launch(name, lambda: kernel[grid](kv, score, ape, out, n_blocks, kv.stride(0), kv.stride(1),
                                               out.stride(0), out.stride(1), BLOCK_D=block_d))
    REGISTRY.note_launch(name, grid=grid, BLOCK_D=block_d, num_warps=4, tokens=kv.shape[1])
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
