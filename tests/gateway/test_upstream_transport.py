"""The upstream backends' network transports (HTTP/1.1 on asyncio's sockets, and aiohttp, both
under httpx's interface), on real sockets.

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
from gateway.backends.http1_transport import Http1Transport
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.upstream_http import UpstreamOptions, client_limits
from gateway.types import BackendError, Final, TextDelta
from tests.support import free_port

from .upstream_helpers import chat_request, fake_replicas, serving

Transport = Callable[[UpstreamOptions], httpx.AsyncBaseTransport]
TRANSPORTS: dict[str, Transport] = {
    "http1": lambda o: Http1Transport(client_limits(o)),
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


OURS = ("http1", "aiohttp")


@pytest.mark.parametrize("stream", [False, True])
async def test_each_transport_serves_what_httpx_serves(stream: bool) -> None:
    results = {}
    for name, transport in TRANSPORTS.items():
        app = fake_replicas(1)[0]  # a fresh cache per transport: the same hits
        with serving(app) as server:
            results[name] = await _serve_all(_pool(f"{server.url}/v1", transport), stream)
    for name in OURS:
        assert results[name] == results["httpx"], name
        assert results[name][2][-1][2] > 0  # the later turns hit the fake's cache
        if stream:
            assert sum(kind == "TextDelta" for kind, *_ in results[name][0][:-1]) > 1


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


@pytest.mark.parametrize("name", OURS)
async def test_no_cookie_rides_along_and_one_connection_is_reused(name: str) -> None:
    seen: list[dict[str, Any]] = []
    app = _recording_app(seen, lambda: ([(b"set-cookie", b"session=tenant-a; Path=/")],
                                        _completion()))
    with serving(app) as server:
        pool = _pool(f"{server.url}/v1", TRANSPORTS[name])
        for tenant in ("a", "b", "c"):
            items = [x async for x in pool.stream(chat_request(
                [{"role": "user", "content": "hi"}], namespace=tenant))]
            assert isinstance(items[-1], Final) and items[-1].text == "ok"
        await pool.aclose()
    assert [s["cookie"] for s in seen] == [None, None, None]
    assert len({s["port"] for s in seen}) == 1  # keep-alive: one connection for all three


@pytest.mark.parametrize("name", OURS)
async def test_a_gzip_answer_is_decoded(name: str) -> None:
    seen: list[dict[str, Any]] = []
    app = _recording_app(seen, lambda: ([(b"content-encoding", b"gzip")],
                                        gzip.compress(_completion("zipped"))))
    with serving(app) as server:
        pool = _pool(f"{server.url}/v1", TRANSPORTS[name])
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
    expected = {"5xx": "upstream_error", "cut": "upstream_stream_cut",
                "timeout": "upstream_timeout", "refused": "upstream_unavailable"}[fault]
    for name in OURS:
        assert errors[name] == errors["httpx"], name
        assert errors[name][1] == expected


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


# The HTTP/1.1 transport's own connection handling, against raw socket servers.

class _RawServer:
    """An asyncio socket server that reads each request whole and answers with `reply(n)`
    (the raw bytes for the n-th request; None: close without answering); it counts
    connections and requests."""

    def __init__(self, reply: Callable[[int], bytes | None], close_after: bool = False) -> None:
        self.reply, self.close_after = reply, close_after
        self.connections = self.requests = 0
        self.server: Any = None
        self.seen: list[bytes] = []  # each request's head and body, as they came

    async def __aenter__(self) -> str:
        import asyncio
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: Any, writer: Any) -> None:
        import asyncio
        self.connections += 1
        try:
            while await self._answer_one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its kept connection
        finally:
            writer.close()

    async def _answer_one(self, reader: Any, writer: Any) -> bool:
        """Read one request and answer it; False when the connection should end."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        self.seen.append(head + await reader.readexactly(length))
        answer = self.reply(self.requests)
        self.requests += 1
        if answer is None:
            return False
        writer.write(answer)
        await writer.drain()
        return not self.close_after


def _json_answer(payload: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(payload)).encode() + b"\r\n" + extra + b"\r\n" + payload)


