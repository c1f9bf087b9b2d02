"""The MoE on stacked expert weights against the dense per-expert loop it replaced (every routed expert on every
token with its routing weight, zero where not chosen, summed in expert order): bitwise equal in every weight
format, with repeated hash experts, another rank's experts, replayed routing and gradients; checkpoints keep the
official per-expert names; the captured graph does not grow with the expert count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.func import functional_call

import v4compile
from v4compile.model.checkpoint import CheckpointError, read_tensors, save
from v4compile.model.moe import Expert, MoE, official_state
from v4compile.model.routing import Routing


def dense_loop(moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
    """The previous MoE forward: each local expert (the model's ``Linear`` on the stacked weights' slice) on every
    token, its hidden state scaled by its column of the scattered routing weights, summed in expert order."""
    flat = x.reshape(-1, moe.dim)
    weights, ids = moe.route(x, input_ids, replay)
    combine = torch.zeros(flat.shape[0], moe.n_experts).scatter(1, ids, weights)
    routed = moe.experts
    with torch.device("meta"):
        expert = Expert(moe.dim, routed.w1.out_features, routed.w1.fmt, routed.w1.pow2_scales, routed.limit)

    def linear(name: str, i: int, inputs: torch.Tensor) -> torch.Tensor:
        stacked = getattr(routed, name)
        params = {"weight": stacked.weight[i]} | ({"scale": stacked.scale[i]} if stacked.scale is not None else {})
        return functional_call(getattr(expert, name), params, (inputs,))

    y = torch.zeros(flat.shape, dtype=torch.float32)
    for i in range(routed.n):
        e = routed.first + i
        gate = linear("w1", i, flat).float().clamp(max=routed.limit)
        up = linear("w3", i, flat).float().clamp(-routed.limit, routed.limit)
        h = combine[:, e : e + 1] * (torch.nn.functional.silu(gate) * up)
        y = y + linear("w2", i, h.to(x.dtype)).float()
    y = moe.tp.all_reduce(y) + moe.shared_experts(flat).float()
    return y.to(x.dtype).view(x.shape)


def _inputs(config: v4compile.V4Config, seed: int, batch: int = 2, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, config.dim, generator=gen).bfloat16()
    return x, torch.randint(0, config.vocab_size, (batch, seq), generator=gen)


@pytest.fixture(scope="module")
def models(golden_root: Path) -> dict[str, v4compile.DeepSeekV4]:
    """Seeded models: the tiny preset (bf16) and the tiny-fp8-fp4 golden config with FP8 or FP4 experts."""
    bf16 = v4compile.V4Config.preset("tiny")
    fp4 = v4compile.V4Config.from_json(golden_root / "tiny-fp8-fp4" / "config.json")
    fp8 = v4compile.V4Config.from_json(golden_root / "tiny-fp8-fp4" / "config.json", expert_dtype=None)
    return {name: v4compile.DeepSeekV4(c, seed=1).eval() for name, c in (("bf16", bf16), ("fp8", fp8), ("fp4", fp4))}


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("layer", [0, 2])
def test_stacked_experts_equal_the_dense_loop_bitwise(models: dict, fmt: str, layer: int) -> None:
    """Layer 0 is hash-routed, layer 2 score-routed; the weight formats are the config's."""
    model = models[fmt]
    moe = model.layers[layer].ffn
    assert moe.experts.w1.fmt == fmt and moe.experts.w1.weight.shape[0] == model.config.n_routed_experts
    x, ids = _inputs(model.config, seed=layer)
    with torch.no_grad():
        assert torch.equal(moe(x, ids), dense_loop(moe, x, ids))


def test_a_repeated_hash_expert_counts_once(models: dict) -> None:
    moe = models["fp4"].layers[0].ffn
    assert moe.gate.hashed
    x, ids = _inputs(models["fp4"].config, seed=5)
    table = moe.gate.tid2eid.clone()
    moe.gate.tid2eid[:, 1] = moe.gate.tid2eid[:, 0]
    try:
        with torch.no_grad():
            got, want = moe(x, ids), dense_loop(moe, x, ids)
    finally:
        moe.gate.tid2eid.copy_(table)
    assert torch.equal(got, want)


