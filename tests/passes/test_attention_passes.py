"""``sparse_attention`` and ``head_padding`` on the tiny preset: what they match, why near-misses do not
match, and that padding heads leaves the logits unchanged."""

from __future__ import annotations

import pytest
import torch

import v4compile
from v4compile.codegen.registry import REGISTRY
from v4compile.debugging import explain, run_entries, sample_ids
from v4compile.model import attention as attention_module
from v4compile.model.cache import PAGE_TOKENS, V4Cache
from v4compile.model.pages import EntryPages


def _stats(optimized: v4compile.OptimizedModel, name: str):
    return [p for report in optimized.reports() for p in report.passes if p.name == name]


@pytest.fixture(scope="module")
def decode_pair(tiny_model: v4compile.DeepSeekV4) -> dict[str, object]:
    """Decode logits with the attention kernels, with and without heads padded to Hopper's 64-row tile (whole
    graphs: every layer's matches listed)."""
    ids = sample_ids(tiny_model)
    out = {}
    for padded in (False, True):
        optimized = v4compile.optimize(tiny_model, backend="triton", passes=["sparse_attention", "head_padding"],
                                       options={"head_padding": {"target": "sm90", "tp": 2}}, inductor=False,
                                       regions=False,
                                       disable=() if padded else ("head_padding",))
        out[padded] = (optimized, run_entries(optimized, ids, ("decode",))["decode"])
    return out


def test_every_attention_and_indexer_scoring_is_rewritten(decode_pair: dict) -> None:
    optimized, _ = decode_pair[False]
    [stats] = _stats(optimized, "sparse_attention")
    forms = sorted((m.location.module, m.details["form"]) for m in stats.matches)
    # four layers attend; the two C4 layers (1 and 3) also score with the indexer
    assert forms == sorted([("layers.0", "attention"), ("layers.1", "attention"), ("layers.2", "attention"),
                            ("layers.3", "attention"), ("layers.1", "indexer scores"), ("layers.3", "indexer scores")])
    assert all(m.kernel.endswith(".triton") for m in stats.matches)
    assert not any(m.details.get("fused_with_topk") for m in stats.matches)


def test_padded_heads_leave_decode_logits_unchanged(decode_pair: dict, tiny_model: v4compile.DeepSeekV4) -> None:
    padded, got = decode_pair[True]
    _, want = decode_pair[False]
    [stats] = _stats(padded, "head_padding")
    assert len(stats.matches) == 4
    assert all(m.details["heads"] == 4 and m.details["padded_heads"] == 64 and m.details["from"] == "sm90"
               for m in stats.matches)
    # each padded call is reported by the name of the kernel it runs, which the registry (and the CLI) know
    assert {m.kernel for m in stats.matches} == {"sparse_attention.d128.bf16dot.triton"}
    launches = REGISTRY.records["sparse_attention.d128.bf16dot.triton"].launches
    run_entries(padded, sample_ids(tiny_model), ("decode",))
    assert REGISTRY.records["sparse_attention.d128.bf16dot.triton"].launches >= launches + 4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_heads_already_a_multiple_are_a_near_miss(tiny_model: v4compile.DeepSeekV4) -> None:
    optimized = v4compile.optimize(tiny_model, regions=False, backend="reference",
                                   passes=["sparse_attention", "head_padding"],
                                   options={"head_padding": {"multiple": 2}}, inductor=False)
    run_entries(optimized, sample_ids(tiny_model), ("forward",))
    [stats] = _stats(optimized, "head_padding")
    assert stats.matches == [] and len(stats.near_misses) == 4
    assert all(m.reason == "4 heads are already a multiple of 2 (option)" for m in stats.near_misses)


