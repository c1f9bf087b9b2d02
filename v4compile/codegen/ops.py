"""The custom ops that rewrites become: torch.library ops with fake and autograd registrations whose
bodies are generated kernels chosen by the ``backend`` argument (visible in every dumped graph)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import reference
from .padding import with_padded_heads
from .registry import with_fallback

KERNEL_BACKENDS = ("triton", "tilelang", "reference")

AUTO_TILELANG = frozenset({"moe_experts"})
"""Ops whose TileLang kernel the "auto" backend runs on a Hopper GPU where TileLang works, measured faster than their
Triton kernel on the H100 (the FP4 expert GEMMs at 2048-8192 tokens, 15-20%; NOTES 38th). The TileLang FP8 GEMM
lost to the default at 5 of the slice's 7 prefill shapes and stays behind ``backend="tilelang"``."""


@functools.cache
def auto_takes_tilelang() -> bool:
    """Whether "auto" runs ``AUTO_TILELANG``'s TileLang kernels here: on a Hopper GPU (their wgmma, TMA and shared
    memory sizes are sm_90a's; other GPUs keep Triton) with TileLang and our TileLang kernels importing (any
    failure of that optional dependency's import means Triton, not an error)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        from . import tilelang  # noqa: F401
    except Exception:  # a broken TileLang or TVM install raises more than ImportError
        return False
    return True


def implementation_backend(op: str, backend: str, example: torch.Tensor | None = None) -> str:
    """The backend whose kernel actually runs ``op`` for the requested ``backend``, given an example of its first
    tensor input (a graph node's fake value; None: one the kernel takes): "auto" (CUDA) is TileLang for the ops in
    ``AUTO_TILELANG`` where ``auto_takes_tilelang`` and Triton for the rest; TileLang ops that do not exist yet, or
    whose kernel does not take the input (off CUDA, another dtype), run their Triton kernel (and are named so in
    reports and the kernel registry)."""
    if backend == "auto":
        backend = "tilelang" if op in AUTO_TILELANG and auto_takes_tilelang() else "triton"
    if backend == "tilelang":
        from .tilelang import ACCEPTS
        from .tilelang import IMPLEMENTATIONS as tilelang_impls

        if op not in tilelang_impls or (example is not None and op in ACCEPTS and not ACCEPTS[op](example)):
            return "triton"
        return "tilelang"
    return backend


def _kernel_body(op: str, implementation: str) -> Callable[..., Any]:
    """``op``'s body in ``implementation`` ("triton" or "tilelang", as ``implementation_backend`` resolved it)."""
    if implementation == "tilelang":
        from .tilelang import IMPLEMENTATIONS as tilelang_impls

        return tilelang_impls[op]
    from .triton import (
        compressor,
        compressor_finish,
        fp8_linear,
        fp32_linear,
        indexer_scores,
        mhc,
        moe,
        radix_topk,
        sparse_attention,
    )

    return {"compressor_pool": compressor.compressor_pool,
            "compressor_entries": compressor_finish.compressor_entries,
            "compressor_entry_state": compressor_finish.compressor_entry_state,
            "indexer_scores": indexer_scores.indexer_scores,
            "indexer_scores_paged": indexer_scores.indexer_scores_paged,
            "compressor_pool_state": compressor.compressor_pool_state,
            "radix_topk": radix_topk.radix_topk,
            "sparse_attention": sparse_attention.sparse_attention,
            "sparse_attention_paged": sparse_attention.sparse_attention_paged,
            "mhc_pre": mhc.mhc_pre,
            "mhc_post": mhc.mhc_post,
            "moe_experts": moe.moe_experts,
            "fp8_linear": fp8_linear.fp8_linear,
            "fp32_linear": fp32_linear.fp32_linear}[op]


def _run(op: str, backend: str, *args: Any) -> Any:
    if backend != "auto" and backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {('auto', *KERNEL_BACKENDS)}")
    ref = getattr(reference, op)
    implementation = implementation_backend(op, backend)
    if implementation == "reference":
        return ref(*args)
    fast = _kernel_body(op, implementation)
    if backend == "auto" and implementation == "tilelang":
        # "auto" chose TileLang as the faster kernel: where it cannot be built here, Triton's is next
        triton = _kernel_body(op, "triton")
        return with_fallback(f"{op} (auto: tilelang)", lambda: fast(*args),
                             lambda: with_fallback(f"{op} (triton)", lambda: triton(*args), lambda: ref(*args)),
                             instead="the Triton kernel")
    return with_fallback(f"{op} ({backend})", lambda: fast(*args), lambda: ref(*args))


_TENSOR = object()
"""Stands in ``ctx.args`` for an input saved through ``save_for_backward``."""

_REFERENCE_BODIES: dict[Any, tuple[str, int]] = {}
"""Each custom op's overload -> its reference body's name and how many of the op's leading inputs that body
takes (-1: all but the trailing backend); filled as the ops are defined below."""


def kernel_families() -> list[str]:
    """The op names that kernel names start with (``sparse_attention`` in ``sparse_attention.d128.bf16dot.triton``):
    what a kernel name may be before anything is built."""
    return sorted({op for op, _ in _REFERENCE_BODIES.values()})


def _reference_body(custom_op: Any, op: str, reference_inputs: int = -1) -> None:
    """Records that ``custom_op`` computes the reference body ``op`` on its leading ``reference_inputs``."""
    _REFERENCE_BODIES[custom_op._opoverload] = (op, reference_inputs)


def _reference_backward(custom_op: Any, op: str, reference_inputs: int = -1) -> None:
    """Records ``custom_op``'s reference body (``_reference_body``) and registers its backward: that body ``op``
    recomputed under autograd on the op's inputs but the trailing backend (``reference_inputs``: how many of the
    leading inputs the reference takes); one gradient per input, None for non-tensors and for tensors that need
    none."""
    _reference_body(custom_op, op, reference_inputs)

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*[a for a in inputs if isinstance(a, torch.Tensor)])
        ctx.args = [_TENSOR if isinstance(a, torch.Tensor) else a for a in inputs]

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = iter(ctx.saved_tensors)
        args = [next(tensors) if a is _TENSOR else a for a in ctx.args]
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
            out = getattr(reference, op)(*leaves[:reference_inputs])
            wanted = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
            grad = grads[0] if len(grads) == 1 else grads
            found = iter(torch.autograd.grad(out, wanted, grad) if wanted else [])
        return tuple(next(found) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in leaves)

    custom_op.register_autograd(backward, setup_context=setup)


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


