"""Print gpu_check.sh's one table from its step log and the JSON its benchmarks wrote.

Run: ``.venv/bin/python benchmarks/gpu_check_report.py OUT_DIR`` (gpu_check.sh does).
Exits non-zero when a step failed or a GPU target was missed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple


class Line(NamedTuple):
    """One row of the table."""

    check: str
    result: str
    ok: bool


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def step_lines(out: Path) -> list[Line]:
    lines = []
    for row in (out / "steps.tsv").read_text().splitlines():
        name, rc, seconds = row.split("\t")
        verdict = "pass" if rc == "0" else ("timeout" if rc == "124" else f"FAIL rc={rc}")
        lines.append(Line(f"step {name}", f"{verdict} ({seconds} s)", rc == "0"))
    return lines


def kernel_lines(result: dict[str, Any]) -> list[Line]:
    lines = []
    if "copy_gbps" in result:
        lines.append(Line("device copy bandwidth", f"{result['copy_gbps']:.0f} GB/s", True))
    for shape, t in result.get("targets", {}).items():
        lines.append(Line(f"decode {shape}: fraction of copy (>= 60%)",
                          f"{t['frac_of_copy']:.1%}", t["frac_of_copy"] >= 0.6))
        lines.append(Line(f"decode {shape}: speedup vs gathered SDPA (>= 2x)",
                          f"{t['speedup_vs_gathered_sdpa']:.2f}x",
                          t["speedup_vs_gathered_sdpa"] >= 2.0))
    return lines


def engine_lines(result: dict[str, Any]) -> list[Line]:
    lines = []
    for a in result.get("agreement", []):
        exact = "float32" in a["config"]
        equal = a["prompts_equal"] == a["prompts"]
        note = "" if exact else " (16-bit: reported)"
        lines.append(Line(f"greedy {a['config']} == CPU float32",
                          f"{a['prompts_equal']}/{a['prompts']}{note}", equal or not exact))
    if "decode_syncs" in result:
        syncs = result["decode_syncs"]
        lines.append(Line("host syncs in decode steps", str(syncs), syncs == 0))
    for s in result.get("speed", []):
        lines.append(Line(f"SmolLM2 {s['backend']} {s['dtype']} batch {s['batch']}",
                          f"TPOT {s['tpot_ms']:.2f} ms, {s['tokens_per_s']:.0f} tok/s", True))
    if result.get("device") == "cpu only":
        lines.append(Line("SmolLM2 on GPU", "not run: no CUDA device", True))
    return lines


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path("/tmp/gpu_check")
    lines = step_lines(out)
    lines += kernel_lines(read_json(out / "bench_kernels.json"))
    lines += engine_lines(read_json(out / "bench_gpu_engine.json"))
    width = max(len(line.check) for line in lines)
    print(f"\n{'check':<{width}}  result")
    print("-" * (width + 40))
    for line in lines:
        mark = "" if line.ok else "   <-- not met"
        print(f"{line.check:<{width}}  {line.result}{mark}")
    return 0 if all(line.ok for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
