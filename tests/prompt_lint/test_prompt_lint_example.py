"""examples/lint_in_ci.py: the gate fails on a raw log and passes once it is fixed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from prompt_lint.cli import fix_main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lint_in_ci.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lint_in_ci_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_gate_fails_then_passes_after_fix(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    example = _load()
    raw = example.demo_log(tmp_path / "raw.jsonl")
    assert example.main([str(raw)]) == 1
    assert "lint gate: FAIL" in capsys.readouterr().out
    fixed = tmp_path / "fixed.jsonl"
    assert fix_main([str(raw), "-o", str(fixed)]) == 0
    assert example.main([str(fixed), "--sarif", str(tmp_path / "x.sarif")]) == 0
    out = capsys.readouterr().out
    assert "lint gate: pass" in out and (tmp_path / "x.sarif").exists()
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert example.main([str(tmp_path / "bad.jsonl")]) == 2


def test_the_demo_fails_the_raw_log_and_passes_its_fix(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`make example-lint` ends 0 when the gate did its job on both logs (it had ended 1, a
    make error, after showing only the failure)."""
    example = _load()
    assert example.main(["--demo", "--sarif", str(tmp_path / "fixed.sarif")]) == 0
    out = capsys.readouterr().out
    assert out.index("lint gate: FAIL") < out.index("lint gate: pass")
    assert "the gate failed the raw log and passed the fixed one" in out
    assert (tmp_path / "fixed.sarif").exists()
