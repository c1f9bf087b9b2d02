"""Exact top-k in TileLang: a threshold from group maxima, a collecting pass, a ranking kernel.

Every candidate is packed as ``key << 32 | ~index`` (64 bits; keys order floats as unsigned integers, NaN
largest), so packed values are unique and their descending order is the stable descending-sort order: the k
largest packed values are the answer, ties going to the lowest index, with no tie pass.

1. ``topk_group_max``: thread g of a row takes the largest packed value of group g (candidates g, g + G, g + 2G,
   ...: strided, so runs of large scores spread over many groups).
2. ``topk_threshold``: one block per row finds ``t``, the k-th largest group maximum, by 8-bit radix rounds over
   the maxima (stopping once the digit's bucket holds exactly the keys still wanted). k group maxima are
   ``>= t``, so every one of the top k is; it also zeroes the row's candidate count.
3. ``topk_collect``: the candidates ``>= t`` are gathered at slots taken by an atomic (about k of them for random
   scores, whatever the ties: a tied group's maximum is its lowest index).
4. ``topk_select``: each candidate's output position is the number of gathered values above it; the value is
   read back from the row at its index. When more than ``CAP`` were gathered (scores clustered so that many
   groups hold many values above ``t``), one block per row instead finds the k-th packed value exactly by
   radix rounds over the whole row, gathers the k values at or above it and ranks those.
"""

from __future__ import annotations

import torch

from .. import reference
from ..registry import REGISTRY
from ..triton import radix_topk as triton_topk
from .common import load_kernels

