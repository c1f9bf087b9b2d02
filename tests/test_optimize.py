"""The optimized model: golden tolerance with every pass and each pass alone, training through the
rewrites, Inductor end to end, and bisect finding a broken kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import v4compile
from v4compile.codegen import ops, reference
from v4compile.debugging import bisect, golden_check
from v4compile.optimize import resolve_backend


def _in_band(name: str, results) -> None:
    got = results["optimized vs golden"]
    eager = results["eager vs golden"]
    print(name, results)
    assert got.median_cos >= 0.99 and got.mean_cos >= 0.97
    # the plain argmax agreement of the optimized model stays where the eager reference model is
    assert got.argmax_agreement >= eager.argmax_agreement - 1 / 40
    assert results["optimized vs eager"].median_cos >= 0.9999


@pytest.mark.parametrize(("folder", "ties"), [("tiny-bf16", "lowest"), ("tiny-fp8-fp4", "lowest"),
                                             ("tiny-bf16-c4first", "official")])
def test_optimized_model_meets_golden_tolerance_with_all_passes(golden_root: Path, golden_models: dict,
                                                                folder: str, ties: str) -> None:
    """A tie-heavy folder needs the official tie rule to be in the band at all (tests/model/test_golden.py); its
    top-k stays torch.topk through the passes."""
    model = golden_models[folder] if ties == "lowest" else v4compile.load(golden_root / folder, index_ties=ties)
    optimized = v4compile.optimize(model.eval(), backend="reference", inductor=False)
    _in_band(folder, golden_check(optimized, golden_root / folder))
    report = optimized.report()
    assert sum(row["matches"] for row in report) > 0
    # a script reads the report as plain JSON, a person prints it as the table
    assert json.loads(report.to_json()) == list(report)
    assert all(isinstance(row["kernels"], list) for row in report)
    assert all(row["pass"] in str(report) for row in report) and "rewrites" in str(report)


@pytest.mark.parametrize("passes", ["compressor_fusion", "radix_topk"])
@pytest.mark.parametrize("folder", ["tiny-bf16", "tiny-fp8-fp4"])
def test_each_pass_alone_keeps_golden_numerics(golden_root: Path, golden_models: dict, folder: str,
                                               passes: str) -> None:
    """Each pass alone on the first golden case: optimized equals eager, and eager is in the golden band."""
    from safetensors.torch import load_file

    model = golden_models[folder]
    cases = load_file(str(golden_root / folder / "cases.safetensors"))
    ids, length = cases["case0.ids"], int(cases["case0.prefill_len"])
    optimized = v4compile.optimize(model, backend="reference", passes=[passes], inductor=False)
    with torch.no_grad():
        got = optimized(ids)[:, length - 1 :].flatten(0, 1)
        want = model(ids)[:, length - 1 :].flatten(0, 1)
    golden = cases["case0.prefill_logits"].flatten(0, 1)
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.9999
    assert F.cosine_similarity(got, golden, dim=-1).median() >= 0.99
    rows = {row["pass"]: row for row in optimized.report()}
    assert rows[passes]["matches"] > 0 and rows.get("compressor_fusion" if passes == "radix_topk" else
                                                    "radix_topk", {"matches": 0})["matches"] == 0


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_generated_kernels_inside_the_optimized_model_match_golden(golden_root: Path, golden_models: dict,
                                                                   backend: str) -> None:
    """The same check with the generated kernels on the shortest cases: Triton's (interpreted on CPU), and
    TileLang's (the ``c`` target; Triton's where TileLang has none or its kernel does not take the input)."""
    from safetensors.torch import load_file

    if backend == "tilelang":
        pytest.importorskip("tilelang")
    model = golden_models["tiny-fp8-fp4"]
    cases = load_file(str(golden_root / "tiny-fp8-fp4" / "cases.safetensors"))
    ids, length = cases["case0.ids"], int(cases["case0.prefill_len"])
    optimized = v4compile.optimize(model, backend=backend, inductor=False, check=True)
    with torch.no_grad():
        got = optimized(ids)[:, length - 1 :]
        want = model(ids)[:, length - 1 :]
    cos = F.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    # the attention kernel's output differs from eager by at most one bf16 rounding step; the FP8 activation
    # quantization downstream amplifies such steps, so the bar here is the golden band, not bit equality
    official, official_decode = (cases[f"case0.{k}_logits"].flatten(0, 1) for k in ("prefill", "decode"))
    top = got.flatten(0, 1).argmax(-1)
    agree = ((top == official.argmax(-1)) | (top == official_decode.argmax(-1))).float().mean()
    assert cos.median() > 0.99
    assert F.cosine_similarity(got.flatten(0, 1), official, dim=-1).median() >= 0.99 and agree >= 0.8
    for row in optimized.report():
        if row["matches"]:
            assert row["worst_rel_error"] is not None and row["worst_rel_error"] < row["tolerance"], row
    if backend == "tilelang":  # the FP4 experts' and FP8 projections' TileLang GEMMs ran
        from v4compile.codegen.registry import REGISTRY

        for name in ("moe_experts.fp4.tilelang", "fp8_linear.tilelang"):
            assert REGISTRY.records[name].launches and REGISTRY.records[name].error is None, name


def test_training_gradients_flow_through_every_rewrite(tiny_model: v4compile.DeepSeekV4) -> None:
    model = v4compile.DeepSeekV4(tiny_model.config, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 136), generator=torch.Generator().manual_seed(3))
    optimized = v4compile.optimize(model, backend="reference", inductor=False)
    optimized(ids).logsumexp(-1).mean().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids).logsumexp(-1).mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    nonzero = {n for n, g in eager.items() if g.abs().sum() > 0}
    assert nonzero == {n for n, g in fast.items() if g.abs().sum() > 0}
    assert "layers.1.attn.compressor.ape" in nonzero and "layers.2.attn.compressor.wgate.weight" in nonzero
    for name in nonzero:
        cos = F.cosine_similarity(fast[name].flatten().float(), eager[name].flatten().float(), dim=0)
        assert cos > 0.98, (name, cos)
    assert sum(row["matches"] for row in optimized.report()) >= 6


def test_auto_picks_each_ops_fastest_kernel_on_cuda_and_compiled_reference_bodies_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("auto", "cuda") == "auto"
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_backend("tilelang", "cpu") == "tilelang"
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", "cpu")
    if not torch.cuda.is_available():
        assert not ops.auto_takes_tilelang()  # TileLang's kernels here are Hopper's
    pytest.importorskip("tilelang")
    for hopper_with_tilelang, moe in ((True, "tilelang"), (False, "triton")):
        monkeypatch.setattr(ops, "auto_takes_tilelang", lambda answer=hopper_with_tilelang: answer)
        assert ops.implementation_backend("moe_experts", "auto") == moe
        assert ops.implementation_backend("fp8_linear", "auto") == "triton"
        assert ops.implementation_backend("sparse_attention", "auto") == "triton"


@pytest.mark.slow
def test_inductor_end_to_end_matches_eager(monkeypatch: pytest.MonkeyPatch, tiny_model: v4compile.DeepSeekV4) -> None:
    from v4compile.codegen.registry import REGISTRY

    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    optimized = v4compile.optimize(tiny_model)
    with torch.no_grad():
        optimized(ids)
        # on the CPU, auto compiles the ops' reference bodies into Inductor's code: a compiled call runs no
        # reference body in Python and launches no Triton kernel (no interpreter)
        calls = []
        for name in ("compressor_pool", "radix_topk", "sparse_attention", "mhc_pre", "mhc_post", "moe_experts"):
            body = getattr(reference, name)
            monkeypatch.setattr(reference, name, lambda *a, _body=body, _name=name: calls.append(_name) or _body(*a))
        launches = sum(r.launches for r in REGISTRY.records.values())
        got, want = optimized(ids), tiny_model(ids)
    assert calls == [] and sum(r.launches for r in REGISTRY.records.values()) == launches
    assert all(kernel.endswith(".reference") for row in optimized.report() for kernel in row["kernels"])
    cos = F.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    assert cos.median() > 0.999
    # compressors 5 + their finishes 5, indexer top-k 2, mHC pre/post 8 + 8, attention 4 + indexer scoring 2,
    # MoE layers 4, less layer 3's, which runs the region compiled for layer 1
    twice = next(r for r in optimized.reports() if r.graph == "forward.layers.1,3")
    assert sum(row["matches"] for row in optimized.report()) + len(twice.matches) == 5 + 5 + 2 + 16 + 6 + 4


def test_bisect_finds_a_deliberately_broken_kernel(monkeypatch: pytest.MonkeyPatch,
                                                   tiny_model: v4compile.DeepSeekV4) -> None:
    healthy = bisect(tiny_model, backend="reference")
    assert healthy.culprit is None and healthy.total_rewrites == 5 + 5 + 2 + 16 + 6 + 4

    real = reference.compressor_pool

    def broken(kv, score, ape, ratio, width, n_blocks):
        """The C4 indexer-key kernel with its output dims reversed: a plausible indexing bug."""
        out = real(kv, score, ape, ratio, width, n_blocks)
        return out.flip(-1) if (ratio, width) == (4, 64) else out

    monkeypatch.setattr(reference, "compressor_pool", broken)
    result = bisect(tiny_model, backend="reference")
    assert result.culprit is not None
    assert result.culprit.kernel == "compressor_pool.c4.w64.reference"
    assert result.culprit.location.module == "layers.1"
    assert result.error_at > 1e-2 >= result.error_before
    assert result.culprit.worst_rel_error > 1e-1


def test_bisect_blames_no_region_within_tolerance_however_the_logits_move(tiny_model: v4compile.DeepSeekV4) -> None:
    """With a logits tolerance no rounding can meet (the Triton kernels sum in another order than the model code),
    the in-tolerance pipeline is still not blamed: each region is checked beside the code it replaced, and the
    logits' movement is reported as what it is."""
    result = bisect(tiny_model, backend="triton", tolerance=1e-12, passes=["compressor_fusion"])
    assert result.culprit is None and result.logits_error > 1e-12
    match, ratio = result.worst_region
    assert ratio <= 1 and match.checked_calls >= 1


