"""`GET /dashboard`: a self-contained HTML page charting `/api/stats` (admin key).

The page (gateway/static/dashboard.html) has its CSS and JavaScript inline and draws its
charts as SVG, so it works offline with no CDN. The browser passes the admin key as `?key=`;
the page forwards it to `/api/stats` in an `Authorization` header. When the charts are drawn
the page sets `data-state="ready"` and `data-charts=N` on `<body>` (tests read them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from gateway.auth import is_admin

StateGetter = Callable[[], Any]  # () -> app.state, as create_app passes it
_SECURITY_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:"
    ),
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}
_DENIED = """<!doctype html><meta charset="utf-8"><title>prefixgate</title>
<body style="font-family:system-ui;padding:2em">Admin key required: open
<code>/dashboard?key=ADMIN_KEY</code>.</body>"""


@cache
def page() -> str:
    """The dashboard's HTML (read once from the package)."""
    return resources.files("gateway").joinpath("static/dashboard.html").read_text("utf-8")


def routes(state_getter: StateGetter | None = None) -> list[Route]:
    """`GET /dashboard`."""
    def get_state(request: Request) -> Any:
        return state_getter() if state_getter is not None else request.app.state

    async def dashboard(request: Request) -> Response:
        if not is_admin(request, get_state(request).config):
            return HTMLResponse(_DENIED, status_code=401, headers=_SECURITY_HEADERS)
        return HTMLResponse(page(), headers=_SECURITY_HEADERS)

    return [Route("/dashboard", dashboard, methods=["GET"])]
