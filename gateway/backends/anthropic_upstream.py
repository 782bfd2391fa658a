"""Anthropic upstream (the Messages API), implementing the `Backend` protocol.

An Anthropic-format client's body is forwarded with `cache_control` breakpoints added at the
stable boundary; an OpenAI-format client is converted first. Streams are passed on delta by
delta. An Anthropic client gets the upstream's thinking and redacted_thinking blocks as they
came (whole: the upstream's content verbatim; streamed: their events, with the tool_use blocks
streamed in place), text blocks with `citations` the same way, and its `anthropic-beta` header
is passed on; an OpenAI client gets no thinking and no citations (chat completions has no field
for them). The upstream's cache report is
`usage.cache_read_input_tokens`; Anthropic's `input_tokens` excludes cached and cache-written
tokens, so the prompt size is their sum.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, NamedTuple

import httpx

from gateway.backends.anthropic_format import place_cache_breakpoints, to_anthropic_body
from gateway.backends.http1_request import PostTemplate, post_template
from gateway.backends.upstream import StreamClock, UpstreamBackend
from gateway.backends.upstream_errors import error_object, loads_event, token_count
from gateway.backends.upstream_http import (
    Item,
    UpstreamOptions,
    dumps_body,
    fetch_json,
    iter_sse,
    whole_as_stream,
)
from gateway.evolve import evolve
from gateway.types import BackendError, ChatRequest, Final, TextDelta, ToolCallDelta, Usage

API_VERSION = "2023-06-01"
# what the Messages API's count_tokens endpoint takes of a Messages body
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers")
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
           "tool_use": "tool_calls", "refusal": "refusal", "pause_turn": "pause_turn",
           "model_context_window_exceeded": "context_window"}
#: content blocks the neutral types have no field for, passed to an Anthropic client as they came
#: (a text block with `citations` too: `passed_block`)
PASSED_BLOCKS = ("thinking", "redacted_thinking")


def passed_block(block: Any) -> bool:
    """True for an answer's block an Anthropic client gets as the upstream sent it: thinking,
    redacted_thinking, and text with `citations` (the answer's sources in a document the
    request carried), which the neutral text cannot hold."""
    if not isinstance(block, dict):
        return False
    kind = block.get("type")
    return kind in PASSED_BLOCKS or (kind == "text" and block.get("citations") is not None)
_BETA_TEMPLATES = 32  # distinct anthropic-beta values whose request templates are kept
# a passed block's first event: its fields empty, as the Messages API starts it (the deltas
# fill them in); a block not named here starts whole (redacted_thinking, as the API sends it)
_EMPTY_START: dict[str, dict[str, Any]] = {"thinking": {"thinking": "", "signature": ""},
                                           "text": {"text": "", "citations": []}}  # cited text


def block_events(block: dict[str, Any], index: int) -> tuple[dict[str, Any], ...]:
    """A whole answer's passed block (`passed_block`) as the stream events the Messages API
    sends for it: its start, its deltas (thinking and signature; text and one per citation),
    its stop."""
    kind = block.get("type")
    deltas: list[dict[str, Any]] = []
    if kind == "thinking":
        deltas = [{"type": "thinking_delta", "thinking": str(block.get("thinking") or "")},
                  {"type": "signature_delta", "signature": str(block.get("signature") or "")}]
    elif kind == "text":
        deltas = [{"type": "text_delta", "text": str(block.get("text") or "")}] + [
            {"type": "citations_delta", "citation": c} for c in block.get("citations") or ()]
    return (
        {"type": "content_block_start", "index": index,
         "content_block": {**block, **_EMPTY_START.get(str(kind), {})}},
        *({"type": "content_block_delta", "index": index, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": index})


def restream_blocks(final: Final) -> tuple[Item, ...]:
    """A whole answer with blocks passed to an Anthropic client as they came (thinking,
    citations: `Final.provider_content`) as the items its stream yields: every block in its
    place, a passed one as its events, text as text, tool_use as its call's pieces, then the
    Final; another answer as `whole_as_stream` yields it."""
    if final.provider_content is None:
        return whole_as_stream(final)
    items: list[Item] = []
    calls = 0
    for index, block in enumerate(final.provider_content):
        kind = block.get("type")
        if kind == "tool_use":
            call = _tool_call(block)
            items.append(TextDelta("", tool_calls=(
                ToolCallDelta(calls, "", id=call["id"], name=call["function"]["name"]),
                ToolCallDelta(calls, call["function"]["arguments"]))))
            calls += 1
        elif kind == "text" and not passed_block(block):
            if block.get("text"):
                items.append(TextDelta(str(block["text"])))
        else:  # thinking, cited text, a block the neutral stream has no field for
            items.append(TextDelta("", provider_events=block_events(block, index)))
    return (*items, final)


class AnthropicUsage(NamedTuple):
    """Token counts as Anthropic reports them, folded into OpenAI's meaning."""

    prompt_tokens: int  # input + cache read + cache write
    completion_tokens: int
    reported_cached_tokens: int | None
    cache_write_tokens: int = 0  # cache_creation_input_tokens: billed apart from input