async def _post(transport: httpx.AsyncBaseTransport, url: str, body: bytes = b"{}",
                whole: bool = False, **timeouts: float) -> tuple[int, bytes]:
    """POST `body`; the answer read by httpx (`aread`) or, with `whole`, as the backends
    read a whole answer (`whole_answer`)."""
    from gateway.backends.upstream_http import send, whole_answer
    request = httpx.Request("POST", f"{url}/v1/chat/completions", content=body,
                            extensions={"timeout": {"connect": 5.0, "read": 5.0, "pool": 5.0,
                                                    **timeouts}})
    response = await send(transport, request)
    try:
        return response.status_code, await (whole_answer(response) if whole
                                            else response.aread())
    finally:
        await response.aclose()


async def test_a_connection_the_server_dropped_while_idle_is_replaced() -> None:
    """The server keeps no connection past its answer but does not say so: the next request
    finds its kept connection closed and goes out on a new one, unharmed."""
    server = _RawServer(lambda n: _json_answer(b'{"n": %d}' % n), close_after=True)
    async with server as url:
        transport = Http1Transport(httpx.Limits(max_connections=4))
        answers = [await _post(transport, url) for _ in range(3)]
        await transport.aclose()
    assert answers == [(200, b'{"n": 0}'), (200, b'{"n": 1}'), (200, b'{"n": 2}')]
    assert server.connections == 3


async def test_a_silent_close_on_a_kept_connection_is_retried_once() -> None:
    """A kept connection that closes before any byte of its answer (the server dropped it
    while the request was on its way) is retried on a new one; a second failure is the
    request's error."""
    replies = iter([_json_answer(b"{}"), None, _json_answer(b'{"again": 1}')])
    server = _RawServer(lambda n: next(replies))
    async with server as url:
        transport = Http1Transport()
        first = await _post(transport, url)
        second = await _post(transport, url)  # first try: closed unanswered; retried
        await transport.aclose()
    assert first == (200, b"{}") and second == (200, b'{"again": 1}')
    assert server.connections == 2 and server.requests == 3


@pytest.mark.parametrize("answer", [
    None,  # a new connection closed unanswered (the server may have crashed on the request)
    b"HTTP/1.1 20",  # half a status line, then the close
    b"HTTP/1.1 200 OK\r\nnot a header\r\n\r\n",  # an answer the parser refuses
])
async def test_a_failed_answer_that_is_not_a_stale_kept_connection_is_sent_once(
        answer: bytes | None) -> None:
    """Only a kept connection closed before any byte of its answer is retried: a POST that
    a new connection, or an answer already begun, may have delivered is never sent again
    (the upstream would run, and bill, it twice); the failure is the request's error."""
    server = _RawServer(lambda n: answer, close_after=True)
    async with server as url:
        transport = Http1Transport()
        with pytest.raises(httpx.RemoteProtocolError):
            await _post(transport, url)
        await transport.aclose()
    assert server.requests == 1


async def test_answers_framed_by_chunks_and_by_the_close_are_read_whole() -> None:
    payload = b"x" * (600 << 10)  # past the high-water mark: reading pauses and resumes
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"".join(
        b"%x\r\n%s\r\n" % (len(piece), piece)
        for piece in (payload[i:i + 70000] for i in range(0, len(payload), 70000))) + b"0\r\n\r\n"
    until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + payload
    for answer, connections in ((chunked, 1), (until_close, 2)):
        server = _RawServer(lambda n, a=answer: a, close_after=answer is until_close)
        async with server as url:
            transport = Http1Transport()
            got = [await _post(transport, url, whole=whole) for whole in (False, True)]
            await transport.aclose()
        assert got == [(200, payload)] * 2
        assert server.connections == connections  # a chunked answer keeps its connection


async def test_connections_are_capped_and_a_wait_for_one_times_out() -> None:
    import asyncio
    server = _RawServer(lambda n: _json_answer(b'{"n": %d}' % n))
    async with server as url:
        transport = Http1Transport(httpx.Limits(max_connections=1))
        answers = await asyncio.gather(*(_post(transport, url) for _ in range(4)))
        assert sorted(a[1] for a in answers) == [b'{"n": %d}' % n for n in range(4)]
        assert server.connections == 1
        held = await transport.handle_async_request(httpx.Request(
            "POST", f"{url}/v1/x", content=b"{}",
            extensions={"timeout": {"read": 5.0, "pool": 0.05}}))
        with pytest.raises(httpx.PoolTimeout):
            await _post(transport, url, pool=0.05)
        await held.aclose()
        assert (await _post(transport, url))[0] == 200  # given back: usable again
        await transport.aclose()


