"""CUDA graphs for the engine's decode buckets: each static batch size is captured once and replayed.

A decode step launches hundreds of small kernels; replaying them from a graph removes the host's launch
gaps, which dominate small-batch decode. The bucket's cache rows are the engine's static decode cache, so a
graph needs only static token and position buffers: the engine copies each step's inputs into them, replays,
and reads the logits from the graph's output before the next replay. Steps that record routing (Python-side
outputs) or verify drafts run without a graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.cache import V4Cache

DecodeFn = Callable[[torch.Tensor, torch.Tensor, V4Cache], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    """Per-bucket CUDA graphs of ``decode(ids, positions, cache)``, captured on a bucket's first step."""

    def __init__(self, decode: DecodeFn) -> None:
        self.decode = decode
        self.graphs: dict[int, _Captured] = {}

    def reset(self) -> None:
        """Drops every graph (they hold the addresses of the tensors they were captured with)."""
        self.graphs.clear()

    def step(self, ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache) -> torch.Tensor:
        """Logits of one decode step for ``ids`` [bucket, 1] at ``positions`` [bucket] over ``cache`` (the same
        rows at every call for a bucket). The result may be the graph's output buffer: read it before the
        next step."""
        bucket = ids.shape[0]
        captured = self.graphs.get(bucket)
        if captured is None:
            logits, self.graphs[bucket] = self._capture(ids, positions, cache)
            return logits
        captured.ids.copy_(ids)
        captured.positions.copy_(positions)
        captured.graph.replay()
        return captured.logits

    def _capture(self, ids: torch.Tensor, positions: torch.Tensor, cache: V4Cache) -> tuple[torch.Tensor, _Captured]:
        """Runs this step on a side stream (compilation and allocator warm-up, as capture requires) and returns
        its logits with the graph captured for the following steps. Capture records kernels without running
        them, so the step takes effect on the cache once."""
        static_ids, static_positions = ids.clone(), positions.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self.decode(static_ids, static_positions, cache).clone()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: per-stream kernel state carries over
            output = self.decode(static_ids, static_positions, cache)
        return logits, _Captured(graph, static_ids, static_positions, output)
