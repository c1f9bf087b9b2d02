"""DeepSeekV4: the whole model (embedding, mHC blocks, head, MTP) serving three uses with one set of weights.

- ``model(ids)``: full-sequence logits (training, scoring);
- ``model(ids, cache=cache)``: the same, and fills ``cache`` (prefill);
- ``model.extend(ids, start, cache)``: a chunk at positions ``start..`` continuing the cache (chunked prefill);
- ``model.decode_step(ids, positions, cache)``: one token per row against the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .block import Block
from .cache import LayerCache, V4Cache
from .config import V4Config
from .linear import Linear
from .mhc import hc_head
from .mtp import MTPBlock
from .norm import RMSNorm
from .parallel import TensorParallel, check_degree
from .routing import Routing


class InputError(ValueError):
    """Model inputs that do not fit the model or its cache."""


class Embedding(nn.Module):
    """Token embedding with a bf16 ``weight`` [vocab, dim]; under tensor parallelism each rank holds a
    contiguous part of the vocabulary."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.first, stop = self.tp.part(vocab_size)
        self.weight = nn.Parameter(torch.zeros(stop - self.first, dim, dtype=torch.bfloat16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeds token ids; a tensor-parallel rank looks up the ids it holds (zeros elsewhere) and the ranks'
        lookups are summed."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(held, local, 0), self.weight).masked_fill(~held.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class DeepSeekV4(nn.Module):
    """The reference DeepSeek-V4 model. ``seed`` gives a seeded random init (None leaves zeros for loading).

    ``tp_rank``/``tp_size``: this process's shard of a tensor-parallel model (see ``parallel.py``); a seeded
    shard holds exactly its part of the single-process model with the same seed."""

    def __init__(self, config: V4Config, *, seed: int | None = 0, device: torch.device | str | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        check_degree(config, tp_size, tp_rank)
        c = self.config = config
        tp = self.tp = TensorParallel(tp_rank, tp_size)
        with torch.device(device or "cpu"):
            self.embed = Embedding(c.vocab_size, c.dim, tp)
            self.layers = nn.ModuleList(Block(c, r, hashed=i < c.n_hash_layers, tp=tp)
                                        for i, r in enumerate(c.layer_ratios))
            self.norm = RMSNorm(c.dim, c.norm_eps)
            self.head = Linear(c.dim, c.vocab_size // tp.size, "fp32")
            self.hc_head_fn = nn.Parameter(torch.zeros(c.hc_mult, c.hc_mult * c.dim, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.zeros(c.hc_mult, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
            self.mtp = nn.ModuleList(MTPBlock(c, k, tp) for k in range(c.n_mtp_layers))
        if seed is not None and str(device) != "meta":
            from .init import random_init

            random_init(self, seed)

    def shard(self, tp_rank: int, tp_size: int) -> DeepSeekV4:
        """This single-process model's part for tensor-parallel rank ``tp_rank`` of ``tp_size``, as a new model on
        the same device: what ``load`` or a seeded build gives that rank, without reading or drawing the weights
        again (a benchmark compares the two models in one process)."""
        if self.tp.size != 1:
            raise ValueError(f"shard() splits a single-process model; this one is already tp rank {self.tp.rank} "
                             f"of {self.tp.size}")
        part = DeepSeekV4(self.config, seed=None, device=self.embed.weight.device, tp_rank=tp_rank, tp_size=tp_size)
        targets = part.state_dict()
        with torch.no_grad():
            for name, value in self.state_dict().items():
                place = part.tp.placement(name, tuple(value.shape), self.config)
                if place is not None:
                    targets[place.name].copy_(place.take(value))
        return part

    # ------------------------------------------------------------------ input checks (eager only)
    def _check_ids(self, input_ids: torch.Tensor, name: str = "input_ids") -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InputError(f"{name} must be a 2-D integer tensor [batch, seq], got {_describe(input_ids)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"{name} must have an integer dtype, got {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise InputError(f"{name} is empty (sequence length 0)")
        if not _values_readable(input_ids) or input_ids.numel() == 0:
            return
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"{name} holds token id {bad} outside the vocabulary [0, {self.config.vocab_size})")

    def _check_length(self, seqlen: int, cache: V4Cache | None) -> None:
        limit = cache.max_seq_len if cache is not None else self.config.max_seq_len
        if seqlen > limit:
            raise InputError(f"sequence of {seqlen} tokens is longer than the configured maximum {limit} "
                             f"(max_seq_len)")

    def _check_routing(self, routing: Routing | None, input_ids: torch.Tensor) -> None:
        if routing is not None and routing.replay and _values_readable(input_ids):
            routing.validate(self.config, *input_ids.shape)

    def _check_cache(self, cache: V4Cache, batch: int) -> None:
        if not isinstance(cache, V4Cache):
            raise InputError(f"cache must be a V4Cache (model.new_cache), got {type(cache).__name__}")
        if cache.batch_size < batch or len(cache.layers) != len(self.layers):
            raise InputError(f"cache holds {cache.batch_size} rows for {len(cache.layers)} layers; "
                             f"need {batch} rows for {len(self.layers)} layers")

    # ------------------------------------------------------------------ public API
    def new_cache(self, batch_size: int, max_seq_len: int | None = None,
                  device: torch.device | str | None = None) -> V4Cache:
        """An empty decode cache for ``batch_size`` sequences (on the model's device by default)."""
        return V4Cache(self.config, batch_size, max_seq_len, device or self.embed.weight.device)

    def hidden_states(self, input_ids: torch.Tensor, cache: V4Cache | None = None,
                      routing: Routing | None = None) -> torch.Tensor:
        """Final mHC streams [B, S, hc_mult, dim] of a full sequence; fills ``cache`` when given (prefill).
        ``routing`` records the experts and indexer entries every layer chose, or replays given ones."""
        self._check_ids(input_ids)
        self._check_routing(routing, input_ids)
        self._check_length(input_ids.shape[1], cache)
        if cache is not None:
            self._check_cache(cache, input_ids.shape[0])
        return self._run_layers(input_ids, cache, routing)

    def _run_layers(self, input_ids: torch.Tensor, cache: V4Cache | None, routing: Routing | None,
                    positions: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
        """The main layers over the embedded ids: a full sequence, a chunk from ``start`` or decode at
        ``positions`` (see ``Block.forward``)."""
        x = self.embed(input_ids).unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)
        for i, layer in enumerate(self.layers):
            x = layer(x, input_ids, cache.layers[i] if cache is not None else None, positions=positions, start=start,
                      routing=routing, layer=i)
        return x

    def logits(self, streams: torch.Tensor, last: bool = False) -> torch.Tensor:
        """fp32 logits from final streams [B, S, n, D]: mHC head, final RMSNorm, output head, [B, S, vocab].
        ``last``: the last position's [B, vocab] only, as the official model computes a prefill's logits (mHC
        head and norm over every position, the output head on the last row; the rows of a product decide
        its rounding, so this is how to reproduce the official logits bitwise)."""
        h = hc_head(streams, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.config.hc_eps,
                    self.config.norm_eps)
        h = self.norm(h)
        return self.tp.all_gather(self.head(self.tp.region_input((h[:, -1] if last else h).float())))

    def forward(self, input_ids: torch.Tensor, cache: V4Cache | None = None,
                routing: Routing | None = None) -> torch.Tensor:
        """fp32 logits [B, S, vocab] at every position; fills ``cache`` when given (prefill from position 0);
        ``routing`` records or replays the discrete choices (see ``Routing``)."""
        return self.logits(self.hidden_states(input_ids, cache, routing))

    def extend_hidden(self, input_ids: torch.Tensor, start: int, cache: V4Cache,
                      routing: Routing | None = None) -> torch.Tensor:
        """Final streams [B, S, hc_mult, dim] of a chunk at positions ``start..start+S-1`` continuing ``cache``
        (which holds the first ``start`` tokens of every row); updates ``cache``."""
        self._check_ids(input_ids)
        self._check_routing(routing, input_ids)
        self._check_cache(cache, input_ids.shape[0])
        if start < 0 or start + input_ids.shape[1] > cache.max_seq_len:
            raise InputError(f"chunk at positions {start}..{start + input_ids.shape[1] - 1} does not fit the "
                             f"cache's maximum length {cache.max_seq_len} (max_seq_len)")
        return self._run_layers(input_ids, cache, routing, start=start)

    def extend(self, input_ids: torch.Tensor, start: int, cache: V4Cache,
               routing: Routing | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] of a chunk continuing ``cache`` at position ``start`` (chunked prefill)."""
        return self.logits(self.extend_hidden(input_ids, start, cache, routing))

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache,
                    routing: Routing | None = None) -> torch.Tensor:
        """Logits [B, 1, vocab] for one new token per row at ``positions`` [B], reading and updating ``cache``."""
        self._check_decode(input_ids, positions, cache, routing, one_token=True)
        return self.logits(self._run_layers(input_ids, cache, routing, positions=positions))

    def decode_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      cache: V4Cache, routing: Routing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, S, vocab] and final streams [B, S, n, D] of S consecutive tokens per row starting at
        ``positions`` [B] (speculative verification: the current token and its drafts); updates ``cache``."""
        self._check_decode(input_ids, positions, cache, routing, one_token=False)
        x = self._run_layers(input_ids, cache, routing, positions=positions)
        return self.logits(x), x

    def _check_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache,
                      routing: Routing | None, one_token: bool) -> None:
        self._check_ids(input_ids)
        self._check_routing(routing, input_ids)
        self._check_cache(cache, input_ids.shape[0])
        if one_token and input_ids.shape[1] != 1:
            raise InputError(f"decode_step takes one token per row, got input_ids of shape {tuple(input_ids.shape)}")
        if positions.shape != (input_ids.shape[0],):
            raise InputError(f"positions must have shape [{input_ids.shape[0]}], got {tuple(positions.shape)}")
        if _values_readable(positions):
            last = int(positions.max()) + input_ids.shape[1] - 1
            if last >= cache.max_seq_len:
                raise InputError(f"position {last} is beyond the cache's maximum length {cache.max_seq_len} "
                                 "(max_seq_len)")

    def mtp_step(self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: V4Cache, *,
                 positions: torch.Tensor | None = None, start: int | None = None, k: int = 0) -> torch.Tensor:
        """Logits of MTP block ``k`` (the token after ``next_ids``) at cached positions: streams ``hidden``
        [B, S, n, D] of the main model at those positions and ``next_ids`` [B, S] (the tokens that followed
        them). ``positions`` [B]: S tokens per row from there (decoding); ``start``: a chunk from that position
        for every row (after a prefill). Updates the block's window ring in ``cache.mtp[k]``."""
        self._check_ids(next_ids, "next_ids")
        self._check_mtp_block(k)
        return self._mtp(hidden, next_ids, k, cache.mtp[k], positions=positions, start=start)

    def _check_mtp_block(self, k: int) -> None:
        if not 0 <= k < len(self.mtp):
            raise InputError(f"MTP block {k} does not exist; the model has {len(self.mtp)}")

    def _mtp(self, hidden: torch.Tensor, next_ids: torch.Tensor, k: int, cache: LayerCache | None,
             positions: torch.Tensor | None = None, start: int | None = None, last: bool = False) -> torch.Tensor:
        """MTP block ``k`` on main-model streams and the ids that followed them, with or without its cache;
        ``last`` as in ``logits``."""
        block = self.mtp[k]
        x = block.streams(self.embed(next_ids), hidden.to(torch.bfloat16))
        x = block(x, next_ids, cache, positions=positions, start=start)
        h = hc_head(x, block.hc_head_fn, block.hc_head_scale, block.hc_head_base, self.config.hc_eps,
                    self.config.norm_eps)
        h = block.norm(h)
        return self.tp.all_gather(self.head(self.tp.region_input((h[:, -1] if last else h).float())))

    def mtp_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor, k: int = 0, last: bool = False) -> torch.Tensor:
        """Logits [B, S, vocab] of MTP block ``k`` from main-model streams ``hidden`` [B, S, n, D] and ``input_ids``
        (``last``: the last position's [B, vocab], computed as ``logits(..., last=True)`` does)."""
        self._check_ids(input_ids)
        self._check_mtp_block(k)
        want = (*input_ids.shape, self.config.hc_mult, self.config.dim)
        if tuple(hidden.shape) != want:
            raise InputError(f"hidden must have shape {want} to match input_ids, got {tuple(hidden.shape)}")
        return self._mtp(hidden, input_ids, k, None, last=last)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def _values_readable(x: torch.Tensor) -> bool:
    """Whether the input checks may read ``x``'s values: not while tracing (no values yet) nor while a CUDA
    graph captures (a host read would break the capture; the runtime checks requests before they get there)."""
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())
