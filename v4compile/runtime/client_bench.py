"""``v4compile serve-bench --server URL``: concurrent streaming clients against a running server, as users see it:
time to first token, the gap between streamed chunks, and completion tokens per second over the whole run."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ClientReport:
    """What ``drive`` measured; times in milliseconds."""

    requests: int
    failed: int
    completion_tokens: int
    wall_s: float
    ttft_ms: list[float] = field(default_factory=list)
    gap_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens of every request over the run's wall time."""
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict[str, float]:
        """Medians and 90th percentiles of the latencies, and the throughput."""
        def pct(values: list[float], q: int) -> float:
            return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)

        return {"requests": self.requests, "failed": self.failed, "completion_tokens": self.completion_tokens,
                "tokens_per_s": self.tokens_per_s, "ttft_p50_ms": pct(self.ttft_ms, 50),
                "ttft_p90_ms": pct(self.ttft_ms, 90), "gap_p50_ms": pct(self.gap_ms, 50),
                "gap_p90_ms": pct(self.gap_ms, 90)}


def drive(url: str, model: str, clients: int, requests: int, max_tokens: int, prompt: str) -> ClientReport:
    """Runs ``requests`` streamed completions of ``prompt`` from ``clients`` threads at once (each client sends its
    next request when the last finished) against the OpenAI-compatible server at ``url`` (``.../v1``)."""
    try:
        import openai
    except ImportError:
        raise RuntimeError("serve-bench --server needs the openai package: pip install openai") from None
    if clients < 1 or requests < 1 or max_tokens < 1:
        raise ValueError(f"clients, requests and max_tokens must be positive, got {clients}, {requests}, {max_tokens}")
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    report = ClientReport(requests=requests, failed=0, completion_tokens=0, wall_s=0.0)
    lock = threading.Lock()
    left = [requests]

    def one() -> None:
        sent = time.perf_counter()
        first, last, gaps, tokens = None, None, [], 0
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append(1e3 * (now - last))
                last = now
        with lock:
            report.completion_tokens += tokens
            report.ttft_ms.append(1e3 * ((first or time.perf_counter()) - sent))
            report.gap_ms.extend(gaps)

    def worker() -> None:
        while True:
            with lock:
                if not left[0]:
                    return
                left[0] -= 1
            try:
                one()
            except Exception as exc:  # a failed request is counted and named, the run goes on
                with lock:
                    report.failed += 1
                    report.errors.append(f"{type(exc).__name__}: {exc}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.wall_s = time.perf_counter() - start
    return report
