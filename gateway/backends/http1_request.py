"""An HTTP/1.1 request as the upstream hop writes it: its origin, its head, prepared POSTs.

`head_of(request, length)` writes any httpx request's request line and headers (the client's,
then the body's length). The backends' POSTs are `PreparedPost`s instead: each URL's request
line and headers are made once (`post_template`: the headers httpx itself would send, host
included), so a request is its body, a length and one join, not an httpx request prepared anew
(~10 us a request in a loop, ~57 us cache-cold in the server). Any other transport (httpx's
own, the tests' ASGI and mock transports, aiohttp for a proxied origin) reads a prepared POST's
`headers`, made on first use.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import httpx

_SKIP_REQUEST_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})


class Origin(NamedTuple):
    """Where a connection goes: scheme, host, port."""

    scheme: str
    host: str
    port: int


def origin_of(url: httpx.URL) -> Origin:
    """`url`'s origin (the scheme's default port when it names none)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    return Origin(url.scheme, url.host, port)


class PostTemplate(NamedTuple):
    """What every POST to one URL with one set of headers shares, made once: the origin, the
    headers httpx would send but the length (`raw`) and, written out, the request line with
    those the transport does not write itself (`head`)."""

    url: httpx.URL
    origin: Origin
    raw: list[tuple[bytes, bytes]]
    head: bytes


def post_template(url: httpx.URL, headers: httpx.Headers) -> PostTemplate:
    """The template of POSTs to `url` with `headers` (and the host httpx adds)."""
    prepared = httpx.Request("POST", url, headers=headers, content=b"")
    raw = [(k, v) for k, v in prepared.headers.raw if k.lower() != b"content-length"]
    written = [(k, v) for k, v in raw if k.lower() not in _SKIP_REQUEST_HEADERS]
    return PostTemplate(url, origin_of(url), raw, _request_lines("POST", url, written))


class PreparedPost(httpx.Request):
    """A POST made from its URL's `PostTemplate` and a body, without httpx's per-request
    preparation (~10 us a request warm, several times that when the code is cache-cold):
    `Http1Transport` writes the template's head, the length and the body as they are; any
    other transport (a test's, the proxy's) reads `headers`, made on first use."""

    def __init__(self, template: PostTemplate, body: bytes,
                 extensions: dict[str, Any]) -> None:
        # httpx.Request.__init__ is not called: every attribute it sets is set here
        self.method = "POST"
        self.url = template.url
        self.extensions = extensions
        self.stream = httpx.ByteStream(body)
        self._content = body
        self.template = template
        self._made_headers: httpx.Headers | None = None

    @property
    def headers(self) -> httpx.Headers:
        if self._made_headers is None:
            length = (b"Content-Length", str(len(self._content)).encode())
            self._made_headers = httpx.Headers([*self.template.raw, length])
        return self._made_headers

    @headers.setter
    def headers(self, value: httpx.Headers) -> None:
        self._made_headers = value

    def head(self) -> bytes:
        """The request line and headers as `Http1Transport` writes them."""
        if self._made_headers is not None:  # its headers were read (and may have changed)
            return head_of(self, len(self._content))
        return b"%scontent-length: %d\r\n\r\n" % (self.template.head, len(self._content))


def head_of(request: httpx.Request, length: int) -> bytes:
    """The request line and headers (the client's, a content length for the body)."""
    raw = [(k, v) for k, v in request.headers.raw if k.lower() not in _SKIP_REQUEST_HEADERS]
    lines = [_request_lines(request.method, request.url, raw)]
    if length or request.method in ("POST", "PUT", "PATCH"):
        lines += (b"content-length: ", str(length).encode(), b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _request_lines(method: str, url: httpx.URL, raw: list[tuple[bytes, bytes]]) -> bytes:
    """The request line and the header lines of `raw` (no blank line after them)."""
    lines = [method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in raw:
        lines += (name, b": ", value, b"\r\n")
    return b"".join(lines)
