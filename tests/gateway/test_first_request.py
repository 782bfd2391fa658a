"""The first request costs what any other does: startup work stays at startup.

An upstream-only gateway never imports torch: not at start, not for a request that carries
tools and a JSON schema (checked against the JSON Schema meta-schema, with no grammar built).
Importing torch there cost the first such request about a second, and the process torch's heap.
The token encoding that lint and the shadow caches use (~0.2 s to load) and anyio's event-loop
backend (~20 ms) load while the app starts, and the upstream client's certificate store when it
is built (~20 ms)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.types import ChatRequest, Final, TextDelta, WarmingBackend
from tests.gateway.gateway_fakes import FAKE_MODEL, FakeBackend, fake_config
from tests.support import run_fresh_python

_SCRIPT = """
import asyncio, sys, tempfile
from pathlib import Path
import httpx
from tests.gateway.upstream_helpers import fake_replicas, gateway_app, pool_over

TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}

async def main(tmp):
    app = gateway_app(Path(tmp), pool_over(fake_replicas(1)))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for extra in ({"tools": [TOOL]}, {"response_format": SCHEMA}):
                body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **extra}
                reply = await client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
            bad = {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_schema", "json_schema": {
                       "name": "a", "schema": {"type": "object", "minProperties": "x"}}}}
            reply = await client.post("/v1/chat/completions", json=bad)
            assert reply.status_code == 400, reply.text

with tempfile.TemporaryDirectory() as tmp:
    asyncio.run(main(tmp))
assert "torch" not in sys.modules, "torch imported"
"""


def test_upstream_gateway_serves_tools_and_schemas_without_torch() -> None:
    run = run_fresh_python(_SCRIPT)
    assert run.returncode == 0, run.stderr[-3000:]


_WARM = """
import asyncio, sys, tempfile
from pathlib import Path
from prompt_lint.tokens import get_encoding
from tests.gateway.upstream_helpers import fake_replicas, gateway_app, pool_over

async def serve(app):
    assert get_encoding.cache_info().currsize == 0, "loaded before startup"
    assert "anyio._backends._asyncio" not in sys.modules, "loaded before startup"
    async with app.router.lifespan_context(app):
        assert get_encoding.cache_info().currsize == 1, "encoding not loaded at startup"
        assert "anyio._backends._asyncio" in sys.modules, "anyio backend not loaded at startup"

with tempfile.TemporaryDirectory() as tmp:
    app = gateway_app(Path(tmp), pool_over(fake_replicas(1)))  # built before serving, as serve does
    asyncio.run(serve(app))
"""


def test_startup_loads_what_the_first_request_would() -> None:
    """Loading cl100k (~0.2 s) and anyio's backend (~20 ms) is startup work: the first request
    must not wait for it."""
    run = run_fresh_python(_WARM)
    assert run.returncode == 0, run.stderr[-3000:]


class _WarmingFake(FakeBackend):
    """The fake backend with one-time work: answers only once it is done."""

    warmed: bool = False

    async def warm_up(self) -> None:
        await asyncio.sleep(0.01)
        self.warmed = True

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        assert self.warmed, "served before warm_up"
        async for item in super().stream(req):
            yield item


async def test_the_app_warms_its_backend_before_serving(tmp_path: Path) -> None:
    backend = _WarmingFake()
    app = create_app(fake_config(tmp_path), backend=backend)
    assert isinstance(backend, WarmingBackend) and not backend.warmed
    async with app.router.lifespan_context(app):
        assert backend.warmed
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            reply = await client.post("/v1/chat/completions", json={
                "model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi there"}]})
    assert reply.status_code == 200, reply.text
    app.state.store.close()


class _BrokenGrammar:
    def warm(self) -> None:
        raise ValueError("token 7 is not valid UTF-8")


async def test_a_grammar_that_cannot_warm_does_not_stop_the_server(
        tmp_path: Path, caplog: Any) -> None:
    """A vocabulary llguidance refuses is logged at start-up, not fatal: the engine still
    serves unconstrained requests (a constrained one reports the error itself)."""
    embedded = pytest.importorskip("gateway.backends.embedded")
    stub = SimpleNamespace(engine=SimpleNamespace(grammar=_BrokenGrammar()))
    backend = embedded.EmbeddedBackend(fake_config(tmp_path), async_engine=stub)
    with caplog.at_level(logging.WARNING, logger="prefixgate.embedded"):
        await backend.warm_up()
    assert "token 7 is not valid UTF-8" in caplog.text
