"""create_app: the Starlette gateway (OpenAI chat, completions and Responses routes, Anthropic
Messages, /healthz, /metrics, stats).

app.state carries: config, backend, store (RecordStore), metrics (Registry), gateway_metrics,
gateway (the shared pipeline state) and learners (per-tenant TemplateLearners).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway import (
    access_log,
    api_stats,
    dashboard,
    memory,
    parse_anthropic,
    parse_openai,
    parse_responses,
    render_anthropic,
    render_openai,
    render_responses,
)
from gateway.admission import Overloaded
from gateway.config import GatewayConfig
from gateway.count_tokens import count_tokens, input_tokens
from gateway.errors import GatewayError, error_body, model_not_found
from gateway.health import StoreMetrics, health_report
from gateway.host_guard import cross_origin, host_allowed
from gateway.lint_stage import LintStage
from gateway.metrics import CONTENT_TYPE, GatewayMetrics, Registry
from gateway.model_cards import client_format, model_card, model_list
from gateway.pipeline import handle
from gateway.request_state import Gateway, RouteSpec
from gateway.stats import RecordStore
from gateway.types import (
    Backend,
    ChatRequest,
    ListingBackend,
    Provider,
    Usage,
    WarmingBackend,
)
from gateway.usage_report import prefixgate_headers
from prompt_lint.tokens import shared_counter

log = logging.getLogger("prefixgate.gateway")
# how long a shutdown waits for the requests it cancelled to write their records (each
# closes its backend stream and queues its row: milliseconds, unless something hangs); small
# beside the default graceful timeout, 25 s inside Kubernetes' 30 s before it kills the pod
SHUTDOWN_RECORDS_S = 2.0


def _chat_stream(req: ChatRequest, early: Usage | None) -> tuple[Any, bytes]:
    chunks = render_openai.ChatChunks(req, parse_openai.include_usage(req.body))
    return chunks, chunks.start()


def _completion_stream(req: ChatRequest, early: Usage | None) -> tuple[Any, bytes]:
    chunks = render_openai.CompletionChunks(req, parse_openai.include_usage(req.body))
    return chunks, chunks.start()


def _messages_stream(req: ChatRequest, early: Usage | None) -> tuple[Any, bytes]:
    events = render_anthropic.MessageEvents(req)
    return events, events.start(early)


def _responses_stream(req: ChatRequest, early: Usage | None) -> tuple[Any, bytes]:
    events = render_responses.ResponseEvents(req)
    return events, events.start()


CHAT = RouteSpec("chat.completions", "openai", parse_openai.parse_chat,
                 render_openai.chat_response, _chat_stream)
COMPLETIONS = RouteSpec("completions", "openai", parse_openai.parse_completion,
                        render_openai.text_completion, _completion_stream)
MESSAGES = RouteSpec("messages", "anthropic", parse_anthropic.parse_messages,
                     lambda req, final, _created: render_anthropic.message_response(req, final),
                     _messages_stream)
RESPONSES = RouteSpec("responses", "openai", parse_responses.parse_responses,
                      render_responses.response_body, _responses_stream,
                      reparse=parse_openai.parse_chat,
                      client_error=parse_responses.client_error)


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def chat_completions(request: Request) -> Response:
    return await handle(_gateway(request), request, CHAT)


async def completions(request: Request) -> Response:
    return await handle(_gateway(request), request, COMPLETIONS)


async def messages(request: Request) -> Response:
    return await handle(_gateway(request), request, MESSAGES)


async def responses(request: Request) -> Response:
    return await handle(_gateway(request), request, RESPONSES)


def error_response(err: GatewayError, provider: Provider = "openai") -> JSONResponse:
    """`err` in the client's format (OpenAI's unless `provider` says otherwise), with its
    `retry-after` when it is a timed refusal."""
    headers = {"retry-after": str(err.retry_after)} if isinstance(err, Overloaded) else None
    return JSONResponse(error_body(err, provider), status_code=err.status, headers=headers)


async def _listed_models(gw: Gateway) -> list[str]:
    """The model ids the gateway lists: an upstream pool's from its replicas (or its
    configured ids), the embedded engine's own."""
    backend = gw.backend
    ids = await backend.list_models() if isinstance(backend, ListingBackend) else backend.models()
    return [m for m in ids if m != "*"]


