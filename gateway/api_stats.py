"""`GET /api/stats`: the gateway's cache statistics as JSON (admin key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

StateGetter = Callable[[Request], Any]


def routes(state_getter: StateGetter | None = None) -> list[Route]:
    """Routes for the stats API; filled in as the record store lands."""
    return []
