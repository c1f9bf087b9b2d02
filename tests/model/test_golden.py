"""The reference model against the official DeepSeek-V4 golden vectors (shared/golden/README.md).

Tolerance, from the README: per logit row cosine similarity median >= 0.99, mean >= 0.97, argmax
agreement >= 0.80; MTP last-position cosine >= 0.95. Rows where the official model's own prefill
and decode paths pick different argmaxes are knife edges of the official model itself; there
either official answer counts as agreement.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import v4compile
from v4compile.model.checkpoint import read_tensors

FOLDERS = ("tiny-bf16", "tiny-fp8-fp4")


def _cases(root: Path, name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    cases = load_file(str(root / name / "cases.safetensors"))
    keys = sorted({k.split(".")[0] for k in cases if k.startswith("case")})
    return cases, keys


def _band(ours: torch.Tensor, official: torch.Tensor, official_alt: torch.Tensor) -> dict[str, float]:
    cos = F.cosine_similarity(ours, official, dim=-1)
    top = ours.argmax(-1)
    agree = (top == official.argmax(-1)) | (top == official_alt.argmax(-1))
    return {"median": cos.median().item(), "mean": cos.mean().item(), "min": cos.min().item(),
            "agree": agree.float().mean().item(), "agree_plain": (top == official.argmax(-1)).float().mean().item()}


def _assert_in_band(stats: dict[str, float], what: str) -> None:
    print(what, {k: round(v, 4) for k, v in stats.items()})
    assert stats["median"] >= 0.99, (what, stats)
    assert stats["mean"] >= 0.97, (what, stats)
    assert stats["agree"] >= 0.80, (what, stats)


@pytest.mark.parametrize("name", FOLDERS)
def test_full_forward_matches_official_prefill(golden_root: Path, golden_models: dict, name: str) -> None:
    model = golden_models[name]
    cases, keys = _cases(golden_root, name)
    ours, official, official_decode = [], [], []
    for key in keys:
        ids, length = cases[f"{key}.ids"], int(cases[f"{key}.prefill_len"])
        n = cases[f"{key}.prefill_logits"].shape[1]
        with torch.no_grad():
            ours.append(model(ids)[:, length - 1 : length - 1 + n].flatten(0, 1))
        official.append(cases[f"{key}.prefill_logits"].flatten(0, 1))
        official_decode.append(cases[f"{key}.decode_logits"].flatten(0, 1))
    _assert_in_band(_band(torch.cat(ours), torch.cat(official), torch.cat(official_decode)), f"{name} prefill")


def _decode_logits(model: v4compile.DeepSeekV4, ids: torch.Tensor, length: int, n: int) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0])
    with torch.no_grad():
        steps = [model(ids[:, :length], cache=cache)[:, -1:]]
        for i in range(n - 1):
            positions = torch.full((ids.shape[0],), length + i)
            steps.append(model.decode_step(ids[:, length + i : length + i + 1], positions, cache))
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("name", FOLDERS)
def test_decode_with_caches_matches_official_decode_and_own_full_forward(
    golden_root: Path, golden_models: dict, name: str
) -> None:
    model = golden_models[name]
    cases, keys = _cases(golden_root, name)
    ours, full, official, official_prefill = [], [], [], []
    for key in keys:
        ids, length = cases[f"{key}.ids"], int(cases[f"{key}.prefill_len"])
        n = cases[f"{key}.decode_logits"].shape[1]
        ours.append(_decode_logits(model, ids, length, n).flatten(0, 1))
        with torch.no_grad():
            full.append(model(ids)[:, length - 1 : length - 1 + n].flatten(0, 1))
        official.append(cases[f"{key}.decode_logits"].flatten(0, 1))
        official_prefill.append(cases[f"{key}.prefill_logits"].flatten(0, 1))
    ours_t, full_t = torch.cat(ours), torch.cat(full)
    official_t, official_prefill_t = torch.cat(official), torch.cat(official_prefill)
    _assert_in_band(_band(ours_t, official_t, official_prefill_t), f"{name} decode vs official decode")
    own = _band(ours_t, full_t, full_t)
    drift = _band(official_t, official_prefill_t, official_prefill_t)
    print(name, "official decode-vs-prefill drift", {k: round(v, 4) for k, v in drift.items()})
    _assert_in_band(own, f"{name} decode vs own full forward")


@pytest.mark.parametrize("name", FOLDERS)
def test_mtp_logits_match_official(golden_root: Path, golden_models: dict, name: str) -> None:
    cases, _ = _cases(golden_root, name)
    with torch.no_grad():
        logits = golden_models[name].mtp_logits(cases["mtp.hidden"], cases["mtp.ids"])[:, -1]
    cos = F.cosine_similarity(logits, cases["mtp.logits"], dim=-1)
    print(name, "mtp cos", cos.tolist())
    assert (cos >= 0.95).all()


def _hf_name(name: str) -> str:
    name = name.replace(".attn.", ".self_attn.").replace(".ffn.", ".mlp.")
    if name.endswith(".gate.bias"):
        name = name[: -len("bias")] + "e_score_correction_bias"
    if name.endswith(".scale") and not name.endswith("hc_head_scale") and "hc_" not in name.rsplit(".", 1)[-1]:
        name = name[: -len("scale")] + "weight_scale_inv"
    return "model." + name


def test_hugging_face_named_copy_loads_to_the_same_logits(golden_root: Path, golden_models: dict,
                                                         tmp_path: Path) -> None:
    name = "tiny-fp8-fp4"
    tensors = read_tensors(golden_root / name)
    save_file({_hf_name(k): v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(golden_root / name / "config.json", tmp_path / "config.json")
    assert any("weight_scale_inv" in k for k in load_file(str(tmp_path / "model.safetensors")))
    hf_model = v4compile.load(tmp_path)
    ids = load_file(str(golden_root / name / "cases.safetensors"))["case0.ids"]
    with torch.no_grad():
        assert torch.equal(hf_model(ids), golden_models[name](ids))
