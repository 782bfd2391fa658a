"""What every step of one request shares: the gateway's state, the route, the request's ticket.

`Ticket` collects what is known about one request as it goes (tenant, parsed request, admission
slot) for its one record and its headers; `Gateway` is the state every route shares.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.admission import Admission, AdmissionConfig, Slot
from gateway.auth import Auth
from gateway.auth_limit import AuthLimiter
from gateway.config import GatewayConfig
from gateway.lint_stage import LintStage
from gateway.metrics import GatewayMetrics
from gateway.progress import Progress
from gateway.salt import UpstreamSalter
from gateway.sessions import Revocations
from gateway.stats import RecordStore
from gateway.types import (
    ApiError,
    Backend,
    ChatRequest,
    Dispatch,
    Final,
    PreparingBackend,
    Provider,
    TextDelta,
    Usage,
)
from gateway.validate import ParseContext

CLIENT_CLOSED = 499  # the status recorded for a client that went away
RECORD_POLL_S = 0.01  # how often a shutdown looks whether the last records are written


class Chunks(Protocol):
    """A streaming renderer for one response."""

    def delta(self, item: TextDelta) -> bytes: ...
    def final(self, final: Final) -> bytes: ...


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """How one route parses bodies and renders results."""

    name: str  # "chat.completions" | "completions" | "messages" | "responses"
    provider: Provider
    parse: Callable[[dict[str, Any], ParseContext], ChatRequest]
    render: Callable[[ChatRequest, Final, int], dict[str, Any]]
    stream_start: Callable[[ChatRequest, Usage | None], tuple[Chunks, bytes]]
    # the parser of a lint-rewritten body when `parse` translates the client's body into
    # another API's (`ChatRequest.body`: Responses -> chat completions); None: `parse`
    reparse: Callable[[dict[str, Any], ParseContext], ChatRequest] | None = None
    # a backend's error named in the client's API when the backend saw a translated body
    # (Responses: `messages` -> `input`); None: as it is
    client_error: Callable[[ApiError, ChatRequest | None], ApiError] | None = None


@dataclass
class Gateway:
    """The state every route shares (also on app.state)."""

    config: GatewayConfig
    backend: Backend
    store: RecordStore
    metrics: GatewayMetrics
    lint: LintStage = field(default_factory=LintStage)
    admission: Admission | None = None  # None: built from config
    salter: UpstreamSalter | None = None  # None: built from config
    # built from config; its sign-outs are kept in `store`'s database
    auth: Auth = field(init=False, repr=False)
    _preparing: tuple[Backend, PreparingBackend | None] | None = field(
        init=False, default=None, repr=False)
    # requests begun and not yet recorded: a shutdown waits for their records (see
    # `records_written`)
    unrecorded: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        c = self.config
        if self.admission is None:
            self.admission = Admission(AdmissionConfig(
                max_concurrency=c.max_concurrency, max_queue=c.max_queue,
                tenant_max_concurrency=c.tenant_max_concurrency,
                tenant_rate_per_s=c.tenant_rate_per_s, tenant_burst=c.tenant_burst))
        if self.salter is None:
            self.salter = UpstreamSalter(c.salt_secret)
        limiter = AuthLimiter(c.auth_max_failures, c.auth_failure_window_s,
                              refused=self.metrics.auth_refused)
        self.auth = Auth(c, limiter, Revocations(self.store.engine))

    async def records_written(self, timeout_s: float) -> bool:
        """Wait until every request begun has written its record, at most `timeout_s`; False
        when some still have not. A shutdown past its graceful timeout cancels the requests in
        flight and goes straight on to the app's own shutdown: the cancelled requests write
        their records only when the event loop next runs them, and the server then ends the
        process at once (it re-raises SIGTERM), so the app waits here before it closes the
        store, or their records are lost."""
        deadline = time.monotonic() + timeout_s
        while self.unrecorded > 0 and time.monotonic() < deadline:
            await asyncio.sleep(RECORD_POLL_S)
        return self.unrecorded <= 0

    def parse_context(self, request_id: str, tenant: str) -> ParseContext:
        """What a parser needs for this backend: its models, and whether it is the embedded
        engine, which constrains its output with the gateway's grammar and must honour every
        field it accepts (upstreams enforce tools, response formats and their own fields
        themselves)."""
        backend = self.backend
        embedded = backend.name == "embedded"
        return ParseContext(request_id, tenant, tuple(backend.models()),
                            grammar=embedded, embedded=embedded)

    @property
    def preparing(self) -> PreparingBackend | None:
        """The backend when it prepares requests (`PreparingBackend`), else None. A Protocol
        isinstance walks the protocol's members: asked once per backend, not per request."""
        known = self._preparing
        if known is None or known[0] is not self.backend:
            backend = self.backend
            known = self._preparing = (
                backend, backend if isinstance(backend, PreparingBackend) else None)
        return known[1]


def new_request_id() -> str:
    """24 random hex digits (96 bits: no two alike in any gateway's lifetime). Not a counter: a
    tenant differencing its own ids (`x-request-id`, `chatcmpl-`, `msg_`) would learn how many
    requests the others sent in between. 0.65 us, less than formatting a counter took."""
    return os.urandom(12).hex()


@dataclass
class Ticket:
    """What is known so far about one request, for its record and headers."""

    route: RouteSpec
    request_id: str = field(default_factory=lambda: new_request_id())
    started: float = field(default_factory=time.perf_counter)
    tenant: str = ""
    req: ChatRequest | None = None
    body: dict[str, Any] | None = None
    recorded: bool = False
    slot: Slot | None = None
    progress: Progress = field(default_factory=Progress)  # what the backend stream delivered
    dispatch: Dispatch = field(default_factory=Dispatch)  # where the backend sent it
