"""Loading and saving checkpoints in the official format or transformers' (``hf_format``), with every mismatch
reported by tensor name."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import hf_format, quant
from .config import ConfigError, V4Config, read_json
from .moe import official_state
from .parallel import Placement, TensorParallel, check_degree
from .transformer import DeepSeekV4


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config or the model (the message names the tensor)."""


_MTP_SHARED = re.compile(r"^mtp\.(\d+)\.(embed|head)\.weight$")
FORMATS = ("official", "hf")

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass
class _Entry:
    """Where one checkpoint tensor lives and what its header says; ``scale`` is set for an FP8 ``wo_a``
    that is dequantized to bf16 when read; ``index`` picks one expert's part out of a fused transformers tensor
    (``shape`` is then that part's)."""

    handle: Any
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale: _Entry | None = None
    index: tuple[int | slice, ...] | None = None


class Checkpoint:
    """The tensors of a checkpoint directory by official name, read lazily: opening reads the headers only,
    ``read`` reads a tensor or just the part of it a tensor-parallel rank holds. transformers' names are mapped
    to official ones and its fused experts split (``hf_format``)."""

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
                name = hf_format.official_name(key)
                info = handle.get_slice(key)
                if info.get_dtype() not in _DTYPES:
                    raise CheckpointError(f"tensor {name} has dtype {info.get_dtype()}, which v4compile cannot read")
                shape, dtype = tuple(info.get_shape()), _DTYPES[info.get_dtype()]
                parts = hf_format.fused_parts(name, shape)
                if parts == []:
                    raise CheckpointError(f"tensor {key} has shape {shape}; transformers stores fused experts as "
                                          "[experts, 2*inter, dim] (gate_up_proj) or [experts, dim, inter] (down_proj)")
                for part, index in parts or [(name, None)]:
                    if part in self.entries:
                        raise CheckpointError(f"tensor {part} appears twice (second time in {key!r} in {f.name})")
                    part_shape = shape if index is None else _indexed_shape(shape, index)
                    self.entries[part] = _Entry(handle, key, part_shape, dtype, index=index)

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
        if entry.index is not None:
            part = entry.handle.get_slice(entry.key)[entry.index]
            return part if place is None else place.take(part)
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


    def tie_head(self) -> None:
        """Reads the output head from the embedding when the checkpoint has no head of its own (transformers'
        ``tie_word_embeddings``: v4compile unties them, the fp32 head a widened copy of the embedding)."""
        if "head.weight" not in self.entries and "embed.weight" in self.entries:
            self.entries["head.weight"] = dataclasses.replace(self.entries["embed.weight"])

    def has_mtp(self) -> bool:
        """Whether any MTP block tensor is in the checkpoint."""
        return any(name.startswith("mtp.") for name in self.entries)


