"""A multi-turn agentic serving workload and its prefix-cache report, shared by ``v4compile serve-bench``
and ``benchmarks/prefix_cache.py``.

Conversations share one system prompt; each turn appends the model's answer and a new user or tool
message to the history, and some conversations branch from an earlier turn of another (an agent
retrying from a checkpoint). The report compares the engine's ShadowRadix cache with a baseline
prefix cache that keeps every cached token's window KV (so it never tombstones), given unlimited room.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..model.cache import PAGE_TOKENS
from .engine import Engine


@dataclass
class Workload:
    """Shape of the workload; lengths are in tokens."""

    conversations: int = 4
    turns: int = 4
    system_len: int = 600
    message_len: tuple[int, int] = (40, 260)
    answer_len: int = 12
    branches: int = 2
    seed: int = 0


@dataclass
class ServeReport:
    """Per-run totals of the workload under the engine and the baseline."""

    requests: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    max_recompute_per_hit: int = 0
    baseline_cached_tokens: int = 0
    branch_prompt_tokens: int = 0
    branch_cached_tokens: int = 0
    branch_baseline_cached_tokens: int = 0
    bytes_per_token: dict[str, float] = field(default_factory=dict)
    baseline_bytes_per_token: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens restored from the cache over all prompt tokens."""
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def recompute_per_hit(self) -> float:
        """Tokens recomputed per request that matched a cached prefix (its window tail evicted or never kept)."""
        return self.recomputed_tokens / max(self.hits, 1)

    @property
    def baseline_hit_rate(self) -> float:
        """The same for the baseline cache."""
        return self.baseline_cached_tokens / max(self.prompt_tokens, 1)

    def kind_hit_rates(self, branches: bool) -> tuple[float, float]:
        """(ours, baseline) hit rates over the branch prompts (``branches``) or over the conversations' own prompts
        (every turn, the first included): a conversation's turn resumes where its last turn ended, a branch at an
        arbitrary earlier point."""
        if branches:
            return (self.branch_cached_tokens / max(self.branch_prompt_tokens, 1),
                    self.branch_baseline_cached_tokens / max(self.branch_prompt_tokens, 1))
        prompts = max(self.prompt_tokens - self.branch_prompt_tokens, 1)
        return ((self.cached_tokens - self.branch_cached_tokens) / prompts,
                (self.baseline_cached_tokens - self.branch_baseline_cached_tokens) / prompts)


def run_workload(engine: Engine, workload: Workload) -> ServeReport:
    """Serves the workload turn by turn (all conversations of a turn as one batch) and reports cache use."""
    if engine.store is None:
        raise ValueError("run_workload needs an engine with its prefix cache on")
    rng = random.Random(workload.seed)
    vocab = engine.config.vocab_size

    def text(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = text(workload.system_len)
    histories = [system + text(rng.randint(*workload.message_len)) for _ in range(workload.conversations)]
    report, baseline = ServeReport(), _BaselineCache(engine.chunk)
    snapshots: list[list[int]] = []
    for turn in range(workload.turns):
        prompts = list(histories)
        if turn and workload.branches:
            for _ in range(workload.branches):
                earlier = rng.choice(snapshots)
                prompts.append(earlier[: rng.randrange(workload.system_len, len(earlier))]
                               + text(rng.randint(*workload.message_len)))
        results = engine.generate(prompts, workload.answer_len)
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            report.requests += 1
            report.hits += result.cache.cached_tokens + result.cache.recomputed_tokens > 0
            report.prompt_tokens += len(prompt)
            report.cached_tokens += result.cache.cached_tokens
            report.recomputed_tokens += result.cache.recomputed_tokens
            report.max_recompute_per_hit = max(report.max_recompute_per_hit, result.cache.recomputed_tokens)
            baseline_hit = baseline.serve(prompt)
            report.baseline_cached_tokens += baseline_hit
            if i >= len(histories):
                report.branch_prompt_tokens += len(prompt)
                report.branch_cached_tokens += result.cache.cached_tokens
                report.branch_baseline_cached_tokens += baseline_hit
        snapshots.extend(histories)
        histories = [h + r.tokens + text(rng.randint(*workload.message_len))
                     for h, r in zip(histories, results[: len(histories)], strict=True)]
    report.bytes_per_token, report.baseline_bytes_per_token = _bytes_per_token(engine)
    return report


class _BaselineCache:
    """A radix cache at the same chunk granularity that keeps full window KV for every cached token: any
    cached aligned prefix can be resumed, so a hit is the longest cached aligned prefix."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.prefixes: set[tuple[int, ...]] = set()

    def serve(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this cache would restore; then caches the prompt's aligned prefixes."""
        limit = (len(prompt) - 1) // self.chunk * self.chunk
        hit = 0
        for end in range(self.chunk, limit + 1, self.chunk):
            if tuple(prompt[:end]) not in self.prefixes:
                break
            hit = end
        boundary = len(prompt) // self.chunk * self.chunk
        for end in range(self.chunk, boundary + 1, self.chunk):
            self.prefixes.add(tuple(prompt[:end]))
        return hit


def _bytes_per_token(engine: Engine) -> tuple[dict[str, float], float]:
    """Bytes held per cached token, per pool and in total (key "all"), and the baseline's bytes per cached
    token (every layer's window KV plus the same compressed entries)."""
    assert engine.store is not None
    stats = engine.store.stats()
    tokens = max(stats["tree"]["cached_tokens"], 1)
    per_pool = {name: pool["used_bytes"] / tokens for name, pool in stats["pools"].items()}
    per_pool["all"] = sum(per_pool.values())
    pools = engine.store.pools
    compressed = pools["pages"].bytes_per_slot / PAGE_TOKENS + (pools["c4"].bytes_per_slot / 4 if "c4" in pools else 0)
    return per_pool, pools["window"].bytes_per_slot + compressed
