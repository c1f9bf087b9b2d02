"""What the passes match on the tiny preset, why near-misses do not match, and the pass manager's instruments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import v4compile
from v4compile.debugging import explain, run_entries, sample_ids
from v4compile.model import compressor as compressor_module
from v4compile.model import indexer as indexer_module
from v4compile.passes import PASSES, build_passes


@pytest.fixture(scope="module")
def explained(tiny_model: v4compile.DeepSeekV4) -> v4compile.OptimizedModel:
    return explain(tiny_model, backend="reference")


def _by_pass(report, name: str):
    return next(p for p in report.passes if p.name == name)


def test_every_compressor_and_indexer_topk_is_rewritten(explained) -> None:
    forward, prefill, decode = explained.reports()
    for report, form in ((forward, "prefill"), (prefill, "prefill"), (decode, "decode")):
        matches = _by_pass(report, "compressor_fusion").matches
        kinds = sorted((m.details["ratio"], m.details["width"], m.details["form"]) for m in matches)
        # layers 1 and 3 are C4 (main width 128 + indexer width 64), layer 2 is C128
        assert kinds == sorted([(4, 128, form), (4, 64, form), (128, 128, form), (4, 128, form), (4, 64, form)])
        assert {m.location.module for m in matches} == {"layers.1", "layers.2", "layers.3"}
        # each entry's finish (norm, RoPE, FP8 or Hadamard + FP4) joins its pooling: the indexer's width-64
        # entries are rotated
        finished = _by_pass(report, "compressor_finish").matches
        assert sorted((m.details["ratio"], m.details["width"], m.details["form"]) for m in finished) == kinds
        assert all(m.details["finish"] == ("hadamard_fp4" if m.details["width"] == 64 else "fp8") for m in finished)
        topk = _by_pass(report, "radix_topk").matches
        assert len(topk) == 2 and all(m.details["masks_invalid"] for m in topk)
        assert all("indexer.py" in m.location.source for m in topk)


def test_near_misses_say_why(explained) -> None:
    report = explained.reports()[0]
    topk_misses = _by_pass(report, "radix_topk").near_misses
    gate_misses = [m for m in topk_misses if m.location.module.endswith("ffn.gate")]
    assert len(gate_misses) == 3 and all("only 8 candidates" in m.reason for m in gate_misses)
    # the routed experts sort their ids and their (token, expert) pairs ascending: a grouping, not a top-k
    expert_misses = [m for m in topk_misses if m.location.module.endswith("ffn.experts")]
    assert expert_misses and all(m.reason == "ascending sort (smallest first)" for m in expert_misses)
    softmax_misses = _by_pass(report, "compressor_fusion").near_misses
    assert any("sinkhorn" in m.location.source for m in softmax_misses)
    assert all(m.reason for m in softmax_misses)


def test_a_perturbed_softmax_axis_does_not_match_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                               tiny_model: v4compile.DeepSeekV4) -> None:
    def pool_over_dims(kv, score, ape, ratio, width):
        """The model's pooling with the softmax taken across blocks (dim 1) instead of a block's tokens."""
        kv = kv.unflatten(1, (-1, ratio))
        score = score.unflatten(1, (-1, ratio)) + ape
        if kv.shape[-1] == 2 * width:
            kv = torch.cat((compressor_module._shift_blocks(kv[..., :width], 0.0), kv[..., width:]), dim=2)
            score = torch.cat((compressor_module._shift_blocks(score[..., :width], float("-inf")),
                               score[..., width:]), dim=2)
        return (kv * score.softmax(dim=1)).sum(dim=2)

    monkeypatch.setattr(compressor_module, "pool_blocks", pool_over_dims)
    optimized = explain(tiny_model, backend="reference", entries=("forward",))
    stats = _by_pass(optimized.reports()[0], "compressor_fusion")
    assert stats.matches == []
    reasons = [m.reason for m in stats.near_misses if "compressor.py" in m.location.source]
    assert reasons and all("not summed over the softmax axis 1" in r for r in reasons), reasons


def test_a_different_finish_keeps_the_pooling_fused_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                 tiny_model: v4compile.DeepSeekV4) -> None:
    model_finish = compressor_module.finish_entries

    def rope_before_norm(pooled, cos, sin, norm_weight, eps, rotate, pow2_scales):
        """The model's finish with RoPE applied before the RMSNorm."""
        rotated = compressor_module.apply_rope(pooled.to(torch.bfloat16), cos, sin).float()
        return model_finish(rotated, cos * 0 + 1, sin * 0, norm_weight, eps, rotate, pow2_scales)

    monkeypatch.setattr(compressor_module, "finish_entries", rope_before_norm)
    optimized = explain(tiny_model, backend="reference", entries=("forward",),
                        passes=["compressor_fusion", "compressor_finish"])
    report = optimized.reports()[0]
    assert len(_by_pass(report, "compressor_fusion").matches) == 5
    assert _by_pass(report, "compressor_finish").matches == []
    reasons = [m.reason for m in _by_pass(report, "compressor_finish").near_misses]
    assert len(reasons) == 5 and all("not finished as the model's finish_entries: it is applied to" in r
                                     for r in reasons), reasons