def _indexed_shape(shape: tuple[int, ...], index: tuple[int | slice, ...]) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape`` (integers drop a dim, slices narrow one)."""
    out = []
    for i, size in enumerate(shape):
        if i >= len(index):
            out.append(size)
        elif isinstance(index[i], slice):
            out.append(len(range(*index[i].indices(size))))
    return tuple(out)


def exact_cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` cast to ``dtype`` when no value changes (widening always; narrowing when every value fits);
    a lossy cast is a CheckpointError naming the tensor."""
    if tensor.dtype == dtype:
        return tensor
    cast = tensor.to(dtype)
    same = cast.to(tensor.dtype) == tensor
    if tensor.dtype.is_floating_point:
        same |= tensor.isnan() & cast.isnan()
    if not bool(same.all()):
        raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}; the model keeps it in {dtype}, and the cast "
                              "would change its values")
    return cast


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in a directory, renamed to official names."""
    with Checkpoint(path) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint.entries}


def _check_against_model(tensors: dict[str, _Entry], expected: dict[str, torch.Tensor], hf: bool) -> None:
    """Every missing, extra or misshapen tensor is a CheckpointError naming it (for a transformers folder, with its
    name there too); an official folder's dtypes must match exactly, a transformers folder's are cast on read
    where the cast is exact (``exact_cast``)."""

    def named(names: list[str]) -> str:
        shown = [f"{n} ({hf_format.hf_name(n)})" if hf else n for n in names[:8]]
        return ", ".join(shown) + (" ..." if len(names) > 8 else "")

    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the config needs: {named(missing)}")
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} tensor(s) the config does not use: {named(extra)}")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {named([name])} has shape {tuple(got.shape)}; the config needs "
                                  f"{tuple(want.shape)}")
        integer_ok = name.endswith("tid2eid") and not got.dtype.is_floating_point
        if got.dtype != want.dtype and not integer_ok and not hf:
            raise CheckpointError(f"tensor {name} has dtype {got.dtype}; the config needs {want.dtype}")


def load(path: str | Path, *, device: torch.device | str | None = None, max_seq_len: int | None = None,
         index_ties: str | None = None, tp_rank: int = 0, tp_size: int = 1) -> DeepSeekV4:
    """Loads a model from a directory with ``config.json`` and ``*.safetensors``: the official format, or the one
    transformers writes for DeepSeek-V4 (told apart by the config's keys; tensor names in either naming).

    Quantized weights stay quantized; each layer's routed experts (``experts.{e}.*`` on disk) are stacked into
    one tensor a projection. Any missing, extra, mis-shaped or mis-typed tensor is a
    CheckpointError naming it (checked against the file headers before any weight is read).
    ``tp_rank``/``tp_size`` load the shard of one tensor-parallel rank, reading only the parts of the
    tensors it holds; a degree the config cannot be split by is a ConfigError (ValueError) naming the
    field, raised before anything else is read. ``max_seq_len`` and ``index_ties`` override the config's
    settings (see ``V4Config``). A transformers folder's tensors are cast to the official dtypes where the cast is
    exact (a lossy one is a CheckpointError naming the tensor) and tied embeddings are untied. A config announcing
    MTP layers for a checkpoint without any MTP tensor (transformers keeps none) loads without MTP, with a warning.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    overrides: dict[str, object] = {"max_seq_len": max_seq_len} if max_seq_len else {}
    if index_ties is not None:
        overrides["index_ties"] = index_ties
    config_path, data = read_json(path / "config.json")
    hf = hf_format.is_hf_config(data)
    try:
        config, tied = hf_format.config_from_hf(data, **overrides) if hf else (V4Config.from_dict(data, **overrides),
                                                                               False)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None
    check_degree(config, tp_size, tp_rank)
    with Checkpoint(path) as checkpoint:
        if tied:
            checkpoint.tie_head()
        if config.n_mtp_layers and not checkpoint.has_mtp():
            warnings.warn(f"{config_path} announces {config.n_mtp_layers} MTP layer(s) but the checkpoint has no MTP "
                          "tensors (transformers keeps none); loading the model without MTP", stacklevel=2)
            config = dataclasses.replace(config, n_mtp_layers=0, compress_ratios=config.layer_ratios)
        model = DeepSeekV4(config, seed=None, tp_rank=tp_rank, tp_size=tp_size)
        checkpoint.fold_official_quirks(model.tp, config)
        whole = model if tp_size == 1 else DeepSeekV4(config, seed=None, device="meta")
        expected = official_state(whole.state_dict())
        _check_against_model(checkpoint.entries, expected, hf)
        targets = official_state(model.state_dict())
        with torch.no_grad():
            for name, want in expected.items():
                place = model.tp.placement(name, tuple(want.shape), config)
                if place is not None:
                    target = targets[place.name]
                    value = checkpoint.read(name, place)
                    target.copy_(exact_cast(name, value, target.dtype) if hf else value.to(target.dtype))
    return model.to(device) if device is not None else model


def save(model: DeepSeekV4, path: str | Path, format: str = "official") -> None:
    """Writes ``model`` (a single-process model) as a checkpoint directory ``load`` reads back: ``config.json``
    and ``model.safetensors``. ``format="official"``: the official keys and names (each routed expert under
    ``experts.{e}.*``, unstacked). ``format="hf"``: transformers' DeepSeek-V4 config keys, module names, fused
    experts and dtypes (where the cast is exact; see ``hf_format.hf_state``), which ``from_pretrained`` reads;
    the MTP block, which transformers ignores, stays in official names. Quantized models save in the official
    format only."""
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; formats are {FORMATS}")
    if model.tp.size != 1:
        raise CheckpointError(f"save writes a whole model; this is rank {model.tp.rank} of a tensor-parallel "
                              f"group of {model.tp.size}")
    path = Path(path)
    if format == "hf":
        config, state, metadata = hf_format.config_to_hf(model.config), hf_format.hf_state(model.state_dict()), {
            "format": "pt"}
    else:
        config, state, metadata = model.config.to_dict(), official_state(model.state_dict()), None
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in state.items()}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
