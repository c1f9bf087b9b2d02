"""The stream schedule on the tiny preset's decode graph: every node scheduled once, every dependency ordered
by the events, branches that may run side by side truly independent, V4's attention branches apart; the
split run equals the whole graph bit for bit; the CLI report; on a GPU, scheduled == unscheduled bitwise,
also inside a CUDA graph; on CPU, regions compiled by Inductor within bf16 rounding of the whole graph."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from typing import Any

import pytest
import torch
from torch import fx

import v4compile
from v4compile import cli
from v4compile.backend import inductor_compile, make_backend
from v4compile.debugging import sample_ids
from v4compile.optimize import resolve_backend
from v4compile.passes import PASSES, build_passes
from v4compile.passes.manager import PassManager, summarize
from v4compile.passes.streams.dag import META_KEY, dependency_graph, written_input
from v4compile.passes.streams.naming import module_path
from v4compile.passes.streams.plan import Plan, make_plan
from v4compile.passes.streams.segments import happens_before, unordered_edges
from v4compile.stream_runner import StreamRunner, executable_segments, scheduled
from v4compile.targets import target


def _capture(model: v4compile.DeepSeekV4, manager: PassManager, ids: torch.Tensor, cache: v4compile.V4Cache,
             inductor: bool = False) -> dict[str, Any]:
    """Compiles ``model.decode_step`` with ``manager``; returns the graphs, what the backend returned, the fake
    and the real inputs of the graph, and the compiled function."""
    got: dict[str, Any] = {"captured": []}
    inner = make_backend(manager, inductor=inductor, captured=got["captured"])

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        fn = inner(gm, example_inputs)
        got.update(gm=gm, returned=fn, fakes=list(example_inputs))

        def record(*args: Any) -> Any:
            if "args" not in got:
                got["args"] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            return fn(*args)

        return record

    positions = torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
    got["fn"] = torch.compile(model.decode_step, backend=backend, dynamic=False)
    got["call"] = (ids[:, -1:], positions)
    with torch.no_grad():
        got["fn"](ids[:, -1:], positions, copy.deepcopy(cache))
    got["rewritten"] = got["returned"] if isinstance(got["returned"], fx.GraphModule) else None
    return got


SM90 = {"stream_schedule": {"target": "sm90"}}
"""Plan for the H200 on this CPU (by default the pass declines CPU graphs)."""


@pytest.fixture(scope="module")
def decode(tiny_model: v4compile.DeepSeekV4) -> dict[str, Any]:
    """The tiny preset's decode graph after every pass (streams planned for sm90 on this CPU)."""
    ids = sample_ids(tiny_model)
    cache = tiny_model.new_cache(ids.shape[0])
    with torch.no_grad():
        tiny_model(ids, cache=cache)
    manager = PassManager(build_passes(list(PASSES), SM90), backend="reference")
    got = _capture(tiny_model, manager, ids, cache)
    got["manager"] = manager
    got["plan"] = next(p for p in manager.passes if p.name == "stream_schedule").plans[0]
    got["dag"] = dependency_graph(got["rewritten"].graph)
    return got


def test_on_cpu_the_graph_runs_unchanged(decode: dict[str, Any]) -> None:
    assert isinstance(decode["returned"], fx.GraphModule)
    assert scheduled(decode["rewritten"], decode["fakes"], inductor_compile) is None
    stats = next(p for p in decode["manager"].reports[0].passes if p.name == "stream_schedule")
    assert stats.enabled and stats.matches
    assert all(m.kernel == "-" and m.details["target"] == "sm90" for m in stats.matches)


