"""Which `Host` names a gateway answers: the guard against DNS rebinding.

A gateway with no keys on a loopback address trusts whoever can reach it, which should be only
this machine. A web page can still reach it: its script resolves its own name to 127.0.0.1 (DNS
rebinding) and then reads the gateway's answers as same-origin, with its own name in `Host`.
So such a gateway answers only requests whose `Host` is a loopback name or address
(`--allowed-hosts` adds names, `*` turns the check off); a gateway with keys or on another
address answers every name (the keys, or the network, are its guard).

A page of another origin cannot read an open gateway's answers, but it can still make one work:
a form, or a script's `no-cors` fetch with a `text/plain` body, is a "simple" request a browser
sends without asking first, and the gateway would run (and bill its upstream key for) the chat it
carries. Browsers name the page's origin in `Origin` on every such POST; SDKs, curl and agent
frameworks send none. So an open gateway refuses a POST whose `Origin` is not its own (the
`Host` it was asked by) nor one of the `--allowed-hosts` names (`*` turns this off too).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"


def is_loopback(host: str) -> bool:
    """Whether a bind address or `Host` name is this machine only (`localhost`, 127.0.0.0/8,
    ::1)."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind: str, open_gateway: bool,
                          given: Iterable[str] | None) -> frozenset[str] | None:
    """The names a served gateway answers (None: every name): `given` names plus the loopback
    ones; with none given, the loopback ones for an open gateway on a loopback address."""
    if given is not None:
        names = {n.strip().lower() for n in given if n.strip()}
        return None if ANY_HOST in names else frozenset(names)
    if open_gateway and is_loopback(bind):
        return frozenset()
    return None


def page_origins(given: Iterable[str] | None) -> frozenset[str] | None:
    """The other origins (names) whose pages may POST to an open gateway: the `given` names
    (None: any, for `*`)."""
    names = {n.strip().lower() for n in given or () if n.strip()}
    return None if ANY_HOST in names else frozenset(names)


def host_name(value: bytes) -> str:
    """A `Host` header's name without its port (`[::1]:8000` -> `::1`)."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text[1:]
    return text.rpartition(":")[0] if text.count(":") == 1 else text


def host_allowed(headers: Iterable[tuple[bytes, bytes]], allowed: frozenset[str]) -> bool:
    """Whether a request's `Host` is a loopback name or one of `allowed` (a request with no
    `Host`, HTTP/1.0's, names none and is answered)."""
    for name, value in headers:
        if name == b"host":
            host = host_name(value)
            return host in LOOPBACK_NAMES or host in allowed or is_loopback(host)
    return True


_DEFAULT_PORTS = {b"http": b":80", b"https": b":443"}


def cross_origin(headers: Iterable[tuple[bytes, bytes]], accepted: frozenset[str]) -> bool:
    """Whether a request was sent by a web page of another origin: its `Origin` names neither
    the `Host` it was sent to (default ports aside) nor one of the `accepted` names (`null`, an
    opaque origin, names none; a request without `Origin` is not a page's)."""
    origin = host = b""
    for name, value in headers:
        if name == b"origin":
            origin = value
        elif name == b"host":
            host = value
    if not origin:
        return False
    scheme, _, netloc = origin.strip().lower().partition(b"://")
    if not netloc:
        return True
    own = host.strip().lower()
    port = _DEFAULT_PORTS.get(scheme, b"")
    if port and own.endswith(port):
        own = own[:-len(port)]
    if port and netloc.endswith(port):
        netloc = netloc[:-len(port)]
    return netloc != own and host_name(netloc) not in accepted
