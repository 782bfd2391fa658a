"""Which `Host` names a gateway answers: the guard against DNS rebinding.

A gateway with no keys on a loopback address trusts whoever can reach it, which should be only
this machine. A web page can still reach it: its script resolves its own name to 127.0.0.1 (DNS
rebinding) and then reads the gateway's answers as same-origin, with its own name in `Host`.
So such a gateway answers only requests whose `Host` is a loopback name or address
(`--allowed-hosts` adds names, `*` turns the check off); a gateway with keys or on another
address answers every name (the keys, or the network, are its guard).
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
