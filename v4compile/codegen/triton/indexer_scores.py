"""The lightning indexer's scoring in Triton: ``sum_h w[h] * relu(q[h] . k[j])`` for a tile of keys per
program, all heads of one query at once (one tensor-core dot), rounding each step to the input dtype as
the model (and the official indexer) does, so the top-k that follows sees the same ties. The paged variant
reads each key where the serving engine keeps it, on a shared page named by the row's page table."""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import ROUND_BF16, load_triton_module, lowered_text

_SOURCE = '''
import triton
import triton.language as tl

DIM = tl.constexpr({dim})
ROUND = tl.constexpr({round})
PAGED = tl.constexpr({paged})
DOT = tl.{dot}
PRECISION = tl.constexpr("{precision}")
''' + ROUND_BF16 + '''


@triton.jit
def _round(x):
    if ROUND:
        x = _round_bf16(x)
    return x


@triton.jit
def indexer_scores(Q, KEYS, TABLE, W, OUT, seqlen, heads, n_keys, per_page, s_qb, s_qs, s_qh, s_kb, s_kn, s_tb,
                   s_wb, s_ws, s_ob, s_os, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    # PAGED: key j of row b is row TABLE[b, j // per_page] * per_page + j % per_page of the flattened pages
    row = tl.program_id(0)
    b = row // seqlen
    s = row % seqlen
    h = tl.arange(0, BLOCK_H)
    hmask = h < heads
    d = tl.arange(0, DIM)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * s_qb + s * s_qs + h[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
    if PAGED:
        page = tl.load(TABLE + b * s_tb + j // per_page, mask=j < n_keys, other=0).to(tl.int64)
        where = KEYS + (page * per_page + j % per_page)[:, None] * s_kn
    else:
        where = KEYS + b * s_kb + j[:, None] * s_kn
    keys = tl.load(where + d[None, :], mask=(j < n_keys)[:, None], other=0.0)
    dots = tl.maximum(_round(tl.dot(q.to(DOT), tl.trans(keys.to(DOT)), input_precision=PRECISION)), 0.0)
    w = tl.load(W + b * s_wb + s * s_ws + h, mask=hmask, other=0.0).to(tl.float32)
    total = _round(tl.sum(_round(dots * w[:, None]), axis=0))
    tl.store(OUT + b * s_ob + s * s_os + j, total, mask=j < n_keys)
'''


def kernel_name(dim: int, dtype: torch.dtype, backend: str = "triton", paged: bool = False) -> str:
    """Stable kernel name, e.g. ``indexer_scores.d128.bf16.triton`` (``.tilelang`` for that backend's kernel;
    ``indexer_scores_paged.d128.bf16.triton`` for keys on pages)."""
    op = "indexer_scores_paged" if paged else "indexer_scores"
    return f"{op}.d{dim}.{'bf16' if dtype == torch.bfloat16 else 'fp32'}.{backend}"


def launch_config(heads: int, cuda: bool) -> dict[str, int]:
    """All heads in one dot (at least 16 rows for the tensor cores) against a tile of keys."""
    return {"BLOCK_H": max(16, triton_next_pow2(heads)), "BLOCK_N": 128 if cuda else 32, "num_warps": 4}


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                   config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::indexer_scores``: q [B,S,H,d], keys [B,N,d], weights [B,S,H] -> [B,S,N] fp32.
    ``config`` overrides the launch configuration (benchmark sweeps)."""
    return _scores(q, keys, None, weights, config)


def indexer_scores_paged(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, weights: torch.Tensor,
                         config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::indexer_scores_paged``: keys on pages, pool [P,E,d] and table [B,pages] (row b's
    keys ``pool[table[b]]``) -> [B,S,pages*E] fp32, the keys read in place."""
    return _scores(q, pool, table, weights, config)


def _scores(q: torch.Tensor, keys: torch.Tensor, table: torch.Tensor | None, weights: torch.Tensor,
            config: dict[str, int] | None) -> torch.Tensor:
    bsz, seqlen, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the indexer scoring kernel needs a power-of-two head dim >= 16, got {dim}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the indexer scoring kernel takes bf16 or fp32 queries, got {q.dtype}")
    cuda = q.device.type == "cuda"
    low, paged = q.dtype == torch.bfloat16, table is not None
    # Triton's CPU interpreter cannot multiply bf16 tensors: there the operands are widened to fp32 (the
    # products of bf16 values are exact in fp32, accumulation is fp32 either way). fp32 queries (transformers'
    # indexer widens bf16 to fp32 before its matmul) multiply on the TF32 tensor cores in three products (hi*hi +
    # hi*lo + lo*hi): fp32-accurate, exact for widened bf16 values (their lo parts are 0); the "ieee" fp32 dot runs
    # on the FMA units, 337 ms a call at 8192 queries x 64 heads x 2048 keys on the H100 (NOTES.md 33rd).
    dot = "bfloat16" if low and cuda else "float32"
    precision = "tf32x3" if cuda and not low else "ieee"
    name = kernel_name(dim, q.dtype, paged=paged)
    module = REGISTRY.build(name, "triton", "v4compile::indexer_scores" + ("_paged" if paged else ""),
                            lambda: _SOURCE.format(dim=dim, round=low, dot=dot, paged=paged, precision=precision),
                            lambda path: load_triton_module(path, not cuda), key=(cuda, q.dtype))
    q, keys, weights = q.contiguous(), keys.to(q.dtype).contiguous(), weights.contiguous()
    if table is None:
        n, per_page, table, s_tb = keys.shape[1], 1, keys, 0
    else:
        table = table.contiguous()
        n, per_page, s_tb = table.shape[1] * keys.shape[1], keys.shape[1], table.stride(0)
        keys = keys.flatten(0, 1).unsqueeze(0)
    out = torch.empty(bsz, seqlen, n, dtype=torch.float32, device=q.device)
    config = config or launch_config(heads, cuda)
    grid = (bsz * seqlen, triton.cdiv(n, config["BLOCK_N"]))
    if out.numel():
        REGISTRY.launch(name, lambda: module.indexer_scores[grid](
            q, keys, table, weights, out, seqlen, heads, n, per_page, q.stride(0), q.stride(1), q.stride(2),
            keys.stride(0), keys.stride(1), s_tb, weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
            BLOCK_H=config["BLOCK_H"], BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"]))
        REGISTRY.note_launch(name, grid=grid, keys=n, **config)
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.indexer_scores) or "")
    return out
