"""Regional compilation: one compiled graph per kind of block whatever the depth, every entry point runs the
compiled regions with the model's results, the reports name the layers each region serves, and the model itself
stays eager."""

from __future__ import annotations

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
    for entry in ("hidden_states", "logits", "extend", "decode_step", "decode_tokens", "mtp_step", "mtp_logits"):
        assert any(g.startswith(f"{entry}.") for g in graphs), (entry, graphs)
    assert "mtp_step.mtp.0" in graphs and "decode_step.layers.1,3" in graphs


def test_the_engine_serves_the_optimized_model_token_for_token(tiny_model: v4compile.DeepSeekV4) -> None:
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    want = Engine(tiny_model, max_batch=2, decode_buckets=(2,)).generate(prompts, max_new_tokens=4)
    optimized = v4compile.optimize(tiny_model, backend="reference", inductor=False)
    got = Engine(optimized, max_batch=2, decode_buckets=(2,)).generate(prompts, max_new_tokens=4)
    assert got == want
    graphs = _graphs(optimized)
    assert any(g.startswith("extend_hidden.layers.") for g in graphs), graphs
    assert any(g.startswith("decode_step.layers.") for g in graphs), graphs


def test_kinds_follow_shapes_and_settings_and_names_stay_short(tiny_model: v4compile.DeepSeekV4) -> None:
    layers = tiny_model.layers
    assert kind_of(layers[1]) == kind_of(layers[3])
    assert len({kind_of(b) for b in layers}) == 3
    assert span([1, 3]) == "1,3" and span([2, 4, 6, 8, 10]) == "2,4,...,10" and span([0, 1, 5, 9]) == "0,1,5,9"
    with pytest.raises(ValueError, match="no repeated blocks in `layers`"):
        Regions(torch.nn.Linear(2, 2), torch.compile)
