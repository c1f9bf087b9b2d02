"""The discrete choices of a forward pass, recorded by the rollout engine and replayed by the trainer.

MoE routing (the experts every token goes to) and the lightning indexer's top-k (the compressed entries
every token attends to) are discrete: a tiny numeric difference between the engine and the trainer can
pick another expert or entry, and the trainer then optimizes a policy the rollout never ran. Recording
them in the engine and replaying them in the trainer's forward removes that source of mismatch, while
gradients still flow through the routing weights (the gate's scores at the replayed experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import V4Config


class ReplayError(ValueError):
    """Replay data that does not fit the model or the input (the message names the mismatch)."""


@dataclass
class Routing:
    """Per main layer: ``experts[i]`` [B, S, n_activated_experts] (MoE) and ``indexer[i]`` [B, S, index_topk
    or fewer] (C4 layers only; None elsewhere). ``replay=False`` records them during a forward;
    ``replay=True`` makes the forward use them instead of its own choices."""

    experts: list[torch.Tensor | None] = field(default_factory=list)
    indexer: list[torch.Tensor | None] = field(default_factory=list)
    replay: bool = False

    @classmethod
    def recorder(cls, config: V4Config) -> Routing:
        """An empty record for one forward of a model with ``config``."""
        return cls([None] * config.n_layers, [None] * config.n_layers, replay=False)

    def for_replay(self) -> Routing:
        """The same choices, to replay."""
        return Routing(list(self.experts), list(self.indexer), replay=True)

    def validate(self, config: V4Config, batch: int, seqlen: int) -> None:
        """Raises ``ReplayError`` unless this replay data fits ``config`` and an input of [batch, seqlen]."""
        if len(self.experts) != config.n_layers or len(self.indexer) != config.n_layers:
            raise ReplayError(f"replay data covers {len(self.experts)} MoE and {len(self.indexer)} indexer layers; "
                              f"the model has {config.n_layers} layers")
        for i, (experts, chosen) in enumerate(zip(self.experts, self.indexer, strict=True)):
            want = (batch, seqlen, config.n_activated_experts)
            if experts is None or tuple(experts.shape) != want:
                got = None if experts is None else tuple(experts.shape)
                raise ReplayError(f"layer {i}: replayed experts have shape {got}, expected {want}")
            if int(experts.min()) < 0 or int(experts.max()) >= config.n_routed_experts:
                raise ReplayError(f"layer {i}: replayed expert ids outside [0, {config.n_routed_experts})")
            if config.layer_ratios[i] == 4:
                if chosen is None or chosen.shape[:2] != (batch, seqlen):
                    got = None if chosen is None else tuple(chosen.shape)
                    raise ReplayError(f"layer {i}: replayed indexer choices have shape {got}, expected "
                                      f"({batch}, {seqlen}, k)")
            elif chosen is not None:
                raise ReplayError(f"layer {i} has no indexer (compress ratio {config.layer_ratios[i]}), "
                                  "but replay data gives it choices")
