"""Exact top-k in Triton: group maxima with a threshold, a collecting pass, a ranking kernel.

1. ``topk_group_max``: many programs per row take the maximum key of every (strided) group of ``GROUP``
   candidates (about two groups per wanted key); keys order floats as unsigned integers. The row's last
   program to finish (a ticket) finds ``t``, the k-th largest group maximum to 16 bits, by two 8-bit radix
   rounds: at least k candidates are ``>= t``, so every one of the top k is, and for random scores few
   more. Each later kernel is launched to start as the one before it ends (programmatic dependent launch).
2. ``topk_collect``: many programs per row gather the candidates ``> t``, packed as ``key << 32 | ~index``,
   at slots taken by one atomic per batch. With many rows (bandwidth counts) the group-maxima pass also
   kept the maximum of every run of ``TILE_G`` consecutive candidates, so only runs whose maximum exceeds
   ``t`` (about one per gathered candidate) are read again; with few rows on the GPU every tile is read
   (fewer dependent steps).
3. ``topk_select``: one program per row sorts the gathered candidates (up to ``SORT``; packed keys are
   unique, so their descending order is the stable descending-sort order, whatever order the atomics
   gathered them in); more than that, and a few programs per row rank each candidate by counting the
   larger ones. The value is decoded from the key, so the row is not read again. Fewer than k above ``t``
   leaves the rest to the lowest-indexed keys equal to ``t`` (ties, or -inf filling a short row), which one
   program emits in index order. When more than ``CAP`` candidates exceed ``t`` (clustered scores), one
   program per row instead finds the k-th key exactly by 8-bit radix rounds over the whole row.
"""

from __future__ import annotations

import torch
import triton

from .. import reference
from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import load_triton_module, lowered_text

