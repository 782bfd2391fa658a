"""/metrics with several worker processes: PROMETHEUS_MULTIPROC_DIR set, each process counts on
its own, and a scrape in any of them sums every worker's series (prometheus_client's files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import sys
from gateway.metrics import GatewayMetrics, Registry
reg = Registry()
metrics = GatewayMetrics(reg)
metrics.requests.inc(int(sys.argv[1]), route="chat", status="200", backend="embedded")
metrics.latency.observe(0.2, route="chat")
if sys.argv[2] == "scrape":
    print(reg.render())
"""


def _run(folder: Path, amount: int, mode: str) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", WORKER, str(amount), mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_scrape_sums_every_worker(tmp_path: Path) -> None:
    _run(tmp_path, 2, "count")
    _run(tmp_path, 3, "count")
    text = _run(tmp_path, 5, "scrape")
    lines = text.splitlines()
    total = 'prefixgate_requests_total{backend="embedded",route="chat",status="200"} 10.0'
    assert total in lines, text
    assert 'prefixgate_request_duration_seconds_count{route="chat"} 3.0' in lines, text
