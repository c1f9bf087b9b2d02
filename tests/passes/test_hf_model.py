"""A second V4 as a fixture: transformers' ``DeepseekV4ForCausalLM`` (tiny, random, every layer kind) through
``v4compile.optimize``, against v4compile's own model loaded from the same folder, and hand-written spellings of
the hot spots that must match alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import v4compile
from v4compile.model.indexer import index_scores
from v4compile.model.mhc import hc_post, hc_pre
from v4compile.passes.manager import GraphReport, PassManager
from v4compile.passes.mhc_tiling import MhcTiling
from v4compile.passes.normalize import normalize
from v4compile.passes.sparse_attention import SparseAttention

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=128, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=16,
    index_n_heads=2, index_head_dim=64, index_topk=4, sliding_window=8, partial_rotary_factor=0.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1024, tie_word_embeddings=False,
)
"""Window-only, C4 (indexer) and C128 attention; hash-routed and score-routed MoE (tests/model/test_hf_checkpoint.py's
config)."""

SEQ = 160  # past one C128 block and 40 C4 entries: every layer kind attends to compressed entries

NOT_YET = {
    ("compressor_fusion", "compressor_pool"): "the softmax weights are cast to torch.bfloat16 before the weighted sum",
    ("radix_topk", "radix_topk"): "topk over the indexer's relu-weighted scores",
    ("sparse_attention", "sparse_attention"): "dense attention: a softmax over every position",
    ("moe_dispatch", "moe_experts"): "fused gate_up experts (one grouped matmul over [E, 2I, D] split by chunk",
}
"""Kernels our model gets and transformers' does not, with the near-miss that says why (compressor_finish follows
compressor_fusion)."""


def _randomize(model: torch.nn.Module, config: transformers.DeepseekV4Config) -> None:
    """transformers initialises sinks, biases and norms to constants and the hash table to zeros: random values
    make every tensor matter (hash rows are distinct experts, which both models count alike)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif name.endswith("tid2eid"):
                experts, k = config.n_routed_experts, config.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(config.vocab_size)]))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random transformers V4 saved in bf16 as transformers saves it (its fp32 modules kept fp32)."""
    root = tmp_path_factory.mktemp("hf")
    config = transformers.DeepseekV4Config(**CONFIG)
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config)
    _randomize(model, config)
    model.save_pretrained(root / "fp32", save_original_format=False)
    bf16 = transformers.DeepseekV4ForCausalLM.from_pretrained(root / "fp32", dtype=torch.bfloat16)
    bf16.save_pretrained(root / "bf16", save_original_format=False)
    return root / "bf16"


@pytest.fixture(scope="module")
def runs(folder: Path) -> dict[str, object]:
    """transformers' model eager and optimized (reference op bodies, no Inductor: the pass pipeline is the subject),
    once more with every rewritten region checked against the graph it replaced, and our model of the same folder
    optimized as one whole graph."""
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="no MTP tensors"):
        ours = v4compile.load(folder).eval()
    with torch.no_grad():
        eager = hf(ids).logits.float()
        optimized = v4compile.optimize(hf, backend="reference", inductor=False)
        got = optimized(ids).logits.float()
        checked = v4compile.optimize(hf, backend="reference", inductor=False, check=True)
        checked(ids)
        ours_optimized = v4compile.optimize(ours, backend="reference", inductor=False, regions=False)
        ours_optimized(ids)
    return {"eager": eager, "optimized": got, "hf": optimized.reports(), "checked": checked.reports(),
            "ours": ours_optimized.reports()}


def _kernels(reports: list[GraphReport]) -> Counter[tuple[str, str]]:
    """(pass, kernel family) -> rewrites, over every graph."""
    return Counter((m.pass_name, m.kernel.split(".")[0]) for r in reports for m in r.matches)


def _reasons(reports: list[GraphReport], name: str) -> list[str]:
    return [n.reason for r in reports for p in r.passes if p.name == name for n in p.near_misses]


def test_transformers_v4_gets_our_rewrites_per_kind_or_says_why_not(runs: dict[str, object]) -> None:
    """mHC pre/post (16) and the indexer's scoring (2) match as on our model; the kernels that do not yet (NOT_YET)
    are near-misses naming transformers' spelling, and nothing else differs."""
    hf, ours = _kernels(runs["hf"]), _kernels(runs["ours"])
    assert hf[("mhc_tiling", "mhc_pre")] == ours[("mhc_tiling", "mhc_pre")] == 8
    assert hf[("mhc_tiling", "mhc_post")] == ours[("mhc_tiling", "mhc_post")] == 8
    assert hf[("sparse_attention", "indexer_scores")] == ours[("sparse_attention", "indexer_scores")] == 2
    missing = {kind for kind in ours if hf[kind] != ours[kind]}
    assert missing == set(NOT_YET) | {("compressor_finish", "compressor_entries")}
    for (name, _), reason in NOT_YET.items():
        assert any(r.startswith(reason) for r in _reasons(runs["hf"], name)), name
    normalized = runs["hf"][0].normalized
    # each of the 8 mHC pre steps splits its mixes and base in three and unbinds its scale; 4 attention dropouts
    assert normalized["split -> slice"] == 48 and normalized["unbind -> select"] == 24
    assert normalized["inactive dropout removed"] == 4 and normalized["no-op cast removed"] > 0


