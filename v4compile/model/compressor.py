"""The KV compressor: ``ratio`` tokens pooled into one entry by a learned per-dim softmax.

C128 pools each block of 128 tokens; C4 overlaps (each entry pools 8 slots: block j-1's tokens
through the first half of the projections, block j's through the second half). Entries are then
RMS-normalized, rotated at position j*ratio, and simulated-quantized: FP8 on the non-RoPE dims
for the main branch, Hadamard + FP4 for the indexer branch.
"""

from __future__ import annotations

import torch
from torch import nn

from . import quant
from .cache import CompressorCache
from .config import V4Config
from .hadamard import hadamard_rotate
from .linear import Linear
from .norm import RMSNorm, rms_norm
from .rope import apply_rope, rope_cos_sin


def pool_blocks(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """Pools complete blocks: kv/score ``[B, N*ratio, c*width]`` plus ``ape`` [ratio, c*width] -> ``[B, N, width]``.

    The overlapping form (c = 2) puts block j-1's first half and block j's second half into one
    softmax of 2*ratio slots per dim; block -1 contributes kv 0 at score -inf.
    """
    kv = kv.unflatten(1, (-1, ratio))
    score = score.unflatten(1, (-1, ratio)) + ape
    if kv.shape[-1] == 2 * width:
        kv = torch.cat((_shift_blocks(kv[..., :width], 0.0), kv[..., width:]), dim=2)
        score = torch.cat((_shift_blocks(score[..., :width], float("-inf")), score[..., width:]), dim=2)
    return (kv * score.softmax(dim=2)).sum(dim=2)


def finish_entries(pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   rotate: bool, pow2_scales: bool, quantize: bool = True) -> torch.Tensor:
    """Pooled entries (fp32) -> cache entries (bf16): RMSNorm, RoPE on the last ``2*cos.shape[-1]`` dims with the
    entries' ``cos``/``sin``, then FP8 simulation of the other dims (main branch) or the Hadamard rotation and FP4
    simulation of all of them (indexer branch, ``rotate``). ``quantize`` False keeps the entries bf16 after the RoPE
    (no simulation, no rotation): the finish of transformers' V4, which has no FP8 KV or FP4 indexer cache."""
    if rotate and not quantize:
        raise ValueError("finish_entries: the Hadamard rotation (rotate) comes with the FP4 simulation (quantize)")
    e = rms_norm(pooled.to(torch.bfloat16), norm_weight, eps)
    e = apply_rope(e, cos, sin)
    if not quantize:
        return e
    if rotate:
        return quant.fp4_simulate(hadamard_rotate(e))
    rope_dim = 2 * cos.shape[-1]
    nope = quant.fp8_simulate(e[..., :-rope_dim], quant.FP8_KV_BLOCK, pow2_scales)
    return torch.cat((nope, e[..., -rope_dim:]), dim=-1)


def _shift_blocks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """Block j gets block j-1's rows; block 0 gets ``fill``."""
    return torch.cat((torch.full_like(x[:, :1], fill), x[:, :-1]), dim=1)


class Compressor(nn.Module):
    """Official names: ``ape`` [ratio, c*width], ``wkv``/``wgate`` (fp32), ``norm``."""

    def __init__(self, config: V4Config, ratio: int, width: int, rotate: bool) -> None:
        super().__init__()
        self.ratio, self.width, self.rotate = ratio, width, rotate
        self.overlap = ratio == 4
        self.pow2_scales = config.pow2_scales
        c = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, c * width, dtype=torch.float32))
        self.wkv = Linear(config.dim, c * width, "fp32")
        self.wgate = Linear(config.dim, c * width, "fp32")
        self.norm = RMSNorm(width, config.norm_eps)

    def finish(self, pooled: torch.Tensor, entry_pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Normalizes, rotates (RoPE at the entry's first token position) and simulated-quantizes entries."""
        cos, sin = rope_cos_sin(freqs, entry_pos)
        return finish_entries(pooled, cos, sin, self.norm.weight, self.norm.eps, self.rotate, self.pow2_scales)

    def forward_full(self, x: torch.Tensor, freqs: torch.Tensor, cache: CompressorCache | None) -> torch.Tensor:
        """Entries ``[B, S//ratio, width]`` of a sequence starting at position 0; fills ``cache`` if given."""
        bsz, seqlen, _ = x.shape
        kv = self.wkv(x)
        score = self.wgate(x)
        n = seqlen // self.ratio
        cutoff = n * self.ratio
        pooled = pool_blocks(kv[:, :cutoff], score[:, :cutoff], self.ape, self.ratio, self.width)
        entry_pos = torch.arange(n, device=x.device) * self.ratio
        entries = self.finish(pooled, entry_pos, freqs)
        if cache is not None:
            self._store_prefill_state(kv, score, cutoff, cache)
            cache.write_range(0, entries)
        return entries

    def _store_prefill_state(self, kv: torch.Tensor, score: torch.Tensor, cutoff: int, cache: CompressorCache) -> None:
        """Leaves the remainder tokens (and, overlapping, the last full block) in the state for decode."""
        bsz, seqlen, _ = kv.shape
        ratio, rem = self.ratio, seqlen - cutoff
        offset = ratio if self.overlap else 0
        cache.kv_state[:bsz] = 0
        cache.score_state[:bsz] = float("-inf")
        if self.overlap and cutoff >= ratio:
            cache.kv_state[:bsz, :ratio] = kv[:, cutoff - ratio : cutoff]
            cache.score_state[:bsz, :ratio] = score[:, cutoff - ratio : cutoff] + self.ape
        if rem:
            cache.kv_state[:bsz, offset : offset + rem] = kv[:, cutoff:]
            cache.score_state[:bsz, offset : offset + rem] = score[:, cutoff:] + self.ape[:rem]

    def forward_chunk(self, x: torch.Tensor, start: int, freqs: torch.Tensor, cache: CompressorCache) -> torch.Tensor:
        """Adds a chunk of tokens at positions ``start..start+S-1`` (every row) to ``cache``: the open block
        in the state and the chunk's tokens complete blocks, whose entries are stored. Returns every entry
        visible by the chunk's end, ``[B, (start+S)//ratio, width]`` (earlier ones from the cache)."""
        bsz, seqlen, _ = x.shape
        ratio, w = self.ratio, self.width
        head = start % ratio
        offset = ratio if self.overlap else 0
        positions = torch.arange(start, start + seqlen, device=x.device)
        kv = torch.cat((cache.kv_state[:bsz, offset : offset + head], self.wkv(x)), dim=1)
        score = torch.cat((cache.score_state[:bsz, offset : offset + head],
                           self.wgate(x) + self.ape[positions % ratio]), dim=1)
        n_new = (head + seqlen) // ratio
        cutoff = n_new * ratio
        first = (start - head) // ratio
        if n_new:
            kv_blocks = kv[:, :cutoff].unflatten(1, (n_new, ratio))
            score_blocks = score[:, :cutoff].unflatten(1, (n_new, ratio))
            if self.overlap:
                prev_kv = torch.cat((cache.kv_state[:bsz, None, :ratio], kv_blocks[:, :-1]), dim=1)
                prev_score = torch.cat((cache.score_state[:bsz, None, :ratio], score_blocks[:, :-1]), dim=1)
                kv_blocks = torch.cat((prev_kv[..., :w], kv_blocks[..., w:]), dim=2)
                score_blocks = torch.cat((prev_score[..., :w], score_blocks[..., w:]), dim=2)
            pooled = (kv_blocks * score_blocks.softmax(dim=2)).sum(dim=2)
            entry_pos = (first + torch.arange(n_new, device=x.device)) * ratio
            cache.write_range(first, self.finish(pooled, entry_pos, freqs))
            if self.overlap:
                cache.kv_state[:bsz, :ratio] = kv[:, cutoff - ratio : cutoff]
                cache.score_state[:bsz, :ratio] = score[:, cutoff - ratio : cutoff]
        rem = head + seqlen - cutoff
        cache.kv_state[:bsz, offset:] = 0
        cache.score_state[:bsz, offset:] = float("-inf")
        cache.kv_state[:bsz, offset : offset + rem] = kv[:, cutoff:]
        cache.score_state[:bsz, offset : offset + rem] = score[:, cutoff:]
        return cache.read(bsz)[:, : (start + seqlen) // ratio]

    def forward_decode(
        self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, cache: CompressorCache
    ) -> None:
        """Adds S consecutive tokens per row (x [B, S, D], usually S = 1) from ``positions`` [B] to the state,
        one at a time; a token that closes a block emits its entry."""
        if x.shape[1] == 1:
            self._decode_token(x, positions, freqs, cache)
            return
        for j in range(x.shape[1]):
            self._decode_token(x[:, j : j + 1], positions + j, freqs, cache)

    def _decode_token(
        self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, cache: CompressorCache
    ) -> None:
        bsz = x.shape[0]
        ratio, w = self.ratio, self.width
        rows = torch.arange(bsz, device=x.device)
        kv = self.wkv(x[:, 0])
        score = self.wgate(x[:, 0]) + self.ape[positions % ratio]
        slot = positions % ratio + (ratio if self.overlap else 0)
        kv_state, score_state = cache.kv_state[:bsz], cache.score_state[:bsz]
        kv_state[rows, slot] = kv
        score_state[rows, slot] = score
        if self.overlap:
            kv_win = torch.cat((kv_state[:, :ratio, :w], kv_state[:, ratio:, w:]), dim=1)
            score_win = torch.cat((score_state[:, :ratio, :w], score_state[:, ratio:, w:]), dim=1)
        else:
            kv_win, score_win = kv_state, score_state
        pooled = (kv_win * score_win.softmax(dim=1)).sum(dim=1)
        entry_index = positions // ratio
        entry = self.finish(pooled, entry_index * ratio, freqs)
        emit = ((positions + 1) % ratio == 0).unsqueeze(-1)
        slot_index = entry_index.clamp(max=cache.capacity - 1)
        where = cache.locate(rows, slot_index)
        cache.pool[where] = torch.where(emit, entry, cache.pool[where])
        if self.overlap:
            e3 = emit.unsqueeze(-1)
            cache.kv_state[:bsz, :ratio] = torch.where(e3, kv_state[:, ratio:], kv_state[:, :ratio])
            cache.score_state[:bsz, :ratio] = torch.where(e3, score_state[:, ratio:], score_state[:, :ratio])
