"""DNS rebinding: an open gateway on a loopback address answers only loopback `Host` names.

Before, `curl -H 'Host: rebind.attacker.example' 127.0.0.1:PORT/v1/chat/completions` got an
answer (and /api/stats its numbers), so a web page whose name resolved to 127.0.0.1 could drive
the gateway and read it as same-origin. The reference is the attack itself over a real socket:
the same request with the page's name and with the gateway's own names.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.host_guard import default_allowed_hosts, host_name, is_loopback
from gateway.serve import build_parser, config_from_args
from tests.gateway.gateway_fakes import FAKE_MODEL, FakeBackend, fake_config
from tests.support import serve

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
    def allowed(*argv: str) -> frozenset[str] | None:
        return config_from_args(build_parser().parse_args(["--upstream", "http://u/v1",
                                                           *argv]), {}).allowed_hosts
    assert allowed() == frozenset()
    assert allowed("--api-key", "sk-one:acme") is None
    assert allowed("--host", "0.0.0.0") is None
    assert allowed("--allowed-hosts", "gw.internal,proxy.lan") == {"gw.internal", "proxy.lan"}
    assert allowed("--allowed-hosts", "*") is None


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
