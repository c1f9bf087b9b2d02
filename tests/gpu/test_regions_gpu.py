"""Compiled regions on the GPU: a prefill in pieces (chunk calls, the sequence and the start dynamic) runs the
Triton kernels and stays within the passes' tolerance of the eager model, and later pieces compile nothing."""

from __future__ import annotations

import pytest
import torch

import v4compile

pytestmark = pytest.mark.gpu


def test_chunked_prefill_runs_compiled_on_cuda() -> None:
    model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=5, device="cuda").eval()
    optimized = v4compile.optimize(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    eager_cache, cache = model.new_cache(1), model.new_cache(1)
    for start in range(0, 512, 128):
        if start == 256:
            compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch.no_grad():
            want = model.extend_hidden(ids[:, start : start + 128], start, eager_cache)
            got = optimized.extend_hidden(ids[:, start : start + 128], start, cache)
        cosine = torch.nn.functional.cosine_similarity(got.flatten().float(), want.flatten().float(), dim=0)
        assert cosine > 0.999, (start, cosine)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    kernels = {m.kernel for r in optimized.reports() for m in r.matches}
    assert any(k.startswith("sparse_attention") for k in kernels) and any(k.startswith("mhc_pre") for k in kernels)
