"""Every Triton kernel compiles for an H100/H200 (sm_90) on this CPU-only machine.

The interpreter runs kernels as Python and accepts code the real compiler rejects (a
non-constexpr global, for one), so the kernels are also lowered to cubins with the ptxas
that ships with Triton, in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .kernels_sm90_compile import ATTENTION_CASES, OP_CASES

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
SCRIPT = Path(__file__).with_name("kernels_sm90_compile.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's bundled ptxas is not installed")
def test_every_triton_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an old cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    compiled = set(run.stdout.split("\n"))
    expected = {f"compiled {name} {dtype}" for name, dtype, _ in ATTENTION_CASES}
    expected |= {f"compiled {name} fp16" for name, _, _ in OP_CASES}
    assert expected <= compiled, run.stdout