async def test_the_sent_callback_hears_of_each_request_once_written() -> None:
    from gateway.types import REQUEST_SENT
    heard: list[int] = []
    server = _RawServer(lambda n: _json_answer(b"{}"))
    async with server as url:
        transport = Http1Transport()
        token = REQUEST_SENT.set(lambda: heard.append(server.requests))
        try:
            await _post(transport, url, body=b'{"a": 1}')
        finally:
            REQUEST_SENT.reset(token)
        await transport.aclose()
    assert heard == [0]  # called once, before the server had read the request


async def test_a_prepared_post_goes_out_as_httpx_builds_the_same_request() -> None:
    """The backends' POSTs (`PreparedPost`: the URL's head made once per backend) reach the
    wire byte for byte as the same request built by httpx does; another transport reads
    httpx's headers from them; headers changed after it was made are the ones sent."""
    from gateway.backends.http1_request import PreparedPost, post_template

    server = _RawServer(lambda n: _json_answer(b"{}"))
    async with server as base:
        url = httpx.URL(f"{base}/v1/chat/completions")
        headers = httpx.Headers({"content-type": "application/json", "authorization": "Bearer k",
                                 "user-agent": "prefixgate-test", "connection": "keep-alive"})
        template = post_template(url, headers)
        transport = Http1Transport()
        sent = []
        for body in (b'{"model": "m"}', b'{"model": "m", "messages": []}' * 40, b""):
            reference = httpx.Request("POST", url, content=body, headers=headers)
            prepared = PreparedPost(template, body, {"timeout": {"read": 5.0}})
            assert sorted(prepared.headers.raw) == sorted(reference.headers.raw)
            assert prepared.content == reference.content == body
            for request in (reference, PreparedPost(template, body, {})):
                response = await transport.handle_async_request(request)
                await response.aread()
                await response.aclose()
            sent.append(body)
        changed = PreparedPost(template, b"{}", {})
        changed.headers["x-extra"] = "1"
        response = await transport.handle_async_request(changed)
        await response.aclose()
        await transport.aclose()
    pairs = server.seen[:-1]
    assert len(pairs) == 2 * len(sent)
    for body, reference, prepared in zip(sent, pairs[0::2], pairs[1::2], strict=True):
        assert prepared == reference
        assert prepared.endswith(b"\r\n\r\n" + body)
        assert f"content-length: {len(body)}\r\n".encode() in prepared
    assert b"\r\nx-extra: 1\r\n" in server.seen[-1]


async def test_an_answers_headers_are_httpxs_made_only_when_read() -> None:
    """A whole answer is read from its body without its headers being normalised; when they
    are read they are httpx's headers of the answer's own lines."""
    from gateway.backends.upstream_http import send, whole_answer

    extra = b"x-upstream: yes\r\nSet-Cookie: a=1\r\nset-cookie: b=2\r\n"
    server = _RawServer(lambda n: _json_answer(b'{"ok": 1}', extra))
    async with server as url:
        transport = Http1Transport()
        got = []
        for read_headers_first in (False, True):
            request = httpx.Request("POST", f"{url}/v1/chat/completions", content=b"{}")
            response = await send(transport, request)
            if read_headers_first:
                got.append(list(response.headers.multi_items()))
            got.append(await whole_answer(response))
            got.append(response._made is not None)  # type: ignore[attr-defined]
            await response.aclose()
        await transport.aclose()
    assert got[0] == got[3] == b'{"ok": 1}'
    assert got[1] is False and got[4] is True
    assert got[2] == [("content-type", "application/json"), ("content-length", "9"),
                      ("x-upstream", "yes"), ("set-cookie", "a=1"), ("set-cookie", "b=2")]


