"""Exact radix-select top-k in Triton: histogram over the float bit pattern 8 bits at a time, find the
threshold bucket, refine, then emit exactly k (ties to the lowest index, -inf never beats a real value)."""

from __future__ import annotations

import torch

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import load_triton_module, lowered_text

_SOURCE = '''
import triton
import triton.language as tl

K = tl.constexpr({k})
BLOCK = tl.constexpr({block})


@triton.jit
def _keys(x):
    # +0.0 folds -0.0 (they compare equal); the key orders floats as unsigned integers.
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def {fn}(X, OUT, n, s_x, s_o):
    row = tl.program_id(0)
    base = X + row * s_x
    bins = tl.arange(0, 256)
    prefix = tl.zeros([1], dtype=tl.uint32)
    known = tl.zeros([1], dtype=tl.uint32)
    need = tl.full([1], K, dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < n
            key = _keys(tl.load(base + offs, mask=valid, other=float("-inf")))
            match = valid & ((key & known) == prefix)
            digit = ((key >> shift) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
        chosen = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
        need -= above
        prefix |= chosen.to(tl.uint32) << shift
        known |= tl.full([1], 255, dtype=tl.uint32) << shift
    n_greater = K - need
    seen_gt = tl.zeros([1], dtype=tl.int32)
    seen_eq = tl.zeros([1], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        key = _keys(tl.load(base + offs, mask=valid, other=float("-inf")))
        gt = (valid & (key > prefix)).to(tl.int32)
        eq = (valid & (key == prefix)).to(tl.int32)
        pos_gt = seen_gt + tl.cumsum(gt, axis=0) - gt
        tl.store(OUT + row * s_o + pos_gt, offs, mask=gt > 0)
        pos_eq = seen_eq + tl.cumsum(eq, axis=0) - eq
        take = (eq > 0) & (pos_eq < need)
        tl.store(OUT + row * s_o + n_greater + pos_eq, offs, mask=take)
        seen_gt += tl.sum(gt, axis=0)
        seen_eq += tl.sum(eq, axis=0)
'''


def kernel_name(k: int) -> str:
    """Stable kernel name, e.g. ``radix_topk.k512.triton``."""
    return f"radix_topk.k{k}.triton"


def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton body of ``v4compile::radix_topk``: select in the kernel, then order the k winners."""
    name = kernel_name(k)
    n = x.shape[-1]
    cuda = x.device.type == "cuda"
    block = min(4096 if cuda else 1024, triton_next_pow2(max(n, 16)))
    warps = 16 if cuda and block >= 4096 else 4
    source = _SOURCE.format(k=k, block=block, fn="radix_topk")
    interpret = x.device.type != "cuda"
    module = REGISTRY.build(name, "triton", "v4compile::radix_topk", source,
                            lambda path: load_triton_module(path, interpret))
    rows = x.reshape(-1, n).float().contiguous()
    ids = torch.empty(rows.shape[0], k, dtype=torch.int32, device=x.device)
    if rows.shape[0]:
        kernel = module.radix_topk
        REGISTRY.launch(name, lambda: kernel[(rows.shape[0],)](rows, ids, n, rows.stride(0), ids.stride(0),
                                                              num_warps=warps))
        REGISTRY.note_launch(name, grid=(rows.shape[0],), BLOCK=block, candidates=n, num_warps=warps)
        if x.device.type == "cuda" and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.radix_topk) or "")
    ids = ids.long()
    values = torch.gather(x.reshape(-1, n), 1, ids)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    values, ids = torch.gather(values, 1, order), torch.gather(ids, 1, order)
    if mask_invalid:
        ids = torch.where(values == float("-inf"), -1, ids)
    return values.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)
