"""Exact radix-select top-k in Triton, spread over many programs per row.

Four rounds of (histogram of the next 8 bits of the float's order-preserving key over every chunk of the
row, then pick the bucket holding the k-th largest) find the k-th key exactly; a count and an ordered
compaction then emit every key above it and the lowest-indexed ties, exactly k. -inf never beats a real
value; the winners are finally ordered by (value desc, index asc), the stable-sort order.
"""

from __future__ import annotations

import torch
import triton

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
def _state(STATE, row):
    prefix = tl.load(STATE + row * 3).to(tl.uint32, bitcast=True)
    known = tl.load(STATE + row * 3 + 1).to(tl.uint32, bitcast=True)
    return prefix, known


@triton.jit
def radix_hist(X, HIST, STATE, n, s_x, iters, SHIFT: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * iters * BLOCK
    prefix, known = _state(STATE, row)
    hist = tl.zeros([256], dtype=tl.int32)
    for it in range(iters):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        key = _keys(tl.load(X + row * s_x + offs, mask=valid, other=float("-inf")))
        match = valid & ((key & known) == prefix)
        hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=match)
    bins = tl.arange(0, 256)
    tl.atomic_add(HIST + row * 256 + bins, hist, mask=hist > 0)


@triton.jit
def radix_select(HIST, STATE, SHIFT: tl.constexpr):
    row = tl.program_id(0)
    bins = tl.arange(0, 256)
    hist = tl.load(HIST + row * 256 + bins)
    tl.store(HIST + row * 256 + bins, tl.zeros([256], dtype=tl.int32))
    prefix, known = _state(STATE, row)
    need = tl.load(STATE + row * 3 + 2)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    chosen = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    prefix = prefix | (chosen.to(tl.uint32) << SHIFT)
    known = known | (tl.full([], 255, tl.uint32) << SHIFT)
    tl.store(STATE + row * 3, prefix.to(tl.int32, bitcast=True))
    tl.store(STATE + row * 3 + 1, known.to(tl.int32, bitcast=True))
    tl.store(STATE + row * 3 + 2, need - above)


@triton.jit
def radix_count(X, STATE, COUNTS, n, s_x, iters, chunks):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * iters * BLOCK
    threshold, _ = _state(STATE, row)
    gt = tl.zeros([BLOCK], dtype=tl.int32)
    eq = tl.zeros([BLOCK], dtype=tl.int32)
    for it in range(iters):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        key = _keys(tl.load(X + row * s_x + offs, mask=valid, other=float("-inf")))
        gt += (valid & (key > threshold)).to(tl.int32)
        eq += (valid & (key == threshold)).to(tl.int32)
    tl.store(COUNTS + (row * chunks + chunk) * 2, tl.sum(gt, axis=0))
    tl.store(COUNTS + (row * chunks + chunk) * 2 + 1, tl.sum(eq, axis=0))


@triton.jit
def radix_emit(X, STATE, COUNTS, OUT, n, s_x, s_o, iters, chunks, CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * iters * BLOCK
    threshold, _ = _state(STATE, row)
    need = tl.load(STATE + row * 3 + 2)
    before = tl.arange(0, CHUNKS_P2)
    earlier = before < chunk
    seen_gt = tl.sum(tl.load(COUNTS + (row * chunks + before) * 2, mask=earlier, other=0), axis=0)
    seen_eq = tl.sum(tl.load(COUNTS + (row * chunks + before) * 2 + 1, mask=earlier, other=0), axis=0)
    for it in range(iters):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        key = _keys(tl.load(X + row * s_x + offs, mask=valid, other=float("-inf")))
        gt = (valid & (key > threshold)).to(tl.int32)
        eq = (valid & (key == threshold)).to(tl.int32)
        pos_gt = seen_gt + tl.cumsum(gt, axis=0) - gt
        tl.store(OUT + row * s_o + pos_gt, offs, mask=gt > 0)
        pos_eq = seen_eq + tl.cumsum(eq, axis=0) - eq
        tl.store(OUT + row * s_o + (K - need) + pos_eq, offs, mask=(eq > 0) & (pos_eq < need))
        seen_gt += tl.sum(gt, axis=0)
        seen_eq += tl.sum(eq, axis=0)
'''


def kernel_name(k: int) -> str:
    """Stable kernel name, e.g. ``radix_topk.k512.triton``."""
    return f"radix_topk.k{k}.triton"


def launch_config(rows: int, n: int, cuda: bool) -> dict[str, int]:
    """Block size, chunks per row and iterations per chunk: about 2048 programs in all on the GPU
    (H200: 4 chunks a row at batch 64 left the histogram pass at 100 us, latency-bound)."""
    block = min(1024 if cuda else 256, triton_next_pow2(max(n, 16)))
    blocks = triton.cdiv(n, block)
    target = max(1, (2048 if cuda else 4) // max(rows, 1))
    iters = triton.cdiv(blocks, min(blocks, target))
    return {"BLOCK": block, "iters": iters, "chunks": triton.cdiv(blocks, iters)}


def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton body of ``v4compile::radix_topk``: select in the kernels, then order the k winners."""
    name = kernel_name(k)
    n = x.shape[-1]
    cuda = x.device.type == "cuda"
    config = launch_config(x.numel() // max(n, 1), n, cuda)
    block = config["BLOCK"]
    module = REGISTRY.build(name, "triton", "v4compile::radix_topk", lambda: _SOURCE.format(k=k, block=block),
                            lambda path: load_triton_module(path, not cuda), key=(block, cuda))
    rows = x.reshape(-1, n).float().contiguous()
    r, iters, chunks = rows.shape[0], config["iters"], config["chunks"]
    ids = torch.empty(r, k, dtype=torch.int32, device=x.device)
    if r:
        state = torch.zeros(r, 3, dtype=torch.int32, device=x.device)
        state[:, 2] = k
        hist = torch.zeros(r, 256, dtype=torch.int32, device=x.device)
        counts = torch.empty(r, chunks, 2, dtype=torch.int32, device=x.device)

        def run() -> None:
            for shift in (24, 16, 8, 0):
                module.radix_hist[(r, chunks)](rows, hist, state, n, rows.stride(0), iters, SHIFT=shift)
                module.radix_select[(r,)](hist, state, SHIFT=shift)
            module.radix_count[(r, chunks)](rows, state, counts, n, rows.stride(0), iters, chunks)
            module.radix_emit[(r, chunks)](rows, state, counts, ids, n, rows.stride(0), ids.stride(0), iters, chunks,
                                           CHUNKS_P2=triton_next_pow2(chunks))

        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, grid=(r, chunks), launches_per_call=10, candidates=n, **config)
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.radix_hist) or "")
    ids = ids.long()
    values = torch.gather(x.reshape(-1, n), 1, ids)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    values, ids = torch.gather(values, 1, order), torch.gather(ids, 1, order)
    if mask_invalid:
        ids = torch.where(values == float("-inf"), -1, ids)
    return values.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)
