"""`GET /dashboard`: an HTML page charting `/api/stats` (admin key).

The page (gateway/static/dashboard.html) draws its charts with uPlot 1.6.32 (MIT, vendored in
gateway/static/ with its LICENSE and served at `/dashboard/static/`), so it works offline with
no CDN. The browser passes the admin key as `?key=`; the page forwards it to `/api/stats` in an
`Authorization` header (all data goes through one `fetchStats` function). `?window=` sets the
time window (seconds, or 1h / 6h / 24h / 7d / 30d). When the charts are drawn the page sets
`data-state="ready"`, `data-charts=N` and `data-clipped=N` (tables wider than their panel) on
`<body>` (tests read them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.auth import is_admin

StateGetter = Callable[[], Any]  # () -> app.state, as create_app passes it
_SECURITY_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": (
        "default-src 'none'; script-src 'self' 'unsafe-inline'; "
        "style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:"
    ),
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}
_DENIED = """<!doctype html><meta charset="utf-8"><title>prefixgate</title>
<body style="font-family:system-ui;padding:2em">Admin key required: open
<code>/dashboard?key=ADMIN_KEY</code>.</body>"""


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


def routes(state_getter: StateGetter | None = None) -> list[Route]:
    """`GET /dashboard`."""
    def get_state(request: Request) -> Any:
        return state_getter() if state_getter is not None else request.app.state

    async def dashboard(request: Request) -> Response:
        if not is_admin(request, get_state(request).config):
            return HTMLResponse(_DENIED, status_code=401, headers=_SECURITY_HEADERS)
        return HTMLResponse(page(), headers=_SECURITY_HEADERS)

    return [Route("/dashboard", dashboard, methods=["GET"]),
            Route("/dashboard/static/{name}", static_file, methods=["GET"])]
