"""``torch.compile(m, backend="v4compile")``: its options apply, its report is reachable (``last_report``), and
``explain --model module:factory`` explains a model built by the user's own code."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import v4compile
from v4compile import backend
from v4compile.cli import main
from v4compile.debugging import explain, sample_ids


def test_the_backends_options_apply_and_its_report_is_the_whole_graphs(tiny_model: v4compile.DeepSeekV4) -> None:
    # a fresh Dynamo: an earlier compile of the shared model's forward in this process (another test file) would
    # make this one's sizes dynamic (automatic dynamic shapes), a graph some passes decline
    torch._dynamo.reset()
    ids = sample_ids(tiny_model)
    compiled = torch.compile(tiny_model, backend="v4compile", options={"inductor": False, "backend": "reference",
                                                                       "disable": ["radix_topk"]})
    with torch.no_grad():
        got = compiled(ids)
        want = tiny_model(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    rows = {row["pass"]: row for row in v4compile.last_report()}
    assert rows["radix_topk"]["matches"] == 0 and not rows["radix_topk"]["enabled"]
    # the same rewrites as the debugging tools' whole forward graph
    whole = {row["pass"]: row["matches"] for row in explain(tiny_model, entries=("forward",),
                                                            disable=("radix_topk",)).report()}
    assert {name: row["matches"] for name, row in rows.items()} == whole and sum(whole.values()) > 0


def test_bad_backend_options_are_named(tiny_model: v4compile.DeepSeekV4, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_BACKEND_REPORTS", [])
    with pytest.raises(ValueError, match="no graph compiled with backend='v4compile' yet"):
        v4compile.last_report()
    compiled = torch.compile(tiny_model, backend="v4compile", options={"inductr": False})
    with pytest.raises(Exception, match=r"unknown v4compile backend option\(s\) \['inductr'\]"):
        compiled(sample_ids(tiny_model))


def test_explain_takes_a_model_from_a_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "my_models.py").write_text(textwrap.dedent('''
        from types import SimpleNamespace
        import torch

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = SimpleNamespace(vocab_size=50)
                self.embed = torch.nn.Embedding(50, 16)
                self.head = torch.nn.Linear(16, 50)

            def forward(self, ids):
                return self.head(torch.softmax(self.embed(ids), dim=-1))

        def build():
            return Tiny()

        not_a_model = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "--model", "my_models:build", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["graph"] == "forward" and report["nodes_before"] > 0
    assert any(p["near_misses"] for p in report["passes"])  # the softmax is no compressor pooling: it says why
    for spec, message in (("my_models", "expects module:factory"), ("nope_module:build", "cannot import"),
                          ("my_models:missing", "has no callable 'missing'")):
        assert main(["explain", "--model", spec]) == 2
        assert message in capsys.readouterr().out
