"""The engine against plain generation: prefix caching (hits, evictions, tombstones) never changes a
greedy token, restored caches equal recomputation bit for bit, and bad requests fail alone."""

from __future__ import annotations

import copy

import pytest
import torch

from v4compile import DeepSeekV4, V4Config
from v4compile.model.cache import V4Cache
from v4compile.model.pages import EntryPages, page_bytes
from v4compile.runtime.cache_manager import plan_memory, row_bytes
from v4compile.runtime.engine import Engine
from v4compile.runtime.hisparse import min_hot_entries, slot_bytes
from v4compile.runtime.pools import PagePool
from v4compile.runtime.prefix_pools import tail_bytes
from v4compile.runtime.prefix_store import PrefixStore


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4(V4Config.preset("tiny", max_seq_len=1024), seed=3).eval()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _conversation(engine: Engine, turns: int, new_tokens: int = 4) -> list[list[int]]:
    """A shared system prompt, three users each growing a conversation turn by turn (prompt = history +
    output + new text), and a branch that edits the second user's history."""
    system = _ids(260, 0)
    histories = [system + _ids(20 + 30 * u, 10 + u) for u in range(3)]
    outputs = []
    for turn in range(turns):
        results = engine.generate(histories, new_tokens)
        outputs.extend(r.tokens for r in results)
        pairs = enumerate(zip(histories, results, strict=True))
        histories = [h + r.tokens + _ids(60, 100 * turn + u) for u, (h, r) in pairs]
    branch = histories[1][:300] + _ids(50, 999)
    outputs.extend(r.tokens for r in engine.generate([branch, histories[0]], new_tokens))
    return outputs


def test_greedy_with_prefix_cache_and_evictions_equals_without(model: DeepSeekV4) -> None:
    plain = _conversation(Engine(model, prefix_cache=False, max_batch=3, decode_buckets=(3,)), turns=2)
    roomy = Engine(model, max_batch=3, decode_buckets=(3,))
    assert _conversation(roomy, turns=2) == plain
    assert roomy.stats()["tree"]["cached_tokens"] >= 384
    row, tail = row_bytes(model.config, 1024), tail_bytes(model.config)
    # the rows, then 11 tails' bytes: one tail, the rest 11 pages (1408 tokens, under three prompts' 12 pages)
    tight = Engine(model, max_batch=3, decode_buckets=(3,), memory_budget=4 * row + 11 * tail)
    assert tight.store is not None and tight.store.pools["state"].capacity == 1  # one tail: evictions
    assert tight.store.pools["pages"].capacity == 11  # too few for three prompts at once: admission waits
    assert _conversation(tight, turns=2) == plain
    tight.store.tree.check()
    stats = tight.stats()["tree"]
    assert stats["tombstones"] > 0


def test_multi_turn_hits_and_recompute_after_window_eviction(model: DeepSeekV4) -> None:
    engine = Engine(model, max_batch=2, decode_buckets=(2,))
    first = _ids(300, 7)
    out1 = engine.generate([first], 4)[0]
    second = first + out1.tokens + _ids(140, 8)
    out2 = engine.generate([second], 4)[0]
    assert out2.cache.cached_tokens == 256 and out2.cache.prefill_tokens == len(second) - 256
    assert engine.store is not None
    engine.store.tree.evict("window", 10**6)  # every tail becomes a tombstone
    out3 = engine.generate([second + _ids(10, 9)], 4)[0]
    assert out3.cache.cached_tokens == 0 and out3.cache.recomputed_tokens == 384
    out4 = engine.generate([second + _ids(10, 9)], 4)[0]  # the insert revived the tombstone
    assert out4.cache.cached_tokens == 384 and out4.tokens == out3.tokens


