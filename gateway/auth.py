"""API keys -> tenants, the admin key, the dashboard's session cookie, and the failed-attempt
limiter in front of all three (one `Auth` per app: `app.state.auth`, `Gateway.auth`).

Clients send their key as `Authorization: Bearer KEY` (OpenAI SDK) or `x-api-key: KEY`
(Anthropic SDK). A key is never read from a URL (URLs end up in access logs and browser
history): the dashboard signs in through a form (`POST /dashboard/login`) that sets an HttpOnly
session cookie (gateway.sessions: signed under the admin key, revoked by signing out). With no
keys configured the gateway is open and every request belongs to the tenant "default".
Every presented key goes through the address's `AuthLimiter` (gateway.auth_limit): a locked
address gets `Overloaded` (429) before any comparison. A missing key is no attempt, and a
session cookie is not a guess (its HMAC cannot be guessed), so neither counts.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import anyio
from starlette.requests import HTTPConnection

from gateway.auth_limit import AuthLimiter, client_address
from gateway.config import DEFAULT_TENANT, GatewayConfig
from gateway.errors import GatewayError
from gateway.sessions import SESSION_COOKIE, Revocations, signed_session


def presented_key(conn: HTTPConnection) -> str | None:
    """The key a client presented in a header, if any (never from the URL)."""
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    key = conn.headers.get("x-api-key")
    if key:
        return key.strip()
    return None


def _lookup(key: str, keys: Mapping[str, str]) -> str | None:
    # Compare against every key in constant time so timing does not reveal a prefix.
    found: str | None = None
    for candidate, tenant in keys.items():
        if hmac.compare_digest(candidate.encode(), key.encode()):
            found = tenant
    return found


def is_admin_key(key: str, config: GatewayConfig) -> bool:
    """True when `key` is the configured admin key."""
    return config.admin_key is not None and hmac.compare_digest(
        key.encode(), config.admin_key.encode())


class Auth:
    """Who a request is: its tenant, whether it may read stats and metrics. Methods that
    check a presented key raise `Overloaded` (429, `retry_after`) for a locked-out address."""

    def __init__(self, config: GatewayConfig, limiter: AuthLimiter,
                 revocations: Revocations) -> None:
        self.config = config
        self.limiter = limiter
        self.revocations = revocations

    def tenant(self, conn: HTTPConnection) -> str:
        """The caller's tenant; a 401 GatewayError for a missing or unknown key."""
        if not self.config.api_keys:
            return DEFAULT_TENANT
        key = presented_key(conn)
        if key is None:
            raise GatewayError(401, "missing API key", kind="authentication_error")
        tenant = self.limiter.verify(client_address(conn), key, self._tenant_of)
        if tenant is None:
            raise GatewayError(401, "invalid API key", kind="authentication_error")
        return tenant

    def _tenant_of(self, key: str) -> str | None:
        return _lookup(key, self.config.api_keys)

    def admin_key_matches(self, conn: HTTPConnection, key: str) -> bool:
        """True when `key` (the sign-in form's) is the admin key; a wrong one counts."""
        return self.limiter.verify(client_address(conn), key, self._admin_of) is not None

    def _admin_of(self, key: str) -> bool | None:
        return True if is_admin_key(key, self.config) else None

    async def is_admin(self, conn: HTTPConnection) -> bool:
        """True when the caller may read stats: it holds a signed-in session cookie or
        presents the admin key (header), or the gateway is open (no admin key and no API
        keys configured)."""
        if self.config.admin_key is None:
            return not self.config.api_keys
        if await self.signed_in(conn):
            return True
        key = presented_key(conn)
        return key is not None and self.admin_key_matches(conn, key)

    async def signed_in(self, conn: HTTPConnection) -> bool:
        """True for a session cookie that is signed, unexpired and not signed out."""
        cookie = conn.cookies.get(SESSION_COOKIE)
        session = signed_session(cookie, self.config) if cookie else None
        if session is None:
            return False
        revoked = await anyio.to_thread.run_sync(self.revocations.is_revoked, session)
        return not revoked

    async def sign_out(self, conn: HTTPConnection) -> None:
        """Revoke the caller's session cookie (nothing for a missing or invalid one)."""
        cookie = conn.cookies.get(SESSION_COOKIE)
        session = signed_session(cookie, self.config) if cookie else None
        if session is not None:
            await anyio.to_thread.run_sync(self.revocations.revoke, session)

    async def may_scrape_metrics(self, conn: HTTPConnection) -> bool:
        """`/metrics` needs a key whenever any key exists: the admin key (or session) when
        one is configured, else any tenant's API key; an open gateway serves it to anyone."""
        if self.config.admin_key is not None:
            return await self.is_admin(conn)
        if not self.config.api_keys:
            return True
        key = presented_key(conn)
        return key is not None and self.limiter.verify(
            client_address(conn), key, self._tenant_of) is not None