def test_replayed_routing_uses_the_given_experts(models: dict) -> None:
    model = models["bf16"]
    moe = model.layers[2].ffn
    x, ids = _inputs(model.config, seed=6)
    replay = torch.randint(0, model.config.n_routed_experts, (2, 7, model.config.n_activated_experts),
                           generator=torch.Generator().manual_seed(6))
    routing = Routing([None] * model.config.n_layers, [None] * model.config.n_layers, replay=True)
    routing.experts[2] = replay
    with torch.no_grad():
        assert torch.equal(moe(x, ids, routing, layer=2), dense_loop(moe, x, ids, replay.reshape(-1, replay.shape[-1])))


def test_gradients_equal_the_dense_loop(models: dict) -> None:
    """bf16 experts train: the gradients of the tokens, the gate and every expert weight match the loop's."""
    moe = models["bf16"].layers[2].ffn
    x, ids = _inputs(models["bf16"].config, seed=7)
    grads = []
    for forward in (moe, lambda inputs, ids: dense_loop(moe, inputs, ids)):
        moe.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        forward(leaf, ids).float().pow(2).sum().backward()
        grads.append([leaf.grad, moe.gate.weight.grad, moe.experts.w1.weight.grad, moe.experts.w2.weight.grad,
                      moe.experts.w3.weight.grad])
    for got, want in zip(*grads, strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    moe.zero_grad(set_to_none=True)


def test_checkpoints_keep_per_expert_names(models: dict, tmp_path: Path) -> None:
    """``save`` unstacks into the official names and ``load`` stacks them back; a missing or misshapen expert
    tensor is named."""
    model = models["fp4"]
    state = model.state_dict()
    assert "layers.1.ffn.experts.w1.weight" in state and "layers.1.ffn.experts.3.w1.weight" not in state
    names = official_state(state)
    assert names["layers.1.ffn.experts.3.w1.scale"].data_ptr() == state["layers.1.ffn.experts.w1.scale"][3].data_ptr()
    assert names["layers.1.ffn.shared_experts.w1.weight"] is state["layers.1.ffn.shared_experts.w1.weight"]
    save(model, tmp_path)
    on_disk = read_tensors(tmp_path)
    assert "layers.1.ffn.experts.7.w2.weight" in on_disk and "layers.1.ffn.experts.w2.weight" not in on_disk
    assert set(on_disk) == set(official_state(state))
    loaded = v4compile.load(tmp_path)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor,
                           state[name].view(torch.uint8) if tensor.dtype.itemsize == 1 else state[name]), name
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["layers.2.ffn.experts.5.w3.scale"] = tensors["layers.2.ffn.experts.5.w3.scale"][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor layers\.2\.ffn\.experts\.5\.w3\.scale has shape"):
        v4compile.load(tmp_path)
    del tensors["layers.2.ffn.experts.5.w3.scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    missing = r"missing 1 tensor\(s\) the config needs: layers\.2\.ffn\.experts\.5\.w3"
    with pytest.raises(CheckpointError, match=missing):
        v4compile.load(tmp_path)


def test_the_captured_graph_does_not_grow_with_the_expert_count() -> None:
    counts = {}
    for n_experts in (8, 64):
        config = v4compile.V4Config.preset("tiny", n_routed_experts=n_experts)
        moe = MoE(config, hashed=False).eval()
        graphs: list[int] = []

        def backend(gm: torch.fx.GraphModule, example: list, graphs: list[int] = graphs) -> object:
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        x, ids = _inputs(config, seed=8)
        with torch.no_grad():
            torch.compile(moe, backend=backend, fullgraph=True, dynamic=False)(x, ids)
        torch._dynamo.reset()
        counts[n_experts] = graphs
    assert counts[8] == counts[64] and len(counts[8]) == 1, counts
