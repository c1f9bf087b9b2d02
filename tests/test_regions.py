"""Regional compilation: one compiled graph per kind of block whatever the depth, every entry point runs the
compiled regions with the model's results, the reports name the layers each region serves, and the model itself
stays eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import v4compile
from v4compile.regions import Regions, kind_of, span
from v4compile.runtime.engine import Engine


def _model(n_layers: int) -> v4compile.DeepSeekV4:
    ratios = [0, *([4, 128] * n_layers)][:n_layers] + [0]
    return v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny", n_layers=n_layers, compress_ratios=ratios),
                                seed=0).eval()


def _graphs(optimized: v4compile.OptimizedModel) -> list[str]:
    return [r.graph for r in optimized.reports()]


@pytest.mark.parametrize("n_layers", [4, 9])
def test_compiled_graphs_do_not_grow_with_depth(n_layers: int) -> None:
    model = _model(n_layers)
    optimized = v4compile.optimize(model, backend="reference", inductor=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = optimized(ids), model(ids)
    assert torch.equal(got, want)
    c4 = ",".join(str(i) for i in range(1, n_layers, 2)) if n_layers < 8 else f"1,3,...,{n_layers - 2}"
    c128 = ",".join(str(i) for i in range(2, n_layers, 2)) if n_layers < 8 else f"2,4,...,{n_layers - 1}"
    assert _graphs(optimized) == ["forward.layers.0", f"forward.layers.{c4}", f"forward.layers.{c128}",
                                  "forward.head"]
    report = {r.graph: r for r in optimized.reports()}
    assert all(str(m.location).startswith(f"layers.{c4}") for m in report[f"forward.layers.{c4}"].matches)
    assert report[f"forward.layers.{c4}"].matches, "the C4 layers' region was not rewritten"
    # outside an optimized call the model is its eager self
    assert all(block._compiled_call_impl is None for block in model.layers) and "logits" not in vars(model)


def test_every_entry_point_runs_compiled_regions_with_the_models_results(tiny_model: v4compile.DeepSeekV4) -> None:
    model = tiny_model
    optimized = v4compile.optimize(model, backend="reference", inductor=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(0, model.config.vocab_size, (2, 2), generator=torch.Generator().manual_seed(2))
    results = {}
    for name, fn in (("optimized", optimized), ("eager", model)):
        cache = model.new_cache(2)
        with torch.no_grad():
            hidden = fn.hidden_states(ids, cache)
            out = {"hidden": hidden, "logits": fn.logits(hidden, last=True)}
            out["extend"] = fn.extend(nxt[:, :1], 9, cache)
            positions = torch.full((2,), 10)
            out["decode_step"] = fn.decode_step(nxt[:, 1:], positions, cache)
            out["decode_tokens"], streams = fn.decode_tokens(nxt, positions + 1, cache)
            out["mtp_step"] = fn.mtp_step(streams, nxt, cache, positions=positions + 1)
            out["mtp_logits"] = fn.mtp_logits(hidden, ids)
        results[name] = out
    for key, want in results["eager"].items():
        assert torch.equal(results["optimized"][key], want), key
    graphs = _graphs(optimized)
    for entry in ("hidden_states", "logits", "decode_step", "decode_tokens", "mtp_step", "mtp_logits"):
        assert any(g.startswith(f"{entry}.") for g in graphs), (entry, graphs)
    assert "mtp_step.mtp.0" in graphs and "decode_step.layers.1,3" in graphs
    assert "extend.layers.1,3" in graphs and "extend.head" in graphs


def test_chunks_at_every_later_position_reuse_the_compiled_chunk_graphs() -> None:
    """A prefill in pieces: the first piece (start 0) and the second (any other start: it is symbolic) compile;
    every later piece reuses them (Dynamo compiles no new frame), and a short remainder adds at most one graph
    per kind, all bitwise equal to the eager model's. Planned for a GPU, the chunk graphs (a dynamic length) stay
    on one stream and say why; the indexer's cut at k = min(topk, entries) becomes the select kernel in every C4
    chunk graph (k = topk, the op returning fewer columns while there are fewer entries)."""
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=5).eval()
    optimized = v4compile.optimize(model, backend="reference", inductor=False,
                                   options={"stream_schedule": {"target": "sm90"}})
    ids = torch.randint(0, model.config.vocab_size, (1, 577), generator=torch.Generator().manual_seed(1))
    eager_cache, cache = model.new_cache(1), model.new_cache(1)
    for start, stop in ((0, 128), (128, 256), (256, 384), (384, 512), (512, 577)):
        if start == 256:
            compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            graphs = _graphs(optimized)
        if start == 512:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
            assert _graphs(optimized) == graphs
        with torch.no_grad():
            want = model.extend_hidden(ids[:, start:stop], start, eager_cache)
            got = optimized.extend_hidden(ids[:, start:stop], start, cache)
        assert torch.equal(got, want), start
    kinds = {"extend_hidden.layers.0", "extend_hidden.layers.1,3", "extend_hidden.layers.2"}
    assert len(graphs) == 6 and {g.split("-")[0] for g in graphs} == kinds
    assert len(_graphs(optimized)) - len(graphs) <= len(kinds)
    for report in optimized.reports():
        streams = next(p for p in report.passes if p.name == "stream_schedule")
        assert not streams.matches and "dynamic size in dim 1" in streams.near_misses[0].reason, report.graph
    topk = [r.graph for r in optimized.reports() for m in r.matches if m.pass_name == "radix_topk"]
    assert {g.split("-")[0] for g in topk} == {"extend_hidden.layers.1,3"} and len(topk) == 3, topk


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor of a cache's layers (dataclasses of tensors, nested), in field order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list):
        return [t for item in value for t in _tensors(item)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    return []


def test_prompt_lengths_after_the_first_share_graphs_with_the_sequence_dynamic() -> None:
    """Prefill graphs have the sequence dynamic from the first length on, compiled once per shape class the model's
    code tells apart (here: a remainder of 0, 1 or more after the C4 blocks; one or more complete C128 blocks), so
    most new lengths compile nothing; every length, the first one again too, bitwise equal to the eager model's
    logits and cache. Every class's graph has the same kernels (the compressor's block count and the indexer's
    k = min(topk, entries) are run-time values)."""
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=5).eval()
    optimized = v4compile.optimize(model, backend="reference", inductor=False)
    generator = torch.Generator().manual_seed(3)
    lengths = (200, 301, 302, 304, 303, 305, 310, 333, 450, 511, 200)
    compiled = []
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (2, length), generator=generator)
        cache, eager_cache = model.new_cache(2), model.new_cache(2)
        with torch.no_grad():
            assert torch.equal(optimized(ids, cache=cache), model(ids, cache=eager_cache)), length
        assert all(torch.equal(a, b) for a, b in zip(_tensors(cache.layers), _tensors(eager_cache.layers),
                                                    strict=True)), length
        compiled.append(len(_graphs(optimized)))
    kinds = 4  # three kinds of block and the head
    assert compiled[0] == kinds and _graphs(optimized)[0] == "prefill.layers.0"
    # 301: C4 remainder 1 and two C128 blocks (200 had one), 302: remainder 2; a static graph per length: 4 each
    assert compiled[3] - compiled[0] <= 3, compiled
    assert compiled[-1] == compiled[3], compiled
    kernels = {r.graph: sorted((m.pass_name, m.kernel) for m in r.matches) for r in optimized.reports()}
    for graph, found in kernels.items():
        assert found == kernels[graph.split("-")[0]], graph
    assert any(kernel.startswith("compressor_entries.c128") for _, kernel in kernels["prefill.layers.2-1"])
    assert any(kernel.startswith("radix_topk") for _, kernel in kernels["prefill.layers.1,3-1"])


def test_replayed_routing_shares_the_sequence_dynamic_graphs() -> None:
    """A trainer replaying each rollout's routing records (experts and indexer entries) at its own length: after the
    second length compiles the dynamic graphs, further lengths compile nothing, each bitwise the eager replay."""
    from v4compile.model import Routing

    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=5).eval()
    optimized = v4compile.optimize(model, backend="reference", inductor=False)
    generator = torch.Generator().manual_seed(3)
    compiled = []
    for length in (200, 301, 333, 450):
        ids = torch.randint(0, model.config.vocab_size, (2, length), generator=generator)
        record = Routing.recorder(model.config)
        with torch.no_grad():
            model(ids, routing=record)
            assert torch.equal(optimized(ids, routing=record.for_replay()), model(ids, routing=record.for_replay()))
        compiled.append(len(_graphs(optimized)))
    assert compiled[1] > compiled[0] and compiled[3] == compiled[1], compiled


def test_new_lengths_keep_every_kernel_on_flash_shaped_layers() -> None:
    """Flash's layer kinds at small dims (FP8 projections, FP4 experts, top-6 of 16, C4 with the indexer and C128):
    a second prompt length of another shape class (a remainder of 2 after the C4 blocks, not 0) compiles a graph
    with the first one's rewrites (the expert sum's ``held[:, j:j+1]`` traces there without the whole-dimension
    slice the template keeps), and both stay bitwise the eager model's."""
    config = v4compile.V4Config.preset(
        "flash", n_layers=2, compress_ratios=[4, 128], n_hash_layers=0, n_mtp_layers=0, max_seq_len=1024, dim=512,
        moe_inter_dim=128, n_routed_experts=16, vocab_size=1024, n_heads=8, q_lora_rank=128, o_groups=2,
        o_lora_rank=64, head_dim=128, index_n_heads=4, index_head_dim=64, index_topk=16)
    model = v4compile.DeepSeekV4(config, seed=1).eval()
    optimized = v4compile.optimize(model, backend="reference", inductor=False)
    generator = torch.Generator().manual_seed(2)
    for length in (600, 450):
        ids = torch.randint(0, config.vocab_size, (1, length), generator=generator)
        with torch.no_grad():
            assert torch.equal(optimized(ids, cache=model.new_cache(1)), model(ids, cache=model.new_cache(1)))
    kernels = {r.graph: sorted((m.pass_name, m.kernel) for m in r.matches) for r in optimized.reports()}
    for graph, found in kernels.items():
        assert found == kernels[graph.split("-")[0]], graph
    assert ("moe_dispatch", "moe_experts.fp4.reference") in kernels["prefill.layers.0-1"], kernels


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def served() -> tuple[v4compile.DeepSeekV4, v4compile.OptimizedModel]:
    """A model and its optimized form shared by the engine tests (their compiled regions too)."""
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny", max_seq_len=256), seed=3).eval()
    return model, v4compile.optimize(model, backend="reference", inductor=False)


