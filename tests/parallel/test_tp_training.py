"""Training under tensor parallelism: at tp=2 (two CPU processes on gloo) with the tp=1 routing replayed, every
block's output and every parameter gradient (a rank's part of it) agrees with the single-process model, and the
replicated parameters (KV path, compressors, norms, router, shared expert, mHC) get the same, whole gradient
on both ranks: the ranks' gradients of a replicated tensor entering split heads, experts or vocabulary are
summed (in fp32). Training through ``v4compile.optimize`` at tp=2 (every pass, collectives in the graph)
gives the eager shard's gradients within the passes' tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo import process_group, run_ranks

import v4compile
from v4compile import DeepSeekV4, V4Config
from v4compile.model import Routing
from v4compile.model.block import Block
from v4compile.rl import precision_report

TP = 2
REPLICATED = ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.wkv.weight", "layers.1.attn.wq_a.weight",
              "layers.1.ffn.gate.weight", "layers.1.ffn.shared_experts.w1.weight", "layers.1.hc_attn_fn",
              "norm.weight")


def _worker(rank: int, port: int, out: str) -> None:
    with process_group(rank, port, TP):
        config = V4Config.preset("tiny", max_seq_len=256)
        single = DeepSeekV4(config, seed=0)
        shard = DeepSeekV4(config, seed=0, tp_rank=rank, tp_size=TP)
        ids = torch.randint(0, config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(4))
        record = Routing.recorder(config)
        with torch.no_grad():
            single(ids, routing=record)
        rows = precision_report(single, shard, lambda: single(ids, routing=record.for_replay()),
                                lambda: shard(ids, routing=record.for_replay()), modules=(Block,),
                                placement=lambda name, shape: shard.tp.placement(name, shape, config))
        grads = {name: p.grad for name, p in shard.named_parameters() if name in REPLICATED}
        counted = sum(p.grad is not None for p in shard.parameters())
        shard.zero_grad(set_to_none=True)
        optimized = v4compile.optimize(shard, tp=TP, inductor=False)
        optimized(ids, routing=record.for_replay()).float().log_softmax(-1).mean().backward()
        through_passes = {name: p.grad for name, p in shard.named_parameters() if name in REPLICATED}
        torch.save({"rows": rows, "replicated": grads, "with_grad": counted, "optimized": through_passes},
                   Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_training")
    run_ranks(_worker, TP, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(TP)]


def test_tp2_activations_and_gradients_match_tp1(ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        rows = result["rows"]
        grads = [r for r in rows if r.kind == "gradient"]
        acts = [r for r in rows if r.kind == "activation"]
        assert len(acts) == 4 and len(grads) == result["with_grad"], (len(acts), len(grads), result["with_grad"])
        worst = rows[0]
        cosines = torch.tensor([r.cosine for r in grads])
        print(f"rank {rank}: worst {worst.kind} {worst.name} cosine {worst.cosine:.6f} rel {worst.rel_error:.2e}; "
              f"gradient cosine median {cosines.median():.6f}, {(cosines > 0.999).float().mean():.1%} above 0.999")
        assert all(r.cosine > 0.99995 for r in acts), acts
        # the ranks add partial sums in another order than one process, so later layers' outputs differ in
        # the last bits; a few cancelling gradients (the mHC scales and head mixing weights, three to a few dozen
        # values summed over every token) amplify that: their cosine depends on the CPU's GEMM kernels (0.94 for
        # layers.2.hc_ffn_scale on an AVX-512 Xeon, above 0.95 where CI ran before), so the bound on the worst is loose
        assert cosines.median() > 0.9999 and (cosines > 0.999).float().mean() > 0.95, rows[:8]
        assert cosines.min() > 0.9, rows[:3]


def test_replicated_parameters_get_the_same_whole_gradient_on_every_rank(ranks: list[dict]) -> None:
    first, second = (r["replicated"] for r in ranks)
    assert set(first) == set(REPLICATED)
    for name in REPLICATED:
        assert first[name] is not None and torch.equal(first[name], second[name]), name


def test_training_through_the_optimized_shard_gives_the_eager_gradients(ranks: list[dict]) -> None:
    for result in ranks:
        for name in REPLICATED:
            eager, optimized = result["replicated"][name].flatten(), result["optimized"][name].flatten()
            cosine = torch.nn.functional.cosine_similarity(eager.double(), optimized.double(), dim=0)
            assert cosine > 0.99, (name, cosine)
