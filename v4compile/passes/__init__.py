"""Graph passes over the captured model, in a fixed named order, and the pass manager that runs them."""

from __future__ import annotations

from .base import GraphPass
from .compressor_fusion import CompressorFusion
from .radix_topk import RadixTopK

PASS_ORDER: tuple[type[GraphPass], ...] = (CompressorFusion, RadixTopK)
PASSES: dict[str, type[GraphPass]] = {p.name: p for p in PASS_ORDER}


def build_passes(names: list[str] | None = None, options: dict[str, dict] | None = None) -> list[GraphPass]:
    """Instances of the named passes (all when None) in the fixed order; unknown names are an error."""
    options = options or {}
    wanted = list(PASSES) if names is None else list(names)
    unknown = [n for n in wanted + list(options) if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; valid passes: {', '.join(PASSES)}")
    return [cls(**options.get(cls.name, {})) for cls in PASS_ORDER if cls.name in wanted]
