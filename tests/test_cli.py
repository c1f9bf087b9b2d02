"""The ``v4compile`` command's debugging tools, run in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from v4compile import cli
from v4compile.cli import main


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.console, "width", 250)


def test_passes_lists_every_pass(capsys: pytest.CaptureFixture) -> None:
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "compressor_fusion" in out and "radix_topk" in out and "max_k" in out


def test_piped_listings_keep_identifiers_whole_and_have_json() -> None:
    """``v4compile passes | grep NAME`` on an 80-column setup finds every pass; ``--json`` lists the same ones."""
    from v4compile.passes import PASS_ORDER

    def run(*argv: str) -> str:
        code = f"from v4compile.cli import main; raise SystemExit(main({list(argv)!r}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                              env={**os.environ, "COLUMNS": "80"})
        return done.stdout

    lines = run("passes").splitlines()
    for cls in PASS_ORDER:
        assert any(cls.name in line.split() for line in lines), cls.name
    assert [row["pass"] for row in json.loads(run("passes", "--json"))] == [cls.name for cls in PASS_ORDER]


def test_explain_json_reports_matches_and_near_misses(capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--entry", "decode", "--backend", "reference", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    passes = {p["name"]: p for p in reports[0]["passes"]}
    forms = {m["details"]["form"] for m in passes["compressor_fusion"]["matches"]}
    assert forms == {"decode"} and len(passes["compressor_fusion"]["matches"]) == 5
    assert len(passes["radix_topk"]["matches"]) == 2
    assert any("only 8 candidates" in m["reason"] for m in passes["radix_topk"]["near_misses"])


def test_dump_writes_graphs_per_pass(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["dump", str(tmp_path), "--entry", "forward", "--backend", "reference"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forward"]
    names = sorted(p.name for p in (tmp_path / "forward").glob("*.txt"))
    # head_padding changes nothing on CPU (any head count tiles there) and stream_schedule plans CUDA graphs only
    assert names == ["00-captured.txt", "01-after-compressor_fusion.txt", "02-after-compressor_finish.txt",
                     "03-after-radix_topk.txt", "04-after-mhc_tiling.txt", "05-after-sparse_attention.txt",
                     "07-after-moe_dispatch.txt"]


def test_kernels_show_prints_source_and_launch(capsys: pytest.CaptureFixture) -> None:
    assert main(["kernels", "--entry", "decode", "--backend", "triton",
                 "--show", "compressor_entry_state.c128.w128.fp8.triton"]) == 0
    out = capsys.readouterr().out
    assert "@triton.jit" in out and "RATIO = tl.constexpr(128)" in out and "def _hadamard" not in out
    assert "grid" in out and "compressor_finish @" in out
    assert main(["kernels", "--entry", "decode", "--show", "nope"]) == 2
    capsys.readouterr()


def test_kernels_json_and_an_unknown_name_answered_before_compiling(capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel built for real (the MoE activation quantizer, under the interpreter), the model compile stubbed
    out: ``--json`` lists its record, and a misspelt name gets its close matches without compiling anything."""
    import torch

    import v4compile.debugging
    from v4compile.codegen.triton import moe

    moe.simulate_fp8(torch.randn(4, 256).bfloat16(), True)
    monkeypatch.setattr(v4compile.debugging, "explain", lambda *a, **k: None)
    assert main(["kernels", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["moe_experts.fp8.triton"]["backend"] == "triton"
    assert Path(records["moe_experts.fp8.triton"]["path"]).is_file()
    monkeypatch.setattr(v4compile.debugging, "explain", lambda *a, **k: pytest.fail("compiled for a known miss"))
    assert main(["kernels", "--show", "moe_experts.fp8.tritn"]) == 2
    out = capsys.readouterr().out
    assert "no kernel named 'moe_experts.fp8.tritn'" in out and "close matches: moe_experts.fp8.triton" in out
    # a name spelled like an op's kernel but not built yet is built (here: the stubbed compile), not refused
    compiled = []
    monkeypatch.setattr(v4compile.debugging, "explain", lambda *a, **k: compiled.append(True))
    assert main(["kernels", "--show", "sparse_attention.d999.bf16dot.triton"]) == 2
    assert compiled and "among the kernels this model's passes build" in capsys.readouterr().out


def test_bad_arguments_are_clear(capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--backend", "cuda", "--entry", "forward"]) == 2
    assert "unknown backend 'cuda'" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["explain", "--entry", "sideways"])


def test_check_against_a_golden_folder(golden_root: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(golden_root / "tiny-bf16"), "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "optimized vs golden" in out and "optimized vs eager" in out
    assert "tiny-bf16: in band" in out and "verdict: in band (index_ties=lowest)" in out


def test_check_json_is_the_whole_output_and_out_of_band_exits_non_zero(golden_root: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    # tiny-fp8-fp4 scores out of band under the default lowest-index tie rule, eager as well (README, Fidelity)
    assert main(["check", str(golden_root / "tiny-fp8-fp4"), "--backend", "reference", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    comparisons = report["comparisons"]
    assert set(comparisons) == {"eager vs golden", "optimized vs golden", "optimized vs eager"}
    assert report["index_ties"] == "lowest" and comparisons["eager vs golden"]["in_band"] is False
    assert report["verdict"] is False
    assert report["verdict"] == (report["eager_in_band"] and comparisons["optimized vs golden"]["in_band"])
    for a in comparisons.values():
        assert a["in_band"] == (a["median_cos"] >= 0.99 and a["mean_cos"] >= 0.97 and a["argmax_agreement"] >= 0.80)
    assert comparisons["optimized vs eager"]["median_cos"] > 0.999


def test_generate_reads_prompts_reports_hits_and_per_request_errors(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(str(i % 500) for i in range(200)) + "\n1, 2, 3\n4 5 9999\n")
    assert main(["generate", "--file", str(prompts), "--max-new-tokens", "3", "--repeat", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [len(r["tokens"]) for r in out] == [3, 3, 0]
    assert out[0]["cache"]["cached_tokens"] == 128 and "9999" in out[2]["error"]
    assert main(["generate", "--ids", "1 x 3"]) == 2
    assert "token ids must be integers" in capsys.readouterr().out


def test_generate_fails_when_every_request_fails_and_refuses_a_negative_length(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--ids", ""]) == 1
    assert "every request failed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ids", "1 2 3", "--max-new-tokens", "-3"])
    assert exit_info.value.code == 2 and "--max-new-tokens: must be at least 1, got -3" in capsys.readouterr().err


def test_serve_bench_prints_hit_rates_and_bytes(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve-bench", "--conversations", "2", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert "ShadowRadix" in out and "baseline" in out and "bytes per cached token by pool" in out
    assert main(["serve-bench", "--conversations", "2", "--turns", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 6 and 0 < report["hit_rate"] <= 1 and report["bytes_per_token"]["all"] > 0