def test_by_default_cpu_graphs_and_prefill_sized_graphs_stay_on_one_stream(tiny_model: v4compile.DeepSeekV4) -> None:
    ids = sample_ids(tiny_model)
    cache = tiny_model.new_cache(ids.shape[0])
    with torch.no_grad():
        tiny_model(ids, cache=cache)
    for options, reason in ((None, "graph on the CPU: no CUDA streams (give the target option to plan for a GPU)"),
                            ({"stream_schedule": {"target": "sm90", "max_rows": 0}},
                             r"products of \d+ rows exceed max_rows 0: each kernel fills the device on its own")):
        manager = PassManager(build_passes(None, options), backend="reference")
        got = _capture(tiny_model, manager, ids, cache)
        stats = next(p for p in manager.reports[0].passes if p.name == "stream_schedule")
        assert stats.enabled and not stats.matches
        assert len(stats.near_misses) == 1 and re.fullmatch(re.escape(reason) if options is None else reason,
                                                            stats.near_misses[0].reason)
        assert not any(META_KEY in n.meta for n in got["rewritten"].graph.nodes)


def test_every_node_is_scheduled_once_and_every_dependency_is_ordered(decode: dict[str, Any]) -> None:
    plan, dag = decode["plan"], decode["dag"]
    assert len(plan.launch) == len(set(plan.launch)) == dag.number_of_nodes()
    in_segments = [n for seg in plan.segments for n in seg.nodes]
    assert in_segments == plan.launch
    position = {n: i for i, n in enumerate(plan.launch)}
    assert all(position[u] < position[v] for u, v in dag.edges)
    assert unordered_edges(dag, plan.segments) == []
    dag2, segs = executable_segments(decode["rewritten"])
    assert [[n.name for n in s.nodes] for s in segs] == [[n.name for n in s.nodes] for s in plan.segments]
    assert [s.waits for s in segs] == [s.waits for s in plan.segments]
    assert unordered_edges(dag2, segs) == []
    streams = {s.stream for s in segs}
    assert streams == set(range(target("sm90")["streams"]))
    memory = [e for e in dag.edges(data=True) if e[2]["kind"] == "memory"]
    assert memory, "cache writes and reads must be ordered"


def test_branches_that_may_run_side_by_side_are_independent(decode: dict[str, Any]) -> None:
    """Two segments on different streams that the events leave unordered have no path between them."""
    plan, dag = decode["plan"], decode["dag"]
    bit = {n: 1 << i for i, n in enumerate(plan.launch)}
    reach: dict[fx.Node, int] = {}
    for node in reversed(plan.launch):
        reach[node] = 0
        for succ in dag.successors(node):
            reach[node] |= reach[succ] | bit[succ]
    segs = plan.segments
    before = happens_before(segs)
    own = [sum(bit[n] for n in s.nodes) for s in segs]
    downstream = [0] * len(segs)
    for s in segs:
        for n in s.nodes:
            downstream[s.id] |= reach[n]
    concurrent = 0
    for a in segs:
        for b in segs[a.id + 1:]:
            if a.stream == b.stream or (before[b.id] >> a.id) & 1:
                continue
            concurrent += 1
            assert not downstream[a.id] & own[b.id] and not downstream[b.id] & own[a.id], (a.id, b.id)
    assert concurrent > 10


def _majority_stream(plan: Plan, prefixes: tuple[str, ...]) -> int:
    counts = Counter(plan.stream_of[n] for n in plan.launch if module_path(n).startswith(prefixes))
    return counts.most_common(1)[0][0]


@pytest.mark.parametrize("layer", [1, 3])
def test_a_c4_layer_runs_query_window_compressor_and_indexer_apart(decode: dict[str, Any], layer: int) -> None:
    plan = decode["plan"]
    at = f"layers.{layer}.attn."
    query = _majority_stream(plan, (at + "wq_a", at + "q_norm", at + "wq_b"))
    window = _majority_stream(plan, (at + "wkv", at + "kv_norm"))
    compressor = _majority_stream(plan, (at + "compressor.",))
    indexer = _majority_stream(plan, (at + "indexer.compressor.",))
    assert len({query, window, compressor, indexer}) == 4
    sections = [s for s in plan.sections if s.unit == f"layers.{layer}"]
    names = " ".join(b.name for s in sections for b in s.branches)
    assert all(word in names for word in ("wq_", "wkv", "compressor", "indexer")), names
    kinds = {e.kind for s in sections for e in s.events}
    assert {"fork", "join"} <= kinds


