"""The mapping between Hugging Face transformers' DeepSeek-V4 checkpoint format and v4compile's official one.

transformers 5.23 (``transformers.models.deepseek_v4``, ``DeepseekV4ForCausalLM``) writes a folder in one of two
tensor namings: its module names (``save_pretrained(..., save_original_format=False)``: ``model.layers.{i}.
self_attn.q_a_proj.weight``, fused experts ``mlp.experts.gate_up_proj`` [E, 2I, D]) or, by default, its "original
format" (its conversion mapping run backwards: the official names under a ``model.`` prefix, except that
``embed_tokens``, ``hc_head.*`` and the final ``norm`` keep their module names and the attention's ``kv_norm`` comes
out as ``attn.norm``). Its ``config.json`` uses transformers' keys (``hidden_size``, ``layer_types`` +
``compress_rates``, nested ``rope_parameters``, ...). This module maps both directions: config keys to and from
``V4Config``, every tensor name to its official name (fused experts split per expert), and the official state
back to transformers' module names, layouts and dtypes, so a transformers folder round-trips bitwise.

transformers keeps no MTP block (it ignores ``mtp.*`` tensors on load) and no quantized V4 weights of its own; a
``quantization_config`` is refused rather than guessed.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .config import ConfigError, V4Config
from .moe import official_state

MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"

_FAMILIES = {
    "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "deepseek_v32": "DeepSeek-V3.2",
    "deepseek_vl_v2": "DeepSeek-VL2",
}

_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_RATIO_LAYER_TYPE = {ratio: kind for kind, ratio in _LAYER_TYPE_RATIO.items()}
_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

_RENAMED_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts", "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "swiglu_limit": "swiglu_limit",
    "q_lora_rank": "q_lora_rank", "head_dim": "head_dim", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
    "index_topk": "index_topk", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "rms_norm_eps": "norm_eps", "num_nextn_predict_layers": "n_mtp_layers",
}
"""transformers keys that are an official key under another name, one to one."""

_FIXED_KEYS: dict[str, Any] = {
    "num_key_value_heads": 1, "norm_topk_prob": True, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False,
}
"""Keys whose only value V4's math has: any other value is an error naming the key."""

_DERIVED_KEYS = {"layer_types", "compress_rates", "compress_rate_csa", "compress_rate_hca", "compress_ratios",
                 "mlp_layer_types", "num_hash_layers", "rope_parameters", "rope_theta", "compress_rope_theta",
                 "partial_rotary_factor", "qk_rope_head_dim", "tie_word_embeddings", "model_type"}
"""Keys read by ``config_from_hf`` itself (several transformers keys make one official key, or the reverse)."""

_IGNORED_KEYS = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "attention_dropout", "max_position_embeddings", "_name_or_path", "output_hidden_states",
    "output_attentions", "return_dict", "is_encoder_decoder", "tokenizer_class", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "keys_to_ignore_at_inference", "auto_map",
}
"""Keys that do not change the inference math (training-only settings, token ids, bookkeeping, transformers'
activation dtype: v4compile keeps the official per-tensor dtypes whatever it says)."""


def is_hf_config(data: dict[str, Any]) -> bool:
    """Whether a ``config.json`` object is in transformers' keys (any transformers config, V4 or not) rather than
    the official inference keys."""
    return "model_type" in data or "hidden_size" in data or "num_hidden_layers" in data


def _integral(key: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")


def _check_family(data: dict[str, Any]) -> None:
    model_type = data.get("model_type")
    if model_type == MODEL_TYPE:
        return
    if model_type is None:
        raise ConfigError(f"config has transformers keys but no 'model_type'; v4compile reads model_type "
                          f"{MODEL_TYPE!r} (DeepSeek-V4)")
    family = _FAMILIES.get(model_type, repr(model_type))
    raise ConfigError(f"this is a {family} config (model_type {model_type!r}); v4compile loads DeepSeek-V4")


def _compress_ratios(data: dict[str, Any], n_layers: int) -> list[int]:
    """Per-layer compress ratios from ``layer_types`` + ``compress_rates`` (or the legacy ``compress_ratios``),
    with transformers' default pattern when neither is given."""
    rates = dict(data.get("compress_rates") or _COMPRESS_RATES)
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):
        if data.get(legacy) is not None:
            rates[kind] = data[legacy]
    if rates != _COMPRESS_RATES:
        raise ConfigError(f"config key 'compress_rates' is {rates}; DeepSeek-V4 compresses by {_COMPRESS_RATES}")
    layer_types = data.get("layer_types")
    if layer_types is None and data.get("compress_ratios") is not None:
        return [_integral("compress_ratios", r) for r in data["compress_ratios"][:n_layers]]
    if layer_types is None:
        interleave = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                      for i in range(max(n_layers - 2, 0))]
        layer_types = ["heavily_compressed_attention"] * min(n_layers, 2) + interleave
    if len(layer_types) != n_layers or any(t not in _LAYER_TYPE_RATIO for t in layer_types):
        raise ConfigError(f"config key 'layer_types' must list {n_layers} entries of {sorted(_LAYER_TYPE_RATIO)}, "
                          f"got {layer_types}")
    return [_LAYER_TYPE_RATIO[t] for t in layer_types]


