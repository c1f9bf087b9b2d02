"""The README's Python snippets run as written, in order, in one namespace (the tiny golden checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    """The bodies of the README's ```python fences, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_readme_snippets_run_as_written(golden_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 3
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    outs, report = namespace["outs"], namespace["report"]
    assert all(len(o.tokens) == 16 and not o.error for o in outs)
    assert report.mean < 0.5 and report.tokens == 16 and namespace["w"].shape == namespace["mask"].shape