def test_the_split_run_equals_the_whole_graph_bitwise(decode: dict[str, Any]) -> None:
    gm = decode["rewritten"]
    _, segs = executable_segments(gm)
    runner = StreamRunner(gm, segs, decode["fakes"], lambda module, inputs: module)
    whole = [a.clone() if isinstance(a, torch.Tensor) else a for a in decode["args"]]
    split = [a.clone() if isinstance(a, torch.Tensor) else a for a in decode["args"]]
    with torch.no_grad():
        want, got = gm(*whole), runner(*split)
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    assert all(torch.equal(w, g) for w, g in zip(whole, split, strict=True) if isinstance(w, torch.Tensor))


def _inputs_like_capture(got: dict[str, Any]) -> list[Any]:
    """Fresh copies of the graph's recorded inputs with the strides of the inputs it was captured with (the
    token ids are a strided slice): Inductor's compiled code checks its inputs' strides."""
    return [torch.empty_strided(x.size(), x.stride(), dtype=x.dtype).copy_(a) if isinstance(a, torch.Tensor) else a
            for x, a in zip(got["fakes"], got["args"], strict=True)]


@pytest.mark.slow
def test_inductor_regions_run_on_cpu_within_bf16_rounding_of_the_whole_graph() -> None:
    """Every region compiled by Inductor, run in order on CPU: logits within bf16 rounding (1e-2 mean row
    error) of the unscheduled graph, the caches it writes likewise. A region once took a KV cache and the
    ``index_put_`` into it as two inputs aliasing each other, which Inductor compiled against a synthetic base
    that its runtime wrapper rebuilt otherwise (in the backend, on GPU: ``wrong number of dimensions`` at run
    time; built outside torch.compile, as here, the compile itself failed). Two layers keep the compile short,
    and the 32-token prompt leaves the C4 layer no more compressed entries than the indexer's top-k keeps, so
    Inductor's rounding differences do not become different selections."""
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny", n_layers=2), seed=0).eval()
    ids = sample_ids(model)
    cache = model.new_cache(ids.shape[0])
    with torch.no_grad():
        model(ids, cache=cache)
    got = _capture(model, PassManager(build_passes(list(PASSES), SM90), backend="reference"), ids, cache)
    gm = got["rewritten"]
    _, segs = executable_segments(gm)
    before, whole, split = (_inputs_like_capture(got) for _ in range(3))
    with torch.no_grad():
        runner = StreamRunner(gm, segs, got["fakes"], inductor_compile)
        want, out = gm(*whole)[0], runner(*split)[0]
    assert not [n for region in runner.regions for n in region.inputs if written_input(n) is not None]
    rows, want_rows = out.flatten(0, -2).float(), want.flatten(0, -2).float()
    rel = ((rows - want_rows).norm(dim=-1) / want_rows.norm(dim=-1)).mean()
    assert rel <= 1e-2, f"mean row error {rel:.2e} against the unscheduled graph"
    written = [(w, s) for b, w, s in zip(before, whole, split, strict=True)
               if isinstance(w, torch.Tensor) and not torch.equal(b, w)]
    assert written, "the decode step writes its caches"
    for w, s in written:
        assert torch.equal(w.isinf(), s.isinf())
        finite_w, finite_s = (t.float().nan_to_num(posinf=0.0, neginf=0.0) for t in (w, s))
        assert (finite_w - finite_s).norm() <= 1e-2 * finite_w.norm()


def test_disabled_by_name_and_planned_for_one_stream_it_does_nothing(decode: dict[str, Any]) -> None:
    assert "stream_schedule" in PASSES and list(PASSES)[-1] == "stream_schedule"
    gm = decode["captured"][0]
    manager = PassManager(build_passes(list(PASSES)), backend="reference", disable=("stream_schedule",))
    manager.run(gm)
    stats = next(p for p in manager.reports[0].passes if p.name == "stream_schedule")
    assert not stats.enabled and not stats.matches
    assert not any(META_KEY in n.meta for n in gm.graph.nodes)
    assert executable_segments(gm) is None
    rows = {r["pass"]: r for r in summarize(manager.reports)}
    assert rows["stream_schedule"]["enabled"] is False
    assert make_plan(gm, "cpu", 10.0).sections == []
    with pytest.raises(ValueError, match="unknown target 'sm00'"):
        target("sm00")


