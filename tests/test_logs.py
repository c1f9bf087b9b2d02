"""``V4COMPILE_LOGS``: topics switched on, off and to debug, and what each topic says on a real run."""

from __future__ import annotations

import logging

import pytest

import v4compile
from v4compile import logs
from v4compile.codegen.registry import KernelRegistry, load_module
from v4compile.debugging import explain
from v4compile.runtime.engine import Engine


def test_the_switch_names_topics_levels_and_unknown_topics() -> None:
    assert logs.parse("passes,+kernels,-compile") == {"passes": logging.INFO, "kernels": logging.DEBUG,
                                                      "compile": logging.WARNING}
    assert set(logs.parse("all")) == set(logs.TOPICS) and logs.parse(" , ") == {}
    with pytest.raises(ValueError, match="unknown topic 'pases'.*topics: all, compile, passes"):
        logs.parse("pases")


@pytest.fixture
def captured(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """Every topic at DEBUG, propagating to pytest's handler; levels and handlers restored afterwards."""
    for topic in logs.TOPICS:
        log = logs.logger(topic)
        monkeypatch.setattr(log, "propagate", True)
        monkeypatch.setattr(log, "handlers", [])
        monkeypatch.setattr(log, "level", log.level)
    logs.configure(",".join(f"+{t}" for t in logs.TOPICS))
    caplog.set_level(logging.DEBUG, logger="v4compile")
    return caplog


def _lines(caplog: pytest.LogCaptureFixture, topic: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == f"v4compile.{topic}"]


def test_passes_and_graphs_say_what_they_rewrote(tiny_model: v4compile.DeepSeekV4, captured) -> None:
    explain(tiny_model, backend="reference", entries=("decode",))
    passes = _lines(captured, "passes")
    assert any("decode_step: radix_topk rewrote layers." in line and "-> radix_topk.k" in line for line in passes)
    assert any("near-miss at" in line and "only 8 candidates" in line for line in passes)
    graphs = _lines(captured, "graphs")
    assert any(line.startswith("decode_step: ") and " nodes, " in line for line in graphs)
    assert any("decode_step after the passes:" in line and "def forward" in line for line in graphs)


def test_kernels_say_what_they_built_and_first_launched(captured) -> None:
    registry = KernelRegistry()  # a registry of its own, so the build happens here whatever ran before
    source = "def double(x):\n    return 2 * x\n"
    module = registry.build("test_logs.double.py", "python", "test::double", lambda: source, load_module)
    registry.launch("test_logs.double.py", lambda: module.double(3))
    registry.note_launch("test_logs.double.py", rows=3)
    registry.note_launch("test_logs.double.py", rows=4)
    kernels = _lines(captured, "kernels")
    assert any(line.startswith("built test_logs.double.py (python, test::double) from ") for line in kernels)
    assert [line for line in kernels if "first launch" in line] == ["test_logs.double.py: first launch {'rows': 3}"]


def test_the_engine_says_what_each_request_did(tiny_model: v4compile.DeepSeekV4, captured) -> None:
    engine = Engine(tiny_model)
    engine.generate([[1, 2, 3] * 30, [1, 2, 3] * 30 + [4], [10**9]], max_new_tokens=2)
    lines = _lines(captured, "engine")
    assert "request 0 admitted: 90 prompt tokens, 0 from the prefix cache" in lines
    assert any(line.startswith("request 1 admitted: 91 prompt tokens,") for line in lines)
    assert "request 0 finished: 2 tokens (length)" in lines
    assert any(line.startswith("request 2 rejected:") for line in lines)
