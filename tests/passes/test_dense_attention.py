"""Dense masked attention (transformers' eager spelling: ``softmax(cat(q K^T * scale + mask, sink))[..., :N] @ V``)
becomes the sparse attention kernel over the columns its mask lets each row read: a sliding band, a top-k scatter,
any other 0 / masked block, and near-misses for what is not that math."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from v4compile.passes.manager import GraphReport, PassManager
from v4compile.passes.sparse_attention import SparseAttention

B, H, S, D, WINDOW, TOP, N_COMP = 2, 4, 24, 64, 6, 3, 6
LOWEST = torch.finfo(torch.bfloat16).min


def _rewrite(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> tuple[GraphReport, torch.fx.GraphModule]:
    gm = make_fx(fn, pre_dispatch=True)(*inputs)
    _, report = PassManager([SparseAttention()], backend="reference").run(gm)
    return report, gm


def _window_mask(padding: torch.Tensor | None = None, positions: bool = False) -> torch.Tensor:
    """transformers' sliding-window causal mask from index comparisons (of the indices themselves, or of the
    positions they look up: ``position_ids[batch_idx, q_idx]``), optionally and-ed with a padding lookup."""
    q_idx = torch.arange(S)[None, None, :, None]
    kv_idx = torch.arange(S)[None, None, None, :]
    if positions:
        position_ids, batch_idx = (torch.arange(S) + 0).unsqueeze(0).expand(B, -1), torch.arange(B)[:, None, None, None]
        q_idx, kv_idx = position_ids[batch_idx, q_idx], position_ids[batch_idx, kv_idx]
    allowed = (kv_idx > q_idx - WINDOW) & (kv_idx <= q_idx)
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
    allowed = allowed.expand(B, -1, S, S)
    return torch.where(allowed, torch.zeros((), dtype=torch.bfloat16), LOWEST)


def _attend(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' eager attention with one KV head read as keys and values, and a per-head sink."""
    keys = kv[:, :, None].expand(B, 1, H, kv.shape[2], D).reshape(B, H, kv.shape[2], D)
    scores = torch.matmul(q, keys.transpose(2, 3)) * D**-0.5 + mask
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, keys).transpose(1, 2).contiguous()


def _inputs(entries: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen).bfloat16()
    kv = torch.randn(B, 1, entries, D, generator=gen).bfloat16()
    return q, kv, torch.randn(H, generator=gen)


def _top_k_block(scores: torch.Tensor) -> torch.Tensor:
    """The C4 layer's block bias: -inf except the top-k entries each row may read (future ones -1, then dropped)."""
    ready = (torch.arange(S) + 1) // 4
    future = torch.arange(N_COMP)[None, None, :] >= ready[None, :, None]
    ids = scores.masked_fill(future, float("-inf")).topk(TOP, dim=-1).indices
    ids = torch.where(ids >= ready[None, :, None], torch.full_like(ids, -1), ids)
    safe = torch.where(ids >= 0, ids, torch.full_like(ids, N_COMP))
    bias = torch.full((B, 1, S, N_COMP + 1), float("-inf"), dtype=torch.bfloat16)
    bias.scatter_(-1, safe.unsqueeze(1), 0.0)
    return bias[..., :N_COMP]