async def list_models(request: Request) -> Response:
    """`GET /v1/models`, in the client's format (`gateway.model_cards`)."""
    gw, provider = _gateway(request), client_format(request.headers)
    try:
        gw.auth.tenant(request)
    except GatewayError as err:
        return error_response(err, provider)
    return JSONResponse(model_list(await _listed_models(gw), provider))


async def retrieve_model(request: Request) -> Response:
    """`GET /v1/models/{id}` (the SDKs' `models.retrieve`): the model's card when the gateway
    lists it, else a 404 (OpenAI's `model_not_found`, Anthropic's `not_found_error`)."""
    gw, provider = _gateway(request), client_format(request.headers)
    try:
        gw.auth.tenant(request)
        model = str(request.path_params["model"])
        if model not in await _listed_models(gw):
            raise model_not_found(f"model {model!r} does not exist")
    except GatewayError as err:
        return error_response(err, provider)
    return JSONResponse(model_card(model, provider))


async def healthz(request: Request) -> Response:
    """Liveness plus what an operator must see: a degraded stats database, records pending."""
    gw = _gateway(request)
    pages = gw.backend.kv_pages()
    body: dict[str, Any] = {**health_report(gw.store).as_json(), "backend": gw.backend.name}
    if pages is not None:
        body["kv_pages_used"], body["kv_pages_total"] = pages
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    try:
        allowed = await gw.auth.may_scrape_metrics(request)
    except Overloaded as err:
        return error_response(err)
    if not allowed:
        needed = "the admin key" if gw.config.admin_key is not None else "an API key"
        return error_response(GatewayError(401, f"/metrics needs {needed}",
                                         kind="authentication_error"))
    _refresh_kv_gauges(gw)
    request.app.state.store_metrics.refresh()
    registry: Registry = request.app.state.metrics
    return PlainTextResponse(registry.render(), media_type=CONTENT_TYPE)


def _refresh_kv_gauges(gw: Gateway) -> None:
    pages = gw.backend.kv_pages()
    if pages is not None:
        gw.metrics.kv_pages_used.set(pages[0])
        gw.metrics.kv_pages_total.set(pages[1])


def _default_backend(config: GatewayConfig, registry: Registry) -> Backend:
    if config.upstreams:
        from gateway.backends.providers import build_upstream_backend

        backend: Backend = build_upstream_backend(config, registry)
        return backend
    from gateway.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(config)


async def _no_such_endpoint(request: Request, exc: Exception) -> Response:
    """A 404 / 405 under /v1/ in the caller's API format (an SDK reads the JSON error, not
    Starlette's plain text); elsewhere (dashboard, stats API) Starlette's own answer."""
    assert isinstance(exc, HTTPException)
    path = _route_path(request.scope)
    if not path.startswith("/v1/"):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    provider: Provider = "anthropic" if path.startswith("/v1/messages") else "openai"
    missing = exc.status_code == 404
    verb = "not found" if missing else "does not accept this method"
    if path.startswith("/v1/responses/"):  # retrieve, delete, cancel, input_items
        verb += ": prefixgate keeps no responses (stateless)"
    err = GatewayError(exc.status_code, f"{request.method} {path}: {verb}")
    return JSONResponse(error_body(err, provider), status_code=exc.status_code,
                        headers=exc.headers)


MISDIRECTED = GatewayError(421, "this gateway does not answer requests for this Host (a page "
                           "reaching it by DNS rebinding?); start it with --allowed-hosts NAME "
                           "to answer NAME")
CROSS_ORIGIN = GatewayError(403, "this gateway has no API keys, so it serves no web page of "
                            "another origin (its Origin header); start it with --allowed-hosts "
                            "NAME to serve pages of NAME, or with API keys")
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def _refused(scope: Scope, err: GatewayError) -> Response:
    """A request the gateway's host guard refuses (gateway.host_guard), in the caller's format
    under /v1/."""
    path = _route_path(scope)
    if not path.startswith("/v1/"):
        return PlainTextResponse(err.message, status_code=err.status)
    provider: Provider = "anthropic" if path.startswith("/v1/messages") else "openai"
    return JSONResponse(error_body(err, provider), status_code=err.status)


def _extra_routes(state_getter: Any) -> list[BaseRoute]:
    """The stats API (/api/stats) and the dashboard (/dashboard)."""
    return [*api_stats.routes(state_getter), *dashboard.routes()]