def read_usage(usage: Any, completion: int | None = None) -> AnthropicUsage:
    """Parse an Anthropic `usage` object."""
    if not isinstance(usage, dict):
        return AnthropicUsage(0, completion or 0, None)
    read = usage.get("cache_read_input_tokens")
    prompt = sum(token_count(usage.get(k), f"usage.{k}") for k in
                 ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    out = completion if completion is not None else token_count(
        usage.get("output_tokens"), "usage.output_tokens")
    cached = None if read is None else token_count(read, "usage.cache_read_input_tokens")
    written = token_count(usage.get("cache_creation_input_tokens"),
                          "usage.cache_creation_input_tokens")
    return AnthropicUsage(prompt, out, cached, written)


def build_body(req: ChatRequest) -> dict[str, Any]:
    """The Messages body sent upstream, with cache breakpoints placed."""
    if req.provider == "anthropic" and req.prompt is None:
        body = dict(req.body)
        body["model"] = req.model
        # prefixgate's own field (the gateway's cache namespace): the Messages API refuses
        # a field it does not know
        body.pop("cache_salt", None)
    else:
        body = to_anthropic_body(req)
    body["stream"] = req.stream
    return place_cache_breakpoints(body)


def passes_blocks(req: ChatRequest) -> bool:
    """True for an Anthropic client's Messages request (its answer's thinking blocks are
    passed on as they came)."""
    return req.provider == "anthropic" and req.prompt is None


def _tool_call(block: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    args = arguments if arguments is not None else json.dumps(block.get("input") or {})
    return {"id": str(block.get("id") or ""), "type": "function",
            "function": {"name": str(block.get("name") or ""), "arguments": args or "{}"}}


def _early_usage(start_usage: dict[str, Any]) -> Usage | None:
    """Usage known at the first delta: Anthropic reports the prompt side in message_start."""
    if not start_usage:
        return None
    u = read_usage(start_usage, 0)
    return Usage(u.prompt_tokens, 0, u.reported_cached_tokens or 0,
                 reported_cached_tokens=u.reported_cached_tokens,
                 cache_write_tokens=u.cache_write_tokens)


class _StreamState:
    """One streamed message: text, tool-use blocks by index, stop reason, usage. The tool_use
    pieces (`calls`) of the last event are left for the caller to pass on as they come (with
    `live_calls`: a chat request's, so a long call's client sees it grow); with `passthrough`
    (an Anthropic client) the events of thinking blocks (`events`) too. An OpenAI client's
    call whose input streamed no fragment gets `{}` as its block ends (its arguments are
    never empty text)."""

    def __init__(self, passthrough: bool = False, live_calls: bool = False) -> None:
        self.text: list[str] = []
        self.tools: dict[int, tuple[dict[str, Any], list[str]]] = {}
        self.ordinals: dict[int, int] = {}  # tool_use block index -> its call's ordinal
        self.passthrough = passthrough
        self.live_calls = live_calls or passthrough
        self.passed: set[int] = set()  # indexes of the blocks passed on as they came
        self.events: list[dict[str, Any]] = []
        self.calls: list[ToolCallDelta] = []
        self.stop: str | None = None
        self.stop_sequence: str | None = None
        self.start_usage: dict[str, Any] = {}
        self.output_tokens: int | None = None
        self.deltas = 0
        self.stopped = False

    def take(self, kind: str, event: dict[str, Any]) -> str:
        """Fold one event in; return its new text."""
        if kind == "message_start":
            self.start_usage = dict((event.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = event.get("content_block") or {}
            index = token_count(event.get("index"), "index")
            if block.get("type") == "tool_use":
                self.tools[index] = (block, [])
                self.ordinals[index] = len(self.ordinals)
                if self.live_calls:
                    self.calls.append(ToolCallDelta(self.ordinals[index], "",
                                                    id=str(block.get("id") or ""),
                                                    name=str(block.get("name") or "")))
            elif self.passthrough and passed_block(block):
                self.passed.add(index)
                self.events.append(event)
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            index = token_count(event.get("index"), "index")
            if index in self.passed:  # a passed text block's text is the answer's too
                self.events.append(event)
                if delta.get("type") == "text_delta":
                    self.text.append(str(delta.get("text") or ""))
            elif delta.get("type") == "text_delta":
                return str(delta.get("text") or "")
            elif delta.get("type") == "input_json_delta":
                slot = self.tools.get(index)
                if slot is not None:
                    piece = str(delta.get("partial_json") or "")
                    slot[1].append(piece)
                    if self.live_calls and piece:
                        self.calls.append(ToolCallDelta(self.ordinals[index], piece))
        elif kind == "content_block_stop":
            index = token_count(event.get("index"), "index")
            if index in self.passed:
                self.events.append(event)
            self.close_call(index)
        elif kind == "message_delta":
            delta = event.get("delta") or {}
            self.stop = delta.get("stop_reason") or self.stop
            self.stop_sequence = delta.get("stop_sequence") or self.stop_sequence
            usage = event.get("usage") or {}
            if "output_tokens" in usage:
                self.output_tokens = token_count(usage["output_tokens"], "usage.output_tokens")
            self.start_usage.update({k: v for k, v in usage.items() if k != "output_tokens"})
        elif kind == "message_stop":
            self.stopped = True
        return ""

    def close_call(self, index: int) -> None:
        """At a tool_use block's end: an OpenAI client's call that streamed no input gets
        `{}` (what its whole answer's arguments say), never empty arguments."""
        slot = self.tools.get(index)
        if slot is not None and self.live_calls and not self.passthrough and not any(slot[1]):
            slot[1].append("{}")
            self.calls.append(ToolCallDelta(self.ordinals[index], "{}"))

    def tool_calls(self) -> tuple[dict[str, Any], ...]:
        return tuple(_tool_call(block, "".join(parts) or "{}")
                     for _, (block, parts) in sorted(self.tools.items()))


class AnthropicUpstream(UpstreamBackend):
    """One Anthropic replica (api.anthropic.com or a compatible server); see `UpstreamBackend`
    for the shared lifecycle."""

    name = "anthropic"

    def __init__(
        self, options: UpstreamOptions, *, transport: httpx.AsyncBaseTransport | None = None,
        models: tuple[str, ...] = (),
    ) -> None:
        super().__init__(options, transport=transport, models=models)
        path = "/messages" if self._base.endswith("/v1") else "/v1/messages"
        self._endpoint_url = httpx.URL(self._base + path)
        self._endpoint = self._template(self._endpoint_url)
        self._beta_templates: dict[tuple[str, str], PostTemplate] = {}
        self._count_url = httpx.URL(self._base + path + "/count_tokens")
        self.models_url = self._base + path.removesuffix("/messages") + "/models"

    async def count_tokens(self, req: ChatRequest) -> int:
        """The upstream's own count of an Anthropic client's request (its count_tokens
        endpoint, passed the fields that endpoint takes)."""
        body = {k: req.body[k] for k in COUNT_FIELDS if k in req.body}
        body["model"] = req.model
        request = self._post(self._with_beta(self._count_url, req.anthropic_beta),
                             dumps_body(body))
        payload = await fetch_json(self._transport, request, self.replica)
        tokens = payload.get("input_tokens") if isinstance(payload, dict) else None
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise BackendError(502, "upstream sent no input_tokens",
                               kind="upstream_error", replica=self.replica)
        return tokens

    def _headers(self) -> dict[str, str]:
        headers = {**super()._headers(), "anthropic-version": API_VERSION}
        if self.options.api_key:
            headers["x-api-key"] = self.options.api_key
        return headers

    def _with_beta(self, url: httpx.URL, beta: str | None) -> PostTemplate:
        """The template of POSTs to `url` carrying the client's `anthropic-beta` header, if
        any (the last few values' templates are kept: a client sends one value, or a few)."""
        if beta is None:
            return self._template(url)
        key = (str(url), beta)
        found = self._beta_templates.get(key)
        if found is None:
            headers = httpx.Headers(self._header_obj)
            headers["anthropic-beta"] = beta
            found = post_template(url, headers)
            if len(self._beta_templates) >= _BETA_TEMPLATES:
                self._beta_templates.pop(next(iter(self._beta_templates)))
            self._beta_templates[key] = found
        return found

    def _request(self, req: ChatRequest) -> httpx.Request:
        template = (self._endpoint if req.anthropic_beta is None
                    else self._with_beta(self._endpoint_url, req.anthropic_beta))
        return self._post(template, dumps_body(build_body(req)))

    async def _read_stream(
        self, response: httpx.Response, clock: StreamClock, req: ChatRequest
    ) -> AsyncGenerator[TextDelta | Final, None]:
        state = _StreamState(passes_blocks(req), live_calls=req.prompt is None)
        async for event in iter_sse(response):
            payload = loads_event(event.data, self.replica)
            kind = event.event or str(payload.get("type", ""))
            if kind == "error":
                raise error_object(payload, self.replica)
            text = state.take(kind, payload)
            if text or state.events or state.calls:
                early = None if clock.first else _early_usage(state.start_usage)
                clock.mark()
                state.deltas += 1
                state.text.append(text)
                yield TextDelta(text, early, tool_calls=tuple(state.calls),
                                provider_events=tuple(state.events))
                state.events.clear()
                state.calls.clear()
            if state.stopped:
                break
        if not state.stopped:
            raise BackendError(502, "upstream stream was cut mid-way",
                               kind="upstream_stream_cut", replica=self.replica)
        usage = read_usage(state.start_usage, state.output_tokens)
        yield self._final("".join(state.text), state.tool_calls(), state.stop, usage,
                          clock, state.deltas, state.stop_sequence)

    def _final(
        self, text: str, tools: tuple[dict[str, Any], ...], stop: str | None,
        usage: AnthropicUsage, clock: StreamClock, deltas: int, sequence: Any = None,
    ) -> Final:
        completion = usage.completion_tokens or deltas
        ttft, tpot = clock.timings(completion)
        matched = sequence if stop == "stop_sequence" and isinstance(sequence, str) else None
        return Final(text, tools, _FINISH.get(stop or "end_turn", "stop"), Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=completion,
            cached_tokens=usage.reported_cached_tokens or 0,
            reported_cached_tokens=usage.reported_cached_tokens, ttft=ttft, tpot=tpot,
            cache_write_tokens=usage.cache_write_tokens,
        ), replica=self.replica, stop_sequence=matched)

    def _restream(self, final: Final) -> tuple[Item, ...]:
        return restream_blocks(final)

    def _read_whole(self, payload: Any, clock: StreamClock, req: ChatRequest) -> Final:
        if isinstance(payload, dict) and payload.get("type") == "error":  # a 200 that is one
            raise error_object(payload, self.replica)
        if not isinstance(payload, dict) or not isinstance(payload.get("content"), list):
            raise BackendError(502, "upstream sent no content",
                               kind="upstream_error", replica=self.replica)
        blocks = payload["content"]
        text = "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")
        tools = tuple(_tool_call(b) for b in blocks if b.get("type") == "tool_use")
        usage = read_usage(payload.get("usage"))
        final = self._final(text, tools, payload.get("stop_reason"), usage, clock, 0,
                            payload.get("stop_sequence"))
        if passes_blocks(req) and any(passed_block(b) for b in blocks):
            return evolve(final, provider_content=tuple(blocks))
        return final
