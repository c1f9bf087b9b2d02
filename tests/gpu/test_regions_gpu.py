"""Compiled regions on the GPU: a prefill in pieces (chunk calls, the sequence and the start dynamic) runs the
Triton kernels, its logits agree with the eager model's within the golden band, and later pieces compile nothing.

The band, not a tight cosine: on the GPU the golden models amplify rounding (discrete top-k and routing choices), and
Inductor alone, with no v4compile pass, moves the full-sequence logits of tiny-bf16 to a mean row cosine of 0.982
and an argmax agreement of 0.844 against eager's (``benchmarks/drift_by_pass.py``); the one-call prefill through every
pass lands at 0.989 / 0.863. On the device, point ``V4_GOLDEN`` at a copy of the golden folders in the tree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import v4compile
from v4compile.golden import Agreement, GoldenFolder

pytestmark = pytest.mark.gpu


def test_chunked_prefill_on_cuda_agrees_with_eager_and_reuses_its_graphs(golden_root: Path) -> None:
    folder = golden_root / "tiny-bf16"
    model = v4compile.load(folder, device="cuda").eval()
    ids = GoldenFolder.read(folder).cases[-1].ids.cuda().repeat(1, 2)  # 614 tokens: five pieces of 128
    optimized = v4compile.optimize(model)
    cache = model.new_cache(ids.shape[0])
    pieces, graphs = [], {}
    with torch.no_grad():
        want = model(ids)
        for start in range(0, ids.shape[1], 128):
            pieces.append(optimized.extend(ids[:, start : start + 128], start, cache))
            graphs[start] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    agreement = Agreement.of(torch.cat(pieces, dim=1), want)
    assert agreement.in_band(), agreement.line()
    assert graphs[384] == graphs[128], graphs  # the pieces at 256 and 384 reuse the graphs of the one at 128
    kernels = {m.kernel for r in optimized.reports() for m in r.matches}
    assert any(k.startswith("sparse_attention") for k in kernels) and any(k.startswith("mhc_pre") for k in kernels)


def test_new_prompt_lengths_on_cuda_run_the_kernels_and_agree_with_eager(golden_root: Path) -> None:
    """Prompt lengths of several shape classes (remainders 3, 1, 0 and 2 after the C4 blocks): each class's graphs
    get the same kernels (the compressor's block count and the indexer's k are run-time values), and every
    length's logits agree with eager's within the golden band."""
    folder = golden_root / "tiny-bf16"
    model = v4compile.load(folder, device="cuda").eval()
    ids = GoldenFolder.read(folder).cases[-1].ids.cuda().repeat(1, 2)
    optimized = v4compile.optimize(model)
    with torch.no_grad():
        for length in (307, 401, 404, 614):
            agreement = Agreement.of(optimized(ids[:, :length]), model(ids[:, :length]))
            assert agreement.in_band(), (length, agreement.line())
    kernels = {r.graph: sorted((m.pass_name, m.kernel) for m in r.matches) for r in optimized.reports()}
    for graph, found in kernels.items():
        assert found == kernels[graph.split("-")[0]], graph
    later = {k for _, k in kernels["forward.layers.1,3-1"]}
    assert any(k.startswith("compressor_entries") for k in later) and any(k.startswith("radix_topk") for k in later)


def test_decode_at_batch_1_compiles_the_graphs_every_batch_reuses_on_cuda(
        golden_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first decode (batch 1) compiles the unbacked-batch graphs; batches 4, 16 and 1 again compile no frame.
    The graphs carry every kernel the static batch-1 graphs do (and fp32_linear where those keep a one-row GEMV,
    which the op runs as cuBLAS's GEMV at one row), and each batch's logits agree with eager's within the golden
    band. (CUDA is not yet in ``regions.UNBACKED_DEVICES``: this test turns it on, and passing is what
    adds it.)"""
    import v4compile.regions as regions

    monkeypatch.setattr(regions, "UNBACKED_DEVICES", {"cpu", "cuda"})

    folder = golden_root / "tiny-bf16"
    model = v4compile.load(folder, device="cuda").eval()
    prompt = GoldenFolder.read(folder).cases[-1].ids.cuda()[:1, :200]

    def decode(fn: object, batch: int) -> torch.Tensor:
        ids = prompt.repeat(batch, 1)
        cache = model.new_cache(batch)
        with torch.no_grad():
            model.hidden_states(ids[:, :-1], cache)
            return fn.decode_step(ids[:, -1:].contiguous(), torch.full((batch,), ids.shape[1] - 1, device="cuda"),
                                  cache)

    optimized = v4compile.optimize(model)
    counts = []
    for batch in (1, 4, 16, 1):
        agreement = Agreement.of(decode(optimized, batch), decode(model, batch))
        assert agreement.in_band(), (batch, agreement.line())
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[1:] == counts[:1] * 3, counts
    kernels = {r.graph: sorted((m.pass_name, m.kernel) for m in r.matches) for r in optimized.reports()
               if r.graph.startswith("decode_step.")}
    monkeypatch.setattr(regions, "mark_dynamic_dims", lambda args, kwargs, sequence=False: None)
    static = v4compile.optimize(model)
    decode(static, 1)
    fixed = {r.graph: sorted((m.pass_name, m.kernel) for m in r.matches) for r in static.reports()}
    differ = {graph: {"static only": sorted(set(fixed.get(graph, [])) - set(kernels.get(graph, []))),
                      "unbacked only": sorted(set(kernels.get(graph, [])) - set(fixed.get(graph, [])))}
              for graph in fixed.keys() | kernels.keys() if fixed.get(graph) != kernels.get(graph)}
    # every kernel of the static graphs runs in the unbacked ones too; those may add fp32_linear, whose op runs
    # cuBLAS's GEMV when a call has one row (why the pass declines a static one-row product)
    extra = {graph: [k for k in d["unbacked only"] if k[0] != "fp32_linear"] for graph, d in differ.items()}
    assert not any(d["static only"] for d in differ.values()) and not any(extra.values()), differ
    assert any(k.startswith("sparse_attention") for found in kernels.values() for _, k in found)
