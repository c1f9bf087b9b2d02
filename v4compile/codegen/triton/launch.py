"""Loading generated Triton sources (compiled on CUDA, through the Triton interpreter on CPU), and the source
fragments several kernels share: bf16 rounding, grouped output tiles, the sum of a split-K GEMM's parts in its
last program (with the tile counters that finds it)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from ..registry import KernelBuildError, load_module

ROUND_BF16 = '''

@triton.jit
def _round_bf16(x):
    # fp32 -> nearest bf16 (ties to even), kept in fp32; bit arithmetic, so the CPU interpreter (whose
    # bf16 casts truncate) and the GPU round alike
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 32767 + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)
'''

GROUPED_TILE = '''

@triton.jit
def _grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    # first row and column of program pid's output tile: GROUP row tiles walk one band of column tiles
    # together, so the weight tiles they share stay in L2
    band = GROUP * tl.cdiv(N, BN)
    first = (pid // band) * GROUP
    rows_here = tl.minimum(tl.cdiv(M, BM) - first, GROUP)
    return (first + (pid % band) % rows_here) * BM, ((pid % band) // rows_here) * BN
'''

SPLIT_LAST = '''

@triton.jit
def _last_split(COUNTER, tile, SPLIT: tl.constexpr):
    # whether this program is the last of its output tile's SPLIT K ranges to store its partial product (all of
    # them are then in memory); the last one puts the tile's counter back to 0 for the next launch. The barrier
    # orders every thread's partial stores before the release; the acquire's result reaches the threads through
    # shared memory behind another barrier (the pattern of CUTLASS's split-K semaphore)
    tl.debug_barrier()
    last = tl.atomic_add(COUNTER + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    if last:
        tl.store(COUNTER + tile, 0)
    return last


@triton.jit
def _sum_splits(PARTS, at, mask, s_part, SPLIT: tl.constexpr):
    # the K ranges' partial products at offsets ``at`` added in split order (the same order for every row and
    # batch, whichever program finished last); read through L2, where the other programs' stores are
    acc = tl.load(PARTS + at, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(PARTS + s * s_part + at, mask=mask, other=0.0, cache_modifier=".cg")
    return acc
'''


def load_triton_module(path: Path, interpret: bool) -> ModuleType:
    """Imports a generated Triton module; CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)."""
    import triton

    if interpret and not triton.knobs.runtime.interpret:
        raise KernelBuildError("CPU tensors need the Triton interpreter, but triton was imported without "
                               "TRITON_INTERPRET=1 (import v4compile first, or set it)")
    return load_module(path)


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, for a split-K GEMM whose last program per tile sums the parts
    (``_last_split``). On CUDA one buffer per stream, reused: kernels on a stream run in order and each leaves its
    counters at 0, and kernels on concurrent streams (the stream schedule) get buffers of their own. A buffer
    outgrown is kept alive, not freed: a captured CUDA graph may still address it. On the CPU a fresh one."""
    if device.type != "cuda":
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return buf


def lowered_text(kernel: object) -> str | None:
    """The compiled kernel's TTGIR and PTX when Triton compiled it (None under the interpreter)."""
    cache = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", None)
    if not cache:
        return None
    for entry in (cache.values() if isinstance(cache, dict) else []):
        compiled_map = entry[0] if isinstance(entry, tuple) else entry
        for compiled in compiled_map.values():
            asm = getattr(compiled, "asm", None)
            if asm:
                parts = [f"// ---- {k}\n{v}" for k, v in asm.items() if isinstance(v, str) and k in ("ttgir", "ptx")]
                return "\n".join(parts)
    return None