_SOURCE = '''
import tilelang
import tilelang.language as T

K = {k}
GROUP = {group}
THREADS = {threads}
BLOCK = {block}
CAP = {cap}
SELECT_THREADS = {select_threads}
SELECTORS = {selectors}
MASK_INVALID = {mask_invalid}
PER = 16
U64 = "uint64"


def build(target):
    rows, n, n_groups = T.dynamic("rows"), T.dynamic("n"), T.dynamic("n_groups")
    cuda = target != "c"
    # the c target runs a block's loops one after another in one thread and keeps one dynamic shared buffer at
    # most: there block-wide and per-thread buffers are plain local arrays and parallel loops serial ones
    shared = T.alloc_shared if cuda else T.alloc_local
    per_thread = T.alloc_fragment if cuda else T.alloc_local
    each = T.Parallel if cuda else T.serial

    @T.macro
    def packed(x, j):
        # the candidate's packed value: +-0 fold, every NaN takes the largest key, larger key then lower index
        # (bit arithmetic only: fast math may fold x + 0 and x != x)
        bits = T.reinterpret(x, "uint32")
        bits = T.if_then_else((bits << T.uint32(1)) == T.uint32(0), T.uint32(0), bits)
        key = bits ^ T.if_then_else((bits >> T.uint32(31)) == T.uint32(1), T.uint32(0xFFFFFFFF), T.uint32(0x80000000))
        key = T.if_then_else((bits & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000), T.uint32(0xFFFFFFFF), key)
        return (T.cast(key, U64) << T.uint64(32)) | T.cast(T.cast(j, "uint32") ^ T.uint32(0xFFFFFFFF), U64)

    @T.macro
    def histogram(hist, src, row, from_row, vals, prefix, r, threads):
        # hist[d]: how many of the row's values (``src`` the row's candidates, packed here, or its group maxima)
        # match the prefix found so far above round r's digit (bits 63 - 8r .. 56 - 8r) and have digit d there.
        # A thread loads PER values before counting them: the counting is a barrier apart from the next load.
        for d in each(256):
            hist[d] = 0
        for c in T.serial(T.ceildiv(src.shape[1], threads * PER)):
            for t in each(threads):
                for u in T.unroll(PER):
                    j = (c * PER + u) * threads + t
                    if from_row:
                        vals[u] = T.if_then_else(j < src.shape[1], packed(src[row, j], j), T.uint64(0))
                    else:
                        vals[u] = T.if_then_else(j < src.shape[1], src[row, j], T.uint64(0))
                for u in T.unroll(PER):
                    # the bits above this round's digit (two shifts: one of 64 bits is undefined)
                    high = (vals[u] >> T.uint64(63 - 8 * r)) >> T.uint64(1)
                    if (c * PER + u) * threads + t < src.shape[1] and \
                            high == (prefix[r] >> T.uint64(63 - 8 * r)) >> T.uint64(1):
                        T.atomic_add(hist[T.cast((vals[u] >> T.uint64(56 - 8 * r)) & T.uint64(255), "int32")], 1)

    @T.macro
    def start(prefix, left, done):
        prefix[0] = T.uint64(0)
        left[0] = K
        done[0] = 0

    @T.macro
    def narrow(hist, above, acc, prefix, left, done, r):
        # the digit holding the left-th largest matching value: round r + 1's prefix and count still wanted;
        # done once that digit's bucket holds exactly the values still wanted (the prefix is then the threshold).
        # above[d]: the values in digits above d, from sums of 16 digits (above[256:]) and the rest of d's 16
        for c in each(16):
            acc[0] = 0
            for b in T.unroll(16):
                acc[0] += hist[16 * c + b]
            above[256 + c] = acc[0]
        for d in each(256):
            acc[0] = 0
            for c in T.unroll(16):
                acc[0] += T.if_then_else(c > d // 16, above[256 + c], 0)
            for b in T.unroll(16):
                acc[0] += T.if_then_else(b > d % 16, hist[d // 16 * 16 + b], 0)
            above[d] = acc[0]
        for d in each(256):
            if above[d] < left[r] and above[d] + hist[d] >= left[r]:
                prefix[r + 1] = prefix[r] | (T.cast(d, U64) << T.uint64(56 - 8 * r))
                left[r + 1] = left[r] - above[d]
                done[r + 1] = T.if_then_else(hist[d] == left[r] - above[d], 1, 0)

    @T.macro
    def carry(prefix, left, done, r):
        # a finished search keeps its threshold through the remaining rounds
        prefix[r + 1] = prefix[r]
        left[r + 1] = left[r]
        done[r + 1] = 1

    @T.macro
    def search(hist, above, acc, vals, prefix, left, done, src, row, from_row, threads):
        # the k-th largest of the row's values (see histogram) by up to eight 8-bit rounds: prefix[8]
        start(prefix, left, done)
        for r in T.serial(8):
            if done[r] == 0:
                histogram(hist, src, row, from_row, vals, prefix, r, threads)
                narrow(hist, above, acc, prefix, left, done, r)
            else:
                carry(prefix, left, done, r)

    @T.macro
    def emit(x, values, ids, row, p, rank):
        # an int32 index (n < 2**31), so the row's offset is formed in 64 bits as in every other access
        j = T.cast(T.cast(p & T.uint64(0xFFFFFFFF), "uint32") ^ T.uint32(0xFFFFFFFF), "int32")
        v = x[row, j]
        values[row, rank] = v
        ids[row, rank] = T.if_then_else(MASK_INVALID and T.reinterpret(v, "int32") == T.int32(-8388608), T.int64(-1),
                                        T.cast(j, "int64"))

    @T.macro
    def rank_and_emit(x, values, ids, row, staged, length, rank, mine, block, blocks):
        # each of staged[:length] goes to output position (number of staged values above it) if below K; this
        # block of ``blocks`` takes every blocks-th run of SELECT_THREADS values
        for m in T.serial(T.ceildiv(length, blocks * SELECT_THREADS)):
            for t in each(SELECT_THREADS):
                i = (m * blocks + block) * SELECT_THREADS + t
                rank[t] = 0
                if i < length:
                    mine[t] = staged[i]
                    for j in T.serial(length):
                        rank[t] += T.if_then_else(staged[j] > mine[t], 1, 0)
                    if rank[t] < K:
                        emit(x, values, ids, row, mine[t], rank[t])

    @T.prim_func
    def topk_group_max(x: T.Tensor((rows, n), "float32"), gmax: T.Tensor((rows, n_groups), U64)):
        with T.Kernel(rows, T.ceildiv(n_groups, THREADS), threads=THREADS) as (row, bg):
            best = per_thread((THREADS,), U64)
            for t in each(THREADS):
                best[t] = T.uint64(0)
            for i in T.unroll(GROUP):
                for t in each(THREADS):
                    j = i * n_groups + bg * THREADS + t
                    if j < n:  # threads past the last group compute a maximum they do not store
                        best[t] = T.max(best[t], packed(x[row, j], j))
            for t in each(THREADS):
                if bg * THREADS + t < n_groups:
                    gmax[row, bg * THREADS + t] = best[t]

    @T.prim_func
    def topk_threshold(gmax: T.Tensor((rows, n_groups), U64), thresh: T.Tensor((rows,), U64),
                       count: T.Tensor((rows,), "int32")):
        with T.Kernel(rows, threads=THREADS) as row:
            hist = shared((256,), "int32")
            above = shared((272,), "int32")
            prefix = shared((9,), U64)
            left = shared((9,), "int32")
            done = shared((9,), "int32")
            vals = T.alloc_local((PER,), U64)
            acc = T.alloc_local((1,), "int32")
            search(hist, above, acc, vals, prefix, left, done, gmax, row, False, THREADS)
            thresh[row] = prefix[8]
            count[row] = 0

    @T.prim_func
    def topk_collect(x: T.Tensor((rows, n), "float32"), thresh: T.Tensor((rows,), U64),
                     count: T.Tensor((rows,), "int32"), cand: T.Tensor((rows, CAP), U64)):
        with T.Kernel(rows, T.ceildiv(n, BLOCK), threads=THREADS) as (row, bc):
            for t in each(BLOCK):
                j = bc * BLOCK + t
                if j < n:
                    p = packed(x[row, j], j)
                    if p >= thresh[row]:
                        slot = T.atomic_add(count[row], 1, return_prev=True)
                        if slot < CAP:
                            cand[row, slot] = p

    @T.prim_func
    def topk_select(x: T.Tensor((rows, n), "float32"), count: T.Tensor((rows,), "int32"),
                    cand: T.Tensor((rows, CAP), U64), values: T.Tensor((rows, K), "float32"),
                    ids: T.Tensor((rows, K), "int64")):
        with T.Kernel(rows, SELECTORS, threads=SELECT_THREADS) as (row, bs):
            staged = shared((CAP,), U64)
            hist = shared((256,), "int32")
            above = shared((272,), "int32")
            prefix = shared((9,), U64)
            left = shared((9,), "int32")
            done = shared((9,), "int32")
            gathered = shared((1,), "int32")
            vals = T.alloc_local((PER,), U64)
            acc = T.alloc_local((1,), "int32")
            rank = per_thread((SELECT_THREADS,), "int32")
            mine = per_thread((SELECT_THREADS,), U64)
            total = T.alloc_var("int32")
            total = count[row]
            if total <= CAP:
                for c in each(total):
                    staged[c] = cand[row, c]
                rank_and_emit(x, values, ids, row, staged, total, rank, mine, bs, SELECTORS)
            elif bs == 0:
                # clustered scores: the exact k-th packed value by radix rounds over the row
                search(hist, above, acc, vals, prefix, left, done, x, row, True, SELECT_THREADS)
                gathered[0] = 0
                for c in T.serial(T.ceildiv(n, SELECT_THREADS)):
                    for t in each(SELECT_THREADS):
                        j = c * SELECT_THREADS + t
                        if j < n:
                            p = packed(x[row, j], j)
                            if p >= prefix[8]:
                                staged[T.atomic_add(gathered[0], 1, return_prev=True)] = p
                rank_and_emit(x, values, ids, row, staged, K, rank, mine, 0, 1)

    configs = {{"tirx.disable_vectorize": not cuda, tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
               tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}}
    return tuple(tilelang.compile(f, target=target, pass_configs=configs)
                 for f in (topk_group_max, topk_threshold, topk_collect, topk_select))
'''


