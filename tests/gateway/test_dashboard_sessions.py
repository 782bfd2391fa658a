"""Signing out of the dashboard revokes the session cookie server-side (gateway.sessions): a
copy of it is refused afterwards, by every gateway process on the same stats database and
after a restart, while a fresh sign-in works; revocations are kept until expiry, no longer."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, func, inspect, select
from sqlalchemy.engine import Engine

from gateway.config import GatewayConfig
from gateway.sessions import (
    REVOKED,
    SESSION_COOKIE,
    SESSION_TTL_S,
    Revocations,
    Session,
    session_token,
    signed_session,
)
from gateway.stats import make_engine

from .gateway_fakes import asgi_client

ADMIN = "root-admin-key"
KEYS = {"key-alice": "alice"}


async def sign_in(browser: httpx.AsyncClient) -> str:
    """Sign `browser` in through the form; its cookie's value."""
    signed = await browser.post("/dashboard/login", data={"key": ADMIN})
    assert signed.status_code == 303
    return browser.cookies[SESSION_COOKIE]


async def with_cookie(app: Any, value: str, path: str = "/api/stats") -> httpx.Response:
    """`GET path` from another machine that holds a copy of the cookie."""
    async with asgi_client(app) as thief:
        thief.cookies.set(SESSION_COOKIE, value)
        return await thief.get(path)


async def test_a_copied_cookie_is_refused_after_sign_out(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    async with asgi_client(app) as browser:
        cookie = await sign_in(browser)
        assert (await with_cookie(app, cookie)).status_code == 200
        out = await browser.post("/dashboard/logout")
        assert out.status_code == 303 and SESSION_COOKIE not in browser.cookies
    assert (await with_cookie(app, cookie)).status_code == 401
    page = await with_cookie(app, cookie, "/dashboard")
    assert page.status_code == 401 and 'name="key"' in page.text
    async with asgi_client(app) as again:
        assert await sign_in(again) != cookie
        assert (await again.get("/api/stats")).status_code == 200
        assert (await again.get("/dashboard")).status_code == 200


async def test_sign_out_holds_at_every_process_on_the_database_and_after_restart(
    make_fake_app,
) -> None:
    """Two gateway processes on one stats database (here two apps on one SQLite file): a
    cookie signed out at one is refused at the other, and by a third started afterwards."""
    first = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    second = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    async with asgi_client(first) as browser:
        cookie = await sign_in(browser)
        assert (await with_cookie(second, cookie)).status_code == 200  # the same admin key
        await browser.post("/dashboard/logout")
    assert (await with_cookie(second, cookie)).status_code == 401
    restarted = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    assert (await with_cookie(restarted, cookie)).status_code == 401
    assert (await with_cookie(restarted, session_token(restarted.state.config))
            ).status_code == 200


async def test_a_sign_out_the_database_refused_still_holds_in_its_process(
    make_fake_app,
) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    def refuse(*_: Any) -> None:
        raise sqlite3.OperationalError("unable to open database file")

    async with asgi_client(app) as browser:
        cookie = await sign_in(browser)
        event.listen(app.state.store.engine, "before_cursor_execute", refuse)
        assert (await browser.post("/dashboard/logout")).status_code == 303
    assert (await with_cookie(app, cookie, "/dashboard")).status_code == 401
    assert (await with_cookie(app, session_token(app.state.config), "/dashboard")
            ).status_code == 200  # an outage signs no one else out


async def test_signing_out_without_a_valid_cookie_revokes_nothing(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    async with asgi_client(app) as stranger:
        stranger.cookies.set(SESSION_COOKIE, "9999999999.forged")
        assert (await stranger.post("/dashboard/logout")).status_code == 303
    assert revoked_rows(app.state.store.engine) == 0


def revoked_rows(engine: Engine) -> int:
    """Rows of the revocation table (none before it is made)."""
    if not inspect(engine).has_table(REVOKED.name):
        return 0
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(REVOKED)).scalar_one())


def test_a_session_value_is_signed_over_its_id_and_expiry() -> None:
    config = GatewayConfig(admin_key=ADMIN)
    token = session_token(config, now=1000)
    session = signed_session(token, config, now=1000)
    assert session is not None and session.expires == 1000 + SESSION_TTL_S
    expires, session_id, signature = token.split(".")
    other_id = ("0" if session_id[0] != "0" else "1") + session_id[1:]
    assert signed_session(f"{expires}.{other_id}.{signature}", config, now=1000) is None
    assert signed_session(f"{int(expires) + 1}.{session_id}.{signature}", config,
                          now=1000) is None
    assert signed_session(token, config, now=1000 + SESSION_TTL_S + 1) is None  # expired
    assert signed_session(token, GatewayConfig(admin_key="another-key"), now=1000) is None


def test_revocations_are_kept_until_expiry_in_a_bounded_memory(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'stats.db'}")
    now = [1000.0]
    revocations = Revocations(engine, max_kept=2, clock=lambda: now[0])
    sessions = [Session(f"{i:032x}", 2000 + i) for i in range(3)]
    for session in sessions:
        revocations.revoke(session)
    assert len(revocations) == 2  # the oldest left memory, not the database
    assert all(revocations.is_revoked(s) for s in sessions)
    assert not revocations.is_revoked(Session(f"{9:032x}", 2009))
    now[0] = 2001.5  # sessions 0 and 1 have expired: the next sign-out deletes their rows
    revocations.revoke(Session(f"{7:032x}", 9000))
    with engine.connect() as conn:
        left = sorted(conn.execute(select(REVOKED.c.session_id)).scalars())
    assert left == [f"{2:032x}", f"{7:032x}"]
    engine.dispose()