def _check(report: GraphReport, gm: torch.fx.GraphModule, want: torch.Tensor, inputs: tuple, entries: int,
           blocks: str) -> None:
    (match,) = report.matches
    assert (match.details["form"], match.details["entries"], match.details["mask"]) == ("dense masked attention",
                                                                                         entries, blocks)
    got = gm(*inputs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < SparseAttention.tolerance


@pytest.mark.parametrize("positions", [False, True])
def test_a_sliding_window_becomes_a_band_of_its_width(positions: bool) -> None:
    inputs = _inputs(S)

    def layer(q, kv, sinks):
        return _attend(q, kv, sinks, _window_mask(positions=positions))

    report, gm = _rewrite(layer, *inputs)
    _check(report, gm, layer(*inputs), inputs, WINDOW, f"band of {WINDOW}")


def test_window_plus_top_k_plus_causal_blocks_read_only_their_entries() -> None:
    """The C4 layer (window + scattered top-k) and the C128 layer (window + a masked_fill causal block, or zero
    columns padded on where it has no block bias) of transformers' V4: W + k and W + T entries a row, matching the
    dense softmax."""
    q, kv, sinks = _inputs(S + N_COMP)
    scores = torch.randn(B, S, N_COMP, generator=torch.Generator().manual_seed(3))

    def c4(q, kv, sinks, scores):
        return _attend(q, kv, sinks, torch.cat([_window_mask(), _top_k_block(scores)], dim=-1))

    def c128(q, kv, sinks, scores):
        ready = ((torch.arange(S) + 1) // 4)[None, None, :, None]
        causal = torch.zeros(B, 1, S, N_COMP, dtype=torch.bfloat16).masked_fill(
            torch.arange(N_COMP).view(1, 1, 1, -1) >= ready, float("-inf"))
        return _attend(q, kv, sinks, torch.cat([_window_mask(), causal], dim=-1))

    def padded(q, kv, sinks, scores):  # transformers' mask when a layer has no block bias: zero columns appended
        return _attend(q, kv, sinks, F.pad(_window_mask(), (0, N_COMP), value=0.0))

    inputs = (q, kv, sinks, scores)
    report, gm = _rewrite(padded, *inputs)
    _check(report, gm, padded(*inputs), inputs, WINDOW + N_COMP, f"band of {WINDOW} + every column of {N_COMP}")
    report, gm = _rewrite(c4, *inputs)
    _check(report, gm, c4(*inputs), inputs, WINDOW + TOP, f"band of {WINDOW} + top-{TOP}")
    report, gm = _rewrite(c128, *inputs)
    _check(report, gm, c128(*inputs), inputs, WINDOW + N_COMP, f"band of {WINDOW} + every column of {N_COMP}")


def test_a_padding_mask_keeps_the_band_and_reads_membership_from_the_mask() -> None:
    """Left padding and-ed into the window (a lookup, not an index comparison): the band still bounds the row, and
    each of its columns is kept where the mask reads it; padded rows see only the sink, as in the dense softmax."""
    inputs = _inputs(S)
    padding = torch.ones(B, S, dtype=torch.long)
    padding[0, :5] = 0

    def layer(q, kv, sinks, padding):
        return _attend(q, kv, sinks, _window_mask(padding))

    report, gm = _rewrite(layer, *inputs, padding)
    _check(report, gm, layer(*inputs, padding), (*inputs, padding), WINDOW, f"band of {WINDOW} (within the mask)")


def test_scattered_ids_that_may_repeat_read_the_whole_block() -> None:
    """ids from a table, not a top-k, may name an entry twice: the mask reads it once, so the block is read column
    by column from the mask instead (the kernel would count a repeated id twice)."""
    q, kv, sinks = _inputs(N_COMP)
    table = torch.tensor([[0, 2, 2], [1, 1, 5], [3, 4, 0]]).repeat(B, S // 3, 1)

    def layer(q, kv, sinks, table):
        bias = torch.full((B, 1, S, N_COMP), float("-inf"), dtype=torch.bfloat16)
        return _attend(q, kv, sinks, bias.scatter(-1, table.unsqueeze(1), 0.0))

    report, gm = _rewrite(layer, q, kv, sinks, table)
    _check(report, gm, layer(q, kv, sinks, table), (q, kv, sinks, table), N_COMP, f"every column of {N_COMP}")


@pytest.mark.parametrize(("variant", "reason"), [
    ("bias", "is not 0 where read"),
    ("per head", "differs per head"),
    ("no sink", "a sink column cut off"),
    ("separate values", "keys and values are not one KV head"),
])
def test_what_is_not_the_kernels_math_is_a_near_miss_saying_why(variant: str, reason: str) -> None:
    q, kv, sinks = _inputs(S)
    other = torch.randn(B, 1, S, D).bfloat16()

    def layer(q, kv, sinks, other):
        mask = _window_mask()
        if variant == "bias":
            mask = mask + torch.linspace(0, 1, S, dtype=torch.bfloat16)
        if variant == "per head":
            mask = mask.expand(B, H, S, S) + torch.zeros(1, H, 1, 1, dtype=torch.bfloat16)
        if variant == "no sink":
            keys = kv.expand(B, H, S, D)
            probs = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * D**-0.5 + mask, dim=-1)
            return torch.matmul(probs, keys).transpose(1, 2)
        if variant == "separate values":
            keys, values = kv.expand(B, H, S, D), other.expand(B, H, S, D)
            scores = torch.matmul(q, keys.transpose(2, 3)) * D**-0.5 + mask
            logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1].to(kv.dtype)
            return torch.matmul(probs, values).transpose(1, 2)
        return _attend(q, kv, sinks, mask)

    report, _ = _rewrite(layer, q, kv, sinks, other)
    assert not report.matches
    reasons = [n.reason for p in report.passes for n in p.near_misses]
    assert any(reason in r for r in reasons), reasons


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 40), window=st.integers(1, 12), shift=st.integers(-3, 3), pad=st.integers(0, 6),
       seed=st.integers(0, 2**16))
def test_any_band_offset_and_padding_reads_what_the_dense_mask_reads(rows: int, window: int, shift: int, pad: int,
                                                                     seed: int) -> None:
    """Bands of any width, moved off the diagonal (``kv <= q + shift``), on any row count, with left padding: the
    kernel's rows equal the dense softmax's (a band wider than the row count is read column by column)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, rows, 16, generator=gen).bfloat16()
    kv = torch.randn(1, 1, rows, 16, generator=gen).bfloat16()
    sinks = torch.randn(2, generator=gen)
    padding = torch.ones(1, rows, dtype=torch.long)
    padding[0, :min(pad, rows - 1)] = 0

    def layer(q, kv, sinks, padding):
        q_idx, kv_idx = torch.arange(rows)[None, None, :, None], torch.arange(rows)[None, None, None, :]
        allowed = (kv_idx > q_idx + shift - window) & (kv_idx <= q_idx + shift) & padding.bool()[:, None, None, :]
        mask = torch.where(allowed, torch.zeros((), dtype=torch.bfloat16), LOWEST)
        keys = kv.expand(1, 2, rows, 16)
        scores = torch.matmul(q, keys.transpose(2, 3)) * 0.25 + mask
        logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(1, -1, rows, -1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(kv.dtype)
        return torch.matmul(probs, keys).transpose(1, 2)

    report, gm = _rewrite(layer, q, kv, sinks, padding)
    (match,) = report.matches
    assert match.details["entries"] == (window if window < rows else rows)
    got, want = gm(q, kv, sinks, padding).float(), layer(q, kv, sinks, padding).float()
    # rows that read nothing attend to the sink alone: 0, in both
    assert (got - want).abs().max() <= SparseAttention.tolerance * want.abs().max()