_reference_backward(compressor_pool, "compressor_pool")


# ----------------------------------------------------------------------------- compressor_pool_state
@torch.library.custom_op("v4compile::compressor_pool_state", mutates_args=())
def compressor_pool_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int,
                          backend: str) -> torch.Tensor:
    """One pooled entry [B, width] (fp32) from the decode state of the open (and previous) block."""
    return _run("compressor_pool_state", backend, kv_state, score_state, ratio, width)


@compressor_pool_state.register_fake
def _(kv_state, score_state, ratio, width, backend):
    return kv_state.new_empty(kv_state.shape[0], width, dtype=reference.accumulation_dtype(kv_state))


_reference_backward(compressor_pool_state, "compressor_pool_state")


# ----------------------------------------------------------------------------- compressor_entries
@torch.library.custom_op("v4compile::compressor_entries", mutates_args=())
def compressor_entries(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                       n_blocks: int, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       rotate: bool, pow2_scales: bool, quantize: bool, backend: str) -> torch.Tensor:
    """Finished cache entries [B, n_blocks, width] (bf16): ``compressor_pool`` then the model's finish (RMSNorm,
    RoPE with the entries' ``cos``/``sin``, FP8 or Hadamard + FP4 simulation, or none without ``quantize``), so
    the pooled fp32 entries are never written."""
    return _run("compressor_entries", backend, kv, score, ape, ratio, width, n_blocks, cos, sin, norm_weight, eps,
                rotate, pow2_scales, quantize)


@compressor_entries.register_fake
def _(kv, score, ape, ratio, width, n_blocks, cos, sin, norm_weight, eps, rotate, pow2_scales, quantize, backend):
    return kv.new_empty(kv.shape[0], n_blocks, width, dtype=torch.bfloat16)


_reference_backward(compressor_entries, "compressor_entries")


# ----------------------------------------------------------------------------- compressor_entry_state
@torch.library.custom_op("v4compile::compressor_entry_state", mutates_args=())
def compressor_entry_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int,
                           cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, rotate: bool,
                           pow2_scales: bool, quantize: bool, backend: str) -> torch.Tensor:
    """The finished entry [B, width] (bf16) of a decode state: ``compressor_pool_state`` then the model's
    finish, in one kernel."""
    return _run("compressor_entry_state", backend, kv_state, score_state, ratio, width, cos, sin, norm_weight, eps,
                rotate, pow2_scales, quantize)


@compressor_entry_state.register_fake
def _(kv_state, score_state, ratio, width, cos, sin, norm_weight, eps, rotate, pow2_scales, quantize, backend):
    return kv_state.new_empty(kv_state.shape[0], width, dtype=torch.bfloat16)


_reference_backward(compressor_entry_state, "compressor_entry_state")