def test_the_schedule_command_prints_branches_streams_and_events(decode: dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(cli.console, "width", 250)
    monkeypatch.setattr(cli.compiler, "_schedule_plans", lambda args: [("decode", decode["plan"])])
    assert cli.main(["schedule"]) == 0
    out = capsys.readouterr().out
    assert "decode: target sm90 (4 streams)" in out and "regions" in out
    for word in ("layers.1", "layers.3", "attn.compressor", "wq_a", "(main)", "s3", "fork s0 after", "join s"):
        assert word in out, word
    assert cli.main(["schedule", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["graph"] == "decode" and plan["streams"] == 4
    assert all({"name", "stream", "kernels", "bytes", "flops", "us"} <= set(b) for s in plan["sections"]
               for b in s["branches"])
    assert cli.main(["schedule", "--target", "sm00"]) == 2
    assert "unknown target 'sm00'" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
def test_scheduled_equals_unscheduled_bitwise_on_gpu_also_in_a_cuda_graph(inductor: bool) -> None:
    """Eager regions launch the whole graph's kernels, so every variant is bitwise equal. Inductor compiles
    each region apart (fusions stop at region borders): the overlapped run is bitwise equal to the same
    regions on one stream and within bf16 rounding (1e-2 mean row error, the bisect default) of the whole
    graph compiled as one."""
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0, device="cuda").eval()
    ids = sample_ids(model).cuda()
    cache = model.new_cache(ids.shape[0])
    with torch.no_grad():
        model(ids, cache=cache)
    options = {"stream_schedule": {"min_branch_us": 30.0}} if inductor else None
    runs = {}
    for name, disable in (("scheduled", ()), ("unscheduled", ("stream_schedule",))):
        manager = PassManager(build_passes(list(PASSES), options), backend=resolve_backend("auto"), disable=disable)
        runs[name] = _capture(model, manager, ids, cache, inductor=inductor)
    runner = runs["scheduled"]["returned"]
    assert isinstance(runner, StreamRunner)
    assert not isinstance(runs["unscheduled"]["returned"], StreamRunner)
    results = {name: _plain_and_graphed(got, cache) for name, got in runs.items()}
    runner.overlap = False
    results["regions, one stream"] = _plain_and_graphed(runs["scheduled"], cache)
    (a, ga, ca), (b, gb, cb) = results["scheduled"], results["unscheduled" if not inductor else "regions, one stream"]
    assert torch.equal(a, b) and torch.equal(ga, gb) and torch.equal(a, ga)
    for x, y in zip(ca, cb, strict=True):
        for tx, ty in zip(x.tensors(), y.tensors(), strict=True):
            assert torch.equal(tx, ty)
    whole = results["unscheduled"][0]
    assert torch.equal(whole, results["unscheduled"][1])
    rows, whole_rows = a.flatten(0, -2).float(), whole.flatten(0, -2).float()
    rel = ((rows - whole_rows).norm(dim=-1) / whole_rows.norm(dim=-1)).mean()
    assert rel <= 1e-2, f"mean row error {rel:.2e} against the whole graph compiled as one"


def _plain_and_graphed(got: dict[str, Any], cache: Any) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, Any]]:
    """Logits of a plain call and of a CUDA-graph replay (each on its own copy of the cache), and the caches."""
    caches = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.no_grad():
        plain = got["fn"](*got["call"], caches[0])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got["fn"](*got["call"], caches[1])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = got["fn"](*got["call"], caches[1])
        graph.replay()
        torch.cuda.synchronize()
    return plain, graphed, caches
