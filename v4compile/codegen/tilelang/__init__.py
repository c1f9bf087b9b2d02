"""TileLang kernels (CUDA target on GPU, ``c`` target on CPU); IMPLEMENTATIONS maps op name to body."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import compressor_finish, fp8_linear, indexer_scores, moe, radix_topk
from .compressor import compressor_pool, compressor_pool_state
from .mhc import mhc_post, mhc_pre
from .sparse_attention import sparse_attention, takes

# TileLang logs each compile at INFO on stdout; the kernel registry reports builds itself (on stderr). This sets
# TileLang's logger for the whole process, once, when v4compile first needs its TileLang kernels.
logging.getLogger("tilelang").setLevel(logging.WARNING)

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {"compressor_pool": compressor_pool,
                                                  "compressor_entries": compressor_finish.compressor_entries,
                                                  "compressor_entry_state": compressor_finish.compressor_entry_state,
                                                  "compressor_pool_state": compressor_pool_state,
                                                  "indexer_scores": indexer_scores.indexer_scores,
                                                  "mhc_pre": mhc_pre, "mhc_post": mhc_post,
                                                  "moe_experts": moe.moe_experts,
                                                  "fp8_linear": fp8_linear.fp8_linear,
                                                  "radix_topk": radix_topk.radix_topk,
                                                  "sparse_attention": sparse_attention}

ACCEPTS: dict[str, Callable[[Any], bool]] = {"sparse_attention": takes, "indexer_scores": indexer_scores.takes}
"""Ops whose TileLang kernel takes only some inputs (sparse attention: bf16 on a CUDA device; indexer scoring:
bf16 on CUDA or bf16 / fp32 on the CPU, head dims 16-256, up to 64 heads), by a predicate on the first tensor
input; for the others their body runs the Triton kernel."""