MAX_K = 4096
"""Largest k the kernel takes: the ranking stages its candidate room (4k packed values) in shared memory."""

MAX_CANDIDATES = 1 << 25
"""Most candidates per row the kernel takes: a row's collecting blocks sit on the grid's second axis (at most
65,535 blocks of 1024); the Triton kernel takes longer rows."""


def launch_config(n: int, k: int, cuda: bool) -> dict[str, int]:
    """Group size (a power of two leaving at least ``8k`` groups, so about k candidates pass the threshold, and at
    most 64 candidates a thread: fewer groups keep the threshold's histograms short, which costs more than the
    group maxima, H200 profile in benchmarks/NOTES.md), threads per block, candidates per collecting block,
    candidate room, and the ranking split (about one candidate per ranking thread for ``2k`` gathered). Small
    blocks on the ``c`` target, where a block's threads run one after another."""
    group = max(1, min(64, 1 << max(0, (n // (8 * k)).bit_length() - 1)))
    threads = 256 if cuda else 32
    select_threads = 256 if cuda else 32
    return {"group": group, "threads": threads, "block": 4 * threads, "cap": max(4096, 4 * k),
            "select_threads": select_threads, "selectors": max(1, -(-2 * k // select_threads))}


def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool,
               config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TileLang body of ``v4compile::radix_topk``: the k largest of the last dim, ordered like a stable
    descending sort (NaN first). k beyond ``MAX_K`` or rows beyond ``MAX_CANDIDATES`` run the Triton kernel.
    ``config`` overrides the launch configuration (benchmark sweeps); one leaving fewer than k groups is a
    ValueError."""
    n = x.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"radix_topk needs 1 <= k <= {n} (the last dim), got k={k}")
    if k > MAX_K or n > MAX_CANDIDATES:
        return triton_topk.radix_topk(x, k, mask_invalid)
    if x.dtype not in triton_topk.KEYED_DTYPES or x.device.type not in ("cuda", "cpu"):
        return reference.radix_topk(x, k, mask_invalid)
    cuda = x.device.type == "cuda"
    rows = x.reshape(-1, n).float().contiguous()
    r = rows.shape[0]
    config = config or launch_config(n, k, cuda)
    n_groups = -(-n // config["group"])
    if n_groups < k:
        raise ValueError(f"radix_topk: groups of {config['group']} leave {n_groups} group maxima for {n} candidates, "
                         f"fewer than k={k}")
    target = "cuda" if cuda else "c"
    name = triton_topk.kernel_name(k, "tilelang")
    group_max, threshold, collect, select = REGISTRY.build(
        name, "tilelang", "v4compile::radix_topk",
        lambda: _SOURCE.format(k=k, mask_invalid=mask_invalid, **config),
        lambda path: load_kernels(path, target, name), key=(target, mask_invalid, *sorted(config.items())))
    values = torch.empty(r, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(r, k, dtype=torch.long, device=x.device)
    if r:
        gmax = torch.empty(r, n_groups, dtype=torch.uint64, device=x.device)
        thresh = torch.empty(r, dtype=torch.uint64, device=x.device)
        count = torch.empty(r, dtype=torch.int32, device=x.device)
        cand = torch.empty(r, config["cap"], dtype=torch.uint64, device=x.device)

        def run() -> None:
            group_max(rows, gmax)
            threshold(gmax, thresh, count)
            collect(rows, thresh, count, cand)
            select(rows, count, cand, values, ids)

        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, grid=(r, -(-n // config["block"])), launches_per_call=4, candidates=n,
                             target=target, **config)
    return triton_topk.in_input_form(x, values, ids)