@pytest.mark.parametrize("mode", ["prefix hits", "mtp", "hisparse"])
def test_the_engine_serves_the_optimized_model_token_for_token(
        mode: str, served: tuple[v4compile.DeepSeekV4, v4compile.OptimizedModel]) -> None:
    """Two turns of three conversations (the second turn hits the prefix cache): the optimized model's tokens are
    the eager model's, with MTP speculation and with HiSparse's host tier too; prefill pieces run compiled."""
    from v4compile.runtime.hisparse import min_hot_entries, slot_bytes

    model, optimized = served
    options = {"max_batch": 3, "decode_buckets": (3,), "max_seq_len": 256}
    if mode == "hisparse":
        options["hisparse_budget"] = min_hot_entries(3, model.config.index_topk) * slot_bytes(model.config)

    def conversation(served: object) -> tuple[list[list[int]], list[int]]:
        engine = Engine(served, **options)
        first = [_ids(140, 4), _ids(200, 5), _ids(75, 6)]
        outs = engine.generate(first, 4, mtp=mode == "mtp")
        second = [p + r.tokens + _ids(9, 7 + i) for i, (p, r) in enumerate(zip(first, outs, strict=True))]
        again = engine.generate(second, 4, mtp=mode == "mtp")
        return [r.tokens for r in outs + again], [r.cache.cached_tokens for r in again]

    want, want_hits = conversation(model)
    got, hits = conversation(optimized)
    assert got == want and hits == want_hits and max(hits) > 0
    graphs = _graphs(optimized)
    assert "extend_hidden.layers.1,3" in graphs, graphs
    if mode == "mtp":
        assert "decode_tokens.layers.1,3" in graphs and "mtp_step.mtp.0" in graphs, graphs
    else:
        assert "decode_step.layers.1,3" in graphs, graphs


