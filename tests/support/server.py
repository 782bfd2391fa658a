"""A real uvicorn server on 127.0.0.1 in a background thread, and a free TCP port.

Shared by every test that needs a socket (the SDK clients, fake upstream replicas, the browser
tests): one implementation, so start-up and shutdown behave the same everywhere.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import uvicorn

from gateway.http_server import HttpProtocol

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread, with the server protocol
    `prefixgate serve` uses (gateway.http_server); a context manager.

    `__enter__` returns once uvicorn accepts connections (or raises if it died or took longer
    than START_TIMEOUT_S); `__exit__` asks it to stop and joins the thread.
    """

    def __init__(self, app: Any, *, lifespan: Literal["on", "off"] = "on",
                 graceful_timeout_s: float | None = None) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan=lifespan, http=HttpProtocol,
                                timeout_graceful_shutdown=graceful_timeout_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def serve(app: Any, *, lifespan: Literal["on", "off"] = "on") -> Iterator[ServerThread]:
    """`with serve(app) as server:` a running server at `server.url`."""
    with ServerThread(app, lifespan=lifespan) as server:
        yield server
