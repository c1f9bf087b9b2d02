"""TileLang kernels (CUDA target on GPU, ``c`` target on CPU); IMPLEMENTATIONS maps op name to body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .compressor import compressor_pool, compressor_pool_state
from .mhc import mhc_post, mhc_pre
from .sparse_attention import sparse_attention

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {"compressor_pool": compressor_pool,
                                                  "compressor_pool_state": compressor_pool_state,
                                                  "mhc_pre": mhc_pre, "mhc_post": mhc_post,
                                                  "sparse_attention": sparse_attention}

CUDA_ONLY = frozenset({"sparse_attention"})
"""Ops whose TileLang kernel needs the tensor cores: on other devices their body runs the Triton kernel."""