_SOURCE = '''
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

K = tl.constexpr({k})
BLOCK = tl.constexpr({block})
GROUP = tl.constexpr({group})
TILE_G = tl.constexpr({tile_g})
RB = tl.constexpr({rb})
HB = tl.constexpr({hb})
SKIP_RUNS = tl.constexpr({skip_runs})
GROUPS = tl.constexpr({groups})
CAP = tl.constexpr({cap})
RANK = tl.constexpr({rank})
SPAN = tl.constexpr({span})
SORT = tl.constexpr({sort})
MASK_INVALID = tl.constexpr({mask_invalid})
PDL = tl.constexpr({pdl})
GPU_NAN = tl.constexpr({gpu_nan})


@triton.jit
def _keys(x):
    # +0.0 folds -0.0 (they compare equal); every NaN takes the largest key (NaN sorts first, ties by index,
    # as in torch): on the GPU the add itself returns the canonical NaN 0x7fffffff for a NaN of either sign
    # or payload (the H200 test's NaN case checks it), so no select; the interpreter keeps a NaN's sign, so it
    # selects. The key orders floats as unsigned integers.
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) | -2147483648)
    if not GPU_NAN:
        key = tl.where(x == x, key, -1)
    return key.to(tl.uint32, bitcast=True)


@triton.jit
def _value(key):
    # the float a key was made from (the inverse of _keys)
    sign = tl.full([], 2147483648, tl.uint32)
    bits = tl.where(key >= sign, key ^ sign, ~key)
    return bits.to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)


@triton.jit
def _packed(key, offs):
    # larger packed value = larger key, then lower index
    return (key.to(tl.uint64) << 32) | (4294967295 - offs.to(tl.uint64))


@triton.jit
def _narrow(hist, prefix, known, left, shift: tl.constexpr):
    # from the histogram of the next 8 bits, the digit holding the left-th largest key
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    digit = tl.max(tl.where(at_or_above >= left, bins, -1), axis=0)
    left -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    return prefix | (digit.to(tl.uint32) << shift), known | (tl.full([], 255, tl.uint32) << shift), left


@triton.jit
def _digits(key, mask, prefix, known, shift: tl.constexpr):
    # histogram of the 8-bit digit at ``shift`` among the keys matching ``prefix`` on the ``known`` bits
    return tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=mask & ((key & known) == prefix))


@triton.jit
def _threshold(GMAX, row, n_groups):
    # the k-th largest group maximum to 16 bits (32 when many share them): 8-bit radix rounds over the row's
    # group maxima
    g = tl.arange(0, GROUPS)
    valid = g < n_groups
    keys = tl.load(GMAX + row * GROUPS + g, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    prefix = tl.full([], 0, tl.uint32)
    known = tl.full([], 0, tl.uint32)
    left = K
    prefix, known, left = _narrow(_digits(keys, valid, prefix, known, 24), prefix, known, left, 24)
    prefix, known, left = _narrow(_digits(keys, valid, prefix, known, 16), prefix, known, left, 16)
    sharing = valid & ((keys & known) == prefix)
    if tl.sum(sharing.to(tl.int32), axis=0) >= 32:
        # many maxima share those 16 bits (ties, rows padded with -inf): the exact k-th maximum, so that the
        # keys equal to it go to the tie pass instead of all being gathered; when they are all equal
        # (bf16-valued scores, padding) that is their common key, without two more rounds
        low = tl.min(tl.where(sharing, keys, 4294967295), axis=0)
        if low == tl.max(tl.where(sharing, keys, 0), axis=0):
            prefix = low
        else:
            prefix, known, left = _narrow(_digits(keys, valid, prefix, known, 8), prefix, known, left, 8)
            prefix, known, left = _narrow(_digits(keys, valid, prefix, known, 0), prefix, known, left, 0)
    return prefix


@triton.jit
def topk_group_max(X, GMAX, RMAX, STATE, THRESH, n, s_x, n_groups, n_runs):
    # group g holds candidates g, g + n_groups, g + 2 n_groups, ...: strided, so runs of large values
    # (scores that grow with position, say) spread over many groups. The row's last program to finish
    # (a ticket in STATE) finds the threshold from all of them and zeroes the row's counters for the collect
    # and the next call (STATE persists between calls: no zero fill per call).
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * TILE_G + tl.arange(0, TILE_G)
    offs = tl.arange(0, GROUP)[:, None] * n_groups + groups[None, :]
    valid = (offs < n) & (groups < n_groups)[None, :]
    key = tl.where(valid, _keys(tl.load(X + row * s_x + offs, mask=valid, other=0.0)), 0)
    tl.store(GMAX + row * GROUPS + groups, tl.max(key, axis=0).to(tl.int32, bitcast=True), mask=groups < n_groups)
    if SKIP_RUNS:  # each tile row is a run of TILE_G consecutive candidates; its maximum lets the collect skip it
        runs = tl.program_id(1) * GROUP + tl.arange(0, GROUP)  # a program's run maxima side by side
        tl.store(RMAX + row * n_runs + runs, tl.max(key, axis=1).to(tl.int32, bitcast=True))
    tl.debug_barrier()
    ticket = tl.atomic_add(STATE + 2 * row + 1, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:
        tl.store(THRESH + row, _threshold(GMAX, row, n_groups).to(tl.int32, bitcast=True))
        tl.store(STATE + 2 * row + tl.arange(0, 2), tl.zeros([2], dtype=tl.int32))


@triton.jit
def _gather(STATE, CAND, row, key, offs, cand):
    # appends the packed keys where ``cand`` is 1 to the row's candidates (1-D tensors)
    found = tl.sum(cand, axis=0)
    if found > 0:
        pos = tl.atomic_add(STATE + 2 * row, found) + tl.cumsum(cand, axis=0) - cand
        tl.store(CAND + row * CAP + pos, _packed(key, offs).to(tl.int64, bitcast=True), mask=(cand > 0) & (pos < CAP))


@triton.jit
def topk_collect(X, RMAX, HOT, THRESH, STATE, CAND, n, s_x, n_groups, n_runs):
    # SKIP_RUNS: RB runs per program, only those whose maximum exceeds t read, HB at a time (many rows:
    # bandwidth counts); else one BLOCK-wide tile per program (few rows: fewer dependent steps), loaded
    # before waiting for the group-maxima kernel (the row was written before that kernel started)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if not SKIP_RUNS:
        tile = tl.load(X + row * s_x + offs, mask=offs < n, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    threshold = tl.load(THRESH + row).to(tl.uint32, bitcast=True)
    if SKIP_RUNS:
        runs = tl.program_id(1) * RB + tl.arange(0, RB)
        peak = tl.load(RMAX + row * n_runs + runs, mask=runs < n_runs, other=0).to(tl.uint32, bitcast=True)
        hot = (peak > threshold).to(tl.int32)
        n_hot = tl.sum(hot, axis=0)
        if n_hot > 0:
            listed = HOT + (row * tl.num_programs(1) + tl.program_id(1)) * RB
            tl.store(listed + tl.cumsum(hot, axis=0) - hot, runs, mask=hot > 0)
            tl.debug_barrier()
            for first in range(0, n_hot, HB):
                j = first + tl.arange(0, HB)
                run = tl.load(listed + j, mask=j < n_hot, other=0)
                g = (run // GROUP)[:, None] * TILE_G + tl.arange(0, TILE_G)[None, :]
                at = (run % GROUP)[:, None] * n_groups + g
                valid = (j < n_hot)[:, None] & (g < n_groups) & (at < n)
                key = _keys(tl.load(X + row * s_x + at, mask=valid, other=0.0))
                cand = (valid & (key > threshold)).to(tl.int32)
                _gather(STATE, CAND, row, tl.reshape(key, [HB * TILE_G]), tl.reshape(at, [HB * TILE_G]),
                        tl.reshape(cand, [HB * TILE_G]))
    else:
        key = _keys(tile)
        _gather(STATE, CAND, row, key, offs, ((offs < n) & (key > threshold)).to(tl.int32))


@triton.jit
def _rank(TABLE, count, mine):
    # how many packed keys among TABLE[:count] exceed each of ``mine``
    rank = tl.zeros([RANK], dtype=tl.int32)
    for j in range(0, count, SPAN):
        cols = j + tl.arange(0, SPAN)
        other = tl.load(TABLE + cols, mask=cols < count, other=0).to(tl.uint64, bitcast=True)
        rank += tl.sum((other[None, :] > mine[:, None]).to(tl.int32), axis=1)
    return rank


@triton.jit
def _emit(X, VALUES, IDS, row, s_x, s_v, s_i, mine, rank, keep):
    idx = (4294967295 - (mine & 4294967295)).to(tl.int64)
    value = _value((mine >> 32).to(tl.uint32))
    # the key lost the sign of a zero and a NaN's payload: those few values are read back from the row
    reread = keep & ((value == 0.0) | (value != value))
    value = tl.where(reread, tl.load(X + row * s_x + idx, mask=reread, other=0.0), value)
    if MASK_INVALID:
        idx = tl.where(value == float("-inf"), -1, idx)
    tl.store(VALUES + row * s_v + rank, value, mask=keep)
    tl.store(IDS + row * s_i + rank, idx, mask=keep)


@triton.jit
def _radix_round(X, row, n, s_x, prefix, known, left, shift: tl.constexpr):
    # one 8-bit radix round over the row, restricted to keys matching ``prefix`` on the ``known`` bits
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        key = _keys(tl.load(X + row * s_x + offs, mask=valid, other=0.0))
        hist += _digits(key, valid, prefix, known, shift)
    return _narrow(hist, prefix, known, left, shift)


@triton.jit
def _select_exactly(X, WIN, VALUES, IDS, row, n, s_x, s_v, s_i):
    # the slow path for heavy ties: the k-th key by radix rounds, then the keys above it and the
    # lowest-indexed ties gathered in index order into WIN, then ranked there
    prefix = tl.full([], 0, tl.uint32)
    known = tl.full([], 0, tl.uint32)
    left = K
    prefix, known, left = _radix_round(X, row, n, s_x, prefix, known, left, 24)
    prefix, known, left = _radix_round(X, row, n, s_x, prefix, known, left, 16)
    prefix, known, left = _radix_round(X, row, n, s_x, prefix, known, left, 8)
    prefix, known, left = _radix_round(X, row, n, s_x, prefix, known, left, 0)
    n_gt = 0
    n_eq = 0
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        key = _keys(tl.load(X + row * s_x + offs, mask=valid, other=0.0))
        packed = _packed(key, offs).to(tl.int64, bitcast=True)
        gt = (valid & (key > prefix)).to(tl.int32)
        tl.store(WIN + n_gt + tl.cumsum(gt, axis=0) - gt, packed, mask=gt > 0)
        eq = (valid & (key == prefix)).to(tl.int32)
        pos_eq = n_eq + tl.cumsum(eq, axis=0) - eq
        tl.store(WIN + (K - left) + pos_eq, packed, mask=(eq > 0) & (pos_eq < left))
        n_gt += tl.sum(gt, axis=0)
        n_eq += tl.sum(eq, axis=0)
    tl.debug_barrier()
    for first in range(0, K, RANK):
        ids = first + tl.arange(0, RANK)
        mine = tl.load(WIN + ids, mask=ids < K, other=0).to(tl.uint64, bitcast=True)
        _emit(X, VALUES, IDS, row, s_x, s_v, s_i, mine, _rank(WIN, K, mine), ids < K)


@triton.jit
def _emit_ties(X, VALUES, IDS, row, n, s_x, s_v, s_i, threshold, first):
    # output positions first..K-1 take the lowest-indexed keys equal to the threshold, in index order
    found = 0
    start = 0
    while (found < K - first) & (start < n):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(X + row * s_x + offs, mask=valid, other=0.0)
        eq = (valid & (_keys(x) == threshold)).to(tl.int32)
        pos = first + found + tl.cumsum(eq, axis=0) - eq
        keep = (eq > 0) & (pos < K)
        idx = offs.to(tl.int64)
        if MASK_INVALID:
            idx = tl.where(x == float("-inf"), -1, idx)
        tl.store(VALUES + row * s_v + pos, x, mask=keep)
        tl.store(IDS + row * s_i + pos, idx, mask=keep)
        found += tl.sum(eq, axis=0)
        start += BLOCK


@triton.jit
def topk_select(X, THRESH, STATE, CAND, VALUES, IDS, n, s_x, s_v, s_i):
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    total = tl.load(STATE + 2 * row)
    if total <= CAP:
        if (tl.program_id(1) == 0) & (total < K):
            _emit_ties(X, VALUES, IDS, row, n, s_x, s_v, s_i, tl.load(THRESH + row).to(tl.uint32, bitcast=True),
                       total)
        if SORT > 0:
            if (total <= SORT) & (tl.program_id(1) == 0):  # one sort of the candidates: their order is the output's
                ids = tl.arange(0, SORT)
                mine = tl.load(CAND + row * CAP + ids, mask=ids < total, other=0).to(tl.uint64, bitcast=True)
                ordered = tl.sort(mine, descending=True)
                _emit(X, VALUES, IDS, row, s_x, s_v, s_i, ordered, ids, (ids < total) & (ids < K))
        if total > SORT:
            for first in range(tl.program_id(1) * RANK, total, tl.num_programs(1) * RANK):
                ids = first + tl.arange(0, RANK)
                mine = tl.load(CAND + row * CAP + ids, mask=ids < total, other=0).to(tl.uint64, bitcast=True)
                rank = _rank(CAND + row * CAP, total, mine)
                _emit(X, VALUES, IDS, row, s_x, s_v, s_i, mine, rank, (ids < total) & (rank < K))
    elif tl.program_id(1) == 0:
        _select_exactly(X, CAND + row * CAP, VALUES, IDS, row, n, s_x, s_v, s_i)
'''