def test_a_finish_whose_intermediate_is_used_elsewhere_is_not_fused(monkeypatch: pytest.MonkeyPatch,
                                                                   tiny_model: v4compile.DeepSeekV4) -> None:
    def finish_and_reuse_the_norm(pooled, cos, sin, norm_weight, eps, rotate, pow2_scales):
        """The model's finish, written out, whose normalized entries also feed another computation."""
        e = compressor_module.rms_norm(pooled.to(torch.bfloat16), norm_weight, eps)
        elsewhere = e.float().mean()
        e = compressor_module.apply_rope(e, cos, sin)
        if rotate:
            out = compressor_module.quant.fp4_simulate(compressor_module.hadamard_rotate(e))
        else:
            nope = compressor_module.quant.fp8_simulate(e[..., :-64], 64, pow2_scales)
            out = torch.cat((nope, e[..., -64:]), dim=-1)
        return out + (0 * elsewhere).to(out.dtype)

    monkeypatch.setattr(compressor_module, "finish_entries", finish_and_reuse_the_norm)
    optimized = explain(tiny_model, backend="reference", entries=("forward",),
                        passes=["compressor_fusion", "compressor_finish"])
    stats = _by_pass(optimized.reports()[0], "compressor_finish")
    assert stats.matches == [] and len(stats.near_misses) == 5
    assert all("are used elsewhere" in m.reason for m in stats.near_misses), [m.reason for m in stats.near_misses]


def test_an_unstable_sort_does_not_match(monkeypatch: pytest.MonkeyPatch, tiny_model: v4compile.DeepSeekV4) -> None:
    def select(self, scores, visible):
        k = min(self.topk, scores.shape[-1])
        values, ids = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True)
        return torch.where(values[..., :k] == float("-inf"), -1, ids[..., :k])

    monkeypatch.setattr(indexer_module.Indexer, "select", select)
    optimized = explain(tiny_model, backend="reference", entries=("forward",), passes=["radix_topk"])
    stats = _by_pass(optimized.reports()[0], "radix_topk")
    assert stats.matches == []
    assert any("unstable sort" in m.reason for m in stats.near_misses)


def test_fuel_disable_and_dumps(tiny_model: v4compile.DeepSeekV4, tmp_path: Path) -> None:
    optimized = v4compile.optimize(tiny_model, regions=False, backend="reference", inductor=False, fuel=3,
                                   debug_dir=tmp_path, disable=("radix_topk",))
    run_entries(optimized, sample_ids(tiny_model), ("forward",))
    report = optimized.reports()[0]
    fused = _by_pass(report, "compressor_fusion")
    assert len(fused.matches) == 3 and fused.skipped_for_fuel == 2
    assert any(m.reason == "out of optimization fuel" for m in fused.near_misses)
    assert not _by_pass(report, "radix_topk").enabled and not _by_pass(report, "radix_topk").matches
    files = sorted(p.name for p in (tmp_path / report.graph).iterdir())
    assert files == ["00-captured.txt", "01-after-compressor_fusion.txt", "report.json"]
    assert "v4compile.compressor_pool" in (tmp_path / report.graph / "01-after-compressor_fusion.txt").read_text()