def test_restored_cache_equals_recomputation_bit_for_bit(model: DeepSeekV4) -> None:
    config = model.config
    entry_pages, pages = EntryPages(config, 64, "cpu"), PagePool("pages", 64)
    store = PrefixStore(config, 128, pages, tails=4, device=torch.device("cpu"))
    tokens = _ids(384, 5)

    def on_pages(row_pages: list[int]) -> V4Cache:
        cache = V4Cache(config, 1, 1024, "cpu", entry_pages)
        assert cache.table is not None
        cache.table[0, : len(row_pages)] = torch.tensor(row_pages)
        return cache

    held: list[int] = []

    def computed(length: int) -> tuple[V4Cache, list[int]]:
        row_pages = pages.alloc(8)
        held.extend(row_pages)
        cache = on_pages(row_pages)
        with torch.no_grad():
            for start in range(0, length, 128):
                model.extend(torch.tensor([tokens[start : start + 128]]), start, cache)
        return cache, row_pages

    saved = {length: computed(length) for length in (256, 384)}
    for length, (cache, row_pages) in saved.items():
        store.save(tokens[:length], cache, row_pages)
    for length in (256, 384):
        restored = V4Cache(config, 1, 1024, "cpu", entry_pages)
        hit = store.restore(tokens[:length] + [1], restored)
        assert hit.resume_len == length
        # the entries are not copied: the hit maps the pages the first computation of each span wrote
        assert hit.pages == saved[256][1][:2] + saved[384][1][2:3][: length // 128 - 2]
        held += hit.pages
        assert restored.table is not None
        restored.table[0, : len(hit.pages)] = torch.tensor(hit.pages)
        want, _ = computed(length)
        for got_layer, want_layer in zip(restored.layers, want.layers, strict=True):
            assert torch.equal(got_layer.window, want_layer.window)
            for a, b in ((got_layer.compressor, want_layer.compressor), (got_layer.indexer, want_layer.indexer)):
                if a is None:
                    continue
                n = length // (4 if a.kv_state.shape[1] == 8 else 128)
                assert torch.equal(a.read()[:, :n], b.read()[:, :n])
                # everything the next token reads: the open block (empty at a boundary) and, for C4, the
                # left half of the previous block's rows
                w, ratio = a.kv_state.shape[-1] // 2, 4 if a.kv_state.shape[1] == 8 else 0
                for got, want_state in ((a.kv_state, b.kv_state), (a.score_state, b.score_state)):
                    assert torch.equal(got[:, ratio:], want_state[:, ratio:])
                    assert torch.equal(got[:, :ratio, :w], want_state[:, :ratio, :w])
    store.tree.check({"pages": held})  # each page's references: the tree's, and one per row holding it


def test_sampling_with_a_seed_does_not_depend_on_the_batch(model: DeepSeekV4) -> None:
    engine = Engine(model, max_batch=3, decode_buckets=(3,))
    prompts = [_ids(40, 1), _ids(90, 2), _ids(20, 3)]
    together = engine.generate(prompts, 6, temperature=0.8, top_p=0.9, seed=11)
    alone = engine.generate(prompts[:2], 6, temperature=0.8, top_p=0.9, seed=11)
    assert [r.tokens for r in together[:2]] == [r.tokens for r in alone]
    assert together[0].tokens != engine.generate(prompts[:1], 6, temperature=0.8, seed=12)[0].tokens
    assert all(len(r.logprobs) == 6 and all(lp <= 0 for lp in r.logprobs) for r in together)


def test_bad_requests_fail_alone_with_a_clear_error(model: DeepSeekV4) -> None:
    engine = Engine(model, max_batch=2)
    good = _ids(30, 4)
    results = engine.generate([[], good, [1, 2, 512], _ids(1020, 5), good], [4, 4, 4, 8, 0])
    assert results[0].error == "empty prompt"
    assert "token id 512 at prompt position 2" in (results[2].error or "")
    assert "exceeds max_seq_len 1024" in (results[3].error or "")
    assert "max_new_tokens must be at least 1" in (results[4].error or "")
    assert results[1].error is None and len(results[1].tokens) == 4
    with pytest.raises(ValueError, match="memory_budget"):
        Engine(model, memory_budget=1000)


def test_mtp_speculation_accepts_right_drafts_and_changes_no_token(model: DeepSeekV4) -> None:
    """With drafts that are always wrong, speculation emits exactly the verifier's own greedy tokens; with
    drafts taken from that run (always right) it emits the same tokens, two per step. So acceptance,
    rollback and positions are exact; the MTP block's own drafts then only change the speed."""
    prompts = [_ids(40, 1), _ids(150, 2), _ids(300, 3)]

    class Drafts(Engine):
        def __init__(self, reference: list[list[int]] | None) -> None:
            super().__init__(model, max_batch=3, decode_buckets=(3,))
            self.reference = reference

        def _pick_draft(self, req, mtp_logits):  # type: ignore[no-untyped-def]
            n = len(req.out.tokens)
            if self.reference is None:
                return (req.token + 1) % 512  # never what the verifier picks unless by chance
            return self.reference[req.index][n] if n < len(self.reference[req.index]) else 0

    rejected = Drafts(None).generate(prompts, 10, mtp=True)
    oracle = Drafts([r.tokens for r in rejected]).generate(prompts, 10, mtp=True)
    assert [r.tokens for r in oracle] == [r.tokens for r in rejected]
    assert all(r.mtp_accepted >= 4 and r.mtp_drafted <= 5 for r in oracle)
    mtp = Engine(model, max_batch=3, decode_buckets=(3,)).generate(prompts, 10, mtp=True)
    assert all(len(r.tokens) == 10 and r.mtp_drafted >= 5 for r in mtp)
    with pytest.raises(ValueError, match="greedy only"):
        Engine(model).generate(prompts, 4, temperature=0.5, mtp=True)


@pytest.mark.gpu
@pytest.mark.parametrize("hisparse", [False, True], ids=["resident", "hisparse"])
def test_cuda_graph_decode_equals_launched_decode(model: DeepSeekV4, hisparse: bool) -> None:
    """Replayed decode buckets (several sizes, rows finishing and moving, prefix hits) give the same tokens and
    log-probs as launching every step; recording routing falls back to launched steps."""
    gpu = copy.deepcopy(model).cuda()
    options = {"max_batch": 3, "decode_buckets": (1, 2, 3)}
    if hisparse:
        options["hisparse_budget"] = min_hot_entries(3, gpu.config.index_topk) * slot_bytes(gpu.config)

    def run(engine: Engine) -> tuple[list[list[int]], list[list[float]]]:
        first = engine.generate([_ids(140, 4), _ids(200, 5), _ids(75, 6)], [3, 7, 5])
        again = engine.generate([_ids(140, 4) + first[0].tokens + _ids(20, 7), _ids(90, 8)], 6)
        together = engine.generate([_ids(20, 10), _ids(30, 11), _ids(25, 12)], 4)
        done = first + again + together
        return [r.tokens for r in done], [r.logprobs for r in done]

    launched = run(Engine(gpu, cuda_graphs=False, **options))
    graphed = Engine(gpu, **options)
    assert run(graphed) == launched
    assert graphed.runner.graphs is not None and sorted(graphed.runner.graphs.graphs) == [1, 2, 3]
    recorded = graphed.generate([_ids(50, 9)], 3, record_routing=True)[0]
    plain = Engine(gpu, **options).generate([_ids(50, 9)], 3)[0]
    assert recorded.routing is not None and recorded.tokens == plain.tokens


def test_cuda_graphs_need_a_cuda_model(model: DeepSeekV4) -> None:
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device; it is on cpu"):
        Engine(model, cuda_graphs=True)


def test_prefix_tails_caps_the_window_tails_and_frees_their_bytes_for_pages(model: DeepSeekV4) -> None:
    roomy, capped = Engine(model, max_batch=3), Engine(model, max_batch=3, prefix_tails=2)
    assert roomy.store is not None and capped.store is not None
    assert roomy.store.pools["state"].capacity > 2 == capped.store.pools["state"].capacity
    assert capped.caches.pages.capacity > roomy.caches.pages.capacity
    with pytest.raises(ValueError, match="at least one window tail"):
        Engine(model, prefix_tails=0)


def test_short_pages_keep_the_prefixes_running_requests_hold(model: DeepSeekV4) -> None:
    """A request that does not fit waits without evicting a cached prefix whose pages a running request holds
    (that would free nothing), and hits it once admitted."""
    config = model.config
    budget = 3 * row_bytes(config, 1024) + 8 * page_bytes(config) + tail_bytes(config)
    engine = Engine(model, max_batch=2, memory_budget=budget)
    assert engine.caches.pages.capacity == 8
    system = _ids(256, 0)
    engine.generate([system + _ids(10, 1)], 1)
    first = engine.submit(system + _ids(10, 2), 400)
    engine.step()
    second = engine.submit(system + _ids(10, 3), 300)
    engine.step()
    assert engine.stats()["tree"]["cached_tokens"] == 256 and len(engine.scheduler.waiting) == 1
    while engine.busy:
        engine.step()
    assert first.cache.cached_tokens == second.cache.cached_tokens == 256


def test_every_budget_holds_one_full_length_sequence(model: DeepSeekV4) -> None:
    config = model.config
    minimal = 2 * row_bytes(config, 1024) + 8 * page_bytes(config) + tail_bytes(config)
    for extra in range(0, 40 * page_bytes(config), 2048):
        assert plan_memory(config, 1024, minimal + extra, 4, 1, None).pages - 1 >= 8, extra


def test_weights_changed_under_a_prefill_keep_its_kv_out_of_the_cache(model: DeepSeekV4) -> None:
    engine = Engine(model, max_batch=2)
    prompt = _ids(400, 4)
    out = engine.submit(prompt, 2)
    engine.step()  # one piece computed with the old weights
    engine.weights_updated()
    while engine.busy:
        engine.step()
    assert out.finish_reason == "length" and engine.stats()["tree"]["cached_tokens"] == 0
    engine.generate([prompt], 2)
    engine.weights_updated()  # with prefixes cached: the old tree's page references all go back
    assert engine.caches.pages.used_count == 0


def test_workload_report_splits_hits_into_continuations_and_branches(model: DeepSeekV4) -> None:
    """The serving benchmark's report says where hits come from: the conversations' own prompts (each turn resumes
    where the last one ended) and the branch prompts (resumed at an arbitrary earlier point), for ours and for the
    baseline that keeps every token's window KV. With no branches in the workload, no prompt counts as one."""
    from v4compile.runtime.workload import Workload, run_workload

    shape = {"conversations": 2, "turns": 3, "system_len": 300, "message_len": (40, 90), "answer_len": 3}
    report = run_workload(Engine(model, max_batch=3), Workload(**shape, branches=1))
    (cont, cont_base), (branch, branch_base) = report.kind_hit_rates(False), report.kind_hit_rates(True)
    assert 0 < report.branch_prompt_tokens < report.prompt_tokens and branch_base > 0
    assert 0 < cont <= cont_base <= 1 and 0 <= branch <= branch_base <= 1
    plain = run_workload(Engine(model, max_batch=3), Workload(**shape, branches=0))
    assert plain.branch_prompt_tokens == plain.branch_cached_tokens == plain.branch_baseline_cached_tokens == 0
    assert plain.kind_hit_rates(False) == (plain.hit_rate, plain.baseline_hit_rate)
