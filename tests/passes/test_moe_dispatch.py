"""``moe_dispatch`` on the MoE layers of the tiny preset, of the tiny-fp8-fp4 golden checkpoint and of a
tensor-parallel shard: what it matches, that the optimized layers keep the model's numerics (the golden band
for the checkpoint's logits on the first sequence of its first case, to keep the interpreted kernels short),
and why near-misses do not match.

The MoE layers are compiled on their own (``optimize`` of a runner that calls the layer, Triton kernels under
the interpreter, no Inductor): the graph is the model's MoE forward as captured inside the whole model, at a
fraction of the compile time, and layers of one structure share it. The whole-model pipeline runs this pass
in tests/test_optimize.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import v4compile
from v4compile.backend import make_backend
from v4compile.codegen.registry import REGISTRY
from v4compile.golden import Agreement
from v4compile.model import moe as moe_module
from v4compile.passes.manager import PassManager
from v4compile.passes.moe_dispatch import MoeDispatch


class _Apply(nn.Module):
    """Runs the MoE layer it is given: compiled once, its graph serves every layer of the same structure (the
    hash-routed first layer and the score-routed rest), each call with that layer's weights as inputs."""

    def forward(self, layer: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return layer(x, input_ids)


class _Compiled(nn.Module):
    """Stands in for a model's MoE layer: calls the optimized ``_Apply`` on it."""

    def __init__(self, optimized: v4compile.OptimizedModel, layer: nn.Module) -> None:
        super().__init__()
        self.optimized, self.layer = optimized, layer

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, routing: object = None, index: int = 0) -> torch.Tensor:
        return self.optimized(self.layer, x, input_ids)


def _stats(optimized: v4compile.OptimizedModel) -> list:
    return [p for report in optimized.reports() for p in report.passes if p.name == "moe_dispatch"]


def _optimized_logits(model: v4compile.DeepSeekV4, ids: torch.Tensor) -> tuple[v4compile.OptimizedModel, torch.Tensor,
                                                                                int]:
    """The model's logits with every MoE layer run through ``moe_dispatch`` and the Triton kernel, the optimized
    runner, and how many MoE kernel calls the forward made."""
    optimized = v4compile.optimize(_Apply(), backend="triton", passes=["moe_dispatch"], inductor=False)
    originals = [layer.ffn for layer in model.layers]
    before = sum(r.launches for n, r in REGISTRY.records.items() if n.startswith("moe_experts."))
    try:
        for layer, original in zip(model.layers, originals, strict=True):
            layer.ffn = _Compiled(optimized, original)
        with torch.no_grad():
            logits = model(ids)
    finally:
        for layer, original in zip(model.layers, originals, strict=True):
            layer.ffn = original
    after = sum(r.launches for n, r in REGISTRY.records.items() if n.startswith("moe_experts."))
    return optimized, logits, after - before


@pytest.fixture(scope="module")
def tiny_run(tiny_model: v4compile.DeepSeekV4) -> dict[str, object]:
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = tiny_model(ids)
    optimized, got, calls = _optimized_logits(tiny_model, ids)
    return {"optimized": optimized, "got": got, "want": want, "calls": calls}


@pytest.fixture(scope="module")
def golden_run(golden_root: Path, golden_models: dict) -> dict[str, object]:
    model = golden_models["tiny-fp8-fp4"]
    cases = load_file(str(golden_root / "tiny-fp8-fp4" / "cases.safetensors"))
    ids, length = cases["case0.ids"][:1], int(cases["case0.prefill_len"])
    rows = slice(length - 1, length - 1 + cases["case0.prefill_logits"].shape[1])
    with torch.no_grad():
        want = model(ids)[0, rows]
    optimized, got, calls = _optimized_logits(model, ids)
    return {"optimized": optimized, "got": got[0, rows], "want": want, "cases": cases, "calls": calls}


def test_every_moe_layer_of_the_tiny_preset_is_rewritten(tiny_run: dict) -> None:
    graphs = _stats(tiny_run["optimized"])
    assert len(graphs) == 2 and tiny_run["calls"] == 4
    for stats in graphs:
        assert stats.near_misses == [], [m.reason for m in stats.near_misses]
        [match] = stats.matches
        assert match.kernel == "moe_experts.bf16.triton"
        assert match.details | {"tokens": 0} == {"experts": 8, "first": 0, "top_k": 2, "format": "bf16",
                                                 "pow2_scales": False, "swiglu_limit": 10.0, "tokens": 0,
                                                 "dim": 128, "inter_dim": 64}
    got, want = tiny_run["got"], tiny_run["want"]
    assert F.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1).min() > 0.9999


def test_golden_fp8_fp4_layers_are_rewritten_and_stay_in_the_golden_band(golden_run: dict) -> None:
    graphs = _stats(golden_run["optimized"])
    assert len(graphs) == 2 and golden_run["calls"] == 4
    for stats in graphs:
        [match] = stats.matches
        assert match.kernel == "moe_experts.fp4.triton"
        assert (match.details["format"], match.details["pow2_scales"], match.details["experts"]) == ("fp4", True, 8)
    got, want, cases = golden_run["got"], golden_run["want"], golden_run["cases"]
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.9999
    official, official_decode = cases["case0.prefill_logits"][0], cases["case0.decode_logits"][0]
    band = Agreement.of(got, official)
    # six rows: one where the official model's own two paths disagree counts either answer
    top = got.argmax(-1)
    agree = ((top == official.argmax(-1)) | (top == official_decode.argmax(-1))).float().mean()
    assert band.median_cos >= 0.99 and band.mean_cos >= 0.97 and agree >= 0.8, (band, agree)