def test_kinds_follow_shapes_and_settings_and_names_stay_short(tiny_model: v4compile.DeepSeekV4) -> None:
    layers = tiny_model.layers
    assert kind_of(layers[1]) == kind_of(layers[3])
    assert len({kind_of(b) for b in layers}) == 3
    assert span([1, 3]) == "1,3" and span([2, 4, 6, 8, 10]) == "2,4,...,10" and span([0, 1, 5, 9]) == "0,1,5,9"
    with pytest.raises(ValueError, match="no repeated blocks in `layers`"):
        Regions(torch.nn.Linear(2, 2), torch.compile)


def _decode(fn: object, model: v4compile.DeepSeekV4, batch: int) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (batch, 11), generator=torch.Generator().manual_seed(batch))
    cache = model.new_cache(batch)
    with torch.no_grad():
        fn.hidden_states(ids[:, :10], cache)
        return fn.decode_step(ids[:, 10:], torch.full((batch,), 10), cache)


def _rewrites(optimized: v4compile.OptimizedModel) -> dict[str, dict[str, int]]:
    return {r.graph: {p.name: len(p.matches) for p in r.passes} for r in optimized.reports()}


def _kernels(optimized: v4compile.OptimizedModel, entry: str) -> dict[str, list[tuple[str, str]]]:
    """Each of ``entry``'s graphs: the rewrites its passes made, as (pass, kernel) pairs."""
    return {r.graph: sorted((m.pass_name, m.kernel) for m in r.matches) for r in optimized.reports()
            if r.graph.startswith(f"{entry}.")}


