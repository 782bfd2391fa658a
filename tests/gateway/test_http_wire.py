"""The server protocol's own wire pieces, held to the standard library and to real sockets."""

from __future__ import annotations

import asyncio
import http.client
from pathlib import Path
from typing import Any

import pytest

from gateway.http_wire import (
    STATUS_LINE,
    client_field,
    is_tls,
    local_address,
    peer_address,
    service_unavailable,
    target_field,
)


@pytest.mark.parametrize("status", [100, 200, 204, 304, 400, 404, 413, 429, 499, 500, 503, 599])
def test_status_lines_carry_the_registered_reason_phrase(status: int) -> None:
    phrase = http.client.responses.get(status, "")
    assert STATUS_LINE[status] == f"HTTP/1.1 {status} {phrase}\r\n".encode()


class _Server(asyncio.Protocol):
    seen: list[asyncio.BaseTransport] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.seen.append(transport)


async def _accepted(server: asyncio.AbstractServer) -> asyncio.BaseTransport:
    for _ in range(200):
        if _Server.seen:
            return _Server.seen.pop()
        await asyncio.sleep(0.005)
    raise AssertionError("no connection accepted")


async def test_addresses_of_a_tcp_connection_are_both_ends() -> None:
    loop = asyncio.get_running_loop()
    tcp = await loop.create_server(_Server, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        transport = await _accepted(tcp)
        client_port = writer.get_extra_info("sockname")[1]
        assert peer_address(transport) == ("127.0.0.1", client_port)
        assert local_address(transport) == ("127.0.0.1", port)
        assert is_tls(transport) is False
        transport.close()
    finally:
        writer.close()
        tcp.close()


async def test_a_unix_socket_has_a_path_and_no_peer(tmp_path: Path) -> None:
    path = str(tmp_path / "gw.sock")
    loop = asyncio.get_running_loop()
    unix = await loop.create_unix_server(_Server, path)
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        transport = await _accepted(unix)
        assert local_address(transport) == (path, None)
        assert peer_address(transport) is None
        transport.close()
    finally:
        writer.close()
        unix.close()


class _Bare:
    """A transport without a socket: the addresses come from its extra info."""

    def __init__(self, **info: Any) -> None:
        self.info = info

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.info.get(name, default)


def test_without_a_socket_the_extra_info_is_read() -> None:
    bare: Any = _Bare(peername=("::1", 5, 0, 0), sockname=("::1", 8000, 0, 0))
    assert peer_address(bare) == ("::1", 5)
    assert local_address(bare) == ("::1", 8000)
    assert peer_address(_Bare()) is None  # type: ignore[arg-type]
    assert local_address(_Bare()) is None  # type: ignore[arg-type]


def test_access_fields_name_the_client_and_escape_the_target() -> None:
    scope = {"client": ("10.0.0.7", 41000), "raw_path": b'/v1/x"y', "query_string": b"a=%22&b"}
    assert client_field(scope) == "10.0.0.7:41000"
    assert client_field({"client": None}) == ""
    assert target_field(scope) == "/v1/x%22y?a=%22&b"
    assert target_field({"raw_path": b"/p", "query_string": b""}) == "/p"


async def test_the_busy_answer_is_a_whole_503_that_closes() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await service_unavailable({}, None, send)
    start, body = sent
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"connection"] == b"close"
    assert int(headers[b"content-length"]) == len(body["body"]) == len(b"Service Unavailable")
    assert not body.get("more_body", False)

