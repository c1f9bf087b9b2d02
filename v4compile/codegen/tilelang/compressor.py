"""The compressor's decode-state pooling in TileLang: one pooled entry per row from the open block's state."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, load_module

_SOURCE = '''
import tilelang
import tilelang.language as T

RATIO = {ratio}
WIDTH = {width}
OVERLAP = {overlap}
SLOTS = 2 * RATIO if OVERLAP else RATIO
COLS = 2 * WIDTH if OVERLAP else WIDTH
BLOCK_D = {block_d}
# Masked state rows hold -inf; the C target builds with fast-math, so clamp them to a finite floor.
FLOOR = -3.0e38


def build(target):
    batch = T.dynamic("batch")

    @T.prim_func
    def {fn}(kv: T.Tensor((batch, SLOTS, COLS), "float32"), score: T.Tensor((batch, SLOTS, COLS), "float32"),
             out: T.Tensor((batch, WIDTH), "float32")):
        with T.Kernel(batch, T.ceildiv(WIDTH, BLOCK_D), threads={threads}) as (b, bd):
            for dd in T.serial(BLOCK_D):
                d = bd * BLOCK_D + dd
                m = T.alloc_var("float32")
                s = T.alloc_var("float32")
                acc = T.alloc_var("float32")
                m = FLOOR
                for r in T.serial(RATIO):
                    current = T.max(score[b, SLOTS - RATIO + r, COLS - WIDTH + d], FLOOR)
                    previous = T.max(score[b, r, d], FLOOR) if OVERLAP else FLOOR
                    m = T.max(m, T.max(current, previous))
                s = 0.0
                acc = 0.0
                for r in T.serial(RATIO):
                    e = T.exp(T.max(score[b, SLOTS - RATIO + r, COLS - WIDTH + d], FLOOR) - m)
                    s = s + e
                    acc = acc + e * kv[b, SLOTS - RATIO + r, COLS - WIDTH + d]
                    if OVERLAP:
                        e_prev = T.exp(T.max(score[b, r, d], FLOOR) - m)
                        s = s + e_prev
                        acc = acc + e_prev * kv[b, r, d]
                out[b, d] = acc / s

    return tilelang.compile({fn}, target=target, out_idx=[2])
'''


def kernel_name(ratio: int, width: int) -> str:
    """Stable kernel name, e.g. ``compressor_pool_state.c4.w512.tilelang``."""
    return f"compressor_pool_state.c{ratio}.w{width}.tilelang"


def compressor_pool_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """TileLang body of ``v4compile::compressor_pool_state`` (``c`` target on CPU, ``cuda`` on GPU)."""
    name = kernel_name(ratio, width)
    overlap = kv_state.shape[-1] == 2 * width
    cuda = kv_state.device.type == "cuda"
    block_d = width if not cuda else 1
    target = "cuda" if cuda else "c"
    kernel = REGISTRY.build(name, "tilelang", "v4compile::compressor_pool_state",
                            lambda: _SOURCE.format(ratio=ratio, width=width, overlap=overlap, fn="pool_state",
                                                   block_d=block_d, threads=1),
                            lambda path: load_module(path).build(target), key=(overlap, target))
    if REGISTRY.records[name].lowered is None:
        REGISTRY.set_lowered(name, kernel.get_kernel_source())
    out = REGISTRY.launch(name, lambda: kernel(kv_state.float().contiguous(), score_state.float().contiguous()))
    REGISTRY.note_launch(name, grid=(kv_state.shape[0], -(-width // block_d)), threads=1, target=target)
    return out
