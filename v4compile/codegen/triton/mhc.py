"""mHC in Triton: the pre step and the post step of a sub-layer's hyper-connections over n streams.

Pre, two kernels. ``mhc_mixes`` projects vec(X) [rows, n*D] onto the (2+n)n mixes and sums its squares,
with the n*D reduction split over programs (split-K): decode batches have 1..64 rows, so rows alone leave
the GPU idle while fn [(2+n)n, n*D] (1.5 MB at V4-Flash dims) is most of the bytes. ``mhc_pre_finish``:
per row block, programs 0..nD-1 add up the partial sums of the pre mixes, apply the RMS scale and the
sigmoids and write one D block of the weighted stream sum y; the last program computes post and runs
Sinkhorn, unrolled for n so that every matrix entry is a register vector and every row or column sum a
chain of adds. Post, one kernel: ``out_k = post_k * y + sum_j comb[j, k] X_j`` in one pass over X.
Everything accumulates in fp32 in the reference's order of steps; bf16 results are rounded to nearest like
PyTorch's casts.
"""

from __future__ import annotations

import torch
import triton

from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import ROUND_BF16, load_triton_module, lowered_text

_HEADER = '''
import triton
import triton.language as tl

N = tl.constexpr({n})
NP = tl.constexpr({np})
DIM = tl.constexpr({dim})
WIDTH = tl.constexpr({n} * {dim})
MIXP = tl.constexpr({mixp})
ROUND_OUT = tl.constexpr({round_out})
SLICE = tl.{slice}
''' + ROUND_BF16

_PRE = _HEADER + '''

@triton.jit
def mhc_mixes(X, FN, PART, SQ, rows, per_split, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (m, s): rows [m BLOCK_M, +BLOCK_M) of vec(X) against columns [s per_split, +per_split) of fn
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    c = tl.arange(0, MIXP)
    rmask = r < rows
    x_rows = X + r.to(tl.int64)[:, None] * WIDTH
    acc = tl.zeros([BLOCK_M, MIXP], tl.float32)
    sq = tl.zeros([BLOCK_M], tl.float32)
    k_begin = split * per_split
    for k0 in range(k_begin, k_begin + per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < WIDTH
        x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(FN + c[:, None] * WIDTH + k[None, :], mask=(c < (2 + N) * N)[:, None] & kmask[None, :],
                    other=0.0)
        if X.dtype.element_ty == tl.bfloat16:
            # fn = hi + mid + lo exactly (three 8-bit slices of its 24-bit significand) and bf16 x times a bf16
            # slice is exact in fp32: three tensor-core products give the fp32 projection (SLICE is bf16 on the
            # GPU; fp32 under the CPU interpreter, which cannot multiply bf16 tensors, with the same products)
            w_hi = w.to(tl.bfloat16)
            rest = w - w_hi.to(tl.float32)
            w_mid = rest.to(tl.bfloat16)
            w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
            xs = x.to(SLICE)
            acc = tl.dot(xs, tl.trans(w_hi.to(SLICE)), acc, input_precision="ieee")
            acc = tl.dot(xs, tl.trans(w_mid.to(SLICE)), acc, input_precision="ieee")
            acc = tl.dot(xs, tl.trans(w_lo.to(SLICE)), acc, input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    # partials [rows, MIXP, splits]: a finishing program reads each mix's splits contiguously
    splits = tl.num_programs(1)
    tl.store(PART + (r[:, None] * MIXP + c[None, :]) * splits + split, acc, mask=rmask[:, None])
    tl.store(SQ + r * splits + split, sq, mask=rmask)


@triton.jit
def _mix(PART, part_rows, smask, inv, SCALE, BASE, splits, col: tl.constexpr, which: tl.constexpr):
    # mix ``col`` of each row: its partial projections summed over the splits, RMS-scaled, * scale + base
    total = tl.sum(tl.load(PART + part_rows + col * splits, mask=smask, other=0.0), axis=1)
    return total * inv * tl.load(SCALE + which) + tl.load(BASE + col)


@triton.jit
def mhc_pre_finish(X, PART, SQ, SCALE, BASE, Y, POST, COMB, rows, splits, iters, hc_eps, norm_eps,
                   ROWS: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # programs (rows, 0..nD-1): y for one D block; program (rows, nD): post and Sinkhorn
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < rows
    s = tl.arange(0, SPLITS_P)
    smask = rmask[:, None] & (s < splits)[None, :]
    sq = tl.sum(tl.load(SQ + r[:, None] * splits + s[None, :], mask=smask, other=0.0), axis=1)
    inv = 1.0 / tl.sqrt(sq / WIDTH + norm_eps)
    part_rows = r[:, None] * (MIXP * splits) + s[None, :]
    if tl.program_id(1) < tl.num_programs(1) - 1:
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        xmask = rmask[:, None] & (d < DIM)[None, :]
        x_rows = X + r.to(tl.int64)[:, None] * WIDTH + d[None, :]
        y = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for j in tl.static_range(N):
            pre = tl.sigmoid(_mix(PART, part_rows, smask, inv, SCALE, BASE, splits, j, 0)) + hc_eps
            y += pre[:, None] * tl.load(x_rows + j * DIM, mask=xmask, other=0.0).to(tl.float32)
        if ROUND_OUT:
            y = _round_bf16(y)
        tl.store(Y + r.to(tl.int64)[:, None] * DIM + d[None, :], y.to(Y.dtype.element_ty), mask=xmask)
    else:
{post_comb}
'''

