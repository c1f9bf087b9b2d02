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

The kernels' source: ``radix_topk_kernels.py``.
"""

from __future__ import annotations

import torch
import triton

from .. import reference
from ..registry import REGISTRY
from .compressor import triton_next_pow2
from .launch import load_triton_module, lowered_text
from .radix_topk_kernels import SOURCE


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
            lambda: SOURCE.format(k=k, mask_invalid=mask_invalid, gpu_nan=cuda, **constants),
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
