"""Graph normalisation rules that hold on one device only: a unit ``torch.polar`` read as its real and imaginary
parts (the RoPE tables' spelling) becomes ``cos`` and ``sin`` of the angles on CUDA, where the two are bitwise equal
(measured on the H100: benchmarks/NOTES.md 33rd), and stays on the CPU, where they differ by an ulp in places."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from v4compile.model.rope import rope_cos_sin
from v4compile.passes.normalize import normalize

aten = torch.ops.aten


def _tables(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(freqs, positions)


def _traced(device: str, fn: Callable[..., object] = _tables) -> torch.fx.GraphModule:
    """``fn`` traced on the CPU, its node values then moved to ``device`` as a capture there records them (fake
    tensors: no such device is needed, and the rules read only the metadata)."""
    gm = make_fx(fn, tracing_mode="fake", pre_dispatch=True)(torch.arange(6)[None], torch.rand(32))
    if device != "cpu":
        with FakeTensorMode():
            for node in gm.graph.nodes:
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device)
    return gm


def _targets(gm: torch.fx.GraphModule) -> set[object]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_unit_polar_becomes_cos_and_sin_on_cuda() -> None:
    gm = _traced("cuda")
    assert normalize(gm)["unit polar -> cos, sin (CUDA)"] == 1
    assert aten.polar.default not in _targets(gm) and {aten.cos.default, aten.sin.default} <= _targets(gm)
    positions, freqs = torch.arange(4096)[None], torch.rand(32)
    cos, sin = gm(positions, freqs)  # the rewritten graph's math, run on the CPU: within an ulp of the tables
    want_cos, want_sin = _tables(positions, freqs)
    torch.testing.assert_close(cos, want_cos, rtol=2**-23, atol=2**-24)
    torch.testing.assert_close(sin, want_sin, rtol=2**-23, atol=2**-24)


def test_polar_stays_on_the_cpu_and_where_its_complex_value_is_used() -> None:
    cpu = _traced("cpu")
    assert "unit polar -> cos, sin (CUDA)" not in normalize(cpu)
    assert aten.polar.default in _targets(cpu)

    def rotate(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        angles = positions.float().unsqueeze(-1) * freqs
        unit = torch.polar(torch.ones_like(angles), angles)
        return torch.view_as_real(unit * unit)

    gm = _traced("cuda", rotate)
    assert "unit polar -> cos, sin (CUDA)" not in normalize(gm)
    assert aten.polar.default in _targets(gm)
