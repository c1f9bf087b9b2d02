"""Loading generated Triton sources (compiled on CUDA, through the Triton interpreter on CPU), and the source
fragments several kernels share: bf16 rounding, grouped output tiles, the sum of a split-K GEMM's parts."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

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

SPLIT_SUM = '''

@triton.jit
def _split_sum(PARTS, total, s_part, SPLIT: tl.constexpr, BE: tl.constexpr):
    # a split-K GEMM's second launch: elements e of program_id(0)'s block of the output, whether each exists, and
    # their K splits' partial products (SPLIT planes s_part apart) added in split order, the same for every row
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < total
    acc = tl.load(PARTS + e, mask=em, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(PARTS + s * s_part + e, mask=em, other=0.0)
    return e, em, acc
'''


def load_triton_module(path: Path, interpret: bool) -> ModuleType:
    """Imports a generated Triton module; CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)."""
    import triton

    if interpret and not triton.knobs.runtime.interpret:
        raise KernelBuildError("CPU tensors need the Triton interpreter, but triton was imported without "
                               "TRITON_INTERPRET=1 (import v4compile first, or set it)")
    return load_module(path)


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
