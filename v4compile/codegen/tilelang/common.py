"""What the TileLang kernels share: dtype names, the dtypes a target computes in, and loading generated sources."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..registry import REGISTRY, load_module

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


def compute_dtypes(dtype: torch.dtype, device: torch.device) -> tuple[str, torch.dtype, torch.dtype]:
    """(target, input dtype, accumulation dtype) for inputs of ``dtype``: the ``c`` target has no 16-bit floats,
    so there the host widens them to fp32; fp64 inputs accumulate in fp64, others in fp32."""
    if dtype not in DTYPES:
        raise ValueError(f"TileLang kernels take fp32/bf16/fp16/fp64 inputs, not {dtype}")
    cuda = device.type == "cuda"
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    in_dtype = dtype if cuda or dtype in (torch.float32, torch.float64) else torch.float32
    return ("cuda" if cuda else "c"), in_dtype, acc


def load_kernels(path: Path, target: str, name: str) -> Any:
    """Compiles the generated source at ``path`` for ``target`` (its ``build`` returns one kernel or a tuple, with
    None for a kernel a configuration does not need) and records TileLang's generated C/CUDA under ``name``."""
    built = load_module(path).build(target)
    kernels = built if isinstance(built, tuple) else (built,)
    REGISTRY.set_lowered(name, "\n".join(k.get_kernel_source() for k in kernels if k is not None))
    return built


TARGET_MACROS = '''

def target_macros(cuda):
    """The steps whose lowering depends on the target: the c target has no 16-bit floats (bf16 rounding on the
    bits there) and no reductions of fragments (loops there)."""

    @T.macro
    def to_bf16(x):
        # nearest bf16, ties to even (finite values and infinities; on the c target a NaN may come out as +-0)
        if cuda:
            return T.cast(T.cast(x, "bfloat16"), "float32")
        bits = T.reinterpret(x, "uint32")
        return T.reinterpret((bits + 0x7FFF + ((bits >> 16) & 1)) & T.uint32(0xFFFF0000), "float32")

    @T.macro
    def reduce_rows(x, out, rows, cols, kind):
        # out[i] = sum or max (``kind``) of x[i, :cols] (the max of values >= 0)
        if cuda:
            if kind == "sum":
                T.reduce_sum(x, out, dim=1)
            else:
                T.reduce_max(x, out, dim=1)
        else:
            for i in T.Parallel(rows):
                out[i] = 0.0
                for c in T.serial(cols):
                    if kind == "sum":
                        out[i] += x[i, c]
                    else:
                        out[i] = T.max(out[i], x[i, c])

    return to_bf16, reduce_rows
'''
"""TileLang source shared by kernels (a generated source includes it after ``import tilelang.language as T``)."""


def hopper_cuda(source: str) -> str:
    """The CUDA TileLang generates for the H100/H200 (sm_90a) from a kernel's generated Python ``source`` (its
    ``build`` returning one kernel), lowered on any machine: no GPU needed."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.py"
        path.write_text(source)
        return load_module(path).build({"kind": "cuda", "arch": "sm_90a"}).get_kernel_source()


def sm90_sass(cuda_source: str) -> list[str]:
    """The SASS instructions of TileLang's generated CUDA for sm_90a, assembled on this machine with ``nvcc`` (on
    PATH; TileLang's own headers) and listed with the ``cuobjdump`` Triton bundles: a kernel's instruction mix
    without a GPU (``benchmarks/sass_mix.py``)."""
    import shutil
    import subprocess
    import tempfile

    import tilelang

    from ..triton.hopper import bundled_tool, sass_lines

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("sm90_sass needs nvcc on PATH to assemble TileLang's CUDA source")
    root = Path(tilelang.__file__).parent
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.cu", Path(folder) / "kernel.cubin"
        source.write_text(cuda_source)
        subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-w", "-DENABLE_BF16",
                        f"-I{root / 'src'}", f"-I{root / '3rdparty' / 'cutlass' / 'include'}", str(source), "-o",
                        str(cubin)], check=True, capture_output=True, text=True)
        listing = subprocess.run([str(bundled_tool("cuobjdump")), "-sass", str(cubin)], check=True,
                                 capture_output=True, text=True).stdout
    return sass_lines(listing)