# ----------------------------------------------------------------------------- radix_topk
@torch.library.custom_op("v4compile::radix_topk", mutates_args=())
def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the last dim, descending, ties to the lowest index (-1 for -inf if ``mask_invalid``); every
    candidate, sorted so, when there are no more than k (a graph compiled for every length meets both)."""
    if x.shape[-1] <= k:
        return reference.radix_topk(x, k, mask_invalid)
    return _run("radix_topk", backend, x, k, mask_invalid)


@radix_topk.register_fake
def _(x, k, mask_invalid, backend):
    shape = (*x.shape[:-1], torch.sym_min(k, x.shape[-1]))
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
_reference_body(radix_topk, "radix_topk")


# ----------------------------------------------------------------------------- sparse_attention
@torch.library.custom_op("v4compile::sparse_attention", mutates_args=())
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor, scale: float,
                     backend: str) -> torch.Tensor:
    """Sparse MQA with sink: q [B,S,H,d] over ``kv[b, index[b,s,:]]`` (-1 masked); returns q's shape and dtype."""
    return _run("sparse_attention", backend, q, kv, sink, index, scale).contiguous()


@sparse_attention.register_fake
def _(q, kv, sink, index, scale, backend):
    return q.new_empty(q.shape)  # contiguous whatever q's strides, as every body returns it


_reference_backward(sparse_attention, "sparse_attention")


@torch.library.custom_op("v4compile::sparse_attention_paged", mutates_args=())
def sparse_attention_paged(q: torch.Tensor, window: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
                           sink: torch.Tensor, index: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    """``sparse_attention`` over ``window`` [B,W,d] then entries on shared pages (row b's ``pool[table[b]]``), each
    read where it lives rather than from a concatenated copy."""
    return _run("sparse_attention_paged", backend, q, window, pool, table, sink, index, scale).contiguous()


@sparse_attention_paged.register_fake
def _(q, window, pool, table, sink, index, scale, backend):
    return q.new_empty(q.shape)  # contiguous whatever q's strides, as every body returns it


_reference_backward(sparse_attention_paged, "sparse_attention_paged")


@torch.library.custom_op("v4compile::sparse_attention_padded", mutates_args=())
def sparse_attention_padded(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor,
                            scale: float, multiple: int, backend: str) -> torch.Tensor:
    """``sparse_attention`` for a kernel that needs the head count to be a multiple of ``multiple``: adds
    zero query heads (sink 0), runs the kernel, and keeps the real heads. Heads are independent, so the
    result equals the unpadded call."""
    return with_padded_heads(lambda padded_q, padded_sink: _run("sparse_attention", backend, padded_q, kv, padded_sink,
                                                                 index, scale), q, sink, multiple)


@sparse_attention_padded.register_fake
def _(q, kv, sink, index, scale, multiple, backend):
    return q.new_empty(q.shape)  # contiguous whatever q's strides, as every body returns it


_reference_backward(sparse_attention_padded, "sparse_attention", reference_inputs=5)  # padding changes no value


# ----------------------------------------------------------------------------- indexer_scores
@torch.library.custom_op("v4compile::indexer_scores", mutates_args=())
def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, backend: str) -> torch.Tensor:
    """Lightning-indexer scores [B,S,N] (fp32) of q [B,S,H,d] against keys [B,N,d] with head weights [B,S,H]."""
    return _run("indexer_scores", backend, q, keys, weights)


@indexer_scores.register_fake
def _(q, keys, weights, backend):
    return q.new_empty(q.shape[0], q.shape[1], keys.shape[1], dtype=torch.float32)


_reference_backward(indexer_scores, "indexer_scores")


@torch.library.custom_op("v4compile::indexer_scores_paged", mutates_args=())
def indexer_scores_paged(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, weights: torch.Tensor,
                         backend: str) -> torch.Tensor:
    """``indexer_scores`` against keys on shared pages: pool [pages, E, d], row b's keys ``pool[table[b]]`` (table
    [B, pages per row]), read in place rather than gathered first."""
    return _run("indexer_scores_paged", backend, q, pool, table, weights)


@indexer_scores_paged.register_fake
def _(q, pool, table, weights, backend):
    return q.new_empty(q.shape[0], q.shape[1], table.shape[1] * pool.shape[1], dtype=torch.float32)


_reference_backward(indexer_scores_paged, "indexer_scores_paged")


