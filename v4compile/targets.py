"""Per-target hardware facts, one dict per target, read by the passes instead of constants inside them.

A target is named by its CUDA compute capability (``sm90``: Hopper, the H100/H200) or ``cpu``. Keys:

- ``streams``: how many CUDA streams the stream schedule spreads one layer's independent branches over
  (the main stream included); 1 means it never overlaps anything.
- ``copy_bytes_per_s`` and ``bf16_flop_per_s``: the rates the schedule's cost estimate divides bytes
  and FLOPs by (measured on the H200: ``benchmarks/kernels.py`` prints them as its ceilings).
- ``launch_s``: the fixed cost the estimate charges per kernel (a launch inside a CUDA graph).
- ``attention_head_multiple``: the query-head count the sparse attention kernel's tensor-core tile needs
  (heads are the rows of its MMA: Hopper's wgmma tile has 64 rows, Blackwell's tcgen05 128, the value the
  FlashMLA kernels pad to); ``head_padding`` pads each rank's heads up to it. 1 means any count.
"""

from __future__ import annotations

from typing import Any

import torch

TARGETS: dict[str, dict[str, Any]] = {
    "cpu": {"streams": 1, "copy_bytes_per_s": 20e9, "bf16_flop_per_s": 1e11, "launch_s": 5e-6,
            "attention_head_multiple": 1},
    "sm90": {"streams": 4, "copy_bytes_per_s": 4.0e12, "bf16_flop_per_s": 7.9e14, "launch_s": 2e-6,
             "attention_head_multiple": 64},
    "sm100": {"streams": 4, "copy_bytes_per_s": 7.0e12, "bf16_flop_per_s": 2.2e15, "launch_s": 2e-6,
              "attention_head_multiple": 128},
}

DEFAULT_GPU_TARGET = "sm90"
"""The target a plan is made for when no GPU tells: the design's reference machine (H200)."""


def target_name(device: torch.device | str | None = None) -> str:
    """The target of ``device``: ``sm<major><minor>`` for a CUDA device with an entry here (else the closest
    older one, else the default GPU target), ``cpu`` otherwise."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    capability = 10 * major + minor
    known = sorted((int(name[2:]), name) for name in TARGETS if name.startswith("sm"))
    older = [name for cap, name in known if cap <= capability]
    return older[-1] if older else DEFAULT_GPU_TARGET


def target(name: str) -> dict[str, Any]:
    """The facts of target ``name``; an unknown name is an error listing the known ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; targets: {', '.join(TARGETS)}")
    return TARGETS[name]