_POST = _HEADER + '''
ACC = tl.constexpr({acc})


@triton.jit
def mhc_post(Y, X, POST, COMB, OUT, rows, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < rows
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = rmask[:, None] & (d < DIM)[None, :]
    k = tl.arange(0, NP)
    kmask = rmask[:, None] & (k < N)[None, :]
    x_rows = X + r.to(tl.int64)[:, None] * WIDTH + d[None, :]
    mixed = tl.zeros([ROWS, NP, BLOCK_D], ACC)
    for j in tl.static_range(N):
        comb = tl.load(COMB + r[:, None] * (N * N) + j * N + k[None, :], mask=kmask, other=0.0).to(ACC)
        x = tl.load(x_rows + j * DIM, mask=dmask, other=0.0).to(ACC)
        mixed += comb[:, :, None] * x[:, None, :]
    post = tl.load(POST + r[:, None] * N + k[None, :], mask=kmask, other=0.0).to(ACC)
    y = tl.load(Y + r.to(tl.int64)[:, None] * DIM + d[None, :], mask=dmask, other=0.0).to(ACC)
    out = post[:, :, None] * y[:, None, :] + mixed
    if ROUND_OUT:
        out = _round_bf16(out.to(tl.float32))
    ptr = OUT + r.to(tl.int64)[:, None, None] * WIDTH + k[None, :, None] * DIM + d[None, None, :]
    tl.store(ptr, out.to(OUT.dtype.element_ty), mask=kmask[:, :, None] & dmask[:, None, :])
'''


def _normalize(groups: list[list[str]]) -> list[str]:
    """Lines dividing each group of matrix entries by (its sum + eps): one Sinkhorn row or column step."""
    lines = []
    for group in groups:
        lines.append(f"total = {' + '.join(group)}")
        lines += [f"{c} = {c} / (total + hc_eps)" for c in group]
    return lines


def post_comb_source(n: int) -> str:
    """The finishing program's post and Sinkhorn code, unrolled for n streams: every matrix entry is one vector
    over the program's rows, so each row or column sum is a chain of adds in registers (no cross-lane reduction
    on Sinkhorn's serial path). Same steps and order as model/mhc.py's sinkhorn."""
    cells = [[f"c{i}_{j}" for j in range(n)] for i in range(n)]
    columns = [[row[j] for row in cells] for j in range(n)]
    mix = "_mix(PART, part_rows, smask, inv, SCALE, BASE, splits, {}, {})"
    lines = [f"tl.store(POST + r * N + {i}, 2 * tl.sigmoid({mix.format(n + i, 1)}), mask=rmask)" for i in range(n)]
    lines += [f"{cells[i][j]} = {mix.format(2 * n + i * n + j, 2)}" for i in range(n) for j in range(n)]
    for row in cells:
        top = row[0]
        for c in row[1:]:
            top = f"tl.maximum({top}, {c})"
        lines.append(f"top = {top}")
        lines += [f"{c} = tl.exp({c} - top)" for c in row]
        lines.append(f"total = {' + '.join(row)}")
        lines += [f"{c} = {c} / total + hc_eps" for c in row]
    lines += _normalize(columns)
    lines.append("for _ in range(iters - 1):")
    lines += ["    " + line for line in _normalize(cells) + _normalize(columns)]
    lines += [f"tl.store(COMB + r * (N * N) + {i * n + j}, {cells[i][j]}, mask=rmask)" for i in range(n)
              for j in range(n)]
    return "\n".join("        " + line for line in lines)