def test_pass_uuid_covers_options_and_is_stable() -> None:
    a, b = build_passes(["radix_topk"])[0], build_passes(["radix_topk"])[0]
    c = build_passes(["radix_topk"], {"radix_topk": {"max_k": 1024}})[0]
    assert a.uuid() == b.uuid() != c.uuid()


def test_bad_names_are_clear_errors(tiny_model: v4compile.DeepSeekV4) -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; valid backends: auto, triton, tilelang, reference"):
        v4compile.optimize(tiny_model, backend="cuda")
    with pytest.raises(ValueError,
                       match=r"unknown pass 'fusion'; valid passes: compressor_fusion, compressor_finish, radix_topk"):
        v4compile.optimize(tiny_model, passes=["fusion"])
    with pytest.raises(ValueError, match=r"unknown pass 'nope'"):
        v4compile.optimize(tiny_model, disable=("nope",))
    with pytest.raises(ValueError, match=r"radix_topk has no options \['k'\]"):
        v4compile.optimize(tiny_model, options={"radix_topk": {"k": 3}})
    assert set(PASSES) == {"compressor_fusion", "compressor_finish", "radix_topk", "mhc_tiling", "sparse_attention",
                           "head_padding", "moe_dispatch", "fp8_linear", "fp32_linear", "stream_schedule"}


def test_a_model_that_is_not_v4_still_optimizes_and_the_report_says_so() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(3, 16)
    optimized = v4compile.optimize(mlp, inductor=False)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), mlp(x))
    rows = optimized.report()
    assert rows and all(row["matches"] == 0 for row in rows)
    assert all(not r.matches for r in optimized.reports())


def test_tilelang_backend_names_the_kernels_that_really_run(tiny_model: v4compile.DeepSeekV4) -> None:
    """TileLang has the pooling with its finish, the indexer scoring and the top-k (the c target here); ops
    without a TileLang kernel, or whose TileLang kernel does not take the input, run (and are named) Triton."""
    optimized = explain(tiny_model, backend="tilelang", entries=("decode",))
    kernels = {m.kernel for m in optimized.reports()[0].matches}
    assert {"compressor_entry_state.c4.w128.fp8.tilelang", "compressor_entry_state.c4.w64.hadamard_fp4.tilelang",
            "indexer_scores.d64.bf16.tilelang", "radix_topk.k8.tilelang"} <= kernels
    unfinished = explain(tiny_model, backend="tilelang", entries=("decode",), disable=("compressor_finish",))
    pooled = {m.kernel for m in unfinished.reports()[0].matches}
    assert "compressor_pool_state.c4.w128.tilelang" in pooled
    # one name per kernel: every kernel a report names is the registry's (what kernels --show takes); the pool
    # kernels compressor_finish supersedes in the first run are built by the second
    from v4compile.codegen.registry import REGISTRY

    named = {k for k in kernels | pooled if k.endswith((".triton", ".tilelang"))}
    assert named <= set(REGISTRY.records), named - set(REGISTRY.records)


def test_passes_run_through_the_inductor_custom_pass_interface(tiny_model: v4compile.DeepSeekV4) -> None:
    """Each pass is a CustomGraphPass: calling it on an ATen graph rewrites that graph in place."""
    from torch import fx

    from v4compile.backend import make_backend
    from v4compile.passes.manager import PassManager

    captured: list[fx.GraphModule] = []
    backend = make_backend(PassManager([], backend="reference"), inductor=False, captured=captured)
    with torch.no_grad():
        torch.compile(tiny_model, backend=backend, dynamic=False)(sample_ids(tiny_model))
    graph = captured[0].graph
    for graph_pass in build_passes():
        graph_pass(graph)
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert {"v4compile.compressor_entries.default", "v4compile.radix_topk.default"} <= targets