def _hash_layers(data: dict[str, Any], n_layers: int) -> int:
    """``n_hash_layers`` from ``mlp_layer_types`` (hash layers must come first, as V4 has them) or the legacy
    ``num_hash_layers`` (transformers' default: 3)."""
    kinds = data.get("mlp_layer_types")
    if kinds is None:
        n_hash = data.get("num_hash_layers")
        return min(n_layers, _integral("num_hash_layers", 3 if n_hash is None else n_hash))
    n_hash = sum(1 for k in kinds if k == "hash_moe")
    if len(kinds) != n_layers or kinds != ["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash):
        raise ConfigError(f"config key 'mlp_layer_types' must be {n_layers} entries, 'hash_moe' layers first and "
                          f"'moe' after, got {kinds}")
    return n_hash


def _rope(data: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The official RoPE keys from ``rope_parameters`` {"main": ..., "compress": ...} (or its flat form, YaRN
    keys for the compressed layers, as transformers' config accepts it)."""
    params = data.get("rope_parameters") or {}
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main = params["main"] if nested else {"rope_type": "default", "rope_theta": data.get("rope_theta", 10000.0)}
    compress = params["compress"] if nested else {
        "rope_type": "default", **params, "rope_theta": data.get("compress_rope_theta", 160000.0)}
    if data.get("qk_rope_head_dim") is not None:
        rope_dim = _integral("qk_rope_head_dim", data["qk_rope_head_dim"])
    else:
        factor = data.get("partial_rotary_factor") or main.get("partial_rotary_factor") or 64 / 512
        rope_dim = int(head_dim * factor)
    for label, part in (("main", main), ("compress", compress)):
        factor = part.get("partial_rotary_factor")
        if factor is not None and int(head_dim * factor) != rope_dim:
            raise ConfigError(f"config key 'rope_parameters.{label}.partial_rotary_factor' = {factor} gives "
                              f"{int(head_dim * factor)} RoPE dims; the other keys give {rope_dim}")
    if main.get("rope_type", "default") != "default":
        raise ConfigError(f"config key 'rope_parameters.main.rope_type' is {main['rope_type']!r}; DeepSeek-V4's "
                          "window-only layers use plain RoPE ('default')")
    known_main = {"rope_type", "rope_theta", "partial_rotary_factor"}
    known_compress = known_main | {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                   "attention_factor", "truncate"}
    for label, part, known in (("main", main, known_main), ("compress", compress, known_compress)):
        unknown = sorted(set(part) - known)
        if unknown:
            raise ConfigError(f"config key 'rope_parameters.{label}.{unknown[0]}' is not part of DeepSeek-V4's RoPE; "
                              f"v4compile cannot honour it")
    out: dict[str, Any] = {"rope_head_dim": rope_dim, "rope_theta": float(main["rope_theta"]),
                           "compress_rope_theta": float(compress["rope_theta"])}
    kind = compress.get("rope_type", "default")
    if kind == "default":
        return {**out, "original_seq_len": 0}
    if kind != "yarn":
        raise ConfigError(f"config key 'rope_parameters.compress.rope_type' is {kind!r}; DeepSeek-V4 uses 'yarn' "
                          "or 'default'")
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(f"config key 'rope_parameters.compress.attention_factor' is {compress['attention_factor']}; "
                          "DeepSeek-V4 applies no YaRN attention scaling (1.0)")
    if compress.get("truncate", True) is not True:
        raise ConfigError("config key 'rope_parameters.compress.truncate' is false; DeepSeek-V4's YaRN truncates "
                          "the correction range")
    return {**out, "original_seq_len": _integral("original_max_position_embeddings",
                                                 compress["original_max_position_embeddings"]),
            "rope_factor": float(compress["factor"]),
            "beta_fast": _integral("beta_fast", compress.get("beta_fast", 32)),
            "beta_slow": _integral("beta_slow", compress.get("beta_slow", 1))}


def config_from_hf(data: dict[str, Any], **overrides: Any) -> tuple[V4Config, bool]:
    """A ``V4Config`` from a transformers DeepSeek-V4 ``config.json`` object, and whether its embeddings are tied
    (the output head is then the embedding). Another model family, a key that changes the math in a way v4compile
    cannot honour, or an unknown key is a ConfigError naming it; ``overrides`` are official keys."""
    _check_family(data)
    unknown = sorted(set(data) - set(_RENAMED_KEYS) - set(_FIXED_KEYS) - _DERIVED_KEYS - _IGNORED_KEYS)
    if "quantization_config" in unknown or data.get("expert_dtype") is not None:
        key = "quantization_config" if "quantization_config" in unknown else "expert_dtype"
        raise ConfigError(f"config key {key!r}: v4compile reads transformers' DeepSeek-V4 folders unquantized only "
                          "(load the official FP8/FP4 release in its official format)")
    unknown = [k for k in unknown if k != "expert_dtype"]
    if unknown:
        raise ConfigError(f"config key {unknown[0]!r} is not a transformers DeepSeek-V4 key v4compile knows; "
                          f"unknown keys: {unknown}")
    for key, want in _FIXED_KEYS.items():
        if key in data and data[key] != want:
            raise ConfigError(f"config key {key!r} is {data[key]!r}; DeepSeek-V4's math needs {want!r}")
    official: dict[str, Any] = {_RENAMED_KEYS[k]: v for k, v in data.items() if k in _RENAMED_KEYS}
    n_layers = _integral("num_hidden_layers", data.get("num_hidden_layers", 43))
    n_mtp = _integral("num_nextn_predict_layers", data.get("num_nextn_predict_layers", 1))
    official.update(n_layers=n_layers, n_mtp_layers=n_mtp, n_hash_layers=_hash_layers(data, n_layers),
                    compress_ratios=_compress_ratios(data, n_layers) + [0] * n_mtp)
    official.update(_rope(data, _integral("head_dim", data.get("head_dim", 512))))
    official.update(dtype="bf16", scale_fmt=None, scale_dtype="fp32", expert_dtype=None)
    return V4Config.from_dict({**official, **overrides}), bool(data.get("tie_word_embeddings", False))


def config_to_hf(config: V4Config) -> dict[str, Any]:
    """transformers' ``config.json`` object for ``config`` (bf16 activations, the official dtype); the settings
    ``max_seq_len`` becomes ``max_position_embeddings`` and ``index_ties`` is not written."""
    if config.weights_fp8 or config.expert_dtype is not None:
        raise ConfigError("transformers' DeepSeek-V4 format holds unquantized weights; this config has "
                          f"dtype {config.dtype!r}, expert_dtype {config.expert_dtype!r}")
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": "bfloat16"}
    out.update({hf: getattr(config, ours) for hf, ours in _RENAMED_KEYS.items()})
    out.update(_FIXED_KEYS)
    partial = config.rope_head_dim / config.head_dim
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": config.compress_rope_theta,
                                "partial_rotary_factor": partial}
    if config.original_seq_len > 0:
        compress.update(rope_type="yarn", factor=config.rope_factor, attention_factor=1.0,
                        original_max_position_embeddings=config.original_seq_len,
                        beta_fast=config.beta_fast, beta_slow=config.beta_slow)
    out.update(
        layer_types=[_RATIO_LAYER_TYPE[r] for r in config.layer_ratios],
        compress_rates=dict(_COMPRESS_RATES),
        mlp_layer_types=["hash_moe"] * config.n_hash_layers + ["moe"] * (config.n_layers - config.n_hash_layers),
        rope_theta=config.rope_theta, compress_rope_theta=config.compress_rope_theta, partial_rotary_factor=partial,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": config.rope_theta,
                                  "partial_rotary_factor": partial}, "compress": compress},
        max_position_embeddings=config.max_seq_len, tie_word_embeddings=False,
    )
    return out


