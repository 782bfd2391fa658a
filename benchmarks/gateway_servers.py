"""Server processes for the gateway benchmark: the fake upstream, the gateway, a bare
pass-through proxy (the floor: `benchmarks/bare_proxy.py`), LiteLLM's proxy.

Each is a context manager that starts a process on 127.0.0.1, waits until it answers, and stops
it on exit. LiteLLM is optional and lives in its own virtual environment (never the project's):
`--litellm PATH` or `PREFIXGATE_BENCH_LITELLM` names its `litellm` executable (default
/work/litellm-venv/bin/litellm); without it the row is skipped. Set up with
`python3.11 -m venv /work/litellm-venv && /work/litellm-venv/bin/pip install 'litellm[proxy]'`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LITELLM = Path("/work/litellm-venv/bin/litellm")
LITELLM_KEY = "sk-bench-local"


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0,
               headers: dict[str, str] | None = None) -> None:
    """Poll `url` until it answers 200; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0, headers=headers).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def process(cmd: list[str], ready: str, env: dict[str, str] | None = None,
            headers: dict[str, str] | None = None, log: Path | None = None,
            timeout: float = 120.0, cwd: Path = ROOT) -> Iterator[subprocess.Popen[bytes]]:
    """Run `cmd` in `cwd` until the block ends; `ready` is polled first. Yields the process."""
    out = open(log, "wb") if log else None  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or dict(os.environ), stdout=out,
                            stderr=subprocess.STDOUT if out else None)
    try:
        wait_ready(ready, proc, timeout, headers)
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if out:
            out.close()


def _env(root: Path = ROOT) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


@contextlib.contextmanager
def fake_upstream(delay_ms: float = 0.0) -> Iterator[str]:
    """The fake OpenAI-compatible upstream without caching (answers at once, or `delay_ms`
    after reading a request); its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.fake_upstream", "--port", str(port), "--no-cache",
           "--delay-ms", str(delay_ms)]
    with process(cmd, f"http://127.0.0.1:{port}/v1/models", _env()):
        yield f"http://127.0.0.1:{port}"


class Server(NamedTuple):
    """A server process started for a benchmark: its base URL and process id."""

    url: str
    pid: int


@contextlib.contextmanager
def gateway_server(upstream: str, db: Path, lint_mode: str = "report",
                   root: Path = ROOT) -> Iterator[Server]:
    """`prefixgate serve --upstream openai=... --lint-mode MODE` (report by default), from the
    source tree `root` (another build of the gateway: a `git worktree` of another commit)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
           "--upstream", f"openai={upstream}/v1", "--db", f"sqlite:///{db}",
           "--lint-mode", lint_mode, "--log-level", "warning"]
    with process(cmd, f"http://127.0.0.1:{port}/healthz", _env(root), cwd=root) as proc:
        yield Server(f"http://127.0.0.1:{port}", proc.pid)


@contextlib.contextmanager
def bare_proxy(upstream: str, protocol: str = "gateway") -> Iterator[str]:
    """`benchmarks/bare_proxy.py` in front of `upstream` on the server `protocol` (the
    gateway's or uvicorn's); its base URL."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bare_proxy.py"), str(port), upstream,
           protocol]
    with process(cmd, f"http://127.0.0.1:{port}/healthz", _env()):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def gateway(upstream: str, db: Path) -> Iterator[str]:
    """`gateway_server`'s base URL."""
    with gateway_server(upstream, db) as server:
        yield server.url


def cpu_ms(pid: int) -> float:
    """CPU time (user + system) a live process has used so far, in ms (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def litellm_path(given: str | None) -> Path | None:
    """The LiteLLM executable to use, or None when there is none."""
    name = given or os.environ.get("PREFIXGATE_BENCH_LITELLM") or str(DEFAULT_LITELLM)
    found = shutil.which(name) if not Path(name).exists() else name
    return Path(found) if found else None


@contextlib.contextmanager
def litellm_proxy(executable: Path, upstream: str, tmp: Path) -> Iterator[str]:
    """LiteLLM's proxy in front of `upstream` (model "fake"), one worker; its base URL."""
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: fake\n    litellm_params:\n"
        f"      model: openai/fake\n      api_base: {upstream}/v1\n      api_key: none\n"
        f"general_settings:\n  master_key: {LITELLM_KEY}\n"
        "litellm_settings:\n  telemetry: false\n")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
           "LITELLM_TELEMETRY": "False"}
    cmd = [str(executable), "--config", str(config), "--port", str(port), "--host",
           "127.0.0.1", "--num_workers", "1"]
    headers = {"authorization": f"Bearer {LITELLM_KEY}"}
    # LiteLLM imports a lot: minutes on a busy 2-core machine
    with process(cmd, f"http://127.0.0.1:{port}/health/liveliness", env, headers,
                 log=tmp / "litellm.log", timeout=600.0):
        yield f"http://127.0.0.1:{port}"