def test_a_tensor_parallel_shard_sums_its_local_experts_before_the_all_reduce() -> None:
    """Rank 1 of 2 holds experts 4..7 and slices combine columns 4..7; its all-reduce runs in a one-process gloo
    group (the sum of one rank), so the shard's own output is compared with its eager run."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shard = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0, tp_rank=1, tp_size=2).eval()
        layer = shard.layers[1].ffn
        manager = PassManager([MoeDispatch()], backend="triton")
        compiled = torch.compile(layer, backend=make_backend(manager, inductor=False), dynamic=False)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(2, 5, shard.config.dim, generator=gen).bfloat16()
        ids = torch.randint(0, shard.config.vocab_size, (2, 5), generator=gen)
        with torch.no_grad():
            got, want = compiled(x, ids), layer(x, ids)
    finally:
        if started:
            dist.destroy_process_group()
    [stats] = manager.reports[0].passes
    [match] = stats.matches
    assert (match.details["first"], match.details["experts"]) == (4, 4)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * want.abs().max().item())


def _near_misses(layer: nn.Module, dim: int, vocab: int) -> list[str]:
    optimized = v4compile.optimize(layer, backend="reference", passes=["moe_dispatch"], inductor=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        optimized(torch.randn(1, 4, dim, generator=gen).bfloat16(), torch.randint(0, vocab, (1, 4), generator=gen))
    [stats] = _stats(optimized)
    assert stats.matches == []
    return [m.reason for m in stats.near_misses]


class _Variant(moe_module.RoutedExperts):
    """The model's routed experts written with one change (``act``: the gate activation; ``descending``: each
    token's experts summed from the highest id down; ``one_sided``: ``up`` clamped from above only)."""

    act, descending, one_sided = staticmethod(F.silu), False, False

    def forward(self, x, weights, ids):
        tokens, k = ids.shape
        ids, order = ids.sort(dim=-1, stable=True, descending=self.descending)
        weights = weights.gather(-1, order)
        repeat = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] == ids[:, :-1]], dim=-1)
        local = ids - self.first
        held = (local >= 0) & (local < self.n) & ~repeat
        experts, pairs = local.clamp(0, self.n - 1).flatten().sort(stable=True)
        ends = torch.searchsorted(experts, torch.arange(1, self.n + 1, device=ids.device)).to(torch.int32)
        rows = x[pairs // k]
        pair_weights = torch.where(held, weights, 0).flatten()[pairs].unsqueeze(-1)
        gate = self.w1(rows, ends).float().clamp(max=self.limit)
        up = self.w3(rows, ends).float()
        up = up.clamp(max=self.limit) if self.one_sided else up.clamp(-self.limit, self.limit)
        h = pair_weights * (self.act(gate) * up)
        out = self.w2(h.to(x.dtype), ends).float()
        out = torch.zeros_like(out).index_copy(0, pairs, out).view(tokens, k, -1)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for j in range(k):
            y = y + torch.where(held[:, j : j + 1], out[:, j], 0)
        return y


def _variant_reasons(tiny_model: v4compile.DeepSeekV4, **change: object) -> list[str]:
    layer = copy.deepcopy(tiny_model.layers[2].ffn)
    layer.experts.__class__ = type("Changed", (_Variant,), change)
    return _near_misses(layer, tiny_model.config.dim, tiny_model.config.vocab_size)


def test_the_variant_without_changes_matches(tiny_model: v4compile.DeepSeekV4) -> None:
    """The near-miss fixture itself is the model's code: unchanged, it is rewritten."""
    layer = copy.deepcopy(tiny_model.layers[2].ffn)
    layer.experts.__class__ = _Variant
    optimized = v4compile.optimize(layer, backend="reference", passes=["moe_dispatch"], inductor=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        optimized(torch.randn(1, 4, 128, generator=gen).bfloat16(), torch.randint(0, 512, (1, 4), generator=gen))
    [stats] = _stats(optimized)
    assert len(stats.matches) == 1 and stats.near_misses == []


def test_an_expert_with_another_activation_is_a_near_miss(tiny_model: v4compile.DeepSeekV4) -> None:
    [reason] = _variant_reasons(tiny_model, act=staticmethod(F.gelu))
    assert reason.startswith("not the model's routed experts (bf16, 8 experts from 0, limit 10.0): expected "
                             "aten.silu.default, found aten.gelu.default at "), reason


def test_experts_summed_out_of_order_are_a_near_miss(tiny_model: v4compile.DeepSeekV4) -> None:
    [reason] = _variant_reasons(tiny_model, descending=True)
    assert "aten.sort.stable has argument True where the model's has None" in reason, reason


def test_a_one_sided_clamp_is_a_near_miss(tiny_model: v4compile.DeepSeekV4) -> None:
    [reason] = _variant_reasons(tiny_model, one_sided=True)
    assert "aten.clamp" in reason and "-10.0" in reason, reason


def test_the_kernel_name_says_which_body_runs_the_call() -> None:
    pytest.importorskip("tilelang")
    from v4compile.passes.moe_dispatch import _implementation

    # TileLang's FP4 body hands CUDA calls of 32 pairs an expert or fewer (decode) to the Triton tiles
    assert _implementation("tilelang", "fp4", pairs=16 * 6, experts=256, cuda=True) == "triton"
    assert _implementation("tilelang", "fp4", pairs=8192 * 6, experts=256, cuda=True) == "tilelang"
    assert _implementation("tilelang", "fp4", pairs=None, experts=256, cuda=True) == "tilelang"  # sequence-dynamic
    assert _implementation("tilelang", "fp4", pairs=6, experts=256, cuda=False) == "tilelang"  # the c target's tiles
    assert _implementation("tilelang", "fp8", pairs=8192 * 6, experts=256, cuda=True) == "triton"
    assert _implementation("triton", "fp4", pairs=8192 * 6, experts=256, cuda=True) == "triton"
