"""``mhc_tiling`` on the tiny model (every hc_pre / hc_post in forward, prefill and decode, Triton kernels in the
loop) and on small traced functions: matches, rewiring, and the reasons of near-misses."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import v4compile
from v4compile.debugging import run_entries, sample_ids
from v4compile.model.mhc import hc_head, hc_mixes, hc_post, hc_pre, sinkhorn
from v4compile.passes.manager import PassManager, PassStats
from v4compile.passes.mhc_tiling import MhcTiling

EPS = 1e-6


@pytest.fixture(scope="module")
def optimized_run(tiny_model: v4compile.DeepSeekV4) -> tuple[v4compile.OptimizedModel, dict, dict]:
    """The tiny model with only mhc_tiling on Triton kernels, every region checked against the model code while
    it runs; its logits and the eager model's on the same tokens."""
    optimized = v4compile.optimize(tiny_model, backend="triton", passes=["mhc_tiling"], inductor=False, check=True,
                                   regions=False)
    ids = sample_ids(tiny_model)
    got = run_entries(optimized, ids, decode_steps=8)
    with torch.no_grad():
        cache = tiny_model.new_cache(ids.shape[0])
        want = {"forward": tiny_model(ids), "prefill": tiny_model(ids, cache=cache)}
        tokens = torch.cat((got["prefill"][:, -1:].argmax(-1), got["decode"][:, :-1].argmax(-1)), dim=1)
        steps = [tiny_model.decode_step(tokens[:, i : i + 1], torch.full((ids.shape[0],), ids.shape[1] + i), cache)
                 for i in range(tokens.shape[1])]
        want["decode"] = torch.cat(steps, dim=1)
    return optimized, got, want


def _stats(report) -> PassStats:
    return next(p for p in report.passes if p.name == "mhc_tiling")


def test_every_hc_pre_and_hc_post_is_rewritten_in_forward_prefill_and_decode(optimized_run) -> None:
    optimized = optimized_run[0]
    reports = optimized.reports()
    assert len(reports) == 3
    for report in reports:
        stats = _stats(report)
        steps = sorted((m.location.module, m.details["step"]) for m in stats.matches)
        assert steps == sorted((f"layers.{i}", step) for i in range(4) for step in ("pre", "pre", "post", "post"))
        assert all(m.details["iters"] == 20 and m.details["streams"] == 4 for m in stats.matches
                   if m.details["step"] == "pre")
        assert {m.kernel for m in stats.matches} == {"mhc_pre.n4.d128.triton", "mhc_post.n4.d128.triton"}
        # the output head's collapse has no Sinkhorn: the one near-miss, named as such
        assert [m.reason for m in stats.near_misses] == [
            "projects onto 4 mixes = n: the output head's collapse (hc_head: pre weights only, no post/comb, "
            "no Sinkhorn)"]
        for match in stats.matches:
            assert match.checked_calls >= 1 and match.worst_rel_error <= MhcTiling.tolerance, match


def test_logits_with_the_kernels_stay_on_the_model(optimized_run) -> None:
    """The same bar as the golden check's optimized-vs-eager: a one-step bf16 difference in a stream may flip a
    routing choice of the random tiny model in a few rows, so the median row and the argmax carry the claim.
    Decode runs eight steps on both rows (sixteen logit rows, so one flipped row moves neither the median nor the
    agreement much): rows from 0.963 to 1.0, median 0.99988, argmax agreement 0.875 on an AVX2 host, held to
    0.999 and to the golden band's agreement (0.80)."""
    _, got, want = optimized_run
    for entry, bar, agree in (("forward", 0.9999, 0.9), ("prefill", 0.9999, 0.9), ("decode", 0.999, 0.8)):
        a, b = got[entry].flatten(0, -2), want[entry].flatten(0, -2)
        assert F.cosine_similarity(a, b, dim=-1).median() > bar, entry
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= agree, entry