def kernel_name(k: int, backend: str = "triton") -> str:
    """Stable kernel name of either backend's top-k, e.g. ``radix_topk.k512.triton``."""
    return f"radix_topk.k{k}.{backend}"


SKIP_RUNS_FROM = 131072
"""Row length from which many rows collect only the runs above the threshold on the GPU. Below it every tile is
read: 8192 rows of 2048 took 946 against 4480 us, 64 rows of 65536 39.5 against 58.5 (H100, scratch sweep; the
skipping collect spends a [HB, TILE_G] tile on two runs when rows are short)."""


def launch_config(rows: int, n: int, k: int, cuda: bool) -> dict[str, int]:
    """Group size (about two strided groups per wanted key: a small table for the threshold, at the price
    of ~1.4k gathered candidates), 16+ groups per group-maxima program (64-byte runs; 128 once rows fill
    the GPU and bandwidth counts), how the collect reads (every tile on the GPU unless many rows are long,
    ``SKIP_RUNS_FROM``; else only runs above the threshold, RB per program, HB at a time), candidate room,
    and the ranking split: small blocks over many programs for few rows, larger ones once rows fill the GPU,
    and programmatic dependent launch where the GPU has it (sm_90+); H200 sweeps, the iteration notes in
    benchmarks/NOTES.md. Grid sizes follow from these (``_derived``), so overriding any of them keeps the
    launch consistent."""
    group = max(1, min(256, 1 << max(0, (n // (2 * k)).bit_length() - 1)))
    few = rows < 16 or not cuda
    return {"BLOCK": min((512 if rows < 16 else 1024) if cuda else 256, triton_next_pow2(max(n, 16))),
            "GROUP": group,
            "TILE_G": min(triton_next_pow2(triton.cdiv(n, group)), max(16 if rows < 16 else 32, 4096 // group)),
            "SKIP_RUNS": int(not cuda or (rows >= 16 and n >= SKIP_RUNS_FROM)), "RB": 64 if few else 256,
            "HB": 8 if few else 16,
            "CAP": max(4096, 4 * triton_next_pow2(k)), "RANK": (8 if rows < 16 else 64) if cuda else 256,
            "SPAN": 1024 if few else 256,
            "PDL": int(cuda and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
            "SORT": triton_next_pow2(2 * k) if k <= 1024 and rows >= 16 and cuda else 0,
            "warps_max": 8 if cuda and rows < 16 else 4, "warps_collect": 4,
            "warps_select": 8 if cuda and rows >= 16 else 4}


def _derived(config: dict[str, int], n: int, k: int) -> dict[str, int]:
    """The sizes a configuration implies for rows of ``n``: group maxima (and their power-of-two table),
    runs, collecting programs and ranking programs per row."""
    n_groups = triton.cdiv(n, config["GROUP"])
    n_runs = config["GROUP"] * triton.cdiv(n_groups, config["TILE_G"])
    collectors = triton.cdiv(n_runs, config["RB"]) if config["SKIP_RUNS"] else triton.cdiv(n, config["BLOCK"])
    return {"n_groups": n_groups, "GROUPS": triton_next_pow2(n_groups), "n_runs": n_runs,
            "collectors": collectors, "SELECTORS": max(1, triton.cdiv(2 * k, config["RANK"]))}


_RUNTIME = ("collectors", "n_runs", "n_groups", "SELECTORS", "warps_max", "warps_collect", "warps_select")


KEYED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes whose values fp32 keys order exactly; wider floats and integers are ranked by the reference."""

MAX_GROUPS = 1 << 16
"""Most group maxima one program counts for the threshold; rows needing more (k beyond ~16K, or beyond
~16M candidates) are ranked by the reference."""


_COUNTERS: dict[tuple[str, int], list[torch.Tensor]] = {}
"""Per (device, stream): the row counters of every size handed out eagerly, newest (largest) last."""


def _row_counters(device: torch.device, rows: int) -> torch.Tensor:
    """Per row: candidates gathered, group-maxima programs finished. Zeroed once when made; each call's
    threshold program zeroes its rows again, so no call pays a fill. One set per stream (calls on one stream
    run in order; a graph captured on a stream shares that stream's set, so graphs captured on one stream must
    not be replayed concurrently); outgrown sets stay alive, since a captured graph may still point at them.
    A set is only made outside capture: a capture without one takes a zero-filled set of its own, filled on
    every replay (a fill made in capture runs only when that graph replays, so it cannot be shared)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = _COUNTERS.setdefault((str(device), stream), [])
    if held and held[-1].shape[0] >= rows:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(rows, 2, dtype=torch.int32, device=device)
    held.append(torch.zeros(triton_next_pow2(rows), 2, dtype=torch.int32, device=device))
    return held[-1]


def in_input_form(x: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's [rows, k] fp32 values and ids shaped as ``x``'s leading dims, the values in ``x``'s own
    precision (kernels select on fp32 copies; -inf where an id is masked)."""
    if x.dtype != torch.float32:
        gathered = torch.gather(x.reshape(-1, x.shape[-1]), 1, ids.clamp(min=0))
        values = torch.where(ids < 0, float("-inf"), gathered)
    k = ids.shape[-1]
    return values.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)


def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool,
               config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton body of ``v4compile::radix_topk``: the k largest of the last dim, ordered like a stable
    descending sort (NaN first). ``config`` overrides the launch configuration (benchmark sweeps)."""
    n = x.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"radix_topk needs 1 <= k <= {n} (the last dim), got k={k}")
    rows = x.reshape(-1, n)
    cuda = x.device.type == "cuda"
    config = config or launch_config(rows.shape[0], n, k, cuda)
    config = {**config, **_derived(config, n, k)}
    if x.dtype not in KEYED_DTYPES or config["GROUPS"] > MAX_GROUPS:
        return reference.radix_topk(x, k, mask_invalid)
    name = kernel_name(k)
    rows = rows.float().contiguous()
    r = rows.shape[0]
    values = torch.empty(r, k, dtype=rows.dtype, device=x.device)
    ids = torch.empty(r, k, dtype=torch.long, device=x.device)
    if r:
        constants = {key.lower(): v for key, v in config.items() if key not in _RUNTIME}
        module = REGISTRY.build(
            name, "triton", "v4compile::radix_topk",
            lambda: _SOURCE.format(k=k, mask_invalid=mask_invalid, gpu_nan=cuda, **constants),
            lambda path: load_triton_module(path, not cuda), key=(tuple(sorted(constants.items())), mask_invalid, cuda))
        gmax = torch.empty(r, config["GROUPS"], dtype=torch.int32, device=x.device)
        thresh = torch.empty(r, dtype=torch.int32, device=x.device)
        state = _row_counters(x.device, r)
        cand = torch.empty(r, config["CAP"], dtype=torch.int64, device=x.device)
        s_x, n_groups, n_runs, collectors = rows.stride(0), config["n_groups"], config["n_runs"], config["collectors"]
        run_max = torch.empty(r, n_runs, dtype=torch.int32, device=x.device)
        hot = torch.empty(r, collectors * config["RB"], dtype=torch.int32, device=x.device)
        pdl = {"launch_pdl": True} if config["PDL"] else {}  # each kernel may start as its predecessor ends

        def run() -> None:
            try:
                module.topk_group_max[(r, triton.cdiv(n_groups, config["TILE_G"]))](
                    rows, gmax, run_max, state, thresh, n, s_x, n_groups, n_runs, num_warps=config["warps_max"])
                module.topk_collect[(r, collectors)](
                    rows, run_max, hot, thresh, state, cand, n, s_x, n_groups, n_runs,
                    num_warps=config["warps_collect"], **pdl)
                module.topk_select[(r, config["SELECTORS"])](
                    rows, thresh, state, cand, values, ids, n, s_x, values.stride(0), ids.stride(0),
                    num_warps=config["warps_select"], **pdl)
            except BaseException:
                state[:r].zero_()  # a grid stopped part way may have left tickets taken
                raise

        REGISTRY.launch(name, run)
        REGISTRY.note_launch(name, grid=(r, collectors), launches_per_call=3, candidates=n, **config)
        if cuda and REGISTRY.records[name].lowered is None:
            REGISTRY.set_lowered(name, lowered_text(module.topk_collect) or "")
    return in_input_form(x, values, ids)
