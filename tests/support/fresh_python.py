"""Code run in a fresh interpreter: for what a process imports or loads, which the test
session's own process has long done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_fresh_python(code: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """`python -c code` in the repository root with the project importable."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
