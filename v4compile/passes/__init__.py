"""Graph passes over the captured model, in a fixed named order, and the pass manager that runs them."""

from __future__ import annotations

from .base import GraphPass
from .compressor_finish import CompressorFinish
from .compressor_fusion import CompressorFusion
from .fp8_linear import Fp8Linear
from .fp32_linear import Fp32Linear
from .head_padding import HeadPadding
from .mhc_tiling import MhcTiling
from .moe_dispatch import MoeDispatch
from .radix_topk import RadixTopK
from .sparse_attention import SparseAttention
from .stream_schedule import StreamSchedule

PASS_ORDER: tuple[type[GraphPass], ...] = (CompressorFusion, CompressorFinish, RadixTopK, MhcTiling, SparseAttention,
                                              HeadPadding, MoeDispatch, Fp8Linear, Fp32Linear,
                                              StreamSchedule)
PASSES: dict[str, type[GraphPass]] = {p.name: p for p in PASS_ORDER}


def build_passes(names: list[str] | None = None, options: dict[str, dict] | None = None) -> list[GraphPass]:
    """Instances of the named passes in the fixed order (when None: every pass that is on by default, plus
    any opt-in pass given options); unknown names are an error."""
    options = options or {}
    wanted = [n for n, p in PASSES.items() if p.on_by_default or n in options] if names is None else list(names)
    unknown = [n for n in wanted + list(options) if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; valid passes: {', '.join(PASSES)}")
    return [cls(**options.get(cls.name, {})) for cls in PASS_ORDER if cls.name in wanted]
