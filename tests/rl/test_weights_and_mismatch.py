"""Importance weights and the log-prob mismatch report on hand-checked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from v4compile.rl import importance_weights, logprob_mismatch


def test_token_level_tis_truncates_and_mis_drops() -> None:
    engine = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.4, 0.9]]))
    trainer = torch.log(torch.tensor([[0.5, 0.25, 2.5 * 0.5], [0.2, 0.4, 0.45]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tis = importance_weights(trainer, engine, mask, mode="tis", cap=2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 0.5, 2.0], [1.0, 1.0, 0.0]]))
    mis = importance_weights(trainer, engine, mask, mode="mis", floor=0.6, cap=2.0)
    torch.testing.assert_close(mis, torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_sequence_level_weight_is_the_geometric_mean_ratio_broadcast() -> None:
    engine = torch.zeros(1, 4)
    trainer = torch.tensor([[math.log(2.0), math.log(0.5), math.log(4.0), 9.0]])
    weights = importance_weights(trainer, engine, torch.tensor([[1, 1, 1, 0]]), level="sequence", cap=10.0)
    want = 4.0 ** (1 / 3)
    torch.testing.assert_close(weights, torch.tensor([[want, want, want, 0.0]]))
    trainer.requires_grad_(True)
    assert not importance_weights(trainer, engine, torch.ones(1, 4)).requires_grad


def test_bad_arguments_name_the_problem() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown mode"):
        importance_weights(x, x, x, mode="ppo")
    with pytest.raises(ValueError, match="same"):
        importance_weights(x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="floor"):
        importance_weights(x, x, x, floor=3.0, cap=2.0)


def test_mismatch_report_on_ragged_sequences() -> None:
    report = logprob_mismatch([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.2]])
    assert report.tokens == 3
    assert report.max == pytest.approx(0.3)
    assert report.mean == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert report.per_sequence_mean == pytest.approx([0.05, 0.3])
    with pytest.raises(ValueError, match="sequence 1: 1 engine log-probs but 2"):
        logprob_mismatch([[-1.0], [-2.0]], [[-1.0], [-2.0, -3.0]])
    with pytest.raises(ValueError, match="no tokens"):
        logprob_mismatch([[]], [[]])


def test_precision_report_finds_the_perturbed_layer_first() -> None:
    from v4compile import DeepSeekV4, V4Config
    from v4compile.model.block import Block
    from v4compile.rl import precision_report

    config = V4Config.preset("tiny")
    a, b = DeepSeekV4(config, seed=0), DeepSeekV4(config, seed=0)
    with torch.no_grad():
        b.layers[2].attn.wkv.weight.mul_(1.25)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    rows = precision_report(a, b, lambda: a(ids), lambda: b(ids), modules=(Block,))
    activations = {r.name: r for r in rows if r.kind == "activation"}
    assert activations["layers.0"].rel_error == 0 and activations["layers.1"].rel_error == 0
    assert activations["layers.2"].rel_error > 1e-3 and activations["layers.3"].rel_error > 1e-3
    grads = [r for r in rows if r.kind == "gradient"]
    assert grads and rows[0].cosine <= min(r.cosine for r in rows)
