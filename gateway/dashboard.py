"""`GET /dashboard`: a self-contained HTML page charting /api/stats (admin key)."""

from __future__ import annotations

from starlette.routing import Route


def routes() -> list[Route]:
    """Routes for the dashboard; filled in as the page lands."""
    return []