# ----------------------------------------------------------------------------- mhc_pre
@torch.library.custom_op("v4compile::mhc_pre", mutates_args=())
def mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, hc_eps: float,
            norm_eps: float, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre step of streams x [..., n, D]: (sub-layer input [..., D] in x's dtype, post [..., n], comb
    [..., n, n] after ``iters`` Sinkhorn steps), fp32 math."""
    return _run("mhc_pre", backend, x, fn, scale, base, iters, hc_eps, norm_eps)


@mhc_pre.register_fake
def _(x, fn, scale, base, iters, hc_eps, norm_eps, backend):
    *lead, n, dim = x.shape
    return (x.new_empty(*lead, dim), x.new_empty(*lead, n, dtype=torch.float32),
            x.new_empty(*lead, n, n, dtype=torch.float32))


_reference_backward(mhc_pre, "mhc_pre")


# ----------------------------------------------------------------------------- mhc_post
@torch.library.custom_op("v4compile::mhc_post", mutates_args=())
def mhc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, backend: str) -> torch.Tensor:
    """mHC post step: new streams ``post_k * y + sum_j comb[j, k] x_j`` [..., n, D] in y's dtype."""
    return _run("mhc_post", backend, y, x, post, comb)


@mhc_post.register_fake
def _(y, x, post, comb, backend):
    return x.new_empty(x.shape, dtype=y.dtype)


_reference_backward(mhc_post, "mhc_post")


# ----------------------------------------------------------------------------- moe_experts
@torch.library.custom_op("v4compile::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None, s3: torch.Tensor | None,
                s2: torch.Tensor | None, fmt: str, pow2: bool, limit: float, backend: str) -> torch.Tensor:
    """The routed experts' weighted sum [T, D] (fp32) for tokens x [T, D] (bf16): each token's experts ``ids``
    [T, k] among the local ones ``first .. first+E-1`` (stacked weights ``w1``, ``w3`` [E, inter, .], ``w2``
    [E, dim, .], scales ``s*`` unless ``fmt`` is bf16), with routing ``weights`` [T, k] inside the clamped SwiGLU;
    a repeated id counts once, outputs are added in ascending expert order (``RoutedExperts.forward``)."""
    from .triton.moe import check_experts

    check_experts(x, weights, ids, w1, w3, w2, s1, s3, s2, fmt)
    return _run("moe_experts", backend, x, weights, ids, first, w1, w3, w2, s1, s3, s2, fmt, pow2, limit)


@moe_experts.register_fake
def _(x, weights, ids, first, w1, w3, w2, s1, s3, s2, fmt, pow2, limit, backend):
    return x.new_empty(x.shape, dtype=torch.float32)


_reference_backward(moe_experts, "moe_experts")


# ----------------------------------------------------------------------------- fp8_linear
@torch.library.custom_op("v4compile::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool, out_dtype: torch.dtype,
               backend: str) -> torch.Tensor:
    """The model's FP8 ``Linear`` on x [..., K]: activation to e4m3 per 128 along K, times the e4m3 weight [N, K]
    with its e8m0 128x128 block ``scale``, accumulated in fp32 -> [..., N] as fp32 (``Linear.unrounded``) or,
    with ``out_dtype`` bf16, rounded once to bf16 (``Linear.forward``: the kernel writes half the bytes)."""
    from .triton.fp8_linear import check_fp8_weight

    check_fp8_weight("v4compile::fp8_linear", x, weight, scale)
    return _run("fp8_linear", backend, x, weight, scale, pow2, out_dtype)


@fp8_linear.register_fake
def _(x, weight, scale, pow2, out_dtype, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)


_reference_backward(fp8_linear, "fp8_linear")


# ----------------------------------------------------------------------------- fp32_linear
@torch.library.custom_op("v4compile::fp32_linear", mutates_args=())
def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
                backend: str) -> torch.Tensor:
    """An fp32 product ``x [..., K] @ weight [N, K]^T (+ bias)`` -> [..., N] fp32 (``transposed``: weight given as
    [K, N], ``x @ weight``), each operand widened exactly from its stored dtype (the model's
    ``F.linear(x.float(), w.float())``): the output head, the compressor's projections, the router scores."""
    from .triton.fp32_linear import check_fp32_linear

    check_fp32_linear("v4compile::fp32_linear", x, weight.t() if transposed else weight, bias)
    return _run("fp32_linear", backend, x, weight, bias, transposed)


@fp32_linear.register_fake
def _(x, weight, bias, transposed, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[1 if transposed else 0], dtype=torch.float32)


_reference_backward(fp32_linear, "fp32_linear")


# ----------------------------------------------------------------------------- reference bodies for Inductor
def reference_decompositions() -> dict[Any, Callable[..., Any]]:
    """Each custom op decomposed into its reference body: handed to Inductor, the ops' math becomes part of
    Inductor's own generated code (C++ on the CPU) instead of an opaque call back into eager PyTorch."""

    def body(name: str, inputs: int) -> Callable[..., Any]:
        return lambda *args: getattr(reference, name)(*args[:inputs])

    return {op: body(name, inputs) for op, (name, inputs) in _REFERENCE_BODIES.items()}
