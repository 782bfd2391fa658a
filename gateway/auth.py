"""API keys -> tenants, the admin key, and the dashboard's session cookie.

Clients send their key as `Authorization: Bearer KEY` (OpenAI SDK) or `x-api-key: KEY`
(Anthropic SDK). A key is never read from a URL (URLs end up in access logs and browser
history): the dashboard signs in through a form (`POST /dashboard/login`) that sets an HttpOnly
session cookie. The cookie is stateless: an expiry time and an HMAC of it under the admin key,
so changing the admin key signs every browser out. With no keys configured the gateway is open
and every request belongs to the tenant "default".
"""

from __future__ import annotations

import hashlib
import hmac
import time

from starlette.requests import HTTPConnection

from gateway.config import DEFAULT_TENANT, GatewayConfig
from gateway.errors import GatewayError

SESSION_COOKIE = "prefixgate_session"
SESSION_TTL_S = 12 * 3600


def presented_key(conn: HTTPConnection) -> str | None:
    """The key a client presented in a header, if any (never from the URL)."""
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    key = conn.headers.get("x-api-key")
    if key:
        return key.strip()
    return None


def _lookup(key: str, keys: dict[str, str]) -> str | None:
    # Compare against every key in constant time so timing does not reveal a prefix.
    found: str | None = None
    for candidate, tenant in keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found


def tenant_for(conn: HTTPConnection, config: GatewayConfig) -> str:
    """The caller's tenant; raises a 401 GatewayError for a missing or unknown key."""
    if not config.api_keys:
        return DEFAULT_TENANT
    key = presented_key(conn)
    if key is None:
        raise GatewayError(401, "missing API key", kind="authentication_error")
    tenant = _lookup(key, dict(config.api_keys))
    if tenant is None:
        raise GatewayError(401, "invalid API key", kind="authentication_error")
    return tenant


def is_admin_key(key: str, config: GatewayConfig) -> bool:
    """True when `key` is the configured admin key."""
    return config.admin_key is not None and hmac.compare_digest(
        key.encode(), config.admin_key.encode())


def _signature(admin_key: str, expires: int) -> str:
    return hmac.new(admin_key.encode(), f"session:{expires}".encode(), hashlib.sha256).hexdigest()


def session_token(config: GatewayConfig, now: float | None = None) -> str:
    """A fresh dashboard session value (`expiry.signature`); needs an admin key."""
    if config.admin_key is None:
        raise ValueError("sessions need an admin key")
    expires = int(now if now is not None else time.time()) + SESSION_TTL_S
    return f"{expires}.{_signature(config.admin_key, expires)}"


def valid_session(token: str, config: GatewayConfig, now: float | None = None) -> bool:
    """True for an unexpired session value signed with the current admin key."""
    if config.admin_key is None:
        return False
    expires_text, _, signature = token.partition(".")
    if not expires_text.isdigit() or len(expires_text) > 12:
        return False
    expires = int(expires_text)
    if expires < (now if now is not None else time.time()):
        return False
    return hmac.compare_digest(signature.encode(), _signature(config.admin_key, expires).encode())


def is_admin(conn: HTTPConnection, config: GatewayConfig) -> bool:
    """True when the caller may read stats: it presents the admin key (header) or a valid
    session cookie, or the gateway is open (no admin key and no API keys configured)."""
    if config.admin_key is None:
        return not config.api_keys
    key = presented_key(conn)
    if key is not None and is_admin_key(key, config):
        return True
    cookie = conn.cookies.get(SESSION_COOKIE)
    return cookie is not None and valid_session(cookie, config)


def may_scrape_metrics(conn: HTTPConnection, config: GatewayConfig) -> bool:
    """`/metrics` needs a key whenever any key exists: the admin key (or session) when one is
    configured, else any tenant's API key; an open gateway serves it to anyone."""
    if config.admin_key is not None:
        return is_admin(conn, config)
    if not config.api_keys:
        return True
    key = presented_key(conn)
    return key is not None and _lookup(key, dict(config.api_keys)) is not None