# --------------------------------------------------------------------------------------------- tensor names
_LAYER = r"^((?:layers|mtp)\.\d+)\."
_RULES: list[tuple[str, str]] = [
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (_LAYER + r"input_layernorm\.", r"\1.attn_norm."),
    (_LAYER + r"post_attention_layernorm\.", r"\1.ffn_norm."),
    (_LAYER + r"(attn|ffn)_hc\.(fn|base|scale)$", r"\1.hc_\2_\3"),
    (_LAYER + r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", r"\1.attn.indexer.weights_proj."),
    (_LAYER + r"self_attn\.compressor\.indexer\.q_b_proj\.", r"\1.attn.indexer.wq_b."),
    (_LAYER + r"self_attn\.compressor\.indexer\.", r"\1.attn.indexer.compressor."),
    (_LAYER + r"self_attn\.", r"\1.attn."),
    (_LAYER + r"mlp\.", r"\1.ffn."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_a_norm\.", ".q_norm."), (r"\.q_b_proj\.", ".wq_b."),
    (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."), (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."), (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.weight_scale_inv$", ".scale"),
]
"""transformers' module names (and the leftovers of its original format) to official names, applied in order
after the ``model.`` prefix is dropped; an official name passes through unchanged."""
_COMPILED = [(re.compile(pattern), repl) for pattern, repl in _RULES]

_FUSED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$")
_MTP_NAME = re.compile(r"^mtp\.\d+\.")


def official_name(name: str) -> str:
    """The official name of a tensor named by transformers (module names or its original format) or already
    official. Fused expert tensors keep a stacked name (``layers.{i}.ffn.experts.gate_up_proj``) that
    ``fused_parts`` splits."""
    name = name.removeprefix("model.")
    for pattern, repl in _COMPILED:
        name = pattern.sub(repl, name)
    return name


def fused_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int | slice, ...]]] | None:
    """For a fused expert tensor (official-renamed ``...experts.gate_up_proj`` [E, 2I, D] or ``...down_proj``
    [E, D, I]): each official per-expert name with the index that reads it out of the stored tensor (w1 is the
    first half of gate_up's rows, w3 the second, as transformers concatenates them). None for any other tensor;
    an empty list for a fused tensor whose shape is not 3-D with an even row count (it cannot be split)."""
    m = _FUSED.match(name)
    if m is None:
        return None
    if len(shape) != 3 or shape[1] % 2:
        return []
    prefix, kind = m.groups()
    if kind == "down_proj":
        return [(f"{prefix}.{e}.w2.weight", (e,)) for e in range(shape[0])]
    inter = shape[1] // 2
    return [part for e in range(shape[0]) for part in (
        (f"{prefix}.{e}.w1.weight", (e, slice(0, inter))), (f"{prefix}.{e}.w3.weight", (e, slice(inter, 2 * inter))))]


