"""The gateway's response classes: JSON by orjson, and answers that run their request's
bookkeeping (closing the backend stream, writing the record) once their last byte is sent, or
their send failed, shielded from cancellation, so that it never delays the answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.responses import JSONResponse, StreamingResponse

Finish = Callable[[], Awaitable[None]]


class FastJSONResponse(JSONResponse):
    """A JSON response encoded by orjson (compact UTF-8, as Starlette's own, several times
    faster for a large completion)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class _Finishing:
    """Mixed into a response class: `finish` runs after the response's own `__call__`."""

    _finish: Finish
    #: True once the server cancelled the response (a shutdown past its graceful timeout): a
    #: client that leaves ends the response's own task group instead, and nothing escapes
    cancelled = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()


class FinishingJSON(_Finishing, FastJSONResponse):
    """A whole JSON answer, then `finish`."""

    def __init__(self, content: Any, finish: Finish, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._finish = finish


class FinishingStream(_Finishing, StreamingResponse):
    """A streamed answer, then `finish` (also when the body was never iterated)."""

    def __init__(self, body: Any, finish: Finish, **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._finish = finish