def _masked_scores(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered entries and their masked scores, spelled as the model spells them."""
    bsz, seqlen, k = index.shape
    gather = index.clamp(min=0).reshape(bsz, seqlen * k, 1).expand(-1, -1, kv.shape[-1])
    keys = torch.gather(kv, 1, gather).view(bsz, seqlen, k, -1).float()
    scores = torch.einsum("bshd,bskd->bshk", q.float(), keys) * scale
    return keys, scores.masked_fill(~(index >= 0).unsqueeze(2), float("-inf"))


def test_attention_without_a_sink_is_a_near_miss(monkeypatch: pytest.MonkeyPatch,
                                                 tiny_model: v4compile.DeepSeekV4) -> None:
    def no_sink(q, kv, sink, index, scale):
        """The model's attention with the sink left out of the softmax."""
        keys, scores = _masked_scores(q, kv, index, scale)
        return torch.einsum("bshk,bskd->bshd", scores.softmax(dim=-1), keys).to(q.dtype)

    monkeypatch.setattr(attention_module, "sparse_attention", no_sink)
    optimized = explain(tiny_model, backend="reference", entries=("forward",), passes=["sparse_attention"])
    [stats] = _stats(optimized, "sparse_attention")
    assert {m.details["form"] for m in stats.matches} == {"indexer scores"}
    reasons = [m.reason for m in stats.near_misses if "attention.py" in m.location.source or m.reason]
    assert len(reasons) == 4
    assert all("neither exp(scores - max)" in r and "prefix of a softmax" in r for r in reasons), reasons


def test_the_concatenated_sink_softmax_is_matched_too(monkeypatch: pytest.MonkeyPatch,
                                                      tiny_model: v4compile.DeepSeekV4) -> None:
    """Another spelling of the same math: the sink as an extra softmax column, cut off before the values."""
    def concatenated(q, kv, sink, index, scale):
        keys, scores = _masked_scores(q, kv, index, scale)
        column = sink.float().view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., : index.shape[-1]]
        return torch.einsum("bshk,bskd->bshd", probs, keys).to(q.dtype)

    monkeypatch.setattr(attention_module, "sparse_attention", concatenated)
    optimized = explain(tiny_model, backend="reference", entries=("forward",), passes=["sparse_attention"])
    [stats] = _stats(optimized, "sparse_attention")
    assert sorted(m.details["form"] for m in stats.matches).count("attention") == 4, stats.near_misses


def test_indexer_keys_on_pages_are_scored_in_place(tiny_model: v4compile.DeepSeekV4) -> None:
    """A decode over a cache on shared pages (the engine's layout, pages scattered): attention and the indexer
    scoring become the paged kernels (head padding leaves them be, saying why), and the logits are bit for bit
    those of the same kernels over a cache owning its rows."""
    config = tiny_model.config
    ids = sample_ids(tiny_model)
    batch, per_row = ids.shape[0], -(-config.max_seq_len // PAGE_TOKENS)

    def cache(paged: bool) -> V4Cache:
        if paged:
            filled = V4Cache(config, batch, config.max_seq_len, "cpu", EntryPages(config, batch * per_row + 1, "cpu"))
            assert filled.table is not None
            order = torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(0))
            filled.table.copy_(order.view(batch, -1) + 1)
        else:
            filled = tiny_model.new_cache(batch)
        with torch.no_grad():
            tiny_model(ids[:, :-1], cache=filled)
        return filled

    positions = torch.full((batch,), ids.shape[1] - 1)
    optimized = v4compile.optimize(tiny_model, backend="triton", passes=["sparse_attention", "head_padding"],
                                   options={"head_padding": {"target": "sm90"}}, inductor=False, regions=False)
    with torch.no_grad():
        got = optimized.decode_step(ids[:, -1:], positions, cache(True))
        [padding] = _stats(optimized, "head_padding")
        # the window-only layer's call is padded; the paged calls are near-misses that say why
        assert [m.location.module for m in padding.matches] == ["layers.0"]
        assert sorted(m.location.module for m in padding.near_misses) == ["layers.1", "layers.2", "layers.3"]
        assert all("masks its head block" in m.reason for m in padding.near_misses)
        [stats] = _stats(optimized, "sparse_attention")
        scoring = [m for m in stats.matches if m.details["form"] == "indexer scores"]
        assert len(scoring) == 2 and all(m.details["paged"] and m.kernel.startswith("indexer_scores_paged.")
                                         for m in scoring)
        attending = {m.location.module: m for m in stats.matches if m.details["form"] == "attention"}
        # the C4 and C128 layers read their entries on pages; the window-only layer has none
        assert sorted(k for k, m in attending.items() if m.details["paged"]) == ["layers.1", "layers.2", "layers.3"]
        assert attending["layers.1"].kernel.startswith("sparse_attention_paged.")
        want = optimized.decode_step(ids[:, -1:], positions, cache(False))
    assert torch.equal(got, want)