def test_a_proxied_origin_goes_through_aiohttp(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.backends.http1_request import origin_of

    monkeypatch.setenv("HTTP_PROXY", "http://proxy.test:3128")
    monkeypatch.setenv("NO_PROXY", "direct.test")
    transport = Http1Transport()

    def proxied(url: str) -> bool:
        return transport._proxied(origin_of(httpx.URL(url)), httpx.URL(url))

    assert proxied("http://up.test/v1/chat/completions")
    assert not proxied("http://direct.test/v1/chat/completions")


def test_the_transport_runs_on_uvloop() -> None:
    """The gateway serves on uvloop, whose transports are its own classes: the same answers,
    kept connections and framings there."""
    uvloop = pytest.importorskip("uvloop")

    async def both() -> None:
        await test_a_connection_the_server_dropped_while_idle_is_replaced()
        await test_answers_framed_by_chunks_and_by_the_close_are_read_whole()
        await test_connections_are_capped_and_a_wait_for_one_times_out()

    uvloop.run(both())


async def test_a_wake_up_for_a_cancelled_waiter_goes_to_the_next() -> None:
    """With one connection and two requests waiting for it: the first is woken as it is given
    back, then cancelled before it runs; the second still gets the connection. (Python 3.11's
    `wait_for` lets the woken first one finish instead; from 3.12 it is cancelled, and the
    transport passes its wake-up on.)"""
    import asyncio
    server = _RawServer(lambda n: _json_answer(b"{}"))
    async with server as url:
        transport = Http1Transport(httpx.Limits(max_connections=1))
        held = await transport.handle_async_request(httpx.Request(
            "POST", f"{url}/v1/x", content=b"{}", extensions={"timeout": {"read": 5.0}}))
        await held.aread()
        first = asyncio.ensure_future(_post(transport, url, pool=10.0))
        second = asyncio.ensure_future(_post(transport, url, pool=10.0))
        await asyncio.sleep(0.01)  # both wait for the one connection
        await held.aclose()  # wakes the first...
        first.cancel()  # ...which is cancelled before it runs
        assert await asyncio.wait_for(second, 2.0) == (200, b"{}")
        assert first.cancelled() or first.result() == (200, b"{}")
        await transport.aclose()


def _self_signed(tmp_path: Any) -> tuple[Any, Any]:
    """A certificate for localhost / 127.0.0.1 and its key (openssl's CLI)."""
    import shutil
    import subprocess
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


async def test_https_answers_and_verifies_the_certificate(tmp_path: Any) -> None:
    """An https:// upstream is spoken to over TLS on a kept connection, and a certificate the
    client's store does not trust is refused as a connect error."""
    import asyncio
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    served = _RawServer(lambda n: _json_answer(b'{"tls": %d}' % n))
    server = await asyncio.start_server(served._serve, "127.0.0.1", 0, ssl=server_tls)
    url = f"https://localhost:{server.sockets[0].getsockname()[1]}"
    try:
        trusting = Http1Transport()
        trusting.tls = ssl.create_default_context(cafile=str(cert))
        assert [await _post(trusting, url) for _ in range(2)] == [(200, b'{"tls": 0}'),
                                                                  (200, b'{"tls": 1}')]
        assert served.connections == 1
        await trusting.aclose()
        default = Http1Transport()  # certifi's store: this certificate is not in it
        with pytest.raises(httpx.ConnectError):
            await _post(default, url)
        await default.aclose()
    finally:
        server.close()


async def test_a_backends_json_posts_share_one_template_per_url(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's one-off JSON POSTs (Anthropic's count_tokens here) make their URL's head
    once, not once a call, and still send the headers httpx would build for them."""
    import gateway.backends.upstream as upstream_module

    made: list[str] = []
    real = upstream_module.post_template
    monkeypatch.setattr(upstream_module, "post_template",
                        lambda url, headers: made.append(str(url)) or real(url, headers))
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"input_tokens": 7})

    options = UpstreamOptions(url="http://anthropic.test", name="a", api_key="k")
    backend = make_upstream("anthropic", options, httpx.MockTransport(answer))
    req = chat_request([{"role": "user", "content": "hi"}])
    assert [await backend.count_tokens(req) for _ in range(3)] == [7, 7, 7]
    count_url = "http://anthropic.test/v1/messages/count_tokens"
    assert made.count(count_url) == 1
    reference = httpx.Request("POST", count_url, content=seen[0].content,
                              headers=backend._header_obj)
    for request in seen:
        assert str(request.url) == count_url
        assert sorted(request.headers.raw) == sorted(reference.headers.raw)
    await backend.aclose()
