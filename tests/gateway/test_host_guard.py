"""Web pages against an open gateway: DNS rebinding and writes from other origins.

Before, `curl -H 'Host: rebind.attacker.example' 127.0.0.1:PORT/v1/chat/completions` got an
answer (and /api/stats its numbers), so a web page whose name resolved to 127.0.0.1 could drive
the gateway and read it as same-origin. And any page could make an open gateway run a chat (billed
to its upstream key) with a form or a `no-cors` fetch, which a browser sends without asking. The
reference is each attack itself: over a real socket, and from a page in a real browser.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.host_guard import (
    cross_origin,
    default_allowed_hosts,
    host_name,
    is_loopback,
    page_origins,
)
from gateway.serve import build_parser, config_from_args
from tests.gateway.gateway_fakes import FAKE_MODEL, FakeBackend, fake_config
from tests.support import serve

CHROMIUM = Path("/usr/bin/chromium")

CHAT = {"model": FAKE_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("value", "name"), [
    (b"127.0.0.1:8000", "127.0.0.1"), (b"[::1]:8000", "::1"), (b"[::1]", "::1"),
    (b"LocalHost", "localhost"), (b"rebind.attacker.example:80", "rebind.attacker.example"),
])
def test_host_names_lose_their_port(value: bytes, name: str) -> None:
    assert host_name(value) == name


def test_loopback_names() -> None:
    assert all(map(is_loopback, ["localhost", "api.localhost", "127.0.0.1", "127.9.8.7",
                                 "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.2", "example.com",
                                     "localhost.example.com", "::"]))


def test_which_gateways_check_the_host() -> None:
    assert default_allowed_hosts("127.0.0.1", True, None) == frozenset()
    assert default_allowed_hosts("127.0.0.1", False, None) is None  # keys guard it
    assert default_allowed_hosts("0.0.0.0", True, None) is None  # the network guards it
    assert default_allowed_hosts("0.0.0.0", True, ["GW.internal", ""]) == {"gw.internal"}
    assert default_allowed_hosts("127.0.0.1", True, ["a.example", "*"]) is None


def test_serve_flags_set_the_guard() -> None:
    def guard(*argv: str) -> tuple[frozenset[str] | None, frozenset[str] | None]:
        config = config_from_args(build_parser().parse_args(["--upstream", "http://u/v1",
                                                             *argv]), {})
        return config.allowed_hosts, config.page_origins
    assert guard() == (frozenset(), frozenset())
    assert guard("--api-key", "sk-one:acme") == (None, frozenset())  # keys guard it
    assert guard("--host", "0.0.0.0") == (None, frozenset())
    names = {"gw.internal", "proxy.lan"}
    assert guard("--allowed-hosts", "gw.internal,proxy.lan") == (names, names)
    assert guard("--allowed-hosts", "*") == (None, None)
    assert page_origins(["A.example ", "", "b.example"]) == {"a.example", "b.example"}


@pytest.mark.parametrize(("origin", "host", "refused"), [
    (None, b"127.0.0.1:8000", False),  # an SDK, curl: no Origin
    (b"http://127.0.0.1:8000", b"127.0.0.1:8000", False),  # the gateway's own page
    (b"HTTP://LocalHost:8000", b"localhost:8000", False),
    (b"https://gw.example", b"gw.example:443", False),  # default ports aside
    (b"http://gw.example:80", b"gw.example", False),
    (b"http://127.0.0.1:3000", b"127.0.0.1:8000", True),  # another port is another origin
    (b"https://gw.example", b"gw.example:80", True),
    (b"https://evil.example", b"127.0.0.1:8000", True),
    (b"null", b"127.0.0.1:8000", True),  # a sandboxed frame, a file:// page
    (b"https://proxy.lan:8443", b"127.0.0.1:8000", False),  # an accepted name, any port
])
def test_which_origins_are_another_page(origin: bytes | None, host: bytes,
                                       refused: bool) -> None:
    headers = [(b"host", host), (b"content-type", b"text/plain")]
    if origin is not None:
        headers.append((b"origin", origin))
    assert cross_origin(headers, frozenset({"proxy.lan"})) is refused


def test_a_rebinding_page_gets_no_answer(tmp_path: Path) -> None:
    app = create_app(fake_config(tmp_path, allowed_hosts=frozenset({"gw.internal"})),
                     backend=FakeBackend())
    try:
        with serve(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
            page = {"host": "rebind.attacker.example"}
            chat = client.post("/v1/chat/completions", json=CHAT, headers=page)
            assert chat.status_code == 421
            assert chat.json()["error"]["type"] == "invalid_request_error"
            assert "--allowed-hosts" in chat.json()["error"]["message"]
            messages = client.post("/v1/messages", json=CHAT, headers=page)
            assert messages.status_code == 421 and messages.json()["type"] == "error"
            assert client.get("/api/stats", headers=page).status_code == 421
            assert client.get("/healthz", headers=page).status_code == 421
            for own in (None, "localhost:8000", "[::1]:8000", "gw.internal", "GW.internal:80"):
                headers = {"host": own} if own else {}
                answer = client.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert answer.status_code == 200, (own, answer.text)
    finally:
        app.state.store.close()


def test_a_gateway_without_the_guard_answers_any_name(tmp_path: Path) -> None:
    app = create_app(fake_config(tmp_path), backend=FakeBackend())
    try:
        with serve(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
            answer = client.post("/v1/chat/completions", json=CHAT,
                                 headers={"host": "gw.example.com"})
            assert answer.status_code == 200
    finally:
        app.state.store.close()


def test_a_page_of_another_origin_cannot_make_an_open_gateway_work(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(fake_config(tmp_path), backend=backend)
    try:
        with serve(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
            # what a page's no-cors fetch sends: a text/plain body and the page's Origin
            page = {"origin": "https://evil.example", "content-type": "text/plain;charset=UTF-8"}
            chat = client.post("/v1/chat/completions", json=CHAT, headers=page)
            assert chat.status_code == 403, chat.text
            assert "Origin" in chat.json()["error"]["message"]
            messages = client.post("/v1/messages", json=CHAT, headers=page)
            assert messages.status_code == 403 and messages.json()["type"] == "error"
            assert messages.json()["error"]["type"] == "permission_error"
            assert backend.seen == []
            # reads stay answered (a page cannot read them across origins), and so do the
            # gateway's own page and every client that is not a page
            assert client.get("/healthz", headers=page).status_code == 200
            own = {"origin": server.url}
            assert client.post("/v1/chat/completions", json=CHAT, headers=own).status_code == 200
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert len(backend.seen) == 2
    finally:
        app.state.store.close()


def test_a_gateway_with_keys_leaves_origins_to_its_keys(tmp_path: Path) -> None:
    app = create_app(fake_config(tmp_path, api_keys={"sk-one": "acme"}),
                     backend=FakeBackend())
    try:
        with serve(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
            headers = {"origin": "https://app.example", "authorization": "Bearer sk-one"}
            answer = client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert answer.status_code == 200, answer.text
    finally:
        app.state.store.close()


ATTACK_PAGE = """<!doctype html><title>page</title>
<iframe name="sink"></iframe>
<form id="form" method="POST" enctype="text/plain" action="{url}" target="sink">
<input name='{{"model": "{model}", "max_tokens": 4, "messages": [{{"role": "user",
"content": "from the form"}}], "pad": "' value='"}}'></form>
<script>
fetch("{url}", {{method: "POST", mode: "no-cors", body: JSON.stringify({{model: "{model}",
  max_tokens: 4, messages: [{{role: "user", content: "from the script"}}]}})}})
  .finally(() => document.getElementById("form").submit());
