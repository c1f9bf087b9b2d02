"""The DeepSeek-V4 configuration: the official ``config.json`` keys, presets, and validation."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .quant import FP8_KV_BLOCK

VALID_COMPRESS_RATIOS = (0, 4, 128)
DEFAULT_MAX_SEQ_LEN = 4096
INDEX_TIE_RULES = ("lowest", "official")


class ConfigError(ValueError):
    """A configuration value that the model cannot be built from."""


def _alternating(first: list[int], n_layers: int, n_mtp: int) -> list[int]:
    rest = [4 if i % 2 == 0 else 128 for i in range(n_layers - len(first))]
    return first + rest + [0] * n_mtp


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_JSON_TYPES: dict[str, tuple[Any, str]] = {
    "int": (_integer, "an integer"),
    "float": (lambda v: _integer(v) or isinstance(v, float), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "list[int]": (lambda v: isinstance(v, (list, tuple)) and all(_integer(x) for x in v), "a list of integers"),
}
"""Per field annotation of ``V4Config``: the check of a value and what it must be."""


@dataclass
class V4Config:
    """Every key of the official inference ``config.json`` plus two settings, ``max_seq_len`` and ``index_ties``.

    ``max_seq_len`` is not an official key: it sizes caches and bounds inputs, and defaults to
    4096 (the official code's default); it is never derived from ``original_seq_len``.
    ``index_ties`` is the lightning indexer's rule among equal scores, which V4-SPEC leaves open: "lowest"
    (default) keeps the lowest entry ids, the same in prefill, chunks and decode, batch-invariant and what the
    radix top-k kernel computes; "official" reproduces the official model's choice on the CPU (``torch.topk``
    over the row the official code builds: every entry existing at the end of the call, -inf where a query
    cannot see it, k = min(index_topk, entries)), for parity with the official outputs. It is an eager
    reference: its decode reads positions on the host, so it is not captured.
    """

    vocab_size: int = 512
    dim: int = 128
    moe_inter_dim: int = 64
    n_layers: int = 4
    n_hash_layers: int = 1
    n_heads: int = 4
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 64
    head_dim: int = 128
    rope_head_dim: int = 64
    o_groups: int = 2
    o_lora_rank: int = 32
    window_size: int = 16
    original_seq_len: int = 64
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 4
    index_head_dim: int = 64
    index_topk: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    dtype: str = "bf16"
    scale_fmt: str | None = None
    scale_dtype: str = "fp32"
    expert_dtype: str | None = None
    compress_rope_theta: float = 160000.0
    compress_ratios: list[int] = field(default_factory=lambda: [0, 4, 128, 4, 0])
    n_mtp_layers: int = 1
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    index_ties: str = "lowest"

    def __post_init__(self) -> None:
        self._check_types()
        self.compress_ratios = [int(r) for r in self.compress_ratios]
        self.validate()

    def _check_types(self) -> None:
        """Raises ConfigError naming the first key whose value has the wrong JSON type."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            check, want = _JSON_TYPES.get(str(f.type), (lambda v: True, ""))
            if not check(value):
                raise ConfigError(f"config key {f.name!r} must be {want}, got {value!r} ({type(value).__name__})")

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> V4Config:
        """Builds a config from official keys; unknown keys are an error naming them."""
        merged = {**data, **overrides}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys are {sorted(known)}")
        return cls(**merged)

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> V4Config:
        """Reads an official ``config.json`` (a file, or a directory holding one)."""
        path, data = read_json(path)
        try:
            return cls.from_dict(data, **overrides)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> V4Config:
        """One of the named presets ``tiny``, ``flash``, ``pro``, with optional overrides.

        Overriding ``n_layers`` keeps the preset's layer pattern (truncated) and its MTP layers.
        """
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        base = dict(PRESETS[name])
        if "n_layers" in overrides and "compress_ratios" not in overrides:
            n, n_mtp = overrides["n_layers"], overrides.get("n_mtp_layers", base["n_mtp_layers"])
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"n_layers must be an integer of at least 1, got {n!r}")
            main = base["compress_ratios"][: base["n_layers"]]
            if n > len(main):
                raise ConfigError(f"preset {name!r} has {len(main)} layers; cannot make {n}")
            base["compress_ratios"] = main[:n] + [0] * n_mtp
        return cls.from_dict(base, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The config as official keys (plus the settings ``max_seq_len`` and ``index_ties``)."""
        return dataclasses.asdict(self)

    # ----------------------------------------------------------------- derived values
    @property
    def layer_ratios(self) -> list[int]:
        """Compress ratio of each main layer."""
        return self.compress_ratios[: self.n_layers]

    def mtp_ratio(self, k: int) -> int:
        """Compress ratio of MTP layer ``k``."""
        return self.compress_ratios[self.n_layers + k]

    @property
    def weights_fp8(self) -> bool:
        """Whether the dense projections are FP8 (e4m3 + block scales)."""
        return self.dtype == "fp8"

    @property
    def pow2_scales(self) -> bool:
        """Whether activation quantization scales are rounded up to powers of two."""
        return self.scale_fmt == "ue8m0" or self.scale_dtype == "fp8"

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raises ConfigError naming the first inconsistent value."""
        if self.n_layers < 1 or self.n_mtp_layers < 0:
            raise ConfigError(f"n_layers must be at least 1 and n_mtp_layers at least 0, got n_layers {self.n_layers}, "
                              f"n_mtp_layers {self.n_mtp_layers}")
        n_expected = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_expected:
            raise ConfigError(
                f"compress_ratios has {len(self.compress_ratios)} entries; expected n_layers + "
                f"n_mtp_layers = {n_expected}"
            )
        for i, r in enumerate(self.compress_ratios):
            if r not in VALID_COMPRESS_RATIOS:
                raise ConfigError(
                    f"compress_ratios[{i}] = {r} is not a known compress ratio; valid: {VALID_COMPRESS_RATIOS}"
                )
        for k in range(self.n_mtp_layers):
            if self.mtp_ratio(k) != 0:
                raise ConfigError(f"MTP layer {k} must be window-only (compress ratio 0), got {self.mtp_ratio(k)}")
        checks = [
            (self.dtype in ("bf16", "fp8"), f"dtype must be 'bf16' or 'fp8', got {self.dtype!r}"),
            (self.scale_fmt in (None, "ue8m0"), f"scale_fmt must be null or 'ue8m0', got {self.scale_fmt!r}"),
            (self.scale_dtype in ("fp32", "fp8"), f"scale_dtype must be 'fp32' or 'fp8', got {self.scale_dtype!r}"),
            (self.expert_dtype in (None, "fp4"),
             f"expert_dtype must be null or 'fp4', got {self.expert_dtype!r}"),
            (self.score_func == "sqrtsoftplus", f"score_func must be 'sqrtsoftplus', got {self.score_func!r}"),
            (self.n_shared_experts == 1, f"n_shared_experts must be 1, got {self.n_shared_experts}"),
            (0 < self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
             f"rope_head_dim {self.rope_head_dim} must be even and at most head_dim {self.head_dim}"),
            ((self.head_dim - self.rope_head_dim) % FP8_KV_BLOCK == 0,
             f"head_dim {self.head_dim} - rope_head_dim {self.rope_head_dim} must be whole FP8 KV blocks of "
             f"{FP8_KV_BLOCK} (the non-RoPE dims of every KV entry are stored in e4m3 blocks of that width)"),
            (self.rope_head_dim <= self.index_head_dim,
             f"rope_head_dim {self.rope_head_dim} exceeds index_head_dim {self.index_head_dim}"),
            (self.index_head_dim & (self.index_head_dim - 1) == 0,
             f"index_head_dim {self.index_head_dim} must be a power of two (Hadamard rotation)"),
            ((self.n_heads * self.head_dim) % self.o_groups == 0,
             f"o_groups {self.o_groups} must divide n_heads*head_dim {self.n_heads * self.head_dim}"),
            (1 <= self.n_activated_experts <= self.n_routed_experts,
             f"n_activated_experts {self.n_activated_experts} must be in 1..{self.n_routed_experts}"),
            (0 <= self.n_hash_layers <= self.n_layers, f"n_hash_layers {self.n_hash_layers} out of range"),
            (self.window_size >= 1, f"window_size must be positive, got {self.window_size}"),
            (self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1"),
            (self.max_seq_len >= 1, f"max_seq_len must be positive, got {self.max_seq_len}"),
            (self.index_ties in INDEX_TIE_RULES,
             f"index_ties must be one of {INDEX_TIE_RULES}, got {self.index_ties!r}"),
            (self.vocab_size >= 1 and self.dim >= 1, "vocab_size and dim must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def read_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The path and JSON object of a ``config.json`` (a file, or a directory holding one), in any key format;
    a missing file, invalid JSON or a non-object is a ConfigError naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object of config keys, got {type(data).__name__}")
    return path, data


_SHARED = dict(
    n_hash_layers=3, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
    beta_fast=32, beta_slow=1, window_size=128, vocab_size=129280, head_dim=512, rope_head_dim=64,
    index_n_heads=64, index_head_dim=128, n_shared_experts=1, n_activated_experts=6,
    score_func="sqrtsoftplus", swiglu_limit=10.0, n_mtp_layers=1, dtype="fp8", scale_fmt="ue8m0",
    scale_dtype="fp8", expert_dtype="fp4",
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512, dim=128, moe_inter_dim=64, n_layers=4, n_hash_layers=1, n_heads=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, route_scale=1.5,
        q_lora_rank=64, head_dim=128, rope_head_dim=64, o_groups=2, o_lora_rank=32, window_size=16,
        original_seq_len=64, index_n_heads=4, index_head_dim=64, index_topk=8,
        compress_ratios=[0, 4, 128, 4, 0], n_mtp_layers=1, dtype="bf16", scale_fmt=None,
        scale_dtype="fp32", expert_dtype=None,
    ),
    "flash": dict(
        _SHARED, n_layers=43, dim=4096, moe_inter_dim=2048, n_heads=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, n_routed_experts=256, route_scale=1.5, index_topk=512,
        compress_ratios=_alternating([0, 0], 43, 1),
    ),
    "pro": dict(
        _SHARED, n_layers=61, dim=7168, moe_inter_dim=3072, n_heads=128, q_lora_rank=1536,
        o_groups=16, o_lora_rank=1024, n_routed_experts=384, route_scale=2.5, index_topk=1024,
        compress_ratios=_alternating([128, 128], 61, 1),
    ),
}
