"""The custom ops that rewrites become: torch.library ops with fake and autograd registrations whose
bodies are generated kernels chosen by the ``backend`` argument (visible in every dumped graph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import reference
from .registry import with_fallback

KERNEL_BACKENDS = ("triton", "tilelang", "reference")


def implementation_backend(op: str, backend: str) -> str:
    """The backend whose kernel actually runs ``op`` for the requested ``backend``: TileLang ops that do not
    exist yet run their Triton kernel (and are named so in reports and the kernel registry)."""
    if backend == "tilelang":
        from .tilelang import IMPLEMENTATIONS as tilelang_impls

        return "tilelang" if op in tilelang_impls else "triton"
    return backend


def _fast_impl(op: str, backend: str) -> Callable[..., Any] | None:
    implementation = implementation_backend(op, backend)
    if implementation == "reference":
        return None
    if implementation == "tilelang":
        from .tilelang import IMPLEMENTATIONS as tilelang_impls

        return tilelang_impls[op]
    from .triton import compressor, indexer_scores, radix_topk, sparse_attention

    return {"compressor_pool": compressor.compressor_pool,
            "indexer_scores": indexer_scores.indexer_scores,
            "compressor_pool_state": compressor.compressor_pool_state,
            "radix_topk": radix_topk.radix_topk,
            "sparse_attention": sparse_attention.sparse_attention}[op]


def _run(op: str, backend: str, *args: Any) -> Any:
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {KERNEL_BACKENDS}")
    ref = getattr(reference, op)
    fast = _fast_impl(op, backend)
    if fast is None:
        return ref(*args)
    return with_fallback(f"{op} ({backend})", lambda: fast(*args), lambda: ref(*args))


def _reference_grads(op: str, tensors: tuple[torch.Tensor, ...], extra: tuple[Any, ...], grad: torch.Tensor,
                     trailing: int) -> tuple[torch.Tensor | None, ...]:
    """Backward of a custom op by recomputing its reference body on ``tensors`` (then ``extra`` args) under
    autograd; returns one gradient per tensor (None where not required) and ``trailing`` Nones."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        out = getattr(reference, op)(*leaves, *extra)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else [])
    return (*(next(grads) if t.requires_grad else None for t in leaves), *([None] * trailing))


# ----------------------------------------------------------------------------- compressor_pool
@torch.library.custom_op("v4compile::compressor_pool", mutates_args=())
def compressor_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                    n_blocks: int, backend: str) -> torch.Tensor:
    """Compressed entries [B, n_blocks, width]: bias, per-dim softmax over each block's tokens, weighted sum.

    Accumulates in fp32 (fp64 for fp64 inputs)."""
    return _run("compressor_pool", backend, kv, score, ape, ratio, width, n_blocks)


@compressor_pool.register_fake
def _(kv, score, ape, ratio, width, n_blocks, backend):
    return kv.new_empty(kv.shape[0], n_blocks, width, dtype=reference.accumulation_dtype(kv))


def _pool_setup(ctx, inputs, output):
    kv, score, ape, ratio, width, n_blocks, _ = inputs
    ctx.save_for_backward(kv, score, ape)
    ctx.args = (ratio, width, n_blocks)


def _pool_backward(ctx, grad):
    return _reference_grads("compressor_pool", ctx.saved_tensors, ctx.args, grad, trailing=4)


compressor_pool.register_autograd(_pool_backward, setup_context=_pool_setup)


# ----------------------------------------------------------------------------- compressor_pool_state
@torch.library.custom_op("v4compile::compressor_pool_state", mutates_args=())
def compressor_pool_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int,
                          backend: str) -> torch.Tensor:
    """One pooled entry [B, width] (fp32) from the decode state of the open (and previous) block."""
    return _run("compressor_pool_state", backend, kv_state, score_state, ratio, width)


@compressor_pool_state.register_fake
def _(kv_state, score_state, ratio, width, backend):
    return kv_state.new_empty(kv_state.shape[0], width, dtype=reference.accumulation_dtype(kv_state))


def _state_setup(ctx, inputs, output):
    kv_state, score_state, ratio, width, _ = inputs
    ctx.save_for_backward(kv_state, score_state)
    ctx.args = (ratio, width)


def _state_backward(ctx, grad):
    return _reference_grads("compressor_pool_state", ctx.saved_tensors, ctx.args, grad, trailing=3)


compressor_pool_state.register_autograd(_state_backward, setup_context=_state_setup)


# ----------------------------------------------------------------------------- radix_topk
@torch.library.custom_op("v4compile::radix_topk", mutates_args=())
def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the last dim, descending, ties to the lowest index (-1 for -inf if ``mask_invalid``)."""
    return _run("radix_topk", backend, x, k, mask_invalid)


@radix_topk.register_fake
def _(x, k, mask_invalid, backend):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.long)


def _topk_setup(ctx, inputs, output):
    ctx.shape = inputs[0].shape
    ctx.save_for_backward(output[1])


def _topk_backward(ctx, grad_values, grad_ids):
    (ids,) = ctx.saved_tensors
    grad = grad_values.new_zeros(ctx.shape)
    keep = ids >= 0
    grad.scatter_add_(-1, ids.clamp(min=0), torch.where(keep, grad_values, 0))
    return grad, None, None, None


radix_topk.register_autograd(_topk_backward, setup_context=_topk_setup)


# ----------------------------------------------------------------------------- sparse_attention
@torch.library.custom_op("v4compile::sparse_attention", mutates_args=())
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor, scale: float,
                     backend: str) -> torch.Tensor:
    """Sparse MQA with sink: q [B,S,H,d] over ``kv[b, index[b,s,:]]`` (-1 masked); returns q's shape and dtype."""
    return _run("sparse_attention", backend, q, kv, sink, index, scale)


@sparse_attention.register_fake
def _(q, kv, sink, index, scale, backend):
    return torch.empty_like(q)


def _attention_setup(ctx, inputs, output):
    q, kv, sink, index, scale, _ = inputs
    ctx.save_for_backward(q, kv, sink)
    ctx.args = (index, scale)


def _attention_backward(ctx, grad):
    return _reference_grads("sparse_attention", ctx.saved_tensors, ctx.args, grad, trailing=3)


sparse_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


# ----------------------------------------------------------------------------- indexer_scores
@torch.library.custom_op("v4compile::indexer_scores", mutates_args=())
def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, backend: str) -> torch.Tensor:
    """Lightning-indexer scores [B,S,N] (fp32) of q [B,S,H,d] against keys [B,N,d] with head weights [B,S,H]."""
    return _run("indexer_scores", backend, q, keys, weights)


@indexer_scores.register_fake
def _(q, keys, weights, backend):
    return q.new_empty(q.shape[0], q.shape[1], keys.shape[1], dtype=torch.float32)


def _scores_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])


def _scores_backward(ctx, grad):
    return _reference_grads("indexer_scores", ctx.saved_tensors, (), grad, trailing=1)


indexer_scores.register_autograd(_scores_backward, setup_context=_scores_setup)
