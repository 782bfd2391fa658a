"""An upstream-only gateway never imports torch: not at start, not for a request that carries
tools and a JSON schema (whose check runs through llguidance alone). Importing torch there
cost the first such request about a second, and the process torch's heap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         timeout=180, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
