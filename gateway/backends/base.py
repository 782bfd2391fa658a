"""The backend seam: the `Backend` protocol (see gateway.types) and small helpers around it."""

from __future__ import annotations

from gateway.types import Backend, BackendError, ChatRequest, Final, TextDelta

__all__ = ["Backend", "BackendError", "collect"]


async def collect(backend: Backend, req: ChatRequest) -> tuple[list[TextDelta], Final]:
    """Run a whole stream; the deltas and the one Final. Raises BackendError if none comes."""
    deltas: list[TextDelta] = []
    final: Final | None = None
    async for item in backend.stream(req):
        if isinstance(item, Final):
            final = item
        else:
            deltas.append(item)
    if final is None:
        raise BackendError(502, f"backend {backend.name} ended without a result")
    return deltas, final
