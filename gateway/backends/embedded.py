"""The embedded backend: prefixgate's own paged-KV engine (SmolLM2-135M-Instruct by default).

Messages and tools go through the model's chat template (`engine`'s tokenizer writes tool
definitions into the system message when the template has no tool support, in the
`<tool_call>{json}</tool_call>` convention); the output is parsed back into OpenAI tool calls by
`gateway.tool_calls`; streamed calls come out as `ToolCallDelta` pieces (`gateway.tool_stream`).
A request's `OutputConstraint` (tool_choice, response_format) becomes the engine's grammar, so
forced tool calls and JSON documents always parse. `cached_tokens` is what the engine actually
reused from its radix cache in the request's namespace. Closing the stream early (client
disconnect) aborts the engine request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import anyio

from engine import (
    AsyncEngine,
    EngineUnavailable,
    InvalidRequest,
    RequestError,
    RequestOutput,
    RequestTooLong,
    SamplingParams,
    StreamDelta,
)
from engine.tokenizer import Tokenizer
from gateway import tool_calls
from gateway.config import GatewayConfig
from gateway.tool_stream import ToolCallStream
from gateway.types import BackendError, ChatRequest, Final, TextDelta, TokenCount, Usage

log = logging.getLogger("prefixgate.embedded")
FINISH_REASONS = {"stop": "stop", "length": "length"}
ABORTED = "the engine aborted the request before its answer was complete (it is shutting down)"
REQUEST_PARAMS = {"prompt": "messages", "messages": "messages", "request_id": "request_id"}
"""The client-facing field of each engine `InvalidRequest.field` (a chat request's)."""


def engine_error(exc: Exception, prompt_param: str = "messages") -> BackendError:
    """The client-facing error of an engine error, chosen by its type (never by its text);
    `prompt_param` is the field the client sent its prompt in ("prompt" on the legacy
    route)."""
    if isinstance(exc, RequestTooLong):
        return BackendError(400, str(exc), kind="context_length_exceeded", param=prompt_param)
    if isinstance(exc, InvalidRequest):
        param = REQUEST_PARAMS.get(exc.field, exc.field)
        return BackendError(400, str(exc), param=prompt_param if param == "messages" else param)
    if isinstance(exc, RequestError):
        return BackendError(500, f"engine error: {exc}")
    if isinstance(exc, EngineUnavailable):
        return BackendError(503, f"engine unavailable: {exc}")
    raise TypeError(f"not an engine error: {type(exc).__name__}") from exc


class EmbeddedBackend:
    """Serves ChatRequests from an in-process `engine.AsyncEngine` built from `config.engine`."""

    name = "embedded"

    def __init__(self, config: GatewayConfig, *, async_engine: AsyncEngine | None = None) -> None:
        self.config = config
        self.owns_engine = async_engine is None
        self.engine: AsyncEngine = async_engine or AsyncEngine(config.engine)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def models(self) -> list[str]:
        return list(self.config.served_models)

    def kv_pages(self) -> tuple[int, int] | None:
        """(pages held by running requests or the prefix cache, pages in the pool)."""
        stats = self.engine.stats()
        return stats.pages_total - stats.pages_free, stats.pages_total

    async def warm_up(self) -> None:
        """The grammar tokenizer (~0.5 s for SmolLM2's vocabulary): agents send tools, and
        a constrained request would otherwise build it first. A vocabulary llguidance cannot
        take does not stop the server: unconstrained requests are served, and a constrained
        one gets the error."""
        try:
            await anyio.to_thread.run_sync(self.engine.engine.grammar.warm)
        except Exception as exc:  # noqa: BLE001 - logged; the request that needs it reports it
            log.warning("grammar tokenizer not built (%s); tool calls and response_format "
                        "will fail", exc)

    async def aclose(self) -> None:
        if self.owns_engine:
            await self.engine.shutdown()

    async def count_tokens(self, req: ChatRequest) -> TokenCount:
        """Exact: the prompt's ids through the template (off the loop), as `stream` prefills."""
        ids = await anyio.to_thread.run_sync(self.prompt_ids, req)
        return TokenCount(len(ids), estimated=False)

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        """Token ids of the request: the raw prompt, or messages + tools through the template
        (an Anthropic request's final assistant message is the start of the answer, which
        continues it)."""
        try:
            if req.prompt is not None:
                return list(self.tokenizer.encode(req.prompt))
            tools = list(req.tools) or None
            return list(self.tokenizer.apply_chat_template(
                list(req.messages), tools=tools, continue_final=_continues(req)))
        except InvalidRequest as exc:  # template errors (role order, ...) are the client's input
            raise engine_error(exc, _prompt_param(req)) from exc

    def sampling_params(self, req: ChatRequest) -> SamplingParams:
        o = req.options
        try:
            return SamplingParams(
                max_tokens=o.max_tokens or self.config.default_max_tokens,
                temperature=1.0 if o.temperature is None else o.temperature,
                top_p=1.0 if o.top_p is None else o.top_p,
                top_k=o.top_k or 0,
                seed=None if o.seed is None else o.seed % (2**63),
                stop=o.stop,
                stop_in_text_before=_free_text_until(req),
                presence_penalty=o.presence_penalty,
                frequency_penalty=o.frequency_penalty,
                logit_bias=o.logit_bias,
                grammar=req.constraint.grammar if req.constraint is not None else None,
            )
        except ValueError as exc:  # SamplingParams checks its own fields
            raise BackendError(400, str(exc), param="sampling") from exc

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        if req.options.max_tokens == 0:
            async for item in self._prefill_only(req):
                yield item
            return
        ids = await anyio.to_thread.run_sync(self.prompt_ids, req)  # template: off the loop
        params = self.sampling_params(req)
        filt = ToolCallStream(req.request_id) if _calls_possible(req) else None
        first = True
        saved_ms: float | None = None  # what the head said, so the final says the same
        tokens = 0  # generated since the last delta yielded (held text still counts)
        try:
            async for delta in self.engine.stream(ids, params, namespace=req.namespace,
                                                  request_id=req.request_id):
                if delta.output is not None and delta.output.finish_reason == "abort":
                    raise EngineUnavailable(ABORTED)  # a cut answer is not a finished one
                tokens += len(delta.token_ids)
                text, calls = filt.feed(delta.text) if filt else (delta.text, [])
                saved_ms = delta.prefill_saved_ms if saved_ms is None else saved_ms
                final = None
                if delta.output is not None:
                    tail, final = self._final(req, saved_ms, delta.output, filt)
                    text += tail
                if text or calls or first:
                    early = _early_usage(len(ids), delta) if first else None
                    yield TextDelta(text, usage=early, tool_calls=tuple(calls), tokens=tokens)
                    first, tokens = False, 0
                if final is not None:
                    yield final
                    return
        except (InvalidRequest, RequestError, EngineUnavailable) as exc:
            raise engine_error(exc, _prompt_param(req)) from exc

    async def _prefill_only(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        """`max_tokens` 0 (Anthropic's cache pre-warming): the prompt is prefilled into the
        prefix cache and nothing is answered. The engine samples one token at least; it is
        dropped, and the answer says 0 output tokens."""
        ids = await anyio.to_thread.run_sync(self.prompt_ids, req)
        params = replace(self.sampling_params(req), max_tokens=1, grammar=None)
        first, saved_ms = True, 0.0
        try:
            async for delta in self.engine.stream(ids, params, namespace=req.namespace,
                                                  request_id=req.request_id):
                out = delta.output
                if out is not None and out.finish_reason == "abort":
                    raise EngineUnavailable(ABORTED)
                if first:
                    saved_ms = delta.prefill_saved_ms
                    yield TextDelta("", usage=_early_usage(len(ids), delta), tokens=0)
                    first = False
                if out is not None:
                    usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=0,
                                  cached_tokens=out.cached_tokens, ttft=out.ttft,
                                  prefill_saved_ms=saved_ms)
                    yield Final(text="", tool_calls=(), finish_reason="length", usage=usage)
                    return
        except (InvalidRequest, RequestError, EngineUnavailable) as exc:
            raise engine_error(exc) from exc

    def _final(
        self, req: ChatRequest, saved_ms: float, out: RequestOutput,
        filt: ToolCallStream | None,
    ) -> tuple[str, Final]:
        tail = ""
        finish = FINISH_REASONS.get(out.finish_reason, "stop")
        if filt is not None:
            tail, parsed = filt.finish(out.text, cut=finish == "length")
            text, calls = parsed.text, parsed.tool_calls
        else:
            text, calls = out.text, ()
        asked = req.options.max_tokens or self.config.default_max_tokens
        if finish == "length" and out.completion_tokens < asked:
            finish = "context_window"  # the sequence reached the context's end first
        if calls and finish == "stop":
            finish = "tool_calls"
        usage = Usage(
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens, ttft=out.ttft, tpot=out.tpot,
            prefill_saved_ms=saved_ms,
            spec_draft_tokens=out.draft_tokens, spec_accepted_tokens=out.accepted_tokens,
        )
        matched = out.stop_string if finish == "stop" else None
        return tail, Final(text=text, tool_calls=calls, finish_reason=finish, usage=usage,
                           stop_sequence=matched)


def _early_usage(prompt_tokens: int, delta: StreamDelta) -> Usage:
    """Usage known after prefill: prompt and cached tokens (for headers, message_start)."""
    cached = delta.output.cached_tokens if delta.output is not None else delta.cached_tokens
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=cached,
                 prefill_saved_ms=delta.prefill_saved_ms)


def _free_text_until(req: ChatRequest) -> str | None:
    """Where stop strings stop applying: a forced call or a JSON document is grammar-shaped from
    its first token (""), an optional call from its opening tag on; None when nothing is."""
    c = req.constraint
    if c is None:
        return None
    return "" if c.tool_calls_required or c.json_document else tool_calls.OPEN


def _prompt_param(req: ChatRequest) -> str:
    """The field that holds the request's prompt: "prompt" (legacy route) or "messages"."""
    return "messages" if req.prompt is None else "prompt"


def _continues(req: ChatRequest) -> bool:
    """Whether the answer continues the last message: Anthropic's prefill (a final assistant
    message); OpenAI's chat completions always answer in a new turn."""
    return req.provider == "anthropic" and bool(req.messages) and \
        req.messages[-1].get("role") == "assistant"


def _calls_possible(req: ChatRequest) -> bool:
    """Tools given and tool_choice not "none" (OpenAI) / {"type": "none"} (Anthropic)."""
    choice = req.body.get("tool_choice")
    none = choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")
    return bool(req.tools) and not none


__all__ = ["EmbeddedBackend", "engine_error"]