def test_one_compile_serves_every_decode_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first decode, at batch 1, compiles the graphs every later batch reuses (the batch is unbacked): batches
    2, 3, 5, 8 and 1 again compile no decode graph, and once the prefill's batch-dynamic graphs exist (batch 2) no
    frame at all. Each graph has every rewrite and kernel the static graphs of batch 1 and of batch 2 have (the
    stream schedule's too: its cost estimates read dynamic sizes without guarding them), and the logits are the
    eager model's bitwise."""
    import v4compile.backend as backend
    import v4compile.regions as regions
    from v4compile.passes.streams.dag import node_values

    unknown: list[str] = []

    def scheduled(gm: torch.fx.GraphModule, example_inputs: list[object], inductor: bool) -> object:
        values = node_values(gm)  # what a GPU's stream runner compiles each region on
        unknown.extend(n.name for n in gm.graph.nodes if n.op == "call_function" and values.get(n) is None
                       and n.target is not torch.ops.aten._assert_scalar.default)  # the batch sizes' run-time checks
        return None

    monkeypatch.setattr(backend, "scheduled", scheduled)
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=5).eval()
    options = {"stream_schedule": {"target": "sm90"}}
    optimized = v4compile.optimize(model, backend="reference", inductor=False, options=options)
    assert torch.equal(_decode(optimized, model, 1), _decode(model, model, 1))
    dynamic = _kernels(optimized, "decode_step")
    assert len(dynamic) == 4 and unknown == [], (dynamic, unknown)
    assert torch.equal(_decode(optimized, model, 2), _decode(model, model, 2))
    assert _kernels(optimized, "decode_step") == dynamic
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    graphs = _graphs(optimized)
    for batch in (3, 5, 8, 1):
        assert torch.equal(_decode(optimized, model, batch), _decode(model, model, batch)), batch
    assert _graphs(optimized) == graphs and torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    assert unknown == []

    monkeypatch.setattr(regions, "mark_dynamic_dims", lambda args, kwargs, sequence=False: None)
    for batch in (1, 2):
        static = v4compile.optimize(model, backend="reference", inductor=False, options=options)
        _decode(static, model, batch)
        assert _kernels(static, "decode_step") == dynamic, batch
    assert sum(len(k) for k in dynamic.values()) > 0
