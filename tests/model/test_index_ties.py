"""The indexer's tie rule (``V4Config.index_ties``), the official rounding order of the sink softmax and the RoPE
tables, and the divergence report that finds where two models part ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import v4compile
from v4compile.cli import main
from v4compile.debugging import sample_ids
from v4compile.divergence import divergence
from v4compile.golden import GoldenFolder
from v4compile.model.config import ConfigError
from v4compile.model.indexer import Indexer
from v4compile.model.rope import rope_cos_sin, rope_frequencies
from v4compile.model.sparse_attention import sparse_attention


def _indexer(ties: str) -> Indexer:
    return Indexer(v4compile.V4Config.preset("tiny", index_ties=ties, index_topk=5), ratio=4)


def _tied_scores(rows: int, entries: int, seed: int) -> torch.Tensor:
    """Scores drawn from a handful of values (ReLU zeros among them), so most rows hold ties."""
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([0.0, 0.0, 0.5, 1.0, -0.25])[torch.randint(0, 5, (2, rows, entries), generator=gen)]


@pytest.mark.parametrize("seed", range(4))
def test_official_ties_are_torch_topk_over_the_masked_row_and_lowest_keeps_the_lowest_ids(seed: int) -> None:
    scores = _tied_scores(9, 12, seed)
    visible = torch.arange(12) < (torch.arange(1, 10) * 4 // 3).unsqueeze(-1)
    masked = scores.masked_fill(~visible, float("-inf"))
    values, ids = masked.topk(5, dim=-1)
    assert torch.equal(_indexer("official").select(scores, visible), torch.where(values == float("-inf"), -1, ids))
    lowest = _indexer("lowest").select(scores, visible)
    for b, s in zip(*torch.where(torch.ones(2, 9, dtype=torch.bool)), strict=True):
        row, want = masked[b, s], []
        for j in sorted(range(12), key=lambda j: (-row[j].item(), j))[:5]:
            want.append(j if row[j] > float("-inf") else -1)
        assert lowest[b, s].tolist() == want


def test_official_decode_ranks_only_the_entries_that_exist_and_pads_with_minus_one() -> None:
    """The official decode's row is the entries existing at each row's position (no -inf tail), k = min(topk, n);
    rows at different positions get their own row length."""
    scores = _tied_scores(1, 16, 7)
    entries = torch.tensor([3, 11])
    visible = torch.arange(16).view(1, 1, -1) < entries.view(-1, 1, 1)
    got = _indexer("official").select(scores, visible, entries)
    assert got.shape == (2, 1, 5)
    assert got[0, 0, 3:].tolist() == [-1, -1] and torch.equal(got[0, 0, :3], scores[0, 0, :3].topk(3).indices)
    assert torch.equal(got[1, 0], scores[1, 0, :11].topk(5).indices)


def test_an_unknown_tie_rule_is_a_config_error_naming_it(golden_root: Path) -> None:
    with pytest.raises(ConfigError, match="index_ties must be one of"):
        v4compile.V4Config.preset("tiny", index_ties="random")
    with pytest.raises(ConfigError, match="index_ties"):
        v4compile.load(golden_root / "tiny-bf16", index_ties="highest")


def test_official_ties_decode_eagerly_and_refuse_an_optimized_decode(golden_root: Path) -> None:
    model = v4compile.load(golden_root / "tiny-bf16-c4first", index_ties="official").eval()
    ids = GoldenFolder.read(golden_root / "tiny-bf16-c4first").cases[1].ids
    cache = model.new_cache(ids.shape[0])
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        step = model.decode_step(ids[:, -1:], torch.full((ids.shape[0],), ids.shape[1] - 1), cache)
    assert step.isfinite().all()
    with pytest.raises(ValueError, match="index_ties='official' decodes eagerly only"):
        v4compile.optimize(model, backend="reference").decode_step(ids[:, -1:], torch.tensor([0, 0]), cache)


def test_sink_softmax_matches_the_concatenated_form_and_a_fully_masked_row_reads_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 4, 16, generator=gen, dtype=torch.float64), torch.randn(2, 9, 16, generator=gen,
                                                                                       dtype=torch.float64)
    sink = torch.randn(4, generator=gen, dtype=torch.float64) * 3
    index = torch.randint(-1, 9, (2, 3, 5), generator=gen)
    index[1, 2] = -1
    got = sparse_attention(q, kv, sink, index, 0.3)
    keys = kv[torch.arange(2).view(2, 1, 1), index.clamp(min=0)]
    scores = torch.einsum("bshd,bskd->bshk", q, keys) * 0.3
    scores = scores.masked_fill((index < 0).unsqueeze(2), float("-inf"))
    probs = torch.cat((scores, sink.view(1, 1, 4, 1).expand(2, 3, 4, 1)), -1).softmax(-1)[..., :5]
    torch.testing.assert_close(got, torch.einsum("bshk,bskd->bshd", probs, keys), rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1, 2], torch.zeros(4, 16, dtype=torch.float64))


def test_rope_tables_are_the_official_polar_table_at_any_position() -> None:
    """The official model builds one table for every position with ``torch.polar``; looking up any positions
    of it equals building them on the fly, bit for bit (``torch.cos`` would differ by an ulp in places)."""
    freqs = rope_frequencies(64, 160000.0, 96, 16.0, 32, 1)
    table = torch.polar(torch.ones(4096, 32), torch.outer(torch.arange(4096), freqs))
    positions = torch.tensor([[0, 5, 127], [4095, 1000, 96]])
    cos, sin = rope_cos_sin(freqs, positions)
    assert torch.equal(cos, table.real[positions]) and torch.equal(sin, table.imag[positions])
    assert not torch.equal(torch.cos(torch.outer(torch.arange(4096), freqs)), table.real)


def test_divergence_finds_the_first_indexer_choice_that_differs(golden_root: Path) -> None:
    folder = golden_root / "tiny-bf16-c4first"
    lowest, official = (v4compile.load(folder, index_ties=t).eval() for t in ("lowest", "official"))
    ids = GoldenFolder.read(folder).cases[1].ids
    report = divergence(lowest, official, lambda m: m(ids))
    first = report.first_divergence
    assert first is not None and first.name == "layers.0.attn.indexer.forward_full" and first.kind == "choices"
    assert 0 < first.rows_differ <= first.order_differs < 1
    before = report.components[: report.components.index(first)]
    assert before and all(c.equal for c in before)
    assert any(c.name.startswith("layers.0.attn.indexer.compressor") for c in before)
    assert divergence(lowest, lowest, lambda m: m(ids)).first_divergence is None


def test_divergence_names_the_first_component_a_changed_weight_moves() -> None:
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0).eval()
    changed = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0).eval()
    with torch.no_grad():
        changed.layers[2].ffn.shared_experts.w3.weight.mul_(1.01)
    report = divergence(model, changed, lambda m: m(sample_ids(model)))
    assert report.first_divergence.name == "layers.2.ffn.shared_experts.w3.forward"
    assert report.first_choice_divergence is None or report.first_choice_divergence.name.startswith(
        ("layers.2.", "layers.3."))


def test_cli_diverge_prints_the_first_divergence(golden_root: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["diverge", str(golden_root / "tiny-fp8-deep"), "--case", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("first divergence: layers.1.attn.indexer.forward_full")
    assert main(["diverge", str(golden_root / "tiny-fp8-deep"), "--case", "9"]) == 2


def test_radix_topk_keeps_the_official_rules_topk_and_says_why() -> None:
    """The select kernel's ties go to the lowest index, so with the official rule the indexer's torch.topk stays
    (even where its size would qualify; the router's top-k too, whose ties the official model also leaves to
    torch.topk), and the near-miss says so; the lowest rule's sort is rewritten."""
    found = {}
    for ties in ("official", "lowest"):
        model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny", index_ties=ties), seed=0).eval()
        optimized = v4compile.optimize(model, regions=False, backend="reference", passes=["radix_topk"], inductor=False,
                                       options={"radix_topk": {"min_candidates": 1}})
        with torch.no_grad():
            torch.testing.assert_close(optimized(sample_ids(model)), model(sample_ids(model)), rtol=0, atol=0)
        [stats] = [p for r in optimized.reports() for p in r.passes if p.name == "radix_topk"]
        found[ties] = stats
    reasons = [m.reason for m in found["official"].near_misses]
    assert found["official"].matches == [] and any("index_ties='official'" in r for r in reasons), reasons
    sorts = [m for m in found["lowest"].matches if m.details["source"] == "stable sort prefix"]
    assert sorted(m.location.module for m in sorts) == ["layers.1", "layers.3"]
