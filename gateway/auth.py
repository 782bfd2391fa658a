"""API keys -> tenants, and the admin key that guards stats and the dashboard.

Clients send their key as `Authorization: Bearer KEY` (OpenAI SDK) or `x-api-key: KEY`
(Anthropic SDK); the browser may use `?key=KEY` for admin pages. With no keys configured the
gateway is open and every request belongs to the tenant "default".
"""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection

from gateway.config import DEFAULT_TENANT, GatewayConfig
from gateway.errors import GatewayError


def presented_key(conn: HTTPConnection, *, allow_query: bool = False) -> str | None:
    """The key a client presented, if any."""
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    key = conn.headers.get("x-api-key")
    if key:
        return key.strip()
    if allow_query:
        return conn.query_params.get("key") or None
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


def is_admin(conn: HTTPConnection, config: GatewayConfig) -> bool:
    """True when the caller may read stats: it presents the admin key, or the gateway is open
    (no admin key and no API keys configured)."""
    if config.admin_key is None:
        return not config.api_keys
    key = presented_key(conn, allow_query=True)
    return key is not None and hmac.compare_digest(key.encode(), config.admin_key.encode())
