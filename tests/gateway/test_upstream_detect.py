"""Upstream kind detection for `--upstream URL` (no `KIND=`).

References: the fake servers answer `/v1/models` and `/props` in the shapes vLLM, SGLang,
OpenAI and llama.cpp's `llama-server` use (checked against a real llama-server build); each
replica must end up with the cache model of the server it really is, and an unknown or silent
server with the generic one, said so in the log.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import ProviderPools, build_upstream_backend
from gateway.config import GatewayConfig, UpstreamSpec
from gateway.fake_llama_server import FakeLlamaConfig, create_fake_llama_server
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream, model_card
from gateway.llama_slots import SlotShadow
from gateway.shadow import ShadowCache
from gateway.types import Final
from gateway.upstream_detect import Detection, detect_kind, kind_from_models, kind_from_props
from tests.support import free_port

from .upstream_helpers import chat_request, pool_over, pool_over_handler


def _ask(text: str) -> Any:
    return chat_request([{"role": "system", "content": "You are terse. " * 40},
                         {"role": "user", "content": text}], stream=True)


async def _serve_once(pool: ReplicaPool, text: str = "hello") -> Final:
    items = [x async for x in pool.stream(_ask(text))]
    assert isinstance(items[-1], Final)
    return items[-1]


@pytest.mark.parametrize(("server", "kind", "length"), [
    ("vllm", "vllm", 4096), ("sglang", "sglang", 4096), ("openai", "openai", None),
])
def test_models_answer_names_the_server(server: str, kind: str, length: int | None) -> None:
    card = model_card(FakeUpstreamConfig(server=server, max_model_len=4096))
    found = kind_from_models({"object": "list", "data": [card]})
    assert found is not None and (found.kind, found.max_model_len) == (kind, length)


def test_unknown_or_malformed_answers_decide_nothing() -> None:
    bare = model_card(FakeUpstreamConfig(server="bare"))
    for payload in ({"object": "list", "data": [bare]}, {"data": []}, {"data": "x"}, [1], None,
                    {"data": [{"owned_by": "someone"}]}):
        assert kind_from_models(payload) is None
    for payload in ({"total_slots": "2"}, {"model_path": "x"}, None, []):
        assert kind_from_props(payload) is None
    found = kind_from_props({"total_slots": 3, "default_generation_settings": {"n_ctx": 512}})
    assert found == Detection("llamacpp", "/props total_slots=3", slots=3, max_model_len=512)


async def test_probes_stop_at_the_first_answer_that_names_the_server() -> None:
    asked: list[str] = []

    async def get_json(url: str) -> Any:
        asked.append(url)
        return {"data": [{"owned_by": "vllm", "max_model_len": 8}]} if url.endswith(
            "/models") else None

    found = await detect_kind("http://h.test:8000/v1/", get_json)
    assert (found.kind, asked) == ("vllm", ["http://h.test:8000/v1/models"])
    asked.clear()
    hosted = await detect_kind("https://api.openai.com/v1", get_json)
    assert (hosted.kind, asked) == ("openai", [])  # known by its host, nothing probed


async def test_a_bare_url_to_llama_server_gets_the_slot_model(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = pool_over([create_fake_llama_server(FakeLlamaConfig(slots=3, n_ctx=1024))],
                     kind="auto")
    with caplog.at_level(logging.INFO, logger="prefixgate.upstream"):
        final = await _serve_once(pool)
    shadow = pool.router.replicas[0].shadow
    assert isinstance(shadow, SlotShadow) and len(shadow.model.slots) == 3
    assert final.usage.reported_cached_tokens == 0
    assert "detected llamacpp" in caplog.text and "slots 3" in caplog.text
    assert "context 1024" in caplog.text
    await pool.aclose()


@pytest.mark.parametrize(("server", "page_size"), [("vllm", 16), ("sglang", 1)])
async def test_a_bare_url_to_vllm_or_sglang_gets_their_radix_page(
        server: str, page_size: int, caplog: pytest.LogCaptureFixture) -> None:
    app = create_fake_upstream(FakeUpstreamConfig(server=server, page_size=page_size))
    pool = pool_over([app], kind="auto")
    with caplog.at_level(logging.INFO, logger="prefixgate.upstream"):
        await _serve_once(pool)
        second = await _serve_once(pool, "hello again")
    shadow = pool.router.replicas[0].shadow
    assert isinstance(shadow, ShadowCache) and shadow.config.page_size == page_size
    assert f"detected {server}" in caplog.text
    # the shadow of the detected kind predicts what the server reports (same page size)
    usage = second.usage
    assert usage.reported_cached_tokens and usage.predicted_cached_tokens is not None
    assert abs(usage.predicted_cached_tokens - usage.reported_cached_tokens) <= page_size + 2
    await pool.aclose()


async def test_a_silent_server_falls_back_to_the_generic_model(
        caplog: pytest.LogCaptureFixture) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # /v1/models and /props: not found
            return httpx.Response(404, json={"error": "not found"})
        body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1}}
        return httpx.Response(200, json=body)

    pool = pool_over_handler(handler, kind="auto")
    with caplog.at_level(logging.INFO, logger="prefixgate.upstream"):
        items = [x async for x in pool.stream(chat_request([{"role": "user", "content": "q"}]))]
    assert isinstance(items[-1], Final) and items[-1].text == "ok"
    shadow = pool.router.replicas[0].shadow
    assert isinstance(shadow, ShadowCache) and shadow.config.page_size == 16
    assert "kind not detected" in caplog.text and "'openai'" in caplog.text
    await pool.aclose()


async def test_concurrent_first_requests_probe_once() -> None:
    gets: list[str] = []
    app = create_fake_llama_server(FakeLlamaConfig(slots=2))

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            gets.append(scope["path"])
        await app(scope, receive, send)

    pool = pool_over([counting], kind="auto")
    finals = await asyncio.gather(*(_serve_once(pool, f"q{i}") for i in range(3)))
    assert len(finals) == 3
    assert sorted(gets) == ["/props", "/v1/models"]
    await pool.aclose()


async def test_bare_urls_of_hosted_apis_are_known_by_host() -> None:
    specs = ("https://api.anthropic.com", "http://a.test:1/v1", "http://b.test:1/v1")
    config = GatewayConfig(upstreams=tuple(UpstreamSpec.parse(s) for s in specs))
    backend = build_upstream_backend(config)
    assert isinstance(backend, ProviderPools)
    assert sorted(backend.pools) == ["anthropic", "auto"]
    assert len(backend.pools["auto"].router.replicas) == 2  # two replicas of one pool
    assert backend.pools["auto"].api == "openai"
    await backend.aclose()


async def test_the_shadow_prompt_is_prepared_with_lint_for_the_rewritten_body(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker-thread call per request: the pool streams the prompt `prepare` built beside
    lint (it never tokenizes again), and that prompt is the one of the body the upstream got
    (after rewrite), as a fresh tokenization of the upstream's body shows."""
    import gateway.backends.pool as pool_module
    from gateway.shadow import request_prompt

    from .upstream_helpers import gateway_app

    def never(req: Any) -> Any:
        raise AssertionError("the pool tokenized the prompt a second time")

    monkeypatch.setattr(pool_module, "_prompt_of", never)
    app_up = create_fake_upstream(FakeUpstreamConfig(page_size=1))
    pool = pool_over([app_up], kind="vllm")
    app = gateway_app(tmp_path, pool)
    body = {"model": "fake", "messages": [
        {"role": "system", "content": "You are terse. Today is 2026-12-01T04:30:00Z. " * 8},
        {"role": "user", "content": "hello"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw.test") as client:
        response = await client.post("/v1/chat/completions", json=body,
                                     headers={"x-prefixgate-lint-mode": "rewrite"})
    assert response.status_code == 200, response.text
    sent = app_up.state.replica.config.bodies[-1]
    assert sent["messages"] != body["messages"]  # the timestamp moved out of the system prompt
    expected = request_prompt(chat_request(sent["messages"], body=sent))
    shadow = pool.router.replicas[0].shadow
    page = shadow.config.page_size
    assert shadow.match_length(expected, "default") == len(expected) // page * page
    app.state.store.close()
    await pool.aclose()


def _served(module: str, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(/v1/models, /props or {}) of `python -m module --port P *args`, run until answered."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                models = httpx.get(f"{base}/v1/models", timeout=1).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        props = httpx.get(f"{base}/props", timeout=5)
        return models, props.json() if props.status_code == 200 else {}
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_fakes_run_from_their_command_lines() -> None:
    """`python -m gateway.fake_llama_server --slots N` serves a llama-server with N slots (it
    had no command line: --help printed nothing) and `python -m gateway.fake_upstream --server
    sglang` one that kind detection reads as SGLang."""
    models, props = _served("gateway.fake_llama_server", "--slots", "3")
    detected, by_models = kind_from_props(props), kind_from_models(models)
    assert detected is not None and (detected.kind, detected.slots) == ("llamacpp", 3)
    assert by_models is not None and by_models.kind == "llamacpp"
    models, _ = _served("gateway.fake_upstream", "--server", "sglang", "--no-cache")
    by_models = kind_from_models(models)
    assert by_models is not None and by_models.kind == "sglang"
