"""Hybrid attention: MQA over a sliding window plus compressed entries (C4 via the indexer, C128 dense).

One 512-d KV entry per token serves as key and value; queries are low-rank with per-head RMS
scaling; a learned per-head sink enters the softmax denominator; the output is un-rotated and
projected by grouped low-rank ``wo_a`` then ``wo_b``.
"""

from __future__ import annotations

import torch
from torch import nn

from . import quant
from .cache import LayerCache
from .compressor import Compressor
from .config import V4Config
from .indexer import Indexer
from .linear import Linear
from .norm import RMSNorm
from .parallel import TensorParallel
from .rope import apply_rope, rope_cos_sin, rope_frequencies
from .routing import Routing
from .sparse_attention import sparse_attention


def window_index_full(seqlen: int, window: int, device: torch.device) -> torch.Tensor:
    """[S, min(S, window)]: query t reads positions max(0, t-window+1)..t; later slots are -1."""
    t = torch.arange(seqlen, device=device).unsqueeze(1)
    idx = (t - window + 1).clamp(min=0) + torch.arange(min(seqlen, window), device=device)
    return torch.where(idx > t, -1, idx)


def window_index_decode(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, window]: the ring slots (slot = position mod window; the ring already holds ``positions``) of
    positions max(0, pos-window+1)..pos, in that order, then -1: the order ``window_index_full`` reads them in,
    so a decode step sums a query's terms as the full forward does (bitwise the same in deterministic mode)."""
    return window_slots(positions.unsqueeze(-1), positions.view(-1, 1, 1) + 1, window)


def window_slots(pos: torch.Tensor, first_new: torch.Tensor, window: int) -> torch.Tensor:
    """[B, S, window] ids for queries at ``pos`` [B, S] reading a window ring followed by this call's own
    keys (from position ``first_new`` [B, 1, 1] on, at ids window + offset): positions max(0, p-window+1)..p in
    order, an earlier one at its ring slot, then -1."""
    held = (pos - window + 1).clamp(min=0).unsqueeze(-1) + torch.arange(window, device=pos.device)
    slot = torch.where(held < first_new, held % window, window + held - first_new)
    return torch.where(held > pos.unsqueeze(-1), -1, slot)


def _replayed(routing: Routing | None, layer: int) -> torch.Tensor | None:
    return routing.indexer[layer] if routing is not None and routing.replay else None


def _record(routing: Routing | None, layer: int, chosen: torch.Tensor) -> None:
    if routing is not None and not routing.replay:
        routing.indexer[layer] = chosen


