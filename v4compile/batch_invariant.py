"""Batch-invariant matrix products: a row's result does not depend on how many rows share the call.

BLAS libraries choose kernels and reduction splits by problem shape, so one token's hidden state comes out an
ulp apart between a one-token decode step (a GEMV) and a 150-token forward (a GEMM): on the CPU, fp32
``F.linear`` of the same row differs by 2e-5 between M=1 and M=150. MoE routing and the indexer's top-k turn
such ulps into different experts and entries, which is why RL trainers and rollout engines disagree.

While ``enable()`` is in force, aten's ``mm``, ``addmm`` and ``bmm`` (CPU and CUDA) compute every product in
blocks of ``ROWS`` rows copied into one fixed buffer (the last block zero-padded), each block one library
call of the same shape: a row's result then depends only on the row and the weight. Autograd's backward
products go through the same kernels. Deterministic mode (``Engine(deterministic=True)``,
``optimize(..., deterministic=True)``) turns it on. Inductor-generated code does not dispatch to these aten
kernels, so deterministic ``optimize`` runs the rewritten graph on aten (``inductor=False``).

On the CPU, aten's vectorised elementwise kernels (exp, rsqrt, ...) round the loop tail through scalar
code, so an element's value can still depend on the tensor's length; ``ATEN_CPU_CAPABILITY=default`` (set
before Python starts) removes that, and ``elementwise_invariant()`` says whether it is in force.
"""

from __future__ import annotations

import os
import warnings

import torch

ROWS = 64
"""Rows per library call: the padded block every product is computed in."""

_library: torch.library.Library | None = None


def _blocked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a [M, K], b [K, N], computed ``ROWS`` rows at a time in one reused buffer, with b in one
    layout (row-major) whatever view it arrives as, since the library picks its kernel by layout too.

    On the CPU each block is multiplied in float64 and rounded once to the result dtype: on an AMD EPYC (AVX2,
    2026-12-01) the library's float32 / bf16 products of such fixed-shape row-major blocks still broke the
    engine-versus-trainer equality (the cause inside MKL / oneDNN not found), and a float64 product rounded to
    float32 or bf16 does not depend on the library's summation order."""
    m, k = a.shape
    wide = a.device.type == "cpu"
    b = (b.to(torch.float64) if wide else b).contiguous()
    out = a.new_empty(m, b.shape[1])
    block = a.new_zeros(ROWS, k, dtype=b.dtype)
    result = b.new_empty(ROWS, b.shape[1])
    for start in range(0, m, ROWS):
        rows = min(ROWS, m - start)
        if rows < ROWS:
            block.zero_()
        block[:rows] = a[start : start + rows]
        torch.mm(block, b, out=result)  # aten::mm.out: the library kernel, not overridden
        out[start : start + rows] = result[:rows]
    return out


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    product = _blocked_mm(a, b)
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # as aten: the bias is ignored, NaNs included
        return product
    return product + (bias if beta == 1 else bias * beta)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([_blocked_mm(a[i], b[i]) for i in range(a.shape[0])]) if a.shape[0] else \
        a.new_empty(0, a.shape[1], b.shape[2])


def enable() -> None:
    """Turns batch-invariant products on for the process (like ``torch.use_deterministic_algorithms``, a
    process-wide switch; calling it again does nothing)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel" is the point here
        warnings.simplefilter("ignore", UserWarning)
        for key in ("CPU", "CUDA"):
            library.impl("mm", _blocked_mm, key)
            library.impl("addmm", _addmm, key)
            library.impl("bmm", _bmm, key)
    _library = library
    if not elementwise_invariant():
        warnings.warn("batch-invariant products are on, but aten's vectorised CPU elementwise kernels still round "
                      "a tensor's tail differently; set ATEN_CPU_CAPABILITY=default before starting Python for "
                      "results that do not depend on the sequence length", stacklevel=2)


def disable() -> None:
    """Gives the library kernels back."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def enabled() -> bool:
    """Whether batch-invariant products are in force."""
    return _library is not None


def elementwise_invariant() -> bool:
    """Whether aten's CPU elementwise kernels give an element the same value at any tensor length (scalar
    kernels: ``ATEN_CPU_CAPABILITY=default``)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default" or \
        torch.backends.cpu.get_cpu_capability() == "DEFAULT"
