"""The upstream backends' network transport (aiohttp under httpx's interface), on real sockets.

Every behaviour is checked against httpx's own network transport as the reference: the same
fake upstream, the same requests, the same items out. Then what the pooled transport must
keep: no cookie jar, keep-alive reuse, content-encoding decoded, faults mapped as before.
"""

from __future__ import annotations

import gzip
import json
import ssl
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.backends.aiohttp_transport import AiohttpTransport
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.upstream_http import UpstreamOptions, client_limits
from gateway.types import BackendError, Final, TextDelta
from tests.support import free_port

from .upstream_helpers import chat_request, fake_replicas, serving

Transport = Callable[[UpstreamOptions], httpx.AsyncBaseTransport]
TRANSPORTS: dict[str, Transport] = {
    "aiohttp": lambda o: AiohttpTransport(client_limits(o)),
    "httpx": lambda o: httpx.AsyncHTTPTransport(limits=client_limits(o)),  # the reference
}


def _pool(url: str, transport: Transport, timeout_s: float = 5.0) -> ReplicaPool:
    options = UpstreamOptions(url=url, name="up", timeout_s=timeout_s)
    return ReplicaPool("openai", [make_upstream("openai", options, transport(options))])


async def _serve_all(pool: ReplicaPool, stream: bool) -> list[list[Any]]:
    out = []
    for turn in range(3):
        messages = [{"role": "user", "content": f"turn {t}: " + "context " * 200}
                    for t in range(turn + 1)]
        items = [x async for x in pool.stream(chat_request(messages, stream=stream))]
        out.append([(type(x).__name__, x.text) for x in items]
                   + [_usage(items[-1])])
    await pool.aclose()
    return out


def _usage(final: Any) -> tuple[int, int, int | None]:
    assert isinstance(final, Final)
    u = final.usage
    return u.prompt_tokens, u.completion_tokens, u.reported_cached_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_aiohttp_transport_serves_what_httpx_serves(stream: bool) -> None:
    results = {}
    for name, transport in TRANSPORTS.items():
        app = fake_replicas(1)[0]  # a fresh cache per transport: the same hits
        with serving(app) as server:
            results[name] = await _serve_all(_pool(f"{server.url}/v1", transport), stream)
    assert results["aiohttp"] == results["httpx"]
    assert results["aiohttp"][2][-1][2] > 0  # the later turns hit the fake's cache
    if stream:
        assert sum(kind == "TextDelta" for kind, *_ in results["aiohttp"][0][:-1]) > 1


def _recording_app(seen: list[dict[str, Any]], answer: Callable[[], tuple[list[Any], bytes]]
                   ) -> Any:
    """A raw ASGI upstream: notes each request's cookie header and client port."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        headers = dict(scope["headers"])
        seen.append({"cookie": headers.get(b"cookie"), "port": scope["client"][1]})
        extra, body = answer()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), *extra]})
        await send({"type": "http.response.body", "body": body})

    return app


def _completion(text: str = "ok") -> bytes:
    return json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": text}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()


async def test_no_cookie_rides_along_and_one_connection_is_reused() -> None:
    seen: list[dict[str, Any]] = []
    app = _recording_app(seen, lambda: ([(b"set-cookie", b"session=tenant-a; Path=/")],
                                        _completion()))
    with serving(app) as server:
        pool = _pool(f"{server.url}/v1", TRANSPORTS["aiohttp"])
        for tenant in ("a", "b", "c"):
            items = [x async for x in pool.stream(chat_request(
                [{"role": "user", "content": "hi"}], namespace=tenant))]
            assert isinstance(items[-1], Final) and items[-1].text == "ok"
        await pool.aclose()
    assert [s["cookie"] for s in seen] == [None, None, None]
    assert len({s["port"] for s in seen}) == 1  # keep-alive: one connection for all three


async def test_a_gzip_answer_is_decoded() -> None:
    seen: list[dict[str, Any]] = []
    app = _recording_app(seen, lambda: ([(b"content-encoding", b"gzip")],
                                        gzip.compress(_completion("zipped"))))
    with serving(app) as server:
        pool = _pool(f"{server.url}/v1", TRANSPORTS["aiohttp"])
        items = [x async for x in pool.stream(chat_request([{"role": "user", "content": "hi"}]))]
        await pool.aclose()
    assert isinstance(items[-1], Final) and items[-1].text == "zipped"


@pytest.mark.parametrize("fault", ["5xx", "cut", "timeout", "refused"])
async def test_faults_map_as_with_httpx(fault: str) -> None:
    """The client-facing error of each fault is the one httpx's transport gives."""
    errors = {}
    for name, transport in TRANSPORTS.items():
        config: dict[str, Any] = {"5xx": {"fail_status": 503}, "cut": {"cut_after": 2},
                                  "timeout": {"delay_s": 1.0}, "refused": {}}[fault]
        with serving(fake_replicas(1, **config)[0]) as server:
            url = f"http://127.0.0.1:{free_port()}/v1" if fault == "refused" else (
                f"{server.url}/v1")
            pool = _pool(url, transport, timeout_s=0.3)
            items: list[TextDelta | Final] = []
            with pytest.raises(BackendError) as caught:
                async for item in pool.stream(chat_request(
                        [{"role": "user", "content": "hi"}], stream=True)):
                    items.append(item)
            await pool.aclose()
        errors[name] = (caught.value.status, caught.value.kind, len(items))
    assert errors["aiohttp"] == errors["httpx"]
    expected = {"5xx": "upstream_error", "cut": "upstream_stream_cut",
                "timeout": "upstream_timeout", "refused": "upstream_unavailable"}[fault]
    assert errors["aiohttp"][1] == expected


def test_environment_proxy_is_read_once_per_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.test:3128")
    monkeypatch.setenv("NO_PROXY", "direct.test")
    transport = AiohttpTransport()
    via = transport._proxy(httpx.URL("http://up.test/v1/chat/completions"))
    direct = transport._proxy(httpx.URL("http://direct.test/v1/chat/completions"))
    assert str(via.url) == "http://proxy.test:3128" and direct.url is None
    monkeypatch.setenv("HTTP_PROXY", "http://other.test:1")  # read once: not seen again
    assert transport._proxy(httpx.URL("http://up.test/v1/models")) is via


def test_certificate_store_is_loaded_once_when_a_transport_is_built() -> None:
    """certifi's store (~20 ms to load) is read when the first transport is built, before
    serving, and shared: not on a replica's first request, not once per replica."""
    first, second = AiohttpTransport(), AiohttpTransport()
    assert first.tls is second.tls
    assert first.tls.verify_mode == ssl.CERT_REQUIRED and first.tls.check_hostname
    assert first.tls.cert_store_stats()["x509_ca"] > 50  # certifi's roots, not an empty store