def _mixp(n: int) -> int:
    """The (2+n)n mixes padded to a power of two of at least 16 (the smallest dot tile)."""
    return max(16, triton_next_pow2((2 + n) * n))


def kernel_name(step: str, n: int, dim: int) -> str:
    """Stable kernel name, e.g. ``mhc_pre.n4.d4096.triton``."""
    return f"{step}.n{n}.d{dim}.triton"


def _module(step: str, n: int, dim: int, out_dtype: torch.dtype, acc: torch.dtype, interpret: bool):
    name = kernel_name(step, n, dim)
    np_ = triton_next_pow2(n)
    fields = {"n": n, "np": np_, "dim": dim, "mixp": _mixp(n),
              "round_out": out_dtype == torch.bfloat16, "acc": "tl.float64" if acc == torch.float64 else "tl.float32",
              "post_comb": post_comb_source(n) if step == "mhc_pre" else "",
              "slice": "float32" if interpret else "bfloat16"}
    template = _PRE if step == "mhc_pre" else _POST
    module = REGISTRY.build(name, "triton", f"v4compile::{step}", lambda: template.format(**fields),
                            lambda path: load_triton_module(path, interpret),
                            key=(interpret, out_dtype, acc))
    return name, module


def pre_launch_config(rows: int, n: int, dim: int, cuda: bool, device: int | None = None) -> dict[str, int]:
    """Split-K sized so rows x splits fill the GPU (about two programs per SM), rows in blocks of 16 to 64 (a
    block reuses each fn tile for all its rows); one warp per finishing program on the GPU (its reductions stay
    inside a warp) taking one row up to 64 rows and four beyond, many rows under the CPU interpreter (whose cost
    is per program).

    H200 sweep at V4-Flash dims (pre+post as one CUDA-graph replay, batch 1/4/16/64): 128 splits of 128
    columns beat 32 or 64 splits and 256 splits of 64; a finishing warp beats 2 or 4 (19.3 against 25.1 us
    at batch 1); 2 projection warps win up to 16 rows (18.6 against 19.3 us), 4 at 64 rows; 32-row blocks
    match 64-row ones at 64 rows (31.1 against 31.7 us), 16-row blocks lose (38.1 us). H100, the finishing rows
    (pre alone): 4 rows a warp take 8192 rows from 768.7 to 304.0 us and 2048 from 252.9 to 100.7 (8 or 16 rows
    with 2 or 4 warps 307-362 / 106-218 us); at 64 rows 82.5 against 84.4 us."""
    width = n * dim
    block_m = 64 if not cuda or rows > 64 else 16 if rows <= 16 else 32
    block_k = 128
    row_blocks = triton.cdiv(rows, block_m)
    k_blocks = triton.cdiv(width, block_k)
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    splits = max(1, min(k_blocks, triton.cdiv(target, row_blocks)))
    per_split = triton.cdiv(k_blocks, splits) * block_k
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "SPLITS": triton.cdiv(width, per_split), "PER_SPLIT": per_split,
            "ROWS": (1 if rows <= 64 else 4) if cuda else min(64, triton_next_pow2(rows)),
            "BLOCK_D": min(triton_next_pow2(dim), 512 if cuda else 256), "num_warps": 2 if cuda and rows <= 16 else 4,
            "FINISH_WARPS": 1 if cuda else 4}


