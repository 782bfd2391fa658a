"""Upstream replica pools: the `Backend` the gateway uses when `--upstream` is given.

`ReplicaPool` tokenizes each request once (prompt_lint's token layout, for the shadow caches),
asks the `Router` for a replica, streams the answer from it, and completes the `Final` with the
shadow cache's prediction beside the upstream's own report (gateway.backends.predicted_usage).
A replica fault before any text was sent fails over to another replica (not a timeout waiting
for an answer to a request the replica was sent: it may be running it); after that it reaches
the client as an error (an SSE error event when streaming). A one-replica pool whose cache
model steers nothing sends first and tokenizes while the upstream works
(`sends_before_tokens`); its whole (non-streaming) answers, once the replica has shown that it
reports its own prompt and cached tokens, are handed on before the tokens are computed at all:
such an answer says what the provider reported and needs no prediction, so the shadow's whole
part (tokens, prediction, recording, learning) runs after it, and the prediction reaches the
request's record through `Final.late` (a stream's head, or an answer without the provider's
figures, still waits for the prediction). The shadow's bookkeeping (recording the prompt,
learning from the report) and the pool's metrics (gateway.backends.pool_metrics) wait until the
item they follow is handed on, so no answer waits for them; closing the stream still runs them.
gateway.backends.providers builds the pools from the configuration.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

import anyio

from gateway.backends.anthropic_upstream import AnthropicUpstream
from gateway.backends.model_listing import ModelListing
from gateway.backends.openai_upstream import OpenAIUpstream
from gateway.backends.pool_metrics import PoolMetrics
from gateway.backends.predicted_usage import (
    answers_first,
    final_usage,
    in_shadow_tokens,
    predicted_hit,
    reports_figures,
    stream_head_usage,
)
from gateway.backends.router import Replica, Route, Router, RouterConfig, unique_names
from gateway.backends.upstream import UpstreamBackend
from gateway.backends.upstream_errors import fails_over, is_replica_fault
from gateway.body import INLINE_BYTES, text_chars
from gateway.config import AUTO_KIND
from gateway.count_tokens import estimate
from gateway.evolve import evolve
from gateway.llama_slots import SlotShadow
from gateway.metrics import Registry
from gateway.overlap import cpu_work, first_while_sent
from gateway.shadow import NO_PROMPT, CacheModel, Prompt, request_prompt
from gateway.shadow_models import cache_model_for
from gateway.types import (
    BackendError,
    ChatRequest,
    Final,
    LateUsage,
    TextDelta,
    TokenCount,
)
from gateway.upstream_detect import detect_kind, log_detection
from prompt_lint.memo import LOCK as MEMO_LOCK

log = logging.getLogger("prefixgate.upstream")
CANCELLED = "cancelled"  # the outcome of an upstream call the gateway stopped reading early


class ReplicaPool:
    """Replicas of one upstream kind behind one `Backend`."""

    def __init__(
        self, kind: str, backends: Sequence[UpstreamBackend], *,
        router: RouterConfig | None = None, shadow: Sequence[CacheModel] | None = None,
        metrics: Registry | None = None, inline_bytes: int = INLINE_BYTES,
    ) -> None:
        if not backends:
            raise ValueError("a replica pool needs at least one upstream")
        models = list(shadow) if shadow is not None else [
            cache_model_for(_model_kind(kind), b.options.url) for b in backends]
        if len(models) != len(backends):
            raise ValueError("need one cache model per replica")
        self.name = kind
        self.api = "anthropic" if kind == "anthropic" else "openai"
        names = unique_names([b.replica for b in backends])
        self.router = Router([Replica(n, b, m)
                              for n, b, m in zip(names, backends, models, strict=True)], router)
        self.metrics: PoolMetrics | None = None
        self.inline_bytes = inline_bytes  # late tokenizing: on the loop up to this size
        self._probed = kind not in ("llamacpp", AUTO_KIND)
        self._probe_lock = anyio.Lock()
        # a generic kind: learn the server from its responses too
        self._detect = shadow is None and kind in ("openai", AUTO_KIND)
        self._auto = shadow is None and kind == AUTO_KIND
        self._listing = ModelListing([r.backend.list_models for r in self.router.replicas])
        if metrics is not None:
            self.bind_metrics(metrics)

    def bind_metrics(self, registry: Registry) -> None:
        """Register this pool's series on `registry` (the app's, for a pool built outside it)."""
        self.metrics = PoolMetrics(registry, self)

    def models(self) -> list[str]:
        """The replicas' configured model ids, or ["*"] (any model is passed upstream)."""
        seen = {m: None for r in self.router.replicas for m in r.backend.models()}
        return list(seen) or ["*"]

    def kv_pages(self) -> tuple[int, int] | None:
        return None

    async def list_models(self) -> list[str]:
        """GET /v1/models: the configured ids, else what the replicas list, in order, once
        (gateway.backends.model_listing: asked at most every few seconds)."""
        configured = self.models()
        if configured != ["*"]:
            return configured
        return await self._listing.ids()

    def prepare(self, req: ChatRequest) -> ChatRequest:
        """`req` with its shadow-cache tokens (call under prompt_lint's lock, off the loop);
        unchanged when the pool sends before tokenizing (`sends_before_tokens`)."""
        if self.sends_before_tokens():
            return req
        return evolve(req, shadow_prompt=request_prompt(req))

    def sends_before_tokens(self) -> bool:
        """One replica whose cache model steers nothing: neither the route nor the body depends
        on the prompt's tokens, so they are computed while the upstream works."""
        replicas = self.router.replicas
        return self._probed and len(replicas) == 1 and not replicas[0].shadow.steers

    def family_in_body(self, req: ChatRequest) -> bool:
        return any(r.backend.family_in_body(req) for r in self.router.replicas)

    async def count_tokens(self, req: ChatRequest) -> TokenCount:
        """The first routable replica's own count: an Anthropic upstream's of an Anthropic
        client's request (its errors are the caller's), a llama.cpp or vLLM server's through
        its tokenizer; for other servers or requests, or when the tokenizer does not answer,
        prefixgate's own count, marked estimated."""
        if not self._probed:
            await self._probe()  # an `auto` replica's kind says which endpoint it has
        replicas = self.router.candidates(set())
        backend = replicas[0].backend if replicas else None
        if isinstance(backend, AnthropicUpstream) and req.provider == "anthropic":
            return TokenCount(await backend.count_tokens(req), estimated=False)
        if isinstance(backend, OpenAIUpstream):
            counted = await backend.count_tokens(req)
            if counted is not None:
                return TokenCount(counted, estimated=False)
        return await estimate(req, self.inline_bytes)

    async def aclose(self) -> None:
        for r in self.router.replicas:
            await r.backend.aclose()

    async def stream(self, req: ChatRequest) -> AsyncGenerator[TextDelta | Final, None]:
        if not self._probed:
            await self._probe()
        # tokenized and packed once for every replica, off the event loop: by `prepare` in
        # the gateway's lint call, else here in a worker thread (prompt_lint's shared memos
        # are guarded by one lock), or, for a pool that sends first, while the upstream works
        prompt = req.shadow_prompt
        if prompt is None and not self.sends_before_tokens():
            prompt = await anyio.to_thread.run_sync(_prompt_of, req)
        tried: set[str] = set()
        while True:
            route = self.router.choose(prompt or NO_PROMPT, req.namespace, tried)
            if route is None:
                raise BackendError(503, "no upstream replica is available",
                                   kind="upstream_unavailable")
            tried.add(route.replica.name)
            emitted = False
            try:
                async with aclosing(self._attempt(req, prompt, route)) as attempt:
                    async for item in attempt:
                        emitted = True
                        yield item
                return
            except BackendError as err:
                if emitted or not fails_over(err) or len(tried) >= len(self.router.replicas):
                    raise

    async def _probe(self) -> None:
        """Once, before the first request: detect each replica's kind (`--upstream URL`) and
        read llama.cpp servers' slot counts from `/props`."""
        async with self._probe_lock:
            if self._probed:
                return
            if self._auto:
                self._auto = False
                await self._detect_kinds()  # reads the slot count with the kind
            else:
                await self._probe_slots()
            self._probed = True

    async def _detect_kinds(self) -> None:
        for r in self.router.replicas:
            backend = r.backend
            if not isinstance(backend, OpenAIUpstream):
                continue
            found = await detect_kind(backend.options.url, backend.get_json)
            r.shadow = cache_model_for(found.kind, backend.options.url, found.slots or 1)
            backend.server_kind = found.kind
            log_detection(r.name, backend.options.url, found, type(r.shadow).__name__)

    async def _probe_slots(self) -> None:
        """llama.cpp servers: read each replica's slot count from `/props`."""
        for r in self.router.replicas:
            if isinstance(r.shadow, SlotShadow) and isinstance(r.backend, OpenAIUpstream):
                slots = await r.backend.total_slots()
                if slots:
                    r.shadow.resize(slots)

    async def _attempt(
        self, req: ChatRequest, prompt: Prompt | None, route: Route
    ) -> AsyncGenerator[TextDelta | Final, None]:
        replica, ns, started = route.replica, req.namespace, prompt
        replica.inflight += 1
        answered = False  # a Final went out: the call is counted "ok" (PoolMetrics.final)
        if req.dispatch is not None:  # the request's record names the replica, however it ends
            req.dispatch.replica = replica.name
        try:
            if started is not None:
                if isinstance(replica.shadow, SlotShadow):  # sent once a slot is free
                    await replica.shadow.slot_free()
                    route = route._replace(matched=replica.shadow.match_length(started, ns))
                fields = replica.shadow.upstream_fields(started, ns)
                if fields:
                    req = evolve(
                        req, upstream_fields={**req.upstream_fields, **fields})
            async with aclosing(replica.backend.stream(req)) as upstream:
                item, prompt, route = await self._head(upstream, req, prompt, route)
                if prompt is None:  # a whole answer with the upstream's own figures
                    assert isinstance(item, Final)
                    late, shadow = LateUsage(), replica.shadow
                    answered = True
                    try:
                        yield self._answered(item, replica, late)
                    finally:  # the shadow's part, once the answer is on its way
                        if replica.shadow is shadow:  # not replaced by a detected kind's
                            await self._shadow_after(req, route, item, late)
                    return
                predicted = predicted_hit(replica, route)
                # the shadow's bookkeeping waits until the item it follows is on its way
                after: list[Callable[[], None]] = []
                if item is not None:  # the upstream has prefilled the prompt by now
                    after.append(functools.partial(replica.shadow.record, prompt, ns))
                    if not isinstance(item, Final):
                        item = evolve(item, usage=stream_head_usage(item, replica, prompt,
                                                                   predicted))
                try:
                    while item is not None:
                        if isinstance(item, Final):
                            item = self._complete(self._answered(item, replica), replica,
                                                  prompt, ns, predicted, after)
                            if started is not None:  # the upstream is done with it now
                                after.append(functools.partial(replica.shadow.finished,
                                                               started, ns))
                                started = None
                            answered = True
                        yield item
                        _settle(after)
                        item = await _next(upstream)
                finally:
                    _settle(after)  # closed after its last item (or on a fault): still once
        except BackendError as err:
            err.replica = err.replica or replica.name
            if is_replica_fault(err):  # the client's message does not name it; the log does
                log.warning("upstream replica %s failed request %s: %s", replica.name,
                            req.request_id, err.message)
                replica.mark_failed(self.router.config, self.router.clock(), err.wait_s)
            if self.metrics:
                self.metrics.requests.inc(replica=replica.name, outcome=err.kind)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            # the gateway stopped reading before the answer (its client left, a shutdown):
            # still a call the replica took, counted so every call has an outcome
            if self.metrics and not answered:
                self.metrics.requests.inc(replica=replica.name, outcome=CANCELLED)
            raise
        finally:
            replica.inflight -= 1
            if started is not None:
                replica.shadow.finished(started, ns)

    async def _head(self, upstream: AsyncGenerator[TextDelta | Final, None], req: ChatRequest,
                    prompt: Prompt | None, route: Route
                    ) -> tuple[TextDelta | Final | None, Prompt | None, Route]:
        """The upstream's first item (None: it sent none), the prompt's tokens and the route
        scored with them. Tokens left for later (prompt None) are computed once the request
        is on its way, while the upstream works; or, for a whole answer from a replica that
        reports its own figures (`answers_first`), after the answer: prompt None is returned
        when that answer came with them (`reports_figures`)."""
        if prompt is not None:
            self._count(route)
            return await _next(upstream), prompt, route
        if answers_first(req, route.replica):
            item = await _next(upstream)
            if reports_figures(item):
                return item, None, route
            late, scored = await self._tokens(req, route)  # the answer needs the prediction
            return item, late, scored
        item, (late, scored) = await first_while_sent(lambda: _next(upstream),
                                                      lambda: self._tokens(req, route))
        return item, late, scored

    async def _tokens(self, req: ChatRequest, route: Route) -> tuple[Prompt, Route]:
        """The prompt's tokens, computed now, and its route scored with them (one replica,
        `sends_before_tokens`: choosing again scores the same one)."""
        size = text_chars(req.messages, req.prompt)
        late = await cpu_work(size, self.inline_bytes, request_prompt, req)
        scored = self.router.choose(late, req.namespace) or route
        self._count(scored)
        return late, scored

    async def _shadow_after(self, req: ChatRequest, route: Route, answer: Final,
                            late: LateUsage) -> None:
        """The shadow's part of an answer sent without it: tokens, prediction, recording and
        learning; the usage with the prediction is left in `late` for the request's record."""
        replica = route.replica
        try:
            prompt, scored = await self._tokens(req, route)
            after: list[Callable[[], None]] = [
                functools.partial(replica.shadow.record, prompt, req.namespace)]
            done = self._complete(answer, replica, prompt, req.namespace,
                                  predicted_hit(replica, scored), after)
            late.usage = done.usage
            _settle(after)
        except Exception:  # noqa: BLE001 - the answer is out; its bookkeeping must not fail it
            log.exception("the shadow cache's part of an answer failed")

    def _count(self, route: Route) -> None:
        if self.metrics:
            self.metrics.routes.inc(replica=route.replica.name, reason=route.reason)

    def _detected(self, replica: Replica) -> None:
        """A replica of the generic `openai` kind that answers like llama.cpp's server gets
        the slot model (its slot count is read from `/props` before the next request)."""
        backend = replica.backend
        if (isinstance(backend, OpenAIUpstream) and backend.server_kind == "llamacpp"
                and not isinstance(replica.shadow, SlotShadow)):
            replica.shadow = cache_model_for("llamacpp", backend.options.url)
            self._probed = False

    def _answered(self, final: Final, replica: Replica, late: LateUsage | None = None
                  ) -> Final:
        """The upstream's answer as the pool hands it on: the replica's health and what it
        reports noted; `late`: the holder of the usage completed after it is sent (its
        cached tokens are the reported ones until then, its prediction unknown)."""
        replica.mark_ok()
        replica.served += 1
        replica.reports_figures = reports_figures(final)
        if self._detect:
            self._detected(replica)
        return evolve(final, replica=replica.name, late=late)

    def _complete(self, final: Final, replica: Replica, prompt: Prompt, namespace: str,
                  predicted: int, after: list[Callable[[], None]]) -> Final:
        """`final` with the prediction beside the upstream's usage; the shadow's learning and
        the metrics are left in `after` (done once the answer is on its way)."""
        usage = final_usage(final.usage, prompt, predicted)
        if usage.reported_cached_tokens is not None:
            reported = in_shadow_tokens(usage.reported_cached_tokens, len(prompt),
                                        usage.prompt_tokens)
            after.append(functools.partial(replica.shadow.learn, prompt, namespace, predicted,
                                           reported))
        final = evolve(final, usage=usage, replica=replica.name)
        if self.metrics:
            after.append(functools.partial(self.metrics.final, replica.name, final))
        return final


def _settle(after: list[Callable[[], None]]) -> None:
    """Run the bookkeeping calls left in `after`, in order, each once."""
    while after:
        after.pop(0)()


async def _next(stream: AsyncGenerator[TextDelta | Final, None]) -> TextDelta | Final | None:
    """The stream's next item, None at its end."""
    return await anext(stream, None)


def _model_kind(kind: str) -> str:
    """The cache model a pool starts with: an undetected (`auto`) replica gets the generic
    OpenAI-compatible one until its probe answers."""
    return "openai" if kind == AUTO_KIND else kind


def _prompt_of(req: ChatRequest) -> Prompt:
    with MEMO_LOCK:
        return request_prompt(req)