def test_each_rewritten_region_stays_within_its_pass_tolerance(runs: dict[str, object]) -> None:
    """Checked while running: mHC pre ~3e-7 (the RMS scale applied after the projection), post up to one bf16 step
    (transformers mixes in bf16, the op sums in fp32: measured 0.5-0.85%), the indexer's scoring ~1e-7."""
    matches = [m for r in runs["checked"] for m in r.matches]
    assert {m.pass_name for m in matches} == {"mhc_tiling", "sparse_attention"}
    tolerance = {p.name: p.tolerance for p in runs["checked"][0].passes}
    for m in matches:
        assert m.checked_calls >= 1 and m.worst_rel_error <= tolerance[m.pass_name], m
        if m.details.get("step") == "pre" or m.details.get("form") == "indexer scores":
            assert m.worst_rel_error < 1e-5, m


def test_logits_stay_on_transformers_eager(runs: dict[str, object]) -> None:
    """A one-step bf16 difference in a stream can flip a near-tied indexer or router choice of the random tiny model
    at a few positions (as on our own model, tests/passes/test_mhc_tiling.py), so the median row and the argmax carry
    the claim: measured cosine median 0.99987, top token equal at 93% of positions."""
    got, want = runs["optimized"][0], runs["eager"][0]
    assert F.cosine_similarity(got, want, dim=-1).median() > 0.9995
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


# ------------------------------------------------------------------------------------- hand-written spellings
EPS = 1e-6


def _rewrite(fn: Callable[..., object], passes: list,
             *inputs: torch.Tensor) -> tuple[GraphReport, torch.fx.GraphModule]:
    """``fn`` traced to pre-dispatch ATen as the backend does, run through ``passes`` (reference bodies)."""
    gm = make_fx(fn, pre_dispatch=True)(*inputs)
    _, report = PassManager(passes, backend="reference").run(gm)
    return report, gm


def _streams(n: int = 4, dim: int = 16, rows: int = 3) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    mixes = (2 + n) * n
    return (torch.randn(1, rows, n, dim).bfloat16(), torch.randn(mixes, n * dim) * 0.1, torch.rand(3) + 0.5,
            torch.randn(mixes))


def _pre_normed_first(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor):
    """hc_pre as transformers writes it: RMS-normalise vec(X) (a view), project, split, unbind, comb viewed n x n
    before its scale and base, pre weighting X itself."""
    b, s, n, _ = x.shape
    flat = x.view(b, s, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)
    mixes = F.linear(flat, fn)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + EPS
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(b, s, n, n) * comb_s + comb_b.view(n, n), dim=-1) + EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(2):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype), post, comb


def test_the_pre_step_matches_in_either_spelling() -> None:
    inputs = _streams()
    ours = lambda x, fn, scale, base: hc_pre(x, fn, scale, base, 3, EPS, EPS)  # noqa: E731
    for fn in (ours, _pre_normed_first):
        report, gm = _rewrite(fn, [MhcTiling()], *inputs)
        assert [(m.details["step"], m.details["iters"]) for m in report.matches] == [("pre", 3)], fn
        got, want = gm(*inputs), fn(*inputs)
        torch.testing.assert_close(got[1:], want[1:], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[0], want[0], rtol=2**-7, atol=0)


@pytest.mark.parametrize("spelling", ["summed", "matmul"])
def test_the_post_step_matches_in_either_spelling(spelling: str) -> None:
    x = _streams()[0]
    y, post, comb = torch.randn(1, 3, 16).bfloat16(), torch.rand(1, 3, 4), torch.rand(1, 3, 4, 4)

    def post_step(y, x, post, comb):
        if spelling == "summed":
            return hc_post(y, x, post, comb)
        dt = x.dtype
        return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)

    report, gm = _rewrite(post_step, [MhcTiling()], y, x, post, comb)
    assert [m.details["step"] for m in report.matches] == ["post"]
    got, want = gm(y, x, post, comb).float(), post_step(y, x, post, comb).float()
    # the matmul spelling rounds post * y, the mixing and their sum to bf16 apart; the op once: a value may land a
    # bf16 step of its own away, within the pass's tolerance (relative to the largest value, as check mode measures)
    assert (got - want).abs().max() / want.abs().max() <= MhcTiling.tolerance


@pytest.mark.parametrize("spelling", ["einsum", "matmul"])
def test_the_indexer_scoring_matches_as_einsum_or_matmul(spelling: str) -> None:
    torch.manual_seed(0)
    q, keys, w = torch.randn(1, 5, 2, 64), torch.randn(1, 7, 64).bfloat16(), torch.randn(1, 5, 2)

    def scores(q, keys, w):
        if spelling == "einsum":
            return index_scores(q, keys, w * 0.125)
        dots = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
        return (F.relu(dots) * 0.125 * w.unsqueeze(-1)).sum(dim=2)

    report, gm = _rewrite(scores, [SparseAttention()], q, keys, w)
    assert [m.details["form"] for m in report.matches] == ["indexer scores"]
    torch.testing.assert_close(gm(q, keys, w), scores(q, keys, w), rtol=1e-5, atol=1e-5)


def test_normalisation_is_exact() -> None:
    """split / unbind / no-op casts rewritten, the values bitwise the same."""

    def fn(m, scale):
        a, b, c = m.split([2, 2, 4], dim=-1)
        s0, s1, s2 = scale.unbind(0)
        return a.float() * s0 + b * s1, c.to(torch.float32) * s2

    m, scale = torch.randn(3, 8), torch.randn(3)
    gm = make_fx(fn, pre_dispatch=True)(m, scale)
    counts = normalize(gm)
    assert counts == {"split -> slice": 3, "unbind -> select": 3, "no-op cast removed": 2}
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not any("split" in t or "unbind" in t for t in targets)
    for got, want in zip(gm(m, scale), fn(m, scale), strict=True):
        assert torch.equal(got, want)