def _rewrite(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[PassStats, torch.fx.GraphModule]:
    """Traces ``fn`` to pre-dispatch ATen like the backend and runs the pass on it (reference op bodies)."""
    gm = make_fx(fn, pre_dispatch=True)(*inputs)
    _, report = PassManager([MhcTiling()], backend="reference").run(gm)
    return report.passes[0], gm


def _streams(n: int = 4, dim: int = 16, rows: int = 3) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(n + dim)
    mixes = (2 + n) * n
    return (torch.randn(rows, n, dim).bfloat16(), torch.randn(mixes, n * dim) * 0.1, torch.rand(3) + 0.5,
            torch.randn(mixes))


@pytest.mark.parametrize(("n", "iters"), [(4, 3), (2, 1)])
def test_a_pre_post_pair_is_rewired_exactly(n: int, iters: int) -> None:
    def layer(x, fn, scale, base):
        y, post, comb = hc_pre(x, fn, scale, base, iters, EPS, EPS)
        return y, post, comb, hc_post(y * 2, x, post, comb)

    inputs = _streams(n)
    stats, gm = _rewrite(layer, *inputs)
    assert [(m.details["step"], m.details.get("iters"), m.details["streams"]) for m in stats.matches] == [
        ("pre", iters, n), ("post", None, n)]
    targets = {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
    assert {"v4compile.mhc_pre.default", "v4compile.mhc_post.default"} <= targets
    assert not any("sigmoid" in t or "softmax" in t for t in targets)
    for got, want in zip(gm(*inputs), layer(*inputs), strict=True):
        assert torch.equal(got, want)


def _sinkhorn_rows_only(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = logits.softmax(dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
    return c


def _pre_with(normalize: Callable[..., torch.Tensor], pre_eps: float = EPS, leak: bool = False):
    """hc_pre with another Sinkhorn, another eps for pre, or vec(X) also returned."""

    def pre(x, fn, scale, base):
        n = x.shape[-2]
        m, flat = hc_mixes(x, fn, EPS)
        weights = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + pre_eps
        post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        end = (2 + n) * n
        comb = normalize((m[..., 2 * n : end] * scale[2] + base[2 * n : end]).unflatten(-1, (n, n)), 4, EPS)
        y = (weights.unsqueeze(-1) * flat.view(x.shape)).sum(dim=-2).to(x.dtype)
        return (y, post, comb, flat.mean()) if leak else (y, post, comb)

    return pre


@pytest.mark.parametrize(("variant", "reason"), [
    (_pre_with(_sinkhorn_rows_only), "Sinkhorn iteration 2 normalises rows but not columns"),
    (_pre_with(lambda c, iters, eps: torch.sigmoid(c)), "comb's logits have no row softmax (no Sinkhorn)"),
    (_pre_with(lambda c, iters, eps: c.softmax(-1) + eps), "Sinkhorn's first column normalisation (after the "
                                                          "softmax) is missing"),
    (_pre_with(sinkhorn, pre_eps=1e-3), "Sinkhorn's eps 1e-06 differs from pre's eps 0.001"),
    (_pre_with(sinkhorn, leak=True), "to inside hc_pre is also used outside it (by mean_1)"),
])
def test_a_modified_pre_step_is_a_near_miss_that_says_why(variant: Callable[..., object], reason: str) -> None:
    stats, _ = _rewrite(variant, *_streams())
    assert stats.matches == []
    assert [m.reason for m in stats.near_misses] == [reason]


def test_other_mix_counts_and_the_head_collapse_do_not_match() -> None:
    x, fn, scale, base = _streams()
    wider = torch.cat((fn, fn[:2])), torch.cat((base, base[:2]))
    stats, _ = _rewrite(_pre_with(sinkhorn), x, wider[0], scale, wider[1])
    assert [m.reason for m in stats.near_misses] == ["projects onto 26 mixes, not (2+n)n = 24 for n = 4 streams"]
    stats, _ = _rewrite(lambda x, fn, s, b: hc_head(x, fn[:4], s[:1], b[:4], EPS, EPS), x, fn, scale, base)
    assert "hc_head" in stats.near_misses[0].reason and not stats.matches


def test_a_post_step_mixing_with_comb_instead_of_its_transpose_is_a_near_miss() -> None:
    x, _, _, _ = _streams()
    y, post, comb = torch.randn(3, 16).bfloat16(), torch.rand(3, 4), torch.rand(3, 4, 4)

    def untransposed(y, x, post, comb):
        mixed = (comb.unsqueeze(-1) * x.unsqueeze(-2)).sum(dim=-2)
        return (post.unsqueeze(-1) * y.unsqueeze(-2) + mixed).to(y.dtype)

    stats, _ = _rewrite(untransposed, y, x, post, comb)
    assert [m.reason for m in stats.near_misses] == [
        "mixes the streams with comb (sum over k, dim -2), not comb^T (sum over j, dim -3)"]


@pytest.mark.skipif(not __import__("importlib").util.find_spec("tilelang"), reason="TileLang is not installed")
def test_tilelang_backend_runs_tilelang_kernels_inside_the_model(tiny_model: v4compile.DeepSeekV4) -> None:
    """backend="tilelang": the pass names the TileLang mHC kernels (the ``c`` target here), every checked region
    stays within the pass's tolerance and the logits stay on the eager model's (the bar of the Triton run above:
    a one-step bf16 difference may flip a routing choice of the random tiny model in a few rows)."""
    optimized = v4compile.optimize(tiny_model, backend="tilelang", passes=["mhc_tiling"], inductor=False, check=True)
    ids = sample_ids(tiny_model)
    with torch.no_grad():
        got, want = optimized(ids), tiny_model(ids)
    stats = _stats(optimized.reports()[0])
    assert {m.kernel for m in stats.matches} == {"mhc_pre.n4.d128.tilelang", "mhc_post.n4.d128.tilelang"}
    assert all(m.checked_calls >= 1 and m.worst_rel_error <= MhcTiling.tolerance for m in stats.matches)
    a, b = got.flatten(0, -2).float(), want.flatten(0, -2).float()
    assert F.cosine_similarity(a, b, dim=-1).median() > 0.9999
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