def _append(keys: torch.Tensor, index: torch.Tensor, entries: torch.Tensor,
            chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys followed by the compressed entries, and the index extended by the chosen entries' slots."""
    return torch.cat((keys, entries), dim=1), torch.cat((index, torch.where(chosen >= 0, chosen + keys.shape[1], -1)),
                                                         dim=-1)


class Attention(nn.Module):
    """Official names: attn_sink, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, compressor, indexer.
    Under tensor parallelism a rank holds ``n_heads / tp`` query heads and ``o_groups / tp`` output groups
    (their ``wo_a`` rows and ``wo_b`` input columns); the KV path and compressors are replicated."""

    def __init__(self, config: V4Config, ratio: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        c = config
        self.tp = tp or TensorParallel()
        heads, groups = c.n_heads // self.tp.size, c.o_groups // self.tp.size
        self.ratio, self.n_heads, self.head_dim, self.rope_dim = ratio, heads, c.head_dim, c.rope_head_dim
        self.window, self.groups, self.o_lora_rank, self.eps = c.window_size, groups, c.o_lora_rank, c.norm_eps
        self.pow2_scales = c.pow2_scales
        self.softmax_scale = c.head_dim**-0.5
        fmt = "fp8" if c.weights_fp8 else "bf16"
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        self.wq_a = Linear(c.dim, c.q_lora_rank, fmt, c.pow2_scales)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = Linear(c.q_lora_rank, heads * c.head_dim, fmt, c.pow2_scales)
        self.wkv = Linear(c.dim, c.head_dim, fmt, c.pow2_scales)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.wo_a = Linear(c.n_heads * c.head_dim // c.o_groups, groups * c.o_lora_rank, "bf16")
        self.wo_b = Linear(groups * c.o_lora_rank, c.dim, fmt, c.pow2_scales)
        self.compressor = Compressor(c, ratio, c.head_dim, rotate=False) if ratio else None
        self.indexer = Indexer(c, ratio, self.tp) if ratio == 4 else None
        if ratio:
            freqs = rope_frequencies(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                                     c.beta_fast, c.beta_slow)
        else:
            freqs = rope_frequencies(c.rope_head_dim, c.rope_theta, 0, c.rope_factor, c.beta_fast, c.beta_slow)
        self.register_buffer("freqs", freqs, persistent=False)

    # ------------------------------------------------------------------ shared pieces
    def _queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(self.tp.region_input(qr)).unflatten(-1, (self.n_heads, self.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        return apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)), qr

    def _window_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        nope = quant.fp8_simulate(kv[..., : -self.rope_dim], quant.FP8_KV_BLOCK, self.pow2_scales)
        return torch.cat((nope, kv[..., -self.rope_dim :]), dim=-1)

    def _output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        o = apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        o = o.flatten(2).unflatten(-1, (self.groups, -1))
        wo_a = self.wo_a.weight.view(self.groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        if self.tp.size == 1:
            return self.wo_b(o.flatten(2))
        return self.tp.all_reduce(self.wo_b.unrounded(o.flatten(2))).to(torch.bfloat16)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Sparse attention of this rank's query heads over the replicated ``keys`` named by ``index``."""
        return sparse_attention(q, self.tp.region_input(keys), self.attn_sink, index, self.softmax_scale)

    def _dense_choice(self, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """C128: every complete entry before each query. ``positions`` [..., S] -> ids [..., S, N], -1 if not yet."""
        ids = torch.arange(entries.shape[1], device=entries.device)
        return torch.where(ids < ((positions + 1) // self.ratio).unsqueeze(-1), ids, -1)

    # ------------------------------------------------------------------ full sequence / prefill
    def forward_full(self, x: torch.Tensor, cache: LayerCache | None, routing: Routing | None = None,
                     layer: int = 0) -> torch.Tensor:
        """Attention for a whole sequence starting at position 0; fills ``cache`` when given (prefill)."""
        bsz, seqlen, _ = x.shape
        cos, sin = rope_cos_sin(self.freqs, torch.arange(seqlen, device=x.device))
        q, qr = self._queries(x, cos, sin)
        kv = self._window_kv(x, cos, sin)
        index = window_index_full(seqlen, self.window, x.device).expand(bsz, -1, -1)
        keys = kv
        if self.ratio:
            entries = self.compressor.forward_full(x, self.freqs, cache.compressor if cache else None)
            if self.indexer is not None:
                chosen = self.indexer.forward_full(x, qr, cos, sin, self.freqs, cache.indexer if cache else None,
                                                   _replayed(routing, layer))
                _record(routing, layer, chosen)
            else:
                chosen = self._dense_choice(entries, torch.arange(seqlen, device=x.device)).expand(bsz, -1, -1)
            keys, index = _append(keys, index, entries, chosen)
        if cache is not None:
            self._store_window(kv, cache)
        return self._output(self._attend(q, keys, index), cos, sin)

    def _store_window(self, kv: torch.Tensor, cache: LayerCache) -> None:
        """Writes the last ``window`` positions of a prefill into their ring slots (slot = pos mod window)."""
        bsz, seqlen, _ = kv.shape
        keep = min(seqlen, self.window)
        slots = torch.arange(seqlen - keep, seqlen, device=kv.device) % self.window
        cache.window[:bsz, slots] = kv[:, seqlen - keep :]

    # ------------------------------------------------------------------ chunk (prefill continuing a cache)
    def forward_chunk(self, x: torch.Tensor, start: int, cache: LayerCache, routing: Routing | None = None,
                      layer: int = 0) -> torch.Tensor:
        """Attention for a chunk of tokens at positions ``start..start+S-1`` (every row) after ``start``
        tokens already in ``cache``: the window reaches back into the ring, the compressed entries cover
        cached and new blocks; updates ``cache``. ``start == 0`` is a prefill."""
        bsz, seqlen, _ = x.shape
        positions = torch.arange(start, start + seqlen, device=x.device)
        cos, sin = rope_cos_sin(self.freqs, positions)
        q, qr = self._queries(x, cos, sin)
        kv = self._window_kv(x, cos, sin)
        back = min(start, self.window - 1)
        earlier = torch.arange(start - back, start, device=x.device) % self.window
        keys = torch.cat((cache.window[:bsz, earlier], kv), dim=1)
        index = window_index_full(back + seqlen, self.window, x.device)[back:].expand(bsz, -1, -1)
        if self.ratio:
            entries = self.compressor.forward_chunk(x, start, self.freqs, cache.compressor)
            if self.indexer is not None:
                chosen = self.indexer.forward_chunk(x, qr, start, cos, sin, self.freqs, cache.indexer,
                                                    _replayed(routing, layer))
                _record(routing, layer, chosen)
            else:
                chosen = self._dense_choice(entries, positions).expand(bsz, -1, -1)
            keys, index = _append(keys, index, entries, chosen)
        keep = min(seqlen, self.window)
        cache.window[:bsz, positions[seqlen - keep :] % self.window] = kv[:, seqlen - keep :]
        return self._output(self._attend(q, keys, index), cos, sin)

    # ------------------------------------------------------------------ decode
    def forward_decode(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache,
                       routing: Routing | None = None, layer: int = 0) -> torch.Tensor:
        """Attention for one token per row (x [B, 1, D]) at ``positions`` [B], reading and updating ``cache``;
        x [B, S, D] takes S consecutive tokens per row from ``positions`` (speculative verification)."""
        if x.shape[1] > 1:
            return self._forward_decode_tokens(x, positions, cache, routing, layer)
        bsz = x.shape[0]
        rows = torch.arange(bsz, device=x.device)
        cos, sin = rope_cos_sin(self.freqs, positions.unsqueeze(-1))
        q, qr = self._queries(x, cos, sin)
        kv = self._window_kv(x, cos, sin)
        cache.window[rows, positions % self.window] = kv[:, 0]
        index = window_index_decode(positions, self.window)
        keys = cache.window[:bsz]
        if self.ratio:
            keys, index = self._decode_compressed(x, qr, positions, positions.view(bsz, 1), cos, sin, cache, routing,
                                                  layer, keys, index)
        return self._output(self._attend(q, keys, index), cos, sin)

    def _decode_compressed(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, pos: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache, routing: Routing | None,
                           layer: int, keys: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: the compressor takes the new tokens, and the chosen compressed entries (indexer top-k for C4,
        all visible ones for C128, as of the query positions ``pos`` [B, S]) join ``keys`` and ``index``."""
        self.compressor.forward_decode(x, positions, self.freqs, cache.compressor)
        entries = cache.compressor.read(x.shape[0])
        if self.indexer is not None:
            chosen = self.indexer.forward_decode(x, qr, positions, cos, sin, self.freqs, cache.indexer,
                                                 _replayed(routing, layer))
            _record(routing, layer, chosen)
            entries, chosen = cache.sparse_entries(chosen, positions)
        else:
            chosen = self._dense_choice(entries, pos)
        return _append(keys, index, entries, chosen)

    def _forward_decode_tokens(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache,
                               routing: Routing | None, layer: int) -> torch.Tensor:
        """S tokens per row at ``positions[b] + 0..S-1``: each reads the ring as it was before this call for
        earlier positions and this call's own keys for the rest (in position order, as the full forward), so
        writing token j's ring slot cannot hide a position token i < j still needs; the compressors take the
        tokens one by one."""
        bsz, seqlen, _ = x.shape
        rows = torch.arange(bsz, device=x.device)
        pos = positions.unsqueeze(-1) + torch.arange(seqlen, device=x.device)
        cos, sin = rope_cos_sin(self.freqs, pos)
        q, qr = self._queries(x, cos, sin)
        kv = self._window_kv(x, cos, sin)
        index = window_slots(pos, positions.view(bsz, 1, 1), self.window)
        keys = torch.cat((cache.window[:bsz], kv), dim=1)
        if self.ratio:
            keys, index = self._decode_compressed(x, qr, positions, pos, cos, sin, cache, routing, layer, keys, index)
        keep = min(seqlen, self.window)  # the ring keeps the last window tokens (one write per slot)
        cache.window[rows.unsqueeze(-1), pos[:, seqlen - keep :] % self.window] = kv[:, seqlen - keep :]
        return self._output(self._attend(q, keys, index), cos, sin)