# --------------------------------------------------------------------------------------------- saving
_HF_FP32 = re.compile(r"(_hc\.|hc_head\.|norm\.weight$|\.sinks$|position_bias$|e_score_correction_bias$)")
"""Tensors transformers keeps in fp32 whatever its dtype (``_keep_in_fp32_modules_strict``); the rest are bf16."""

_OFFICIAL_TO_HF: list[tuple[str, str]] = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.experts\.\d+\.w[13]\.weight$", ".experts.gate_up_proj"),
    (r"\.experts\.\d+\.w2\.weight$", ".experts.down_proj"),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.attn_sink$", ".sinks"),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.(compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"^layers\.", "model.layers."),
]
_COMPILED_BACK = [(re.compile(pattern), repl) for pattern, repl in _OFFICIAL_TO_HF]
_STACKED = re.compile(r"^(layers\.\d+)\.ffn\.experts\.(w[123])\.weight$")


def hf_name(name: str) -> str:
    """transformers' module name of an official tensor name (a routed expert's: the fused tensor holding it);
    MTP tensors, which transformers has no module for, keep their official names."""
    if _MTP_NAME.match(name):
        return name
    for pattern, repl in _COMPILED_BACK:
        name = pattern.sub(repl, name)
    return name


def _hf_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
    if name.endswith("tid2eid"):
        return torch.int64
    if not tensor.dtype.is_floating_point:
        return tensor.dtype
    return torch.float32 if _HF_FP32.search(name) else torch.bfloat16


def to_hf_dtype(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the dtype transformers keeps it in, where that cast is exact (a bf16-valued fp32 head goes
    back to bf16); otherwise unchanged, so saving never loses a bit."""
    want = _hf_dtype(name, tensor)
    if want == tensor.dtype:
        return tensor
    cast = tensor.to(want)
    return cast if torch.equal(cast.to(tensor.dtype), tensor) else tensor


def hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict (stacked experts, as ``DeepSeekV4.state_dict()``) in transformers' names, layouts and
    dtypes: ``experts.w1``/``w3`` [E, I, D] fused into ``gate_up_proj`` [E, 2I, D], ``w2`` is ``down_proj``; the MTP
    block (which transformers ignores on load) in official names, its experts one tensor each."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _STACKED.match(name)
        if m is None:
            out.update({hf_name(n): to_hf_dtype(hf_name(n), t) for n, t in official_state({name: tensor}).items()})
        elif m.group(2) == "w2":
            out[f"model.{m.group(1)}.mlp.experts.down_proj"] = tensor
        elif m.group(2) == "w1":
            w3 = state[f"{m.group(1)}.ffn.experts.w3.weight"]
            out[f"model.{m.group(1)}.mlp.experts.gate_up_proj"] = torch.cat([tensor, w3], dim=1)
    return out