def _route_path(scope: Scope) -> str:
    """The request's path below the app's root path (what the routes are matched on)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else str(path)


async def _warm_up(backend: Backend) -> None:
    """What the first request would otherwise load: the token encoding of lint and the shadow
    caches (~0.2 s), anyio's event-loop backend (~20 ms; a response's bookkeeping and a
    worker-thread hop run through it) and the backend's own (the engine's grammar tokenizer)."""
    shared_counter()
    await anyio.sleep(0)
    if isinstance(backend, WarmingBackend):
        await backend.warm_up()


class GatewayApp(Starlette):
    """The Starlette app, with its POST API routes served straight from the ASGI call:
    `handle` answers every request itself (errors in the caller's format included), so the
    middleware stack and the router, ~0.1 ms a request here (measured paired, one client),
    are left for everything else (other methods and paths, the dashboard, the stats API)."""

    def __init__(self, *args: Any, api: Mapping[str, RouteSpec] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.api = dict(api or {})  # path (below the root path) -> its route
        self.allowed_hosts: frozenset[str] | None = None  # Host names answered (host_guard)
        # other origins whose pages' writes are served (host_guard); None: any
        self.page_origins: frozenset[str] | None = None

    def _refusal(self, scope: Scope) -> GatewayError | None:
        """Why the host guard refuses this request (a `Host` not answered, a page of another
        origin writing to an open gateway), or None."""
        hosts, origins = self.allowed_hosts, self.page_origins
        if hosts is not None and not host_allowed(scope["headers"], hosts):
            return MISDIRECTED
        if origins is not None and scope["method"] not in _READS and cross_origin(
                scope["headers"], origins):
            return CROSS_ORIGIN
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (err := self._refusal(scope)) is not None:
            await _refused(scope, err)(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.api.get(_route_path(scope))
            if route is not None:
                scope["app"] = self
                response = await handle(self.state.gateway, Request(scope, receive, send), route)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig, backend: Backend | None = None) -> Starlette:
    """The gateway app. With `backend` None the app builds (and on shutdown closes) its own:
    the embedded engine, or the upstream pool when `config.upstreams` is set. A backend passed
    in belongs to the caller, who closes it."""
    registry = Registry()
    owns_backend = backend is None
    # the database first: one that cannot be opened fails before an engine is loaded
    store = RecordStore(config.db_url, batch_size=config.stats_batch_size,
                        flush_interval_s=config.stats_flush_interval_s,
                        max_queue=config.stats_max_queue, spill_path=config.stats_spill_path)
    if backend is None:
        try:
            backend = _default_backend(config, registry)
        except BaseException:
            store.close()
            raise
    elif callable(bind := getattr(backend, "bind_metrics", None)):
        bind(registry)  # a pool built outside the app reports on the app's /metrics
    # no credential in a logged URL, whichever server runs the app
    access_log.install([*config.api_keys, config.admin_key or ""])
    # freed large bodies go back to the OS (not beside the embedded engine: see malloc_threshold)
    memory.tune_malloc(config.malloc_threshold(embedded=backend.name == "embedded"))
    gw = Gateway(config=config, backend=backend, store=store, metrics=GatewayMetrics(registry),
                 lint=LintStage(config.lint_learner_bytes))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await _warm_up(backend)
            yield
        finally:
            if not await gw.records_written(SHUTDOWN_RECORDS_S):
                log.warning("%d requests in flight at shutdown left no record", gw.unrecorded)
            if owns_backend:
                await backend.aclose()
            store.close()

    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    api = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/messages": MESSAGES,
           "/v1/responses": RESPONSES}
    app = GatewayApp(routes=routes, lifespan=lifespan, api=api,
                     exception_handlers={404: _no_such_endpoint, 405: _no_such_endpoint})
    app.router.routes.extend(_extra_routes(lambda: app.state))
    app.allowed_hosts = config.allowed_hosts
    app.page_origins = None if config.api_keys else config.page_origins
    app.state.config = config
    app.state.backend = backend
    app.state.store = store
    app.state.metrics = registry
    app.state.gateway_metrics = gw.metrics
    app.state.store_metrics = StoreMetrics(registry, store)
    app.state.gateway = gw
    app.state.auth = gw.auth
    app.state.learners = gw.lint.learners
    return app


__all__ = ["create_app", "prefixgate_headers"]
