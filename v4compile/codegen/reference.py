"""Reference (plain PyTorch) bodies of the custom ops: the model's own math, used as fallback and oracle."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch.func import functional_call

from ..model import quant
from ..model.compressor import finish_entries, pool_blocks
from ..model.indexer import index_scores as indexer_scores  # noqa: F401  (the op's reference body)
from ..model.mhc import hc_post as mhc_post  # noqa: F401  (the op's reference body)
from ..model.mhc import hc_pre as mhc_pre  # noqa: F401  (the op's reference body)
from ..model.moe import RoutedExperts
from ..model.sparse_attention import sparse_attention  # noqa: F401  (the op's reference body)


def sparse_attention_paged(q: torch.Tensor, window: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
                           sink: torch.Tensor, index: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse attention over ``window`` [B, W, d] followed by entries on pages (row b's: ``pool[table[b]]``): ids
    below W name window keys, the others entry id - W."""
    return sparse_attention(q, torch.cat((window, pool[table].flatten(1, 2)), dim=1), sink, index, scale)


def indexer_scores_paged(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, weights: torch.Tensor
                         ) -> torch.Tensor:
    """Lightning-indexer scores against keys kept on pages: row b's keys are ``pool[table[b]]`` in order."""
    return indexer_scores(q, pool[table].flatten(1, 2), weights)


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for reduced-precision inputs, fp64 stays fp64 (for gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def compressor_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                    n_blocks: int) -> torch.Tensor:
    """Pooled entries [B, n_blocks, width] from the first ``n_blocks * ratio`` tokens of kv/score [B, S, c*width]."""
    cutoff, acc = n_blocks * ratio, accumulation_dtype(kv)
    return pool_blocks(kv[:, :cutoff].to(acc), score[:, :cutoff].to(acc), ape.to(acc), ratio, width)


def compressor_pool_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """Pooled entry [B, width] from a decode state [B, c*ratio, c*width] whose scores already hold ``ape``."""
    if kv_state.shape[-1] == 2 * width:
        kv = torch.cat((kv_state[:, :ratio, :width], kv_state[:, ratio:, width:]), dim=1)
        score = torch.cat((score_state[:, :ratio, :width], score_state[:, ratio:, width:]), dim=1)
    else:
        kv, score = kv_state, score_state
    acc = accumulation_dtype(kv)
    return (kv.to(acc) * score.to(acc).softmax(dim=1)).sum(dim=1)


def compressor_entries(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, width: int,
                       n_blocks: int, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       rotate: bool, pow2_scales: bool, quantize: bool) -> torch.Tensor:
    """Finished cache entries [B, n_blocks, width] (bf16): the pooled entries through the model's finish."""
    pooled = compressor_pool(kv, score, ape, ratio, width, n_blocks)
    return finish_entries(pooled, cos, sin, norm_weight, eps, rotate, pow2_scales, quantize)


def compressor_entry_state(kv_state: torch.Tensor, score_state: torch.Tensor, ratio: int, width: int,
                           cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, rotate: bool,
                           pow2_scales: bool, quantize: bool) -> torch.Tensor:
    """The finished entry [B, width] (bf16) of a decode state: its pooled entry through the model's finish."""
    pooled = compressor_pool_state(kv_state, score_state, ratio, width)
    return finish_entries(pooled, cos, sin, norm_weight, eps, rotate, pow2_scales, quantize)


def radix_topk(x: torch.Tensor, k: int, mask_invalid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last dim, sorted descending, ties to the lowest index.

    With ``mask_invalid`` the index of a -inf value is -1 (fewer than k real candidates).
    """
    values, ids = x.sort(dim=-1, descending=True, stable=True)
    values, ids = values[..., :k], ids[..., :k]
    if mask_invalid:
        ids = torch.where(values == float("-inf"), -1, ids)
    return values, ids


@lru_cache(maxsize=32)
def _experts_template(n: int, first: int, dim: int, inter: int, fmt: str, pow2: bool, limit: float) -> RoutedExperts:
    """The model's routed-experts module on the meta device: its forward is applied to the op's tensors."""
    with torch.device("meta"):
        return RoutedExperts(n, first, dim, inter, fmt, pow2, limit)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None, s3: torch.Tensor | None,
                s2: torch.Tensor | None, fmt: str, pow2: bool, limit: float) -> torch.Tensor:
    """The model's routed experts (``RoutedExperts.forward``) on the op's stacked weights."""
    inter = w1.shape[1]
    module = _experts_template(w1.shape[0], first, x.shape[-1], inter, fmt, pow2, limit)
    params = {"w1.weight": w1, "w3.weight": w3, "w2.weight": w2}
    if fmt != "bf16":
        params.update({"w1.scale": s1, "w3.scale": s3, "w2.scale": s2})
    return functional_call(module, params, (x, weights, ids))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The model's FP8 ``Linear``: fp32 [..., N] before its bf16 rounding (``Linear.unrounded``), or rounded to
    ``out_dtype`` bf16 (``Linear.forward``)."""
    xq = quant.fp8_simulate(x, quant.FP8_ACT_BLOCK, pow2).float()
    return torch.nn.functional.linear(xq, quant.dequant_fp8_weight(weight, scale)).to(out_dtype)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                transposed: bool = False) -> torch.Tensor:
    """An fp32 product of the operands widened from their stored dtypes: ``F.linear(x.float(), weight.float(),
    bias.float())``, the weight given as [K, N] when ``transposed``."""
    weight = weight.t() if transposed else weight
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
