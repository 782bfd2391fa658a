"""`prefixgate serve` stopped by SIGTERM with streams in flight: past `--graceful-timeout` they
are cancelled and each still leaves its one record in the database before the process exits.

The real command line in its own process: uvicorn, in the main thread, re-raises the signal
once its shutdown is done, which ends the process at once, so only what the app finished
before then is in the database. Reference: the request ids and prompt tokens the streams'
heads carried."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support import free_port, serve

ROOT = Path(__file__).resolve().parents[2]
STREAMS = 2


def _slow_upstream() -> Starlette:
    """An OpenAI-compatible server whose streams send a word every 0.2 s for a minute."""
    async def words() -> AsyncIterator[bytes]:
        for i in range(300):
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                  "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.2)

    async def complete(request: Request) -> Response:
        await request.body()
        return StreamingResponse(words(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/models", models)])


def _gateway(upstream: str, db: Path, port: int) -> subprocess.Popen[bytes]:
    """`prefixgate serve` over `upstream`, once it answers /healthz."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
         "--upstream", f"openai={upstream}/v1", "--db", f"sqlite:///{db}",
         "--lint-mode", "off", "--graceful-timeout", "1", "--log-level", "warning"],
        cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the gateway did not start")
        time.sleep(0.1)


def _rows(db: Path) -> list[tuple[str, int, int, str]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return sorted(conn.execute(
            "select request_id, status, prompt_tokens, error from requests"))


def _leave_mid_stream(url: str, body: dict[str, Any], heads: list[Any]) -> None:
    """Read one stream to its first word, then hang up (a client that leaves)."""
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        heads.append(response.headers)
        for line in response.iter_lines():
            if "w0" in line:
                return


def _wait_in_flight(base: str, count: int) -> None:
    """Until the gateway serves `count` requests (the left stream's record is written), or
    30 s pass (the test's own assertions then say what went wrong)."""
    deadline = time.monotonic() + 30
    gauge = "prefixgate_requests_in_flight "
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=5).text
        values = [line.removeprefix(gauge) for line in text.splitlines()
                  if line.startswith(gauge)]
        if values and float(values[0]) <= count:
            return
        time.sleep(0.05)


def _read_stream(url: str, body: dict[str, Any], heads: list[Any], started: threading.Event
                 ) -> None:
    """Read one stream to its end (or its cut), as a client does; its head goes to `heads`."""
    with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url, json=body,
                                                            timeout=30) as response:
        heads.append(response.headers)
        for line in response.iter_lines():
            if "w0" in line:
                started.set()


def test_streams_cut_by_a_sigterm_shutdown_keep_their_records(tmp_path: Path) -> None:
    """Each stream the shutdown cut is recorded 499 "cancelled" (as the README promises, and
    as a whole answer's record says); one whose client left before is "client disconnected"."""
    db = tmp_path / "gw.db"
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "m", "stream": True,
            "messages": [{"role": "user", "content": "write on " * 40}]}
    heads: list[Any] = []
    with serve(_slow_upstream(), lifespan="off") as upstream:
        proc = _gateway(upstream.url, db, port)
        try:
            left: list[Any] = []
            _leave_mid_stream(url, body, left)
            # the /metrics request itself is one in flight
            _wait_in_flight(f"http://127.0.0.1:{port}", 1)
            started = [threading.Event() for _ in range(STREAMS)]
            clients = [threading.Thread(target=_read_stream, args=(url, body, heads, event))
                       for event in started]
            for client in clients:
                client.start()
            assert all(event.wait(30) for event in started)  # every stream is mid-way
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            for client in clients:
                client.join(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    expected = sorted([(h["x-request-id"], 499, int(h["x-prefixgate-prompt-tokens"]),
                        "cancelled") for h in heads]
                      + [(h["x-request-id"], 499, int(h["x-prefixgate-prompt-tokens"]),
                          "client disconnected") for h in left])
    assert len(heads) == STREAMS and len(left) == 1 and _rows(db) == expected
