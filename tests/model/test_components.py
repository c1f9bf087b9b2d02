"""Model building blocks on random inputs: RoPE, Sinkhorn, the compressor's incremental state."""

from __future__ import annotations

import pytest
import torch

import v4compile
from v4compile import V4Config
from v4compile.model.attention import window_index_decode, window_index_full
from v4compile.model.cache import V4Cache
from v4compile.model.compressor import Compressor
from v4compile.model.init import random_init
from v4compile.model.mhc import sinkhorn
from v4compile.model.rope import apply_rope, rope_cos_sin, rope_frequencies


@pytest.mark.parametrize("yarn", [0, 64, 65536])
def test_rope_then_inverse_rope_is_identity(yarn: int) -> None:
    torch.manual_seed(0)
    freqs = rope_frequencies(64, 160000.0, yarn, 16.0, 32, 1)
    x = torch.randn(2, 50, 4, 128, dtype=torch.float32)
    cos, sin = rope_cos_sin(freqs, torch.arange(50))
    y = apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2))
    assert not torch.allclose(y[..., 64:], x[..., 64:])
    assert torch.equal(y[..., :64], x[..., :64])
    back = apply_rope(y, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


def test_rope_rotates_interleaved_pairs() -> None:
    freqs = torch.tensor([1.0])
    x = torch.tensor([[1.0, 0.0]])
    cos, sin = rope_cos_sin(freqs, torch.tensor([torch.pi / 2]))
    assert torch.allclose(apply_rope(x, cos, sin), torch.tensor([[0.0, 1.0]]), atol=1e-6)


def test_yarn_keeps_fast_dims_and_scales_slow_dims() -> None:
    plain = rope_frequencies(64, 160000.0, 0, 16.0, 32, 1)
    yarn = rope_frequencies(64, 160000.0, 65536, 16.0, 32, 1)
    assert torch.allclose(yarn[0], plain[0])
    assert torch.allclose(yarn[-1], plain[-1] / 16)


def test_sinkhorn_output_is_doubly_stochastic() -> None:
    """Columns are exact after the last step; rows converge (20 steps suffice at mHC's logit scale)."""
    torch.manual_seed(0)
    c = sinkhorn(torch.randn(1000, 4, 4), iters=20, eps=1e-6)
    assert (c > 0).all()
    assert torch.allclose(c.sum(-2), torch.ones(1000, 4), atol=1e-5)
    assert torch.allclose(c.sum(-1), torch.ones(1000, 4), atol=1e-3)
    wide = torch.randn(1000, 4, 4) * 3
    err = [(sinkhorn(wide, n, 1e-6).sum(-1) - 1).abs().max() for n in (5, 20, 100)]
    assert err[0] > err[1] > err[2]


def test_window_indices_agree_between_prefill_and_ring() -> None:
    """Decode reads the ring's positions in the full forward's order (so both sum a query's terms alike)."""
    window = 16
    full = window_index_full(40, window, torch.device("cpu"))
    for pos in range(40):
        ring = window_index_decode(torch.tensor([pos]), window)[0, 0]
        held = [pos - ((pos - s) % window) if s >= 0 else -1 for s in ring.tolist()]
        assert held == full[pos].tolist()


def _compressor(ratio: int, rotate: bool) -> Compressor:
    config = V4Config.preset("tiny")
    comp = Compressor(config, ratio, config.index_head_dim if rotate else config.head_dim, rotate)
    random_init(comp, seed=ratio + rotate)
    return comp


def _compressor_case(ratio: int, rotate: bool, seed: int
                     ) -> tuple[V4Config, Compressor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A compressor, its RoPE table, 2 x (2 ratio + 3) random tokens and their batch-compressed entries."""
    torch.manual_seed(seed)
    config = V4Config.preset("tiny", max_seq_len=512)
    comp = _compressor(ratio, rotate)
    freqs = rope_frequencies(config.rope_head_dim, config.compress_rope_theta, config.original_seq_len,
                             config.rope_factor, config.beta_fast, config.beta_slow)
    x = torch.randn(2, 2 * ratio + 3, config.dim).to(torch.bfloat16)
    with torch.no_grad():
        reference = comp.forward_full(x, freqs, None).float()
    return config, comp, freqs, x, reference


@pytest.mark.parametrize(("ratio", "rotate"), [(4, False), (4, True), (128, False)])
def test_compressor_incremental_state_equals_batch_compression_at_every_remainder(ratio: int, rotate: bool) -> None:
    """Prefill p tokens, decode the rest one by one: every emitted entry equals batch compression."""
    config, comp, freqs, x, reference = _compressor_case(ratio, rotate, seed=0)
    total = x.shape[1]
    with torch.no_grad():
        prefixes = range(1, total) if ratio == 4 else [1, ratio - 1, ratio, ratio + 1, 2 * ratio - 1, 2 * ratio]
        for p in prefixes:
            cache = V4Cache(config, 2, 512).layers[1 if ratio == 4 else 2]
            state = cache.indexer if rotate else cache.compressor
            comp.forward_full(x[:, :p], freqs, state)
            for t in range(p, total):
                comp.forward_decode(x[:, t : t + 1], torch.tensor([t, t]), freqs, state)
            got = state.read()[:, : total // ratio].float()
            assert torch.allclose(got, reference, atol=2e-2, rtol=2e-2), f"prefix {p}"
            assert (state.read()[:, total // ratio :] == 0).all()


@pytest.mark.parametrize(("ratio", "rotate"), [(4, False), (4, True), (128, False)])
def test_compressor_chunks_equal_batch_compression_at_every_split(ratio: int, rotate: bool) -> None:
    """Feed the tokens in two chunks split anywhere: every entry equals batch compression."""
    config, comp, freqs, x, reference = _compressor_case(ratio, rotate, seed=1)
    total = x.shape[1]
    with torch.no_grad():
        splits = range(1, total) if ratio == 4 else [1, ratio - 1, ratio, ratio + 1, 2 * ratio + 1]
        for p in splits:
            cache = V4Cache(config, 2, 512).layers[1 if ratio == 4 else 2]
            state = cache.indexer if rotate else cache.compressor
            comp.forward_chunk(x[:, :p], 0, freqs, state)
            entries = comp.forward_chunk(x[:, p:], p, freqs, state)
            assert entries.shape[1] == total // ratio
            assert torch.allclose(entries.float(), reference, atol=2e-2, rtol=2e-2), f"split {p}"
            comp.forward_decode(x[:, -1:], torch.tensor([total, total]), freqs, state)  # the state decodes on


def test_chunked_prefill_matches_full_prefill_and_decodes_on(tiny_model: v4compile.DeepSeekV4) -> None:
    """model.extend over chunks (any split, including chunks inside a compressor block or the window)
    agrees with one full forward within bf16 noise, and decoding continues from its cache alike."""
    torch.manual_seed(2)
    model, vocab = tiny_model, tiny_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 150))
    nxt = torch.randint(0, vocab, (2, 1))
    with torch.no_grad():
        full = model(ids)
        reference_cache = model.new_cache(2, 256)
        model(ids, cache=reference_cache)
        want = model.decode_step(nxt, torch.tensor([150, 150]), reference_cache)
        for chunks in ([150], [16, 16, 118], [7, 121, 22], [1, 3, 128, 18]):
            cache, outs, start = model.new_cache(2, 256), [], 0
            for size in chunks:
                outs.append(model.extend(ids[:, start : start + size], start, cache))
                start += size
            cos = torch.nn.functional.cosine_similarity(torch.cat(outs, 1), full, dim=-1)
            assert cos.mean() > 0.99, chunks
            got = model.decode_step(nxt, torch.tensor([150, 150]), cache)
            assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99, chunks
    with pytest.raises(v4compile.InputError, match="does not fit"):
        model.extend(ids[:, :10], 250, model.new_cache(2, 256))


def test_several_decode_tokens_equal_one_at_a_time_and_a_rejected_draft_rolls_back(
        tiny_model: v4compile.DeepSeekV4) -> None:
    """decode_tokens (speculative verification) over 3 tokens equals three decode steps, caches included;
    a wrong draft, rolled back, leaves the cache as if only the real token had been decoded."""
    model = tiny_model
    torch.manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 131))
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        one, many = model.new_cache(2, 256), model.new_cache(2, 256)
        for cache in (one, many):
            model(ids[:, :127], cache=cache)
        pos = torch.tensor([127, 127])
        steps = [model.decode_step(ids[:, 127 + j : 128 + j], pos + j, one) for j in range(3)]
        logits, hidden = model.decode_tokens(ids[:, 127:130], pos, many)
        assert hidden.shape == (2, 3, model.config.hc_mult, model.config.dim)
        assert cos(logits, torch.cat(steps, 1), dim=-1).min() > 0.9999
        for a, b in zip(one.layers, many.layers, strict=True):
            assert torch.equal(a.window, b.window)
            for x, y in ((a.compressor, b.compressor), (a.indexer, b.indexer)):
                if x is not None:
                    assert torch.equal(x.read(), y.read()) and torch.equal(x.kv_state, y.kv_state)
        # the wrong draft at 127 closes a C4 and a C128 block: the rollback must undo that
        plain = model.new_cache(2, 256)
        model(ids[:, :126], cache=plain)
        fresh = model.new_cache(2, 256)
        model(ids[:, :126], cache=fresh)
        want = model.decode_step(ids[:, 126:127], pos - 1, plain)
        checkpoint = fresh.draft_checkpoint()
        got, _ = model.decode_tokens(torch.cat((ids[:, 126:127], torch.full((2, 1), 7)), 1), pos - 1, fresh)
        fresh.rollback_draft(checkpoint, torch.arange(2), pos)
        assert cos(got[:, 0], want[:, 0], dim=-1).min() > 0.9999
        after_plain = model.decode_step(ids[:, 127:128], pos, plain)
        after_draft = model.decode_step(ids[:, 127:128], pos, fresh)
        assert cos(after_plain, after_draft, dim=-1).min() > 0.9999


def test_mtp_step_after_a_prefill_chunk_and_in_decode_matches_the_full_path(tiny_model: v4compile.DeepSeekV4) -> None:
    model, window = tiny_model, tiny_model.config.window_size
    torch.manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (2, 101))
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        full = model.mtp_logits(hidden[:, :100], ids[:, 1:101])
        cache = model.new_cache(2, 256)
        start = 99 - window
        chunk = model.mtp_step(hidden[:, start:99], ids[:, start + 1 : 100], cache, start=start)
        assert cos(chunk[:, -1], full[:, 98], dim=-1).min() > 0.9999
        step = model.mtp_step(hidden[:, 99:100], ids[:, 100:101], cache, positions=torch.tensor([99, 99]))
        assert cos(step[:, 0], full[:, 99], dim=-1).min() > 0.9999