def post_launch_config(rows: int, dim: int, cuda: bool) -> dict[str, int]:
    """One row and D blocks of 1024 per program on the GPU (the best of 128..1024 at batch 1..64 on the H200);
    many rows per program under the CPU interpreter."""
    if not cuda:
        return {"ROWS": min(64, triton_next_pow2(rows)), "BLOCK_D": min(triton_next_pow2(dim), 256), "num_warps": 4}
    return {"ROWS": 1, "BLOCK_D": min(triton_next_pow2(dim), 1024), "num_warps": 4}


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, hc_eps: float,
            norm_eps: float, config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton body of ``v4compile::mhc_pre``: streams x [..., n, D] -> (y [..., D] in x's dtype, post [..., n],
    comb [..., n, n]) in fp32. ``config`` overrides the launch configuration (benchmark sweeps)."""
    *lead, n, dim = x.shape
    cuda = x.device.type == "cuda"
    rows = x.numel() // (n * dim) if x.numel() else 0
    y = x.new_empty(*lead, dim)
    post = x.new_empty(*lead, n, dtype=torch.float32)
    comb = x.new_empty(*lead, n, n, dtype=torch.float32)
    if rows == 0:
        return y, post, comb
    name, module = _module("mhc_pre", n, dim, x.dtype, torch.float32, not cuda)
    config = config or pre_launch_config(rows, n, dim, cuda, x.device.index)
    splits = config["SPLITS"]
    x = x.contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    mixp = _mixp(n)
    part = torch.empty(rows, mixp, splits, dtype=torch.float32, device=x.device)
    sq = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    grid_mix = (triton.cdiv(rows, config["BLOCK_M"]), splits)
    grid_finish = (triton.cdiv(rows, config["ROWS"]), triton.cdiv(dim, config["BLOCK_D"]) + 1)

    def run() -> None:
        module.mhc_mixes[grid_mix](x, fn, part, sq, rows, config["PER_SPLIT"], BLOCK_M=config["BLOCK_M"],
                                   BLOCK_K=config["BLOCK_K"], num_warps=config["num_warps"])
        module.mhc_pre_finish[grid_finish](x, part, sq, scale, base, y, post, comb, rows, splits, iters, hc_eps,
                                           norm_eps, ROWS=config["ROWS"], SPLITS_P=triton_next_pow2(splits),
                                           BLOCK_D=config["BLOCK_D"], num_warps=config["FINISH_WARPS"])

    REGISTRY.launch(name, run)
    REGISTRY.note_launch(name, grid=grid_mix, finish_grid=grid_finish, rows=rows, **config)
    if cuda and REGISTRY.records[name].lowered is None:
        REGISTRY.set_lowered(name, lowered_text(module.mhc_mixes) or "")
    return y, post, comb


def mhc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton body of ``v4compile::mhc_post``: ``out_k = post_k * y + sum_j comb[j, k] x_j`` for streams x
    [..., n, D], returned in y's dtype. ``config`` overrides the launch configuration."""
    *lead, n, dim = x.shape
    cuda = x.device.type == "cuda"
    out = torch.empty(x.shape, dtype=y.dtype, device=x.device)
    rows = x.numel() // (n * dim) if x.numel() else 0
    if rows == 0:
        return out
    acc = torch.promote_types(torch.promote_types(y.dtype, x.dtype), torch.promote_types(post.dtype, comb.dtype))
    acc = torch.float64 if acc == torch.float64 else torch.float32
    name, module = _module("mhc_post", n, dim, y.dtype, acc, not cuda)
    config = config or post_launch_config(rows, dim, cuda)
    y, x, post, comb = y.contiguous(), x.contiguous(), post.contiguous(), comb.contiguous()
    grid = (triton.cdiv(rows, config["ROWS"]), triton.cdiv(dim, config["BLOCK_D"]))
    REGISTRY.launch(name, lambda: module.mhc_post[grid](y, x, post, comb, out, rows, ROWS=config["ROWS"],
                                                        BLOCK_D=config["BLOCK_D"], num_warps=config["num_warps"]))
    REGISTRY.note_launch(name, grid=grid, rows=rows, **config)
    if cuda and REGISTRY.records[name].lowered is None:
        REGISTRY.set_lowered(name, lowered_text(module.mhc_post) or "")
    return out
