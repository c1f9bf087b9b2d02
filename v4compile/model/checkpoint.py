"""Loading checkpoints in official or Hugging Face names, with every mismatch reported by tensor name."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from . import quant
from .config import V4Config
from .transformer import DeepSeekV4


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config or the model (the message names the tensor)."""


_HF_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"\.self_attn\."), ".attn."),
    (re.compile(r"\.mlp\."), ".ffn."),
    (re.compile(r"\.weight_scale_inv$"), ".scale"),
    (re.compile(r"\.e_score_correction_bias$"), ".bias"),
]
_MTP_SHARED = re.compile(r"^mtp\.(\d+)\.(embed|head)\.weight$")


def official_name(name: str) -> str:
    """Maps a Hugging Face tensor name to the official one (official names pass through unchanged)."""
    for pattern, repl in _HF_RULES:
        name = pattern.sub(repl, name)
    return name


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in a directory, renamed to official names."""
    files = sorted(path.glob("*.safetensors"))
    files = [f for f in files if f.name != "cases.safetensors"]
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                name = official_name(key)
                if name in tensors:
                    raise CheckpointError(f"tensor {name} appears twice (second time as {key!r} in {f.name})")
                tensors[name] = handle.get_tensor(key)
    return tensors


def _fold_official_quirks(tensors: dict[str, torch.Tensor]) -> None:
    """Drops the MTP block's copies of embed/head (they are shared) and dequantizes an FP8 ``wo_a`` to bf16."""
    for name in [n for n in tensors if _MTP_SHARED.match(n)]:
        main = "embed.weight" if name.endswith("embed.weight") else "head.weight"
        copy = tensors.pop(name)
        if main in tensors and (copy.shape != tensors[main].shape or not torch.equal(copy, tensors[main])):
            raise CheckpointError(f"{name} differs from {main}; DeepSeek-V4 shares them, so they must be equal")
    for name in [n for n in tensors if n.endswith("attn.wo_a.weight")]:
        scale_name = name[: -len("weight")] + "scale"
        if tensors[name].dtype == torch.float8_e4m3fn and scale_name in tensors:
            tensors[name] = quant.dequant_fp8_weight(tensors[name], tensors.pop(scale_name)).to(torch.bfloat16)


def _check_against_model(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the config needs: "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} tensor(s) the config does not use: "
                              f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(got.shape)}; the config needs {tuple(want.shape)}")
        integer_ok = name.endswith("tid2eid") and not got.is_floating_point()
        if got.dtype != want.dtype and not integer_ok:
            raise CheckpointError(f"tensor {name} has dtype {got.dtype}; the config needs {want.dtype}")


def load(path: str | Path, *, device: torch.device | str | None = None, max_seq_len: int | None = None) -> DeepSeekV4:
    """Loads a model from a directory with ``config.json`` and ``*.safetensors`` (official or HF names).

    Quantized weights stay quantized. Any missing, extra, mis-shaped or mis-typed tensor is a
    CheckpointError naming it.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    overrides = {"max_seq_len": max_seq_len} if max_seq_len else {}
    config = V4Config.from_json(path / "config.json", **overrides)
    tensors = read_tensors(path)
    _fold_official_quirks(tensors)
    model = DeepSeekV4(config, seed=None)
    expected = model.state_dict()
    _check_against_model(tensors, expected)
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name].to(target.dtype))
    return model.to(device) if device is not None else model