def test_quantized_weights_compile_with_inductor_on_cpu() -> None:
    """FP8 and FP4 linears (e8m0 scales, which Inductor's CPU code generator has no type for) compile through
    the full pipeline and agree with eager (Inductor's fused fp32 arithmetic may move a value across an FP8
    activation rounding boundary, so not bit for bit; decoding the scale bytes wrongly gives cosine ~0.4)."""
    from torch import nn

    from v4compile.model import quant
    from v4compile.model.linear import Linear

    torch.manual_seed(0)
    layers = nn.Sequential(Linear(256, 128, "fp8", True), Linear(128, 64, "fp4", True))
    for layer, quantize in zip(layers, (quant.quantize_fp8_weight, quant.quantize_fp4_weight), strict=True):
        weight, scale = quantize(torch.randn(layer.out_features, layer.in_features) / 16)
        layer.weight.data.copy_(weight)
        layer.scale.copy_(scale)
    x = torch.randn(4, 256).bfloat16()
    with torch.no_grad():
        got, want = v4compile.optimize(layers, backend="reference")(x), layers(x)
    assert F.cosine_similarity(got.float(), want.float(), dim=-1).min() > 0.999


def test_inductors_cache_is_keyed_by_the_ops_definitions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's compiled code calls our ops with what their fake kernels announced (output strides, dtypes): a
    cached graph compiled against other op definitions (an older v4compile) is not served, the same ones are."""
    import uuid

    from torch import nn
    from torch._dynamo.utils import counters

    from v4compile import backend
    from v4compile.model import quant
    from v4compile.model.linear import Linear

    torch.manual_seed(2)
    layer = nn.Sequential(Linear(256, 128, "fp8", True))
    weight, scale = quant.quantize_fp8_weight(torch.randn(128, 256) / 16)
    layer[0].weight.data.copy_(weight)
    layer[0].scale.copy_(scale)
    x = torch.randn(2, 256).bfloat16()

    def compile_again() -> tuple[int, int]:
        torch._dynamo.reset()
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        with torch.no_grad():
            v4compile.optimize(layer, backend="triton")(x)
        return counters["inductor"]["fxgraph_cache_hit"] - hits, counters["inductor"]["fxgraph_cache_miss"] - misses

    compile_again()
    assert compile_again() == (1, 0)
    source = backend.op_definitions_source()
    other = f"{source}\n# another definition, {uuid.uuid4()}"  # new to the persistent cache on every run
    monkeypatch.setattr(backend, "op_definitions_source", lambda: other)
    assert compile_again() == (0, 1)


def test_a_second_compile_reuses_inductors_cached_graph() -> None:
    """Warm starts: the custom ops' reference bodies are inlined before Inductor, so its FX graph cache has a
    stable key and a fresh compile of the same model (a new process, or after ``torch._dynamo.reset()``) loads
    the compiled graph instead of compiling it again."""
    from torch import nn
    from torch._dynamo.utils import counters

    from v4compile.model import quant
    from v4compile.model.linear import Linear

    torch.manual_seed(1)
    layers = nn.Sequential(Linear(256, 128, "fp8", True), Linear(128, 64, "bf16", True))
    weight, scale = quant.quantize_fp8_weight(torch.randn(128, 256) / 16)
    layers[0].weight.data.copy_(weight)
    layers[0].scale.copy_(scale)
    x = torch.randn(3, 256).bfloat16()
    with torch.no_grad():
        first = v4compile.optimize(layers, backend="reference")
        want = first(x)
        assert [m.kernel for row in first.reports() for p in row.passes for m in p.matches] == ["fp8_linear.reference"]
        torch._dynamo.reset()
        hits, bypasses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_bypass"]
        got = v4compile.optimize(layers, backend="reference")(x)
    assert counters["inductor"]["fxgraph_cache_hit"] > hits
    assert counters["inductor"]["fxgraph_cache_bypass"] == bypasses
    assert torch.equal(got, want)
