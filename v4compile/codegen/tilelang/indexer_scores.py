"""The lightning indexer's scoring in TileLang: ``sum_h w[h] * relu(q[h] . k[j])`` for one query's heads against
TILES tiles of BLOCK_N keys per block. The key tiles stream through shared memory (asynchronous copies STAGES
deep on CUDA), the [keys, heads] product runs on the tensor cores (wgmma) on CUDA and as plain loops on the ``c``
target, and every step rounds to bf16 as the model (and the official indexer) does, so the top-k that follows
sees the same ties: the product, each weighted head, and the head sum.
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import REGISTRY
from ..triton import indexer_scores as triton_scores
from .common import DTYPES, TARGET_MACROS, compute_dtypes, load_kernels

_SOURCE = '''
import tilelang
import tilelang.language as T

DIM = {dim}
BLOCK_H = {block_h}
BLOCK_N = {block_n}
TILES = {tiles}
STAGES = {stages}
THREADS = {threads}
ROUND = {round}
IN = "{in_dtype}"
''' + TARGET_MACROS + '''

def build(target):
    batch, seqlen, heads, n_keys = T.dynamic("batch"), T.dynamic("seqlen"), T.dynamic("heads"), T.dynamic("n_keys")
    cuda = target != "c"
    # the c target keeps one dynamic shared buffer at most: its tiles are plain arrays there
    staged = T.alloc_shared if cuda else T.alloc_fragment

    to_bf16, reduce_rows = target_macros(cuda)

    @T.macro
    def rounded(x):
        if ROUND:
            return to_bf16(x)
        return x

    @T.macro
    def product(k_s, q_s, dots):
        # dots[n, h] = k[n] . q[h]: keys are the rows (split over the warp groups), so the head sum runs along
        # a thread's own columns and its quad
        if cuda:
            T.gemm(k_s, q_s, dots, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
        else:
            for n, h in T.Parallel(BLOCK_N, BLOCK_H):
                dots[n, h] = 0.0
                for d in T.serial(DIM):
                    dots[n, h] += T.cast(k_s[n, d], "float32") * T.cast(q_s[h, d], "float32")

    @T.prim_func
    def indexer_scores(q: T.Tensor((batch, seqlen, heads, DIM), IN), keys: T.Tensor((batch, n_keys, DIM), IN),
                       w: T.Tensor((batch, seqlen, heads), IN), out: T.Tensor((batch, seqlen, n_keys), "float32")):
        # block (bn, s, b): query s of row b (all its heads, zero-padded to BLOCK_H) against TILES key tiles
        with T.Kernel(T.ceildiv(n_keys, BLOCK_N * TILES), seqlen, batch, threads=THREADS) as (bn, s, b):
            q_s = staged((BLOCK_H, DIM), IN)
            k_s = staged((BLOCK_N, DIM), IN)
            dots = T.alloc_fragment((BLOCK_N, BLOCK_H), "float32")
            weight = T.alloc_fragment((BLOCK_H,), "float32")
            total = T.alloc_fragment((BLOCK_N,), "float32")
            for h, d in T.Parallel(BLOCK_H, DIM):
                q_s[h, d] = T.if_then_else(h < heads, q[b, s, h, d], T.cast(0, IN))
            for h in T.Parallel(BLOCK_H):
                weight[h] = T.if_then_else(h < heads, T.cast(w[b, s, h], "float32"), 0.0)
            for t in T.Pipelined(TILES, num_stages=STAGES):
                n0 = (bn * TILES + t) * BLOCK_N
                T.copy(keys[b, n0:n0 + BLOCK_N, :], k_s)
                product(k_s, q_s, dots)
                for n, h in T.Parallel(BLOCK_N, BLOCK_H):
                    dots[n, h] = rounded(rounded(T.max(dots[n, h], 0.0)) * weight[h])
                reduce_rows(dots, total, BLOCK_N, BLOCK_H, "sum")  # the head sum
                for n in T.Parallel(BLOCK_N):
                    if n0 + n < n_keys:
                        out[b, s, n0 + n] = rounded(total[n])

    configs = {{"tirx.disable_vectorize": not cuda, tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
               tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}}
    return tilelang.compile(indexer_scores, target=target, pass_configs=configs)
'''


def takes(q: torch.Tensor) -> bool:
    """Whether the TileLang kernel takes these queries: bf16 (the tensor-core product) on a CUDA device, bf16 or
    fp32 on the CPU (``c`` target), a power-of-two head dim of 16 to 256 (the queries and three key tiles fit
    in shared memory) and at most 64 heads (one wgmma tile)."""
    dim, heads = q.shape[-1], q.shape[-2]
    dtypes = (torch.bfloat16,) if q.device.type == "cuda" else (torch.bfloat16, torch.float32)
    return q.device.type in ("cuda", "cpu") and q.dtype in dtypes and 16 <= dim <= 256 and not dim & (dim - 1) \
        and heads <= 64


def launch_config(rows: int, n_keys: int, cuda: bool, sms: int = 132) -> dict[str, int]:
    """128 keys a tile against all heads, 64 keys per warp group (two), streamed through three stages; a block
    takes a power of two of a row's tiles, as many as leave about one block per SM (``sms``, 132 on the H200),
    at most 16 and never more than the row has (H200 sweep: benchmarks/NOTES.md). Small tiles on the ``c``
    target."""
    if not cuda:
        return {"block_n": 32, "tiles": 2, "stages": 1, "threads": 128}
    per_row = -(-n_keys // 128)
    tiles = max(1, min(16, per_row, rows * per_row // sms))
    return {"block_n": 128, "tiles": 1 << (tiles.bit_length() - 1), "stages": 3, "threads": 256}


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                   config: dict[str, int] | None = None) -> torch.Tensor:
    """TileLang body of ``v4compile::indexer_scores``: q [B,S,H,d], keys [B,N,d], weights [B,S,H] -> [B,S,N] fp32.
    Queries the kernel does not take (see ``takes``) run the Triton kernel. ``config`` overrides the launch
    configuration (benchmark sweeps)."""
    if not takes(q):
        return triton_scores.indexer_scores(q, keys, weights)
    bsz, seqlen, heads, dim = q.shape
    target, in_dtype, _ = compute_dtypes(q.dtype, q.device)
    cuda = target == "cuda"
    config = config or launch_config(bsz * seqlen, keys.shape[1], cuda,
                                     torch.cuda.get_device_properties(q.device).multi_processor_count if cuda else 1)
    block_h = 64 if cuda else max(16, 1 << (heads - 1).bit_length())
    name = triton_scores.kernel_name(dim, q.dtype, "tilelang")
    kernel: Any = REGISTRY.build(
        name, "tilelang", "v4compile::indexer_scores",
        lambda: _SOURCE.format(dim=dim, block_h=block_h, round=q.dtype == torch.bfloat16, in_dtype=DTYPES[in_dtype],
                               **config),
        lambda path: load_kernels(path, target, name), key=(target, block_h, *sorted(config.items())))
    q, keys, weights = (t.to(in_dtype).contiguous() for t in (q, keys.to(q.dtype), weights.to(q.dtype)))
    out = torch.empty(bsz, seqlen, keys.shape[1], dtype=torch.float32, device=q.device)
    if out.numel():
        REGISTRY.launch(name, lambda: kernel(q, keys, weights, out))
        grid = (-(-keys.shape[1] // (config["block_n"] * config["tiles"])), seqlen, bsz)
        REGISTRY.note_launch(name, grid=grid, keys=keys.shape[1], target=target, block_h=block_h, **config)
    return out
