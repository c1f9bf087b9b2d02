"""Every kernel against its reference on random inputs (CPU: Triton interpreter, TileLang c target)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from v4compile.codegen import ops, reference
from v4compile.codegen.registry import REGISTRY
from v4compile.codegen.triton import radix_topk as radix_topk_triton
from v4compile.codegen.triton.compressor import triton_next_pow2

FAST = ("triton", "tilelang")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize(("ratio", "overlap", "width", "tokens"), [
    (4, True, 128, 4 * 7 + 3), (4, True, 48, 8), (128, False, 64, 256 + 5), (128, False, 128, 100), (4, True, 64, 3),
])
def test_compressor_pool_matches_reference(backend: str, ratio: int, overlap: bool, width: int, tokens: int) -> None:
    torch.manual_seed(ratio + width + tokens)
    c = 2 if overlap else 1
    kv = torch.randn(2, tokens, c * width) * 3
    score = torch.randn(2, tokens, c * width) * 3
    ape = torch.randn(ratio, c * width)
    blocks = tokens // ratio
    want = reference.compressor_pool(kv, score, ape, ratio, width, blocks)
    got = ops.compressor_pool(kv, score, ape, ratio, width, blocks, backend)
    assert got.shape == (2, blocks, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize(("ratio", "overlap", "width"), [(4, True, 128), (4, True, 64), (128, False, 128)])
def test_compressor_pool_state_matches_reference(backend: str, ratio: int, overlap: bool, width: int) -> None:
    torch.manual_seed(ratio + width)
    c = 2 if overlap else 1
    kv = torch.randn(3, c * ratio, c * width)
    score = torch.randn(3, c * ratio, c * width) * 2
    score[0, : c * ratio // 2] = float("-inf")
    want = reference.compressor_pool_state(kv, score, ratio, width)
    got = ops.compressor_pool_state(kv, score, ratio, width, backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _finished_entries(backend: str, ratio: int, width: int, rope: int, state: bool, finish: tuple[bool, bool, bool],
                      tables: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The op's entries on ``backend`` and the reference's for random inputs (a decode state with unwritten slots, or
    prefill blocks with a partial block left over), ``finish`` = (rotate, pow2, quantize), RoPE tables in ``tables``;
    returns (got, want, the op's arguments)."""
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    torch.manual_seed(ratio + width + rope)
    c, blocks = (2 if ratio == 4 else 1), 5
    freqs = rope_frequencies(rope, 1.6e5, 65536, 16, 32, 1)
    weight = torch.rand(width) + 0.5
    if state:
        kv, score = torch.randn(3, c * ratio, c * width) * 3, torch.randn(3, c * ratio, c * width) * 2
        score[0, : c * ratio // 2] = float("-inf")  # slots not yet written
        cos, sin = (t.to(tables) for t in rope_cos_sin(freqs, torch.tensor([0, 40000, 123456]) // ratio * ratio))
        args = (kv, score, ratio, width, cos, sin, weight, 1e-6, *finish)
        return ops.compressor_entry_state(*args, backend), reference.compressor_entry_state(*args), args
    tokens = blocks * ratio + ratio // 2  # a partial block left over
    kv, score = torch.randn(2, tokens, c * width) * 3, torch.randn(2, tokens, c * width) * 2
    ape = torch.randn(ratio, c * width)
    cos, sin = (t.to(tables) for t in rope_cos_sin(freqs, torch.arange(blocks) * ratio))
    args = (kv, score, ape, ratio, width, blocks, cos, sin, weight, 1e-6, *finish)
    return ops.compressor_entries(*args, backend), reference.compressor_entries(*args), args


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize(("ratio", "width", "rope", "rotate", "pow2", "state"), [
    (4, 128, 64, False, True, False), (4, 128, 64, False, False, True), (4, 192, 64, False, True, False),
    (4, 64, 64, True, True, False), (4, 128, 32, True, True, True), (128, 128, 64, False, True, False),
    (128, 128, 64, False, False, True), (4, 512, 64, False, True, True), (128, 320, 64, False, True, False),
    (4, 1088, 64, False, False, True),  # pooled dims split over programs, the entry's last one finishes it
])
def test_compressor_entries_pool_and_finish_like_the_model(backend: str, ratio: int, width: int, rope: int,
                                                           rotate: bool, pow2: bool, state: bool,
                                                           assert_finished_entries: Callable) -> None:
    got, want, _ = _finished_entries(backend, ratio, width, rope, state, (rotate, pow2, True))
    assert_finished_entries(got, want, rotate, 0.995)
    form = "hadamard_fp4" if rotate else "fp8"
    record = REGISTRY.records[f"compressor_entr{'y_state' if state else 'ies'}.c{ratio}.w{width}.{form}.{backend}"]
    assert record.error is None and record.launches


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize(("ratio", "width", "rope", "state", "tables"), [
    (4, 128, 64, False, torch.bfloat16), (4, 64, 64, True, torch.bfloat16), (128, 128, 64, False, torch.float32),
    (4, 96, 32, False, torch.float32), (128, 128, 64, True, torch.bfloat16),
])
def test_compressor_entries_kept_bf16_like_transformers(backend: str, ratio: int, width: int, rope: int, state: bool,
                                                        tables: torch.dtype) -> None:
    """The finish without quantization (transformers' V4 keeps its entries bf16, with bf16 RoPE tables): the
    model's entries but where the pooling's fp32 rounding crosses a bf16 boundary (one step), any width of whole
    pairs; the rotation without its FP4 simulation is refused by name."""
    got, want, args = _finished_entries(backend, ratio, width, rope, state, (False, False, False), tables)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got == want).float().mean() >= 0.995
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    name = f"compressor_entr{'y_state' if state else 'ies'}.c{ratio}.w{width}.bf16.{backend}"
    assert REGISTRY.records[name].error is None and REGISTRY.records[name].launches
    if not state:
        with pytest.raises(ValueError, match="rotation .* comes with the FP4 simulation"):
            ops.compressor_entries(*args[:-3], True, False, False, backend)


@settings(max_examples=25, deadline=None)
@given(ratio=st.sampled_from([4, 8, 128]), overlap=st.booleans(), rotate=st.booleans(), pow2=st.booleans(),
       state=st.booleans(), rope=st.sampled_from([2, 16, 32, 64]), extra=st.integers(0, 3), seed=st.integers(0, 99))
def test_compressor_entries_property_random_dims(ratio: int, overlap: bool, rotate: bool, pow2: bool, state: bool,
                                                 rope: int, extra: int, seed: int,
                                                 assert_finished_entries: Callable) -> None:
    """Random pooling geometry and finish dims the kernel takes: the model's entries, bit for bit but for the
    pooling's rounding crossing a boundary (rotated widths: powers of two; main widths: RoPE + whole FP8 blocks)."""
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    width = max(32, 1 << (rope - 1).bit_length()) << min(extra, 2) if rotate else rope + 64 * extra
    torch.manual_seed(seed)
    c = 2 if overlap else 1
    cos, sin = rope_cos_sin(rope_frequencies(rope, 1e4, 0, 1, 32, 1), torch.arange(3) * ratio + 7 * seed)
    weight = torch.rand(width) + 0.5
    if state:
        kv, score = torch.randn(3, c * ratio, c * width) * 3, torch.randn(3, c * ratio, c * width) * 2
        score[0, ratio // 2:] = float("-inf")
        args = (kv, score, ratio, width, cos, sin, weight, 1e-6, rotate, pow2, True)
        got, want = ops.compressor_entry_state(*args, "triton"), reference.compressor_entry_state(*args)
    else:
        kv, score = torch.randn(1, 3 * ratio + 1, c * width) * 3, torch.randn(1, 3 * ratio + 1, c * width) * 2
        args = (kv, score, torch.randn(ratio, c * width), ratio, width, 3, cos, sin, weight, 1e-6, rotate, pow2, True)
        got, want = ops.compressor_entries(*args, "triton"), reference.compressor_entries(*args)
    assert_finished_entries(got, want, rotate, 0.995)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize("backend", FAST)
def test_compressor_entries_edge_inputs(backend: str, assert_finished_entries: Callable) -> None:
    """Overlap follows the shapes (not the ratio), a column of -inf scores gives the model's NaN entry, and dims
    the kernel does not take run the reference, which names what is wrong."""
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    torch.manual_seed(7)
    cos, sin = rope_cos_sin(rope_frequencies(64, 1e4, 0, 1, 32, 1), torch.arange(3) * 4)
    weight = torch.rand(128) + 0.5
    for c in (1, 2):  # ratio 4 without the overlap, then with it
        kv, score, ape = torch.randn(2, 13, c * 128), torch.randn(2, 13, c * 128), torch.randn(4, c * 128)
        args = (kv, score, ape, 4, 128, 3, cos, sin, weight, 1e-6, False, True, True)
        assert_finished_entries(ops.compressor_entries(*args, backend), reference.compressor_entries(*args), False)
    kv, score = torch.randn(2, 8, 256), torch.randn(2, 8, 256)
    score[1, :, 5] = score[1, :, 128 + 5] = float("-inf")  # dim 5 of row 1: no slot (of either half) written
    args = (kv, score, 4, 128, cos[:2], sin[:2], weight, 1e-6, False, True, True)
    got, want = ops.compressor_entry_state(*args, backend), reference.compressor_entry_state(*args)
    assert want[1].isnan().all() and got[1].isnan().all() and torch.equal(got[0], want[0])
    kv, score, ape = torch.randn(1, 12, 384), torch.randn(1, 12, 384), torch.randn(4, 384)
    with pytest.raises(ValueError, match="power-of-two dim"):  # a rotation of 192 dims
        ops.compressor_entries(kv, score, ape, 4, 192, 3, cos, sin, torch.ones(192), 1e-6, True, True, True, backend)


def _lowest_index_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent oracle: rank by (value desc, index asc) with Python's sort."""
    rows_v, rows_i = [], []
    for row in x.reshape(-1, x.shape[-1]).tolist():
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        rows_i.append(order)
        rows_v.append([row[i] for i in order])
    return torch.tensor(rows_v).view(*x.shape[:-1], k), torch.tensor(rows_i).view(*x.shape[:-1], k)


def test_radix_topk_nan_zero_signs_and_wide_dtypes_match_the_reference() -> None:
    """NaN of either sign ranks first (ties by index), a zero keeps its sign, and fp64 / integer scores
    (which fp32 keys cannot order) are ranked exactly too."""
    torch.manual_seed(5)
    x = torch.randn(2, 3000)
    x[0, 7] = float("nan")
    x[0, 50] = -float("nan")
    x[1] = -1.0
    x[1, [10, 30]] = -0.0
    x[1, 20] = 0.0
    for mask in (False, True):
        values, ids = ops.radix_topk(x, 8, mask, "triton")
        want_v, want_i = reference.radix_topk(x, 8, mask)
        assert torch.equal(ids, want_i)
        assert torch.equal(values.isnan(), want_v.isnan()) and torch.equal(values.signbit(), want_v.signbit())
    wide = torch.tensor([[1.0, 1.0 + 1e-12, -1e300, 3.0, 1e300, 2.0]], dtype=torch.float64)
    assert torch.equal(ops.radix_topk(wide, 6, True, "triton")[1], reference.radix_topk(wide, 6, True)[1])
    ints = torch.tensor([[16777216, 16777217, 5, 3]], dtype=torch.int32)
    got_v, got_i = ops.radix_topk(ints, 2, False, "triton")
    assert torch.equal(got_i, torch.tensor([[1, 0]])) and got_v.dtype == torch.int32


@pytest.mark.parametrize(("skip_runs", "sort", "rank"), [(0, 256, 256), (1, 256, 256), (1, 0, 256), (1, 0, 16),
                                                   (0, 128, 16)])
def test_radix_topk_collect_and_select_modes_are_exact(skip_runs: int, sort: int, rank: int) -> None:
    """The collect reads every tile (few rows on the GPU) or only runs above the threshold (otherwise); the
    select sorts the gathered candidates (up to SORT of them) or ranks each by counting, RANK at a time against
    SPAN at a time (small ones: many ranking programs, each ranking and counting in several steps)."""
    torch.manual_seed(skip_runs)
    x = torch.randn(3, 6000).bfloat16().float()
    x[1] = torch.arange(6000.0)  # the top keys sit in the last runs
    x[2, 3000:] = float("-inf")
    config = {**radix_topk_triton.launch_config(3, 6000, 100, cuda=False), "SKIP_RUNS": skip_runs, "SORT": sort,
              "RANK": rank, "SPAN": 4 * rank}
    for mask in (False, True):
        values, ids = radix_topk_triton.radix_topk(x, 100, mask, config)
        want_v, want_i = reference.radix_topk(x, 100, mask)
        assert torch.equal(ids, want_i) and torch.equal(values, want_v)


@pytest.mark.parametrize(("rows", "n", "k"), [(3, 100, 8), (2, 1024, 8), (2, 5000, 64), (2, 37, 37), (1, 3000, 2048)])
def test_radix_topk_is_exact_with_lowest_index_ties(rows: int, n: int, k: int) -> None:
    torch.manual_seed(n + k)
    x = torch.randn(rows, n)
    x[0, : n // 4] = 0.5
    x[-1, n // 3 : n // 2] = -0.0
    x[-1, n // 2 : n // 2 + 7] = 0.0
    values, ids = ops.radix_topk(x, k, False, "triton")
    want_v, want_i = _lowest_index_topk(x, k)
    assert torch.equal(ids, want_i)
    assert torch.equal(values, want_v)


def test_radix_topk_counters_persist_between_calls_and_rest_at_zero() -> None:
    """The per-row counters are zeroed by each call's threshold program, not per call: calls of growing,
    shrinking and repeated row counts (and the slow path in between) stay exact; the finished-programs
    count rests at zero for the next call, the gathered count holds this call's candidates."""
    torch.manual_seed(3)
    for rows, n, k in [(2, 3000, 64), (5, 3000, 64), (1, 3000, 64), (5, 900, 32), (3, 2000, 128), (5, 900, 32)]:
        x = torch.randn(rows, n)
        if rows == 3:  # every group holds one repeated value: the candidate room overflows
            x = (torch.arange(n) % 50).float().expand(rows, n).contiguous()
        values, ids = ops.radix_topk(x, k, False, "triton")
        want_v, want_i = _lowest_index_topk(x, k)
        assert torch.equal(ids, want_i) and torch.equal(values, want_v)
        held = radix_topk_triton._COUNTERS[("cpu", 0)]
        assert all(not counters[:, 1].any() for counters in held) and held[-1].shape[0] >= rows
        assert (held[-1][:rows, 0] >= k).all()


def test_radix_topk_masked_candidates_never_win_and_missing_slots_are_minus_one() -> None:
    x = torch.full((3, 600), float("-inf"))
    x[0, 17] = -1e30
    x[1, ::100] = torch.arange(6, dtype=torch.float32)
    values, ids = ops.radix_topk(x, 8, True, "triton")
    assert ids[0].tolist() == [17] + [-1] * 7
    assert ids[1].tolist() == [500, 400, 300, 200, 100, 0, -1, -1]
    assert ids[2].tolist() == [-1] * 8
    assert torch.isinf(values[2]).all()


@pytest.mark.parametrize("mask", [False, True])
def test_radix_topk_heavy_ties_and_short_rows_fill_from_the_lowest_index(mask: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 2, (3, 20000), generator=gen).float()
    x[1, 5000:] = float("-inf")
    x[2] = float("-inf")
    x[2, 777::1000] = torch.arange(20.0)
    values, ids = ops.radix_topk(x, 32, mask, "triton")
    want_v, want_i = reference.radix_topk(x, 32, mask)
    assert torch.equal(ids, want_i) and torch.equal(values, want_v)


def test_radix_topk_periodic_scores_overflowing_the_candidate_room_take_the_exact_slow_path() -> None:
    x = (torch.arange(80000) % 1250).float().view(1, -1)
    x[0, 40000:40100] = 1249.0
    values, ids = ops.radix_topk(x, 128, False, "triton")
    want_v, want_i = reference.radix_topk(x, 128, False)
    assert torch.equal(ids, want_i) and torch.equal(values, want_v)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 2**31 - 1), st.sampled_from([2, 5, 1000]))
def test_radix_topk_property_random_with_many_ties(n: int, k: int, seed: int, levels: int) -> None:
    k = min(k, n)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels, (2, n), generator=gen).float() / 3
    x[x == x.min()] = float("-inf")
    values, ids = ops.radix_topk(x, k, False, "triton")
    want_v, want_i = _lowest_index_topk(x, k)
    assert torch.equal(ids, want_i) and torch.equal(values, want_v)
    assert set(ids[0].tolist()) == set(torch.topk(x[0], k).indices.tolist()) or \
        (torch.topk(x[0], k).values == values[0]).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp64_gradcheck_of_every_op(backend: str) -> None:
    torch.manual_seed(0)
    opts = {"dtype": torch.float64, "requires_grad": True}
    fast = backend != "reference"
    for ratio, c, width in [(4, 2, 8), (8, 1, 8)]:
        tokens = 3 * ratio + 1
        kv, score = torch.randn(2, tokens, c * width, **opts), torch.randn(2, tokens, c * width, **opts)
        ape = torch.randn(ratio, c * width, **opts)

        def pool(a, b, e, ratio=ratio, width=width):
            return ops.compressor_pool(a, b, e, ratio, width, 3, backend)

        def pool_state(a, b, ratio=ratio, width=width):
            return ops.compressor_pool_state(a, b, ratio, width, backend)

        assert torch.autograd.gradcheck(pool, (kv, score, ape), fast_mode=fast)
        state = (torch.randn(2, c * ratio, c * width, **opts), torch.randn(2, c * ratio, c * width, **opts))
        assert torch.autograd.gradcheck(pool_state, state, fast_mode=fast)
    x = torch.randn(3, 40, **opts)
    assert torch.autograd.gradcheck(lambda t: ops.radix_topk(t, 6, False, backend)[0], (x,),
                                    fast_mode=backend != "reference")


def test_kernel_that_fails_to_build_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from v4compile.codegen.triton import compressor

    monkeypatch.setattr(compressor, "_POOL_STATE", compressor._POOL_STATE.replace("tl.exp(", "tl.no_such_fn("))
    torch.manual_seed(1)
    kv, score = torch.randn(2, 8, 24), torch.randn(2, 8, 24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ops.compressor_pool_state(kv, score, 4, 12, "triton")
    assert torch.equal(got, reference.compressor_pool_state(kv, score, 4, 12))
    messages = [str(w.message) for w in caught]
    assert any("compressor_pool_state.c4.w12.triton" in m and "reference" in m for m in messages), messages
    assert REGISTRY.records["compressor_pool_state.c4.w12.triton"].error is not None


def test_a_launch_config_that_fails_falls_back_for_that_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from v4compile.codegen.triton import sparse_attention as attention

    torch.manual_seed(3)
    q, kv = torch.randn(1, 1, 16, 32), torch.randn(1, 20, 32)
    sink, index = torch.randn(16), torch.randint(-1, 20, (1, 1, 12))
    want = reference.sparse_attention(q, kv, sink, index, 0.2)
    torch.testing.assert_close(ops.sparse_attention(q, kv, sink, index, 0.2, "triton"), want)
    name = attention.kernel_name(32, False)
    config = attention.launch_config(1, 16, 12, False)
    monkeypatch.setattr(attention, "launch_config", lambda *args: {**config, "BLOCK_H": 12})  # not a power of 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ops.sparse_attention(q, kv, sink, index, 0.2, "triton")
    assert torch.equal(got, want)
    assert any(name in str(w.message) and "reference" in str(w.message) for w in caught)
    assert REGISTRY.records[name].error is None  # the kernel still serves the configurations that work
    monkeypatch.undo()
    launches = REGISTRY.records[name].launches
    torch.testing.assert_close(ops.sparse_attention(q, kv, sink, index, 0.2, "triton"), want)
    assert REGISTRY.records[name].launches == launches + 1


def test_registry_records_source_launch_and_disk_cache() -> None:
    torch.manual_seed(2)
    ops.compressor_pool(torch.randn(1, 8, 32), torch.randn(1, 8, 32), torch.randn(4, 32), 4, 16, 2, "triton")
    record = REGISTRY.records["compressor_pool.c4.w16.triton"]
    assert "@triton.jit" in record.source and "RATIO = tl.constexpr(4)" in record.source
    assert record.launch["grid"] == (1, 1) and record.launch["BLOCK_J"] == 16 and record.launches >= 1
    with open(record.path) as f:
        assert f.read() == record.source
    assert record.source_hash in record.path


@pytest.mark.parametrize(("bsz", "seqlen", "heads", "dim", "entries", "k"), [
    (2, 3, 4, 128, 40, 24), (1, 2, 20, 64, 100, 37), (2, 1, 16, 32, 10, 8),
])
def test_sparse_attention_matches_reference(bsz: int, seqlen: int, heads: int, dim: int, entries: int, k: int) -> None:
    torch.manual_seed(bsz * 100 + k)
    q = torch.randn(bsz, seqlen, heads, dim).bfloat16()
    kv = torch.randn(bsz, entries, dim).bfloat16()
    sink = torch.randn(heads)
    index = torch.randint(-1, entries, (bsz, seqlen, k))
    index[0, 0] = -1
    index[-1, -1, : k // 2] = index[-1, -1, k // 2 : 2 * (k // 2)]
    got = ops.sparse_attention(q, kv, sink, index, dim**-0.5, "triton")
    want = reference.sparse_attention(q, kv, sink, index, dim**-0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    # the model's fp32 numerics, up to one bf16 rounding step of the output
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)


def test_sparse_attention_fp64_gradcheck() -> None:
    torch.manual_seed(5)
    opts = {"dtype": torch.float64, "requires_grad": True}
    q, kv, sink = torch.randn(1, 2, 3, 16, **opts), torch.randn(1, 7, 16, **opts), torch.randn(3, **opts)
    index = torch.tensor([[[0, 3, -1, 6], [2, 2, 5, -1]]])
    assert torch.autograd.gradcheck(lambda a, b, c: ops.sparse_attention(a, b, c, index, 0.25, "reference"),
                                    (q, kv, sink))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_attention_split_over_programs_matches_reference(dtype: torch.dtype, splits: int) -> None:
    from v4compile.codegen.triton.sparse_attention import sparse_attention

    torch.manual_seed(splits)
    q, kv = torch.randn(2, 2, 20, 64).to(dtype), torch.randn(2, 50, 64).to(dtype)
    sink = torch.randn(20) * 3
    index = torch.randint(-1, 50, (2, 2, 70))
    index[0, 0] = -1
    index[1, 1, :10] = -1
    config = {"BLOCK_H": 16, "BLOCK_K": 16, "SPLITS": splits, "num_warps": 4}
    got = sparse_attention(q, kv, sink, index, 0.125, config)
    want = reference.sparse_attention(q, kv, sink, index, 0.125)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_scores_match_the_model_rounding(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    q, keys, w = torch.randn(2, 3, 10, 32).to(dtype), torch.randn(2, 70, 32).to(dtype), torch.randn(2, 3, 10).to(dtype)
    got = ops.indexer_scores(q, keys, w, "triton")
    want = reference.indexer_scores(q, keys, w)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 70)
    if dtype == torch.bfloat16:  # every step rounded to bf16 as the model does: identical here
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_indexer_scores_fp64_gradcheck() -> None:
    torch.manual_seed(4)
    opts = {"dtype": torch.float64, "requires_grad": True}
    q, keys, w = torch.randn(1, 2, 3, 16, **opts), torch.randn(1, 5, 16, **opts), torch.randn(1, 2, 3, **opts)
    assert torch.autograd.gradcheck(lambda a, b, c: ops.indexer_scores(a, b, c, "reference"), (q, keys, w))


def test_paged_indexer_scores_read_the_keys_in_place() -> None:
    """Keys on shared pages through a scattered page table score as the same keys gathered first, bit for bit."""
    torch.manual_seed(5)
    pool = torch.randn(9, 4, 32).bfloat16()
    table = torch.tensor([[3, 7, 1], [8, 2, 5]])
    q, w = torch.randn(2, 3, 10, 32).bfloat16(), torch.randn(2, 3, 10).bfloat16()
    got = ops.indexer_scores_paged(q, pool, table, w, "triton")
    assert got.shape == (2, 3, 12)
    assert torch.equal(got, ops.indexer_scores(q, pool[table].flatten(1, 2), w, "triton"))
    assert torch.equal(got, reference.indexer_scores_paged(q, pool, table, w))
    assert REGISTRY.records["indexer_scores_paged.d32.bf16.triton"].launches >= 1


@pytest.mark.parametrize("padded", [False, True])
def test_attention_of_transposed_queries_compiles_with_the_layout_it_returns(padded: bool) -> None:
    """transformers hands the attention queries as a [B,H,S,d] tensor transposed to [B,S,H,d]: under Inductor the
    op's output must have the strides its fake announced (contiguous), or Inductor's stride check fails (seen on the
    H100 with the Triton kernel, whose output is contiguous); the values equal the call on contiguous queries."""
    torch.manual_seed(8)
    x = torch.randn(1, 4, 6, 32).bfloat16()
    kv, sink, index = torch.randn(1, 9, 32).bfloat16(), torch.randn(4), torch.randint(-1, 9, (1, 6, 5))

    def attend(x: torch.Tensor) -> torch.Tensor:
        q = (x * 2).transpose(1, 2)
        if padded:
            return ops.sparse_attention_padded(q, kv, sink, index, 0.125, 16, "triton") * 2
        return ops.sparse_attention(q, kv, sink, index, 0.125, "triton") * 2

    torch._dynamo.reset()
    got = torch.compile(attend, backend="inductor", fullgraph=True)(x)
    assert torch.equal(got, attend(x))


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_sparse_attention_reads_window_and_pages_in_place(splits: int) -> None:
    """Window keys plus entries on scattered pages attend as their concatenated copy does, bit for bit (ids below
    the window's length name window keys; -1 and ids past the entries are masked)."""
    torch.manual_seed(6)
    window, pool = torch.randn(2, 5, 32).bfloat16(), torch.randn(9, 4, 32).bfloat16()
    table = torch.tensor([[3, 7, 1], [8, 2, 5]])
    q, sink = torch.randn(2, 2, 4, 32).bfloat16(), torch.randn(4)
    index = torch.randint(-1, 17, (2, 2, 12))
    config = {"BLOCK_H": 16, "BLOCK_K": 16, "SPLITS": splits, "num_warps": 4}
    from v4compile.codegen.triton.sparse_attention import sparse_attention, sparse_attention_paged

    got = sparse_attention_paged(q, window, pool, table, sink, index, 0.125, config)
    copied = torch.cat((window, pool[table].flatten(1, 2)), dim=1)
    assert torch.equal(got, sparse_attention(q, copied, sink, index, 0.125, config))
    torch.testing.assert_close(got.float(), reference.sparse_attention_paged(q, window, pool, table, sink, index,
                                                                              0.125).float(), rtol=2**-7, atol=1e-5)
    assert torch.equal(ops.sparse_attention_paged(q, window, pool, table, sink, index, 0.125, "triton"),
                       sparse_attention_paged(q, window, pool, table, sink, index, 0.125))


def _load_kinds(ptx: str) -> dict[str, int]:
    """Global-memory load instructions of a kernel's PTX, counted by kind."""
    import re

    loads = re.findall(r"(?:ld\.global|cp\.async\.c[ag])[.\w]*", ptx)
    return {kind: loads.count(kind) for kind in set(loads)}


def test_paged_sparse_attention_loads_entries_16_bytes_at_a_time_on_hopper(sm90_ptx: Callable[..., str]) -> None:
    """The paged kernel picks each key from the window or a page; lowered for sm_90 it still copies the keys in
    16-byte asynchronous loads as the kernel over the gathered copy does (with this Triton, a plain select lowers
    them to two-byte loads), and only when both tensors are 16-byte aligned."""
    from v4compile.codegen.triton import sparse_attention as attention

    names = ("Q KV WIN TABLE SINK INDEX OUT PART seqlen heads n_entries n_window per_page k_total per_split scale "
             "s_qb s_qs s_qh s_kvb s_kvn s_wb s_wn s_tb s_ib s_is s_ob s_os s_oh").split()
    types = {"Q": "*bf16", "KV": "*bf16", "WIN": "*bf16", "TABLE": "*i64", "SINK": "*fp32", "INDEX": "*i32",
             "OUT": "*bf16", "PART": "*fp32", "scale": "fp32"}
    signature = {n: types.get(n, "i32") for n in names} | dict.fromkeys(("BLOCK_H", "BLOCK_K", "SPLITS", "ALIGNED"),
                                                                         "constexpr")
    aligned = [n for n in names if n not in ("seqlen", "scale")]
    counts = {}
    for paged, hint in ((False, False), (True, True), (True, False)):
        source = attention._SOURCE.format(dim=512, low=True, dot="bfloat16", precision="ieee", rounded_p=False,
                                          paged=paged)
        counts[paged, hint] = _load_kinds(sm90_ptx(source, "sparse_attention", signature,
                                                   {"BLOCK_H": 16, "BLOCK_K": 64, "SPLITS": 4, "ALIGNED": hint},
                                                   aligned, 8))
    gathered, paged, unhinted = counts[False, False], counts[True, True], counts[True, False]
    assert gathered.get("cp.async.cg.shared.global", 0) >= 32 and "ld.global.b16" not in gathered
    assert paged.get("cp.async.cg.shared.global", 0) == gathered["cp.async.cg.shared.global"]
    assert "ld.global.b16" not in paged
    assert unhinted.get("ld.global.b16", 0) > 0  # without the alignment the keys must load element by element


@pytest.mark.parametrize(("ratio", "width", "rotate", "quantize", "state"), [
    (4, 512, False, True, False), (4, 128, True, True, True), (4, 128, False, False, False),
    (128, 512, False, False, True), (128, 512, False, True, False),
])
def test_compressor_entries_compile_for_hopper(ratio: int, width: int, rotate: bool, quantize: bool, state: bool,
                                               sm90_ptx: Callable[..., str]) -> None:
    """The fused pooling + finish as the GPU compiles it, every finish form (FP8, Hadamard + FP4, bf16 for
    transformers' V4) and both forms (prefill, decode state), at V4-Flash's widths and the launch's tiles: the
    interpreter accepts code Triton's GPU compiler rejects. A C128 entry split over programs takes its ticket with an
    acquire-release atomic after a barrier."""
    from v4compile.codegen.triton.compressor_finish import SIGNATURE, _kernel, launch_config

    name, _ = _kernel(ratio, width, ratio == 4, 64, rotate, True, quantize, state, True)
    config = launch_config(ratio, width, state)
    fn = name.split(".")[0]
    signature = SIGNATURE
    constexprs = {k: config[k] for k in ("BLOCK_J", "CHUNK", "BLOCK_D")}
    divisible = ["KV", "SCORE", "APE", "COS", "SIN", "NORM_W", "POOLED", "OUT", "TICKETS", "s_kb", "s_ks", "s_ob"]
    ptx = sm90_ptx(REGISTRY.records[name].source, fn, signature | dict.fromkeys(constexprs, "constexpr"), constexprs,
                   divisible, config["num_warps"])
    assert f".entry {fn}" in ptx
    if config["BLOCK_D"] < triton_next_pow2(width):
        release = ptx.index("atom.global.gpu.acq_rel.add")
        assert "bar.sync" in ptx[:release]
