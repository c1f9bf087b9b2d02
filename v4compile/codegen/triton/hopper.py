"""A generated Triton kernel as the H100/H200 would run it, produced on any machine: its PTX for sm_90 (Triton's own
compiler, no GPU needed) and its SASS (the ``ptxas`` and ``cuobjdump`` Triton bundles), and the instruction mix of
its main loop. The CPU's interpreter accepts code the GPU's compiler rejects and says nothing about speed; this is
what tests check lowering with, and what a kernel's issue cost is estimated from where no GPU is at hand.

Lowering runs in a child process without ``TRITON_INTERPRET`` (under the interpreter ``triton.compile`` is not the
GPU's). ``divisible`` names the arguments to compile as 16-aligned (pointers) or multiples of 16 (integers), as Triton
specializes them at launch: without those hints loads do not vectorize and the code is not what the GPU runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_LOWER = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
path, kernel, signature, constexprs, divisible, num_warps = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
spec = importlib.util.spec_from_file_location("lowered_kernel", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
names = list(signature)
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
compiled = triton.compile(ASTSource(fn=getattr(module, kernel), signature=signature, constexprs=constexprs,
                                    attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
print(compiled.asm["ptx"])
"""


def sm90_ptx(source: str, kernel: str, signature: dict[str, str], constexprs: dict[str, object],
             divisible: list[str], num_warps: int) -> str:
    """The PTX of ``kernel`` in the Triton module ``source`` for sm_90: ``signature`` maps every argument to its
    Triton type (``"*bf16"``, ``"i32"``, ``"constexpr"``), ``constexprs`` gives the constexpr values. Raises a
    RuntimeError with the compiler's message when the GPU's compiler rejects the kernel."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lowered_kernel.py"
        path.write_text(source)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", _LOWER, str(path), kernel, json.dumps(signature),
                               json.dumps(constexprs), json.dumps(divisible), json.dumps(num_warps)],
                              capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"lowering {kernel} for sm_90 failed:\n{done.stderr[-3000:]}")
    return done.stdout


def bundled_tool(name: str) -> Path:
    """A CUDA binary tool Triton ships (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def sm90_sass(ptx: str) -> list[str]:
    """The SASS instructions of ``ptx`` assembled for sm_90a (predicates kept, addresses and encodings dropped).
    Uses the newest bundled ``ptxas`` (Triton may emit a PTX version the older one rejects)."""
    assembler = next(p for p in (bundled_tool("ptxas-blackwell"), bundled_tool("ptxas")) if p.exists())
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        subprocess.run([str(assembler), "-arch=sm_90a", "-O3", str(source), "-o", str(cubin)], check=True,
                       capture_output=True, text=True)
        listing = subprocess.run([str(bundled_tool("cuobjdump")), "-sass", str(cubin)], check=True,
                                 capture_output=True, text=True).stdout
    return sass_lines(listing)


def sass_lines(listing: str) -> list[str]:
    """The instructions of a ``cuobjdump -sass`` listing (predicates kept, addresses and encodings dropped)."""
    return [m.group(2).strip() for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", listing)]


def unpredicated(instruction: str) -> str:
    """A SASS instruction without its predicate guard (``@!P0 LDG.E.U8 ...`` -> ``LDG.E.U8 ...``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction)


@dataclass
class LoopMix:
    """The longest loop of a kernel's SASS: how many instructions a thread issues per iteration, by opcode."""

    text: list[str]
    """The loop's instructions as listed."""

    @property
    def instructions(self) -> int:
        """Instructions a thread issues per iteration."""
        return len(self.text)

    @property
    def opcodes(self) -> Counter[str]:
        """The iteration's instructions counted by opcode (``LDG.E.U8`` counts as ``LDG``)."""
        return Counter(unpredicated(t).split()[0].split(".")[0] for t in self.text)

    def per(self, elements: int, threads: int) -> float:
        """Instructions per element when ``threads`` threads cover ``elements`` elements (e.g. weights) an
        iteration."""
        return self.instructions * threads / elements


def _loops(sass: list[str]) -> list[list[str]]:
    """Every loop of a SASS listing: a backward branch and the instructions from its target."""
    loops = []
    for i, text in enumerate(sass):
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        start = int(target.group(1), 16) // 16 if target else i  # sm_90 instructions are 16 bytes apart
        if start < i:
            loops.append(sass[start:i + 1])
    return loops


def main_loop(sass: list[str]) -> LoopMix:
    """The longest loop (a backward branch and the instructions from its target) of a SASS listing."""
    return LoopMix(max(_loops(sass), key=len, default=[]))


def mma_loop(sass: list[str]) -> LoopMix:
    """The innermost loop issuing warp-group MMAs (``HGMMA`` for 16-bit operands, ``QGMMA`` for FP8): a
    warp-specialized kernel's consumer loop, where the longest loop may be a barrier's retry branch from the
    kernel's end back into it."""
    return LoopMix(min((loop for loop in _loops(sass) if any("GMMA" in t for t in loop)), key=len, default=[]))
