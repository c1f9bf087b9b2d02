"""Gradients through the newer custom ops equal those of the model code they replace (random inputs).

``sparse_attention_padded`` is checked by fp64 gradcheck; the mHC and MoE ops compute in fp32 / bf16 as the
model does, so their gradients are compared with autograd through the model's own functions instead (the op's
forward runs its Triton kernel under the interpreter, its backward must route every gradient to the right
input and leave the non-tensor arguments without one).
"""

from __future__ import annotations

import torch

from v4compile.codegen import ops
from v4compile.model.mhc import hc_post, hc_pre
from v4compile.model.moe import RoutedExperts


def test_padded_sparse_attention_fp64_gradcheck() -> None:
    torch.manual_seed(1)
    opts = {"dtype": torch.float64, "requires_grad": True}
    q, kv, sink = torch.randn(1, 2, 3, 16, **opts), torch.randn(1, 7, 16, **opts), torch.randn(3, **opts)
    index = torch.tensor([[[0, 3, -1, 6], [2, 2, 5, -1]]])
    assert torch.autograd.gradcheck(
        lambda a, b, c: ops.sparse_attention_padded(a, b, c, index, 0.25, 4, "reference"), (q, kv, sink))


def _grads(out: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in out)
    return list(torch.autograd.grad(loss, inputs))


def test_mhc_pre_and_post_gradients_match_the_model() -> None:
    torch.manual_seed(2)
    n, dim, rows = 4, 64, 3
    x = torch.randn(rows, n, dim).bfloat16().requires_grad_()
    fn = (torch.randn((2 + n) * n, n * dim) * 0.02).requires_grad_()
    scale = torch.rand(3).add(0.5).requires_grad_()
    base = (torch.randn((2 + n) * n) * 0.1).requires_grad_()
    args = (20, 1e-6, 1e-6)
    want = _grads(hc_pre(x, fn, scale, base, *args), (x, fn, scale, base), 0)
    got = _grads(ops.mhc_pre(x, fn, scale, base, *args, "triton"), (x, fn, scale, base), 0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-3, atol=1e-5)

    y = torch.randn(rows, dim).bfloat16().requires_grad_()
    post = torch.rand(rows, n).requires_grad_()
    comb = torch.rand(rows, n, n).requires_grad_()
    want = _grads((hc_post(y, x, post, comb),), (y, x, post, comb), 1)
    got = _grads((ops.mhc_post(y, x, post, comb, "triton"),), (y, x, post, comb), 1)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-3, atol=1e-4)


def test_moe_experts_gradients_match_the_model() -> None:
    torch.manual_seed(3)
    dim, inter, n_experts, tokens = 64, 32, 4, 5
    experts = RoutedExperts(n_experts, 0, dim, inter, "bf16", False, 10.0)
    for lin in (experts.w1, experts.w2, experts.w3):
        lin.weight.data.normal_(std=lin.in_features ** -0.5)
    x = torch.randn(tokens, dim).bfloat16().requires_grad_()
    ids = torch.stack([torch.randperm(n_experts)[:2] for _ in range(tokens)])
    weights = (torch.rand(tokens, 2) + 0.1).requires_grad_()
    model = experts(x, weights, ids)
    layers = (experts.w1, experts.w3, experts.w2)
    fused = ops.moe_experts(x, weights, ids, 0, *(w.weight for w in layers), None, None, None, "bf16", False, 10.0,
                            "triton")
    params = (x, weights, experts.w1.weight, experts.w2.weight)
    want, got = _grads((model,), params, 4), _grads((fused,), params, 4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-3)


def test_fused_compressor_entries_gradients_match_the_model() -> None:
    from v4compile.model.compressor import finish_entries, pool_blocks
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    torch.manual_seed(4)
    ratio, width, blocks = 4, 128, 3
    kv, score = torch.randn(2, blocks * ratio, 2 * width, requires_grad=True), torch.randn(2, blocks * ratio, 2 * width)
    ape, weight = torch.randn(ratio, 2 * width), torch.rand(width).add(0.5).requires_grad_()
    cos, sin = rope_cos_sin(rope_frequencies(64, 1e4, 0, 1, 32, 1), torch.arange(blocks) * ratio)
    inputs = (kv, weight)
    want = _grads((finish_entries(pool_blocks(kv, score, ape, ratio, width), cos, sin, weight, 1e-6, False, True),),
                  inputs, 5)
    got = _grads((ops.compressor_entries(kv, score, ape, ratio, width, blocks, cos, sin, weight, 1e-6, False, True,
                                         True, "triton"),), inputs, 5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
