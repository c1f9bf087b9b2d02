"""The lightning indexer of C4 layers: scores compressed entries per query and keeps the top k."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import quant
from .cache import CompressorCache
from .compressor import Compressor
from .config import V4Config
from .hadamard import hadamard_rotate
from .linear import Linear
from .parallel import TensorParallel
from .rope import apply_rope


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``I[b, s, j] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, j])`` [B, S, N] as fp32, from q [B, S, H, d],
    keys [B, N, d] and weights [B, S, H]; every step rounds to q's dtype (bf16 in the model), as the official
    indexer does. ``reduce`` (tensor parallelism: a sum over the ranks, each holding some heads) is applied to
    the unrounded fp32 head sums, which are rounded after it, so the result equals the single-process one."""
    dots = torch.einsum("bshd,bnd->bshn", q, keys.to(q.dtype)).relu()
    weighted = dots * weights.to(q.dtype).unsqueeze(-1)
    out = torch.promote_types(q.dtype, torch.float32)
    if reduce is None:
        return weighted.sum(dim=2).to(out)
    return reduce(weighted.to(out).sum(dim=2)).to(q.dtype).to(out)


def _official_rows(masked: torch.Tensor, entries: torch.Tensor, topk: int, width: int) -> torch.Tensor:
    """``torch.topk`` over each row's first ``entries[b]`` columns, k = min(topk, entries[b]), padded with -1 to
    ``width``: the official decode's row layout. Reads ``entries`` on the host, so it runs eagerly only."""
    if torch.compiler.is_compiling():
        raise RuntimeError("index_ties='official' decodes eagerly only (its top-k length follows each row's "
                           "position); compile with index_ties='lowest'")
    out = torch.full((*masked.shape[:-1], width), -1, dtype=torch.long, device=masked.device)
    counts = entries.tolist()
    for count in sorted(set(counts)):
        rows = torch.tensor([b for b, c in enumerate(counts) if c == count], device=masked.device)
        k = min(topk, count, width)
        if k:
            values, ids = masked[rows, :, :count].topk(k, dim=-1)
            out[rows, :, :k] = torch.where(values == float("-inf"), -1, ids)
    return out


class Indexer(nn.Module):
    """Official names: ``wq_b``, ``weights_proj`` (bf16), ``compressor`` (width index_head_dim, rotating).
    Under tensor parallelism a rank holds ``index_n_heads / tp`` heads; the compressor is replicated."""

    def __init__(self, config: V4Config, ratio: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.n_heads, self.head_dim, self.topk, self.ratio = (
            config.index_n_heads // self.tp.size, config.index_head_dim, config.index_topk, ratio)
        fmt = "fp8" if config.weights_fp8 else "bf16"
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, fmt, config.pow2_scales)
        self.weights_proj = Linear(config.dim, self.n_heads, "bf16")
        self.compressor = Compressor(config, ratio, self.head_dim, rotate=True)
        self.weight_scale = self.head_dim**-0.5 * config.index_n_heads**-0.5
        self.ties = config.index_ties

    def queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer queries [B, S, H_I, d_I]: projected, rotated (RoPE, Hadamard), FP4-simulated."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        return quant.fp4_simulate(hadamard_rotate(q))

    def scores(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``I[b, s, j] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, j])``, [B, S, N] (fp32 out).

        Computed in bf16 like the official indexer: its top-k ties and near-ties depend on that rounding. A
        tensor-parallel rank scores its own heads and the ranks' head sums are added before the rounding,
        so every rank selects the same entries, and the ones the single-process model selects."""
        weights = self.weights_proj(x) * self.weight_scale
        if self.tp.size == 1:
            return index_scores(q, keys, weights)
        return index_scores(q, keys, weights, self.tp.all_reduce)

    def select(self, scores: torch.Tensor, visible: torch.Tensor, entries: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k entry ids among visible ones [B, S, min(topk, N)] by ``config.index_ties``; -1 fills missing slots.

        The tie rule matters: the bf16 scores tie often (ReLU zeros), and prefill and decode must choose alike.
        "lowest" keeps the lowest ids. "official" takes ``torch.topk`` over the first ``entries`` [B] columns
        of each row (the entries that exist at the end of the call; all columns when None), as the official
        model does on the CPU."""
        k = min(self.topk, scores.shape[-1])
        masked = scores.masked_fill(~visible, float("-inf"))
        if self.ties == "lowest":
            values, ids = masked.sort(dim=-1, descending=True, stable=True)
            return torch.where(values[..., :k] == float("-inf"), -1, ids[..., :k])
        if entries is None:
            values, ids = masked.topk(k, dim=-1)
            return torch.where(values == float("-inf"), -1, ids)
        return _official_rows(masked, entries, self.topk, k)

    def forward_full(
        self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, freqs: torch.Tensor,
        cache: CompressorCache | None, replay: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Selected entry ids [B, S, k] for a sequence starting at position 0 (``replay`` instead, if given)."""
        seqlen = x.shape[1]
        keys = self.compressor.forward_full(x, freqs, cache)
        q = self.queries(qr, cos, sin)
        scores = self.scores(x, q, keys)
        count = (torch.arange(1, seqlen + 1, device=x.device) // self.ratio).unsqueeze(-1)
        visible = torch.arange(keys.shape[1], device=x.device) < count
        return replay if replay is not None else self.select(scores, visible.unsqueeze(0))

    def forward_chunk(
        self, x: torch.Tensor, qr: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
        freqs: torch.Tensor, cache: CompressorCache, replay: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Selected entry ids [B, S, k] for a chunk of tokens at positions ``start..start+S-1``."""
        seqlen = x.shape[1]
        keys = self.compressor.forward_chunk(x, start, freqs, cache)
        scores = self.scores(x, self.queries(qr, cos, sin), keys)
        count = (torch.arange(start + 1, start + seqlen + 1, device=x.device) // self.ratio).unsqueeze(-1)
        visible = torch.arange(keys.shape[1], device=x.device) < count
        return replay if replay is not None else self.select(scores, visible.unsqueeze(0))

    def forward_decode(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        freqs: torch.Tensor, cache: CompressorCache, replay: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Selected entry ids [B, S, k] for S consecutive tokens per row from ``positions`` [B] (usually S = 1)."""
        bsz, seqlen = x.shape[:2]
        pos = positions.unsqueeze(-1) + torch.arange(seqlen, device=x.device)
        self.compressor.forward_decode(x, positions, freqs, cache)
        keys = cache.read(bsz)
        q = self.queries(qr, cos, sin)
        scores = self.scores(x, q, keys)
        count = ((pos + 1) // self.ratio).unsqueeze(-1)
        visible = torch.arange(keys.shape[1], device=x.device).view(1, 1, -1) < count
        if replay is not None:
            return replay
        return self.select(scores, visible, count[:, -1, 0] if self.ties == "official" else None)
