"""GET /v1/models through upstream pools: what the replicas serve, asked of them when no model
id is configured (an SDK that lists models to pick one found an empty list before)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from gateway.backends.openai_upstream import OpenAIUpstream
from gateway.backends.pool import ReplicaPool
from gateway.backends.upstream_http import UpstreamOptions
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream

from .upstream_helpers import gateway_app, pool_over, pool_over_handler


def sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", http_client=http,
                              max_retries=0)


async def test_models_are_the_replicas_own_once_each(tmp_path: Path):
    apps = [create_fake_upstream(FakeUpstreamConfig(name=f"r{i}", server="vllm"))
            for i in range(2)]
    app = gateway_app(tmp_path, pool_over(apps, kind="vllm"))
    listed = await sdk(app).models.list()
    assert [m.id for m in listed.data] == ["fake"]  # both replicas serve it: listed once


async def test_configured_ids_are_listed_without_asking(tmp_path: Path):
    asked: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "other"}]})

    backend = OpenAIUpstream(UpstreamOptions(url="http://up.test/v1", name="up"),
                             transport=httpx.MockTransport(upstream), models=("gpt-x", "gpt-y"))
    app = gateway_app(tmp_path, ReplicaPool("openai", [backend]))
    listed = await sdk(app).models.list()
    assert [m.id for m in listed.data] == ["gpt-x", "gpt-y"] and asked == []


async def test_an_anthropic_upstream_is_asked_at_its_models_path(tmp_path: Path):
    asked: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        if request.url.path != "/v1/models":
            return httpx.Response(404)
        return httpx.Response(200, json={"data": [{"id": "claude-a", "type": "model"},
                                                  {"type": "model"}]})

    pool = pool_over_handler(upstream, kind="anthropic", url="http://up.test")
    listed = await sdk(gateway_app(tmp_path, pool)).models.list()
    assert [m.id for m in listed.data] == ["claude-a"]  # an entry without an id is skipped
    assert asked == ["http://up.test/v1/models"]


async def test_an_upstream_that_does_not_answer_lists_nothing(tmp_path: Path):
    pool = pool_over_handler(lambda request: httpx.Response(503), kind="openai")
    listed = await sdk(gateway_app(tmp_path, pool)).models.list()
    assert listed.data == []
