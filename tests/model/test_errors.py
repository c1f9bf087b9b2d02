"""Bad input gets a clear error naming what was wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import v4compile
from v4compile import CheckpointError, ConfigError, InputError, V4Config


@pytest.fixture()
def checkpoint_copy(golden_root: Path, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = golden_root / "tiny-bf16"
    shutil.copy(src / "config.json", tmp_path / "config.json")
    return tmp_path, load_file(str(src / "model.safetensors"))


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def test_missing_tensor_is_named(checkpoint_copy) -> None:
    path, tensors = checkpoint_copy
    del tensors["layers.1.attn.compressor.ape"]
    _save(path, tensors)
    with pytest.raises(CheckpointError, match=r"missing .*layers\.1\.attn\.compressor\.ape"):
        v4compile.load(path)


def test_extra_tensor_is_named(checkpoint_copy) -> None:
    path, tensors = checkpoint_copy
    tensors["layers.0.attn.surprise"] = torch.zeros(3)
    _save(path, tensors)
    with pytest.raises(CheckpointError, match=r"does not use: layers\.0\.attn\.surprise"):
        v4compile.load(path)


def test_wrong_shape_is_named(checkpoint_copy) -> None:
    path, tensors = checkpoint_copy
    tensors["layers.2.attn.wq_a.weight"] = tensors["layers.2.attn.wq_a.weight"][:-1]
    _save(path, tensors)
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wq_a\.weight has shape \(63, 128\).*\(64, 128\)"):
        v4compile.load(path)


def test_wrong_dtype_is_named(checkpoint_copy) -> None:
    path, tensors = checkpoint_copy
    tensors["head.weight"] = tensors["head.weight"].to(torch.bfloat16)
    _save(path, tensors)
    with pytest.raises(CheckpointError, match=r"head\.weight has dtype torch\.bfloat16.*torch\.float32"):
        v4compile.load(path)


def test_config_that_does_not_fit_checkpoint(checkpoint_copy) -> None:
    path, tensors = checkpoint_copy
    config = json.loads((path / "config.json").read_text())
    config["q_lora_rank"] = 96
    (path / "config.json").write_text(json.dumps(config))
    _save(path, tensors)
    expected = r"layers\.0\.attn\.wq_a\.weight has shape \(64, 128\); the config needs \(96, 128\)"
    with pytest.raises(CheckpointError, match=expected):
        v4compile.load(path)


def test_unknown_compress_ratio_in_config() -> None:
    with pytest.raises(ConfigError, match=r"compress_ratios\[1\] = 8 is not a known compress ratio"):
        V4Config.preset("tiny", compress_ratios=[0, 8, 128, 4, 0])


def test_a_head_dim_without_whole_fp8_kv_blocks_is_named() -> None:
    """A head whose non-RoPE dims are not whole e4m3 blocks of 64 would build and fail inside the first forward."""
    with pytest.raises(ConfigError, match=r"head_dim 96 - rope_head_dim 64 must be whole FP8 KV blocks of 64"):
        V4Config.preset("tiny", head_dim=96)


def test_unknown_config_key_and_preset() -> None:
    with pytest.raises(ConfigError, match=r"unknown config keys \['dimm'\]"):
        V4Config.from_dict({**V4Config.preset("tiny").to_dict(), "dimm": 3})
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'.*flash"):
        V4Config.preset("huge")


def test_missing_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        v4compile.load(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(V4Config.preset("tiny").to_dict()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        v4compile.load(tmp_path)


def test_token_ids_outside_vocabulary(tiny_model) -> None:
    with pytest.raises(InputError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        tiny_model(torch.tensor([[1, 2, 512]]))
    with pytest.raises(InputError, match=r"token id -1 outside"):
        tiny_model(torch.tensor([[-1, 2]]))
    with pytest.raises(InputError, match="integer dtype"):
        tiny_model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(InputError, match="2-D integer tensor"):
        tiny_model(torch.tensor([1, 2]))


def test_sequence_longer_than_maximum(tiny_model) -> None:
    with pytest.raises(InputError, match=r"4097 tokens is longer than the configured maximum 4096"):
        tiny_model(torch.zeros(1, 4097, dtype=torch.long))
    cache = tiny_model.new_cache(1, max_seq_len=32)
    with pytest.raises(InputError, match=r"40 tokens is longer than the configured maximum 32"):
        tiny_model(torch.zeros(1, 40, dtype=torch.long), cache=cache)
    tiny_model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(InputError, match=r"position 32 is beyond the cache's maximum length 32"):
        tiny_model.decode_step(torch.zeros(1, 1, dtype=torch.long), torch.tensor([32]), cache)


def test_decode_input_shapes(tiny_model) -> None:
    cache = tiny_model.new_cache(2)
    with pytest.raises(InputError, match="one token per row"):
        tiny_model.decode_step(torch.zeros(2, 2, dtype=torch.long), torch.tensor([3, 3]), cache)
    with pytest.raises(InputError, match=r"positions must have shape \[2\]"):
        tiny_model.decode_step(torch.zeros(2, 1, dtype=torch.long), torch.tensor([3]), cache)
    with pytest.raises(InputError, match="need 3 rows"):
        tiny_model.decode_step(torch.zeros(3, 1, dtype=torch.long), torch.tensor([3, 3, 3]), cache)


def test_a_config_value_of_the_wrong_type_names_the_key_and_the_file(checkpoint_copy) -> None:
    path, tensors = checkpoint_copy
    _save(path, tensors)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n_heads": "four"}))
    with pytest.raises(ConfigError, match=r"config\.json: config key 'n_heads' must be an integer, got 'four'"):
        v4compile.load(path)
    with pytest.raises(ConfigError, match="'compress_ratios' must be a list of integers"):
        V4Config.preset("tiny", compress_ratios=[0, 4, "128", 4, 0])


def test_config_json_that_is_not_json_names_the_file_and_the_place(checkpoint_copy) -> None:
    path, _ = checkpoint_copy
    (path / "config.json").write_text('{"dim": 128,\n "n_layers": }')
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON: .* line 2, column"):
        v4compile.load(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        v4compile.load(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_safetensors_file_is_named(checkpoint_copy, damage: str) -> None:
    path, tensors = checkpoint_copy
    _save(path, tensors)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:100] if damage == "truncated" else b"not a checkpoint" * 8)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        v4compile.load(path)


def test_zero_layers_says_so() -> None:
    with pytest.raises(ConfigError, match="n_layers must be an integer of at least 1, got 0"):
        V4Config.preset("tiny", n_layers=0)
    with pytest.raises(ConfigError, match="n_layers must be at least 1"):
        V4Config.preset("tiny", n_layers=0, compress_ratios=[0])


def test_negative_fuel_is_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match="fuel must be None or a non-negative integer"):
        v4compile.optimize(tiny_model, fuel=-1)