</script>"""


def _page_app(html: str) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/html; charset=utf-8")]})
        await send({"type": "http.response.body", "body": html.encode()})
    return app


def _visit(url: str, tmp_path: Path) -> None:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=5000", "--dump-dom"]
    subprocess.run([str(CHROMIUM), *flags, url], capture_output=True, text=True, timeout=90,
                   check=False)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
@pytest.mark.parametrize("guarded", [True, False])
def test_a_page_in_a_browser_cannot_make_an_open_gateway_work(tmp_path: Path,
                                                              guarded: bool) -> None:
    """The page posts a chat by script and by form; unguarded (`--allowed-hosts '*'`) the
    browser delivers both, which shows the attack is real."""
    backend = FakeBackend()
    config = fake_config(tmp_path, page_origins=frozenset() if guarded else None)
    app = create_app(config, backend=backend)
    try:
        with serve(app) as gateway:
            page = ATTACK_PAGE.format(url=f"{gateway.url}/v1/chat/completions", model=FAKE_MODEL)
            with serve(_page_app(page), lifespan="off") as site:
                _visit(site.url, tmp_path)
        sent = sorted(m["content"] for r in backend.seen for m in r.messages)
        assert sent == ([] if guarded else ["from the form", "from the script"])
    finally:
        app.state.store.close()
