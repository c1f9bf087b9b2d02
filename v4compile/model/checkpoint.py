"""Loading checkpoints in official or Hugging Face names, with every mismatch reported by tensor name."""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import quant
from .config import V4Config
from .moe import official_state
from .parallel import Placement, TensorParallel, check_degree
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


_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass
class _Entry:
    """Where one checkpoint tensor lives and what its header says; ``scale`` is set for an FP8 ``wo_a``
    that is dequantized to bf16 when read."""

    handle: Any
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale: _Entry | None = None


class Checkpoint:
    """The tensors of a checkpoint directory by official name, read lazily: opening reads the headers only,
    ``read`` reads a tensor or just the part of it a tensor-parallel rank holds."""

    def __init__(self, path: Path) -> None:
        files = [f for f in sorted(path.glob("*.safetensors")) if f.name != "cases.safetensors"]
        if not files:
            raise CheckpointError(f"no *.safetensors weight files in {path}")
        self._files = ExitStack()
        self.entries: dict[str, _Entry] = {}
        for f in files:
            try:
                handle = self._files.enter_context(safe_open(str(f), framework="pt"))
            except Exception as exc:  # safetensors raises its own error type for truncated or foreign files
                self._files.close()
                raise CheckpointError(f"{f} is not a readable safetensors file: {exc}") from None
            for key in handle.keys():
                name = official_name(key)
                if name in self.entries:
                    raise CheckpointError(f"tensor {name} appears twice (second time as {key!r} in {f.name})")
                info = handle.get_slice(key)
                if info.get_dtype() not in _DTYPES:
                    raise CheckpointError(f"tensor {name} has dtype {info.get_dtype()}, which v4compile cannot read")
                self.entries[name] = _Entry(handle, key, tuple(info.get_shape()), _DTYPES[info.get_dtype()])

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()

    def read(self, name: str, place: Placement | None = None) -> torch.Tensor:
        """Tensor ``name``, or only the part ``place`` names (rows ``start:stop`` of one dim)."""
        return self._read(self.entries[name], place)

    def _read(self, entry: _Entry, place: Placement | None) -> torch.Tensor:
        if entry.scale is not None:
            return self._dequantized(entry, place)
        if place is None or place.dim is None:
            return entry.handle.get_tensor(entry.key)
        return self._rows(entry, place.dim, place.start, place.stop)

    @staticmethod
    def _rows(entry: _Entry, dim: int, start: int, stop: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, stop),)
        return entry.handle.get_slice(entry.key)[index]

    def _dequantized(self, entry: _Entry, place: Placement | None) -> torch.Tensor:
        """An FP8 ``[out, in]`` weight's rows ``start:stop`` as bf16, reading only the 128-row blocks covering them."""
        rows, block = entry.shape[0], quant.FP8_WEIGHT_BLOCK
        start, stop = (0, rows) if place is None or place.dim is None else (place.start, place.stop)
        lo, hi = start // block * block, min(-(-stop // block) * block, rows)
        weight = self._rows(entry, 0, lo, hi)
        scale = self._rows(entry.scale, 0, lo // block, -(-hi // block))
        return quant.dequant_fp8_weight(weight, scale)[start - lo : stop - lo].to(torch.bfloat16)

    def fold_official_quirks(self, tp: TensorParallel, config: V4Config) -> None:
        """Drops the MTP block's copies of embed/head (they are shared; the held part of each must equal the
        main tensor's) and marks an FP8 ``wo_a`` with its scale for dequantization to bf16 on read."""
        for name in [n for n in self.entries if _MTP_SHARED.match(n)]:
            main = "embed.weight" if name.endswith("embed.weight") else "head.weight"
            copy = self.entries.pop(name)
            if main not in self.entries:
                continue
            held = self.entries[main]
            place = tp.placement(main, held.shape, config)
            if copy.shape != held.shape or not torch.equal(self.read(main, place), self._read(copy, place)):
                raise CheckpointError(f"{name} differs from {main}; DeepSeek-V4 shares them, so they must be equal")
        for name in [n for n in self.entries if n.endswith("attn.wo_a.weight")]:
            scale_name = name[: -len("weight")] + "scale"
            entry = self.entries[name]
            if entry.dtype == torch.float8_e4m3fn and scale_name in self.entries:
                entry.scale, entry.dtype = self.entries.pop(scale_name), torch.bfloat16


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in a directory, renamed to official names."""
    with Checkpoint(path) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint.entries}


def _check_against_model(tensors: dict[str, _Entry], expected: dict[str, torch.Tensor]) -> None:
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
        integer_ok = name.endswith("tid2eid") and not got.dtype.is_floating_point
        if got.dtype != want.dtype and not integer_ok:
            raise CheckpointError(f"tensor {name} has dtype {got.dtype}; the config needs {want.dtype}")


def load(path: str | Path, *, device: torch.device | str | None = None, max_seq_len: int | None = None,
         index_ties: str | None = None, tp_rank: int = 0, tp_size: int = 1) -> DeepSeekV4:
    """Loads a model from a directory with ``config.json`` and ``*.safetensors`` (official or HF names).

    Quantized weights stay quantized; each layer's routed experts (``experts.{e}.*`` on disk) are stacked into
    one tensor a projection. Any missing, extra, mis-shaped or mis-typed tensor is a
    CheckpointError naming it (checked against the file headers before any weight is read).
    ``tp_rank``/``tp_size`` load the shard of one tensor-parallel rank, reading only the parts of the
    tensors it holds; a degree the config cannot be split by is a ConfigError (ValueError) naming the
    field, raised before anything else is read. ``max_seq_len`` and ``index_ties`` override the config's
    settings (see ``V4Config``).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    overrides: dict[str, object] = {"max_seq_len": max_seq_len} if max_seq_len else {}
    if index_ties is not None:
        overrides["index_ties"] = index_ties
    config = V4Config.from_json(path / "config.json", **overrides)
    check_degree(config, tp_size, tp_rank)
    with Checkpoint(path) as checkpoint:
        model = DeepSeekV4(config, seed=None, tp_rank=tp_rank, tp_size=tp_size)
        checkpoint.fold_official_quirks(model.tp, config)
        whole = model if tp_size == 1 else DeepSeekV4(config, seed=None, device="meta")
        expected = official_state(whole.state_dict())
        _check_against_model(checkpoint.entries, expected)
        targets = official_state(model.state_dict())
        with torch.no_grad():
            for name, want in expected.items():
                place = model.tp.placement(name, tuple(want.shape), config)
                if place is not None:
                    target = targets[place.name]
                    target.copy_(checkpoint.read(name, place).to(target.dtype))
    return model.to(device) if device is not None else model


def save(model: DeepSeekV4, path: str | Path) -> None:
    """Writes ``model`` (a single-process model) as a checkpoint directory ``load`` reads back: ``config.json``
    and ``model.safetensors`` in the official names (each routed expert under ``experts.{e}.*``, unstacked)."""
    if model.tp.size != 1:
        raise CheckpointError(f"save writes a whole model; this is rank {model.tp.rank} of a tensor-parallel "
                              f"group of {model.tp.size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in official_state(model.state_dict()).items()}
    (path / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"))
