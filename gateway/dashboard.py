"""`GET /dashboard`: an HTML page charting `/api/stats` (admin only).

The page (gateway/static/dashboard.html) draws its charts with uPlot 1.6.32 (MIT, vendored in
gateway/static/ with its LICENSE and served at `/dashboard/static/`), so it works offline with
no CDN. It fetches `/api/stats` from the same origin, which sends the session cookie: an admin
signs in with the form at `/dashboard` (`POST /dashboard/login`), which sets an HttpOnly,
SameSite=Strict session cookie (Secure over HTTPS); the key never appears in a URL.
`?window=` sets the time window (seconds, or 1h / 6h / 24h / 7d / 30d). When the charts are
drawn the page sets `data-state="ready"`, `data-charts=N`, `data-clipped=N` (tables wider
than their panel) and `data-unfit=N` (charts not as wide as their panel; charts follow their
panels' width) on `<body>` (tests read them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import anyio
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway.admission import Overloaded
from gateway.sessions import SESSION_COOKIE, SESSION_TTL_S, session_token

StateGetter = Callable[[], Any]  # () -> app.state, as create_app passes it
MAX_LOGIN_BODY = 4096
LOGIN_READ_S = 10.0  # the sign-in form's body must arrive within this
_SECURITY_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": (
        "default-src 'none'; script-src 'self' 'unsafe-inline'; "
        "style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
        # neither falls back to default-src: no site may frame the page (clickjacking the
        # sign-in form) and no injected <base> may move the page's relative script URLs
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",  # frame-ancestors for browsers that predate it
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}
_LOGIN = """<!doctype html><meta charset="utf-8"><title>prefixgate: sign in</title>
<body style="font-family:system-ui;padding:2em">
<form method="post" action="/dashboard/login{query}" autocomplete="off">
<label>Admin key <input type="password" name="key" required autofocus></label>
<button type="submit">Sign in</button></form>{error}</body>"""


_WINDOW = re.compile(r"[0-9]{1,12}[smhd]?")  # the `?window=` forms the page itself reads


def window_query(request: Request) -> str:
    """`?window=VALUE` when the request asks for a window the page understands (seconds, or
    6h / 7d / 90m style), else "": the sign-in form carries it through the login redirect, so
    a bookmarked `/dashboard?window=6h` still shows six hours after signing in. Anything else
    is dropped, never echoed into the page or the redirect."""
    value = request.query_params.get("window", "")
    return f"?window={value}" if _WINDOW.fullmatch(value) else ""


STATIC_FILES: dict[str, str] = {
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
"""The vendored files `/dashboard/static/NAME` serves (nothing else is reachable)."""


@cache
def page() -> str:
    """The dashboard's HTML (read once from the package)."""
    return static_text("dashboard.html")


@cache
def static_text(name: str) -> str:
    """A file of gateway/static/ (read once)."""
    return resources.files("gateway").joinpath(f"static/{name}").read_text("utf-8")


async def static_file(request: Request) -> Response:
    """`GET /dashboard/static/NAME`: the vendored chart library (public, cacheable)."""
    name = request.path_params["name"]
    if name not in STATIC_FILES:
        return PlainTextResponse("not found", status_code=404)
    headers = {"cache-control": "public, max-age=86400", "x-content-type-options": "nosniff"}
    return Response(static_text(name), media_type=STATIC_FILES[name], headers=headers)


def login_page(error: str = "", status: int = 401, query: str = "") -> HTMLResponse:
    """The sign-in form (POSTs the key in the body, never in the URL); `query` is
    `window_query`'s, kept on the form's action."""
    note = f'<p role="alert" style="color:#b00">{error}</p>' if error else ""
    return HTMLResponse(_LOGIN.format(error=note, query=query), status_code=status,
                        headers=_SECURITY_HEADERS)


def locked_out_page(err: Overloaded, query: str = "") -> HTMLResponse:
    """The sign-in form, refused (429) for an address locked out after repeated wrong keys."""
    minutes = max(1, -(-err.retry_after // 60))
    note = (f"Too many wrong keys from your address: signing in is refused for "
            f"{err.retry_after} more seconds (about {minutes} min).")
    page = login_page(note, status=429, query=query)
    page.headers["retry-after"] = str(err.retry_after)
    return page


NO_ADMIN_KEY = ("This gateway has no admin key, so no one can sign in: start it with "
                "--admin-key (or PREFIXGATE_ADMIN_KEY).")


async def _form_key(request: Request) -> str:
    """The form's `key` field; "" (a wrong key) for a form too large, too slow to arrive (an
    unauthenticated client must not hold the route open) or of too many fields."""
    body = b""
    with anyio.move_on_after(LOGIN_READ_S):
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return ""
        try:
            values = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
        except ValueError:  # more fields than a sign-in form has
            return ""
        return (values.get("key") or [""])[0]
    return ""


def routes(state_getter: StateGetter | None = None) -> list[Route]:
    """`GET /dashboard`, `GET /dashboard/static/NAME`, `POST /dashboard/login`, `.../logout`."""
    def get_state(request: Request) -> Any:
        return state_getter() if state_getter is not None else request.app.state

    async def dashboard(request: Request) -> Response:
        state = get_state(request)
        config = state.config
        try:
            admitted = await state.auth.is_admin(request)
        except Overloaded as err:
            return locked_out_page(err, window_query(request))
        if not admitted:
            # tenant keys but no admin key: say why every key would be refused
            note = NO_ADMIN_KEY if config.admin_key is None else ""
            return login_page(note, query=window_query(request))
        return HTMLResponse(page(), headers=_SECURITY_HEADERS)

    async def login(request: Request) -> Response:
        state = get_state(request)
        config = state.config
        key = await _form_key(request)
        query = window_query(request)
        if config.admin_key is None:
            return login_page(NO_ADMIN_KEY, query=query)
        try:
            if not state.auth.admin_key_matches(request, key):
                return login_page("Wrong admin key.", query=query)
        except Overloaded as err:
            return locked_out_page(err, query)
        response = RedirectResponse(f"/dashboard{query}", status_code=303,
                                    headers=_SECURITY_HEADERS)
        response.set_cookie(SESSION_COOKIE, session_token(config), max_age=SESSION_TTL_S,
                            path="/", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    async def logout(request: Request) -> Response:
        await get_state(request).auth.sign_out(request)  # a copy of the cookie stops working
        response = RedirectResponse("/dashboard", status_code=303, headers=_SECURITY_HEADERS)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    return [Route("/dashboard", dashboard, methods=["GET"]),
            Route("/dashboard/static/{name}", static_file, methods=["GET"]),
            Route("/dashboard/login", login, methods=["POST"]),
            Route("/dashboard/logout", logout, methods=["POST"])]
