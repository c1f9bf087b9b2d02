"""The Triton source of the three top-k kernels, whose algorithm ``radix_topk.py`` describes (with the launch
configuration that fills the constants below, and the host wrapper).

The source is a format string: every launch-configuration constant (``BLOCK``, ``GROUP``, ``TILE_G``, ``RB``,
``HB``, ``SKIP_RUNS``, ``GROUPS``, ``CAP``, ``RANK``, ``SPAN``, ``SORT``, ``PDL``) and ``K``, ``MASK_INVALID`` and
``GPU_NAN`` are module constants of the generated file, one file per configuration.
"""

SOURCE = '''
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
