"""GET /v1/models through upstream pools: what the replicas serve, asked of them when no model
id is configured (an SDK that lists models to pick one found an empty list before)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

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


async def test_a_listed_model_is_retrieved_and_another_is_a_404(tmp_path: Path):
    """`models.retrieve` (GET /v1/models/{id}) answers a listed model's card, the same as its
    entry in the list (ids with a slash too, as vLLM serves `org/name`), and OpenAI's 404
    `model_not_found` for a model the replicas do not list."""
    listed = ["meta-llama/Llama-3.1-8B-Instruct", "small"]
    pool = pool_over_handler(lambda request: httpx.Response(200, json={
        "object": "list", "data": [{"id": m, "object": "model"} for m in listed]}))
    client = sdk(gateway_app(tmp_path, pool))
    cards = {m.id: m for m in (await client.models.list()).data}
    for model in listed:
        assert await client.models.retrieve(model) == cards[model]
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("gpt-unknown")
    assert info.value.code == "model_not_found"
