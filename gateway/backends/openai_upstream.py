"""OpenAI-compatible upstream (OpenAI, vLLM, SGLang, llama.cpp server, DeepSeek, ...).

The client's body (after lint rewrite) is forwarded as-is when the client spoke OpenAI; an
Anthropic-format client is re-expressed from the neutral `ChatRequest` (its `top_k` as vLLM's
extension, a 400 for api.openai.com, which has none; `output_config.format` as
`response_format` json_schema; extended `thinking`, which has no OpenAI field, a 400).
Streaming requests are streamed from the upstream and passed on delta by delta. The upstream's
own cache report is read back into `Usage.reported_cached_tokens`:
`usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM, SGLang) or
`usage.prompt_cache_hit_tokens` (DeepSeek).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from gateway.backends.openai_answer import (
    StreamState,
    call_id,
    estimate,
    prefill_rate,
    read_usage,
    reasoning_text,
    tool_call,
)
from gateway.backends.upstream import StreamClock, UpstreamBackend
from gateway.backends.upstream_errors import loads_event, stream_error_event
from gateway.backends.upstream_http import UpstreamOptions, dumps_body, iter_sse
from gateway.salt import SaltMode, salt_upstream_body
from gateway.types import (
    BackendError,
    ChatRequest,
    Final,
    TextDelta,
    Usage,
)
from gateway.upstream_detect import api_root

# OpenAI finish reasons -> the neutral vocabulary; a content filter's stop is the neutral
# "refusal", so an OpenAI client still reads "content_filter" and an Anthropic one "refusal"
# (an agent must not take a filtered answer for a finished one)
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
           "function_call": "tool_calls", "content_filter": "refusal"}


# finish reasons of an answer the server gave up on (vLLM's and SGLang's "abort", an
# "error"): what came is not the whole answer, so the client gets an error, never a "stop"
ABORTED = frozenset({"abort", "error"})


# what vLLM's `/tokenize` takes of a chat body to render the prompt its chat path would
_VLLM_TOKENIZE_FIELDS = ("model", "messages", "tools", "chat_template", "chat_template_kwargs",
                         "add_generation_prompt", "continue_final_message")
PREFILL_EWMA = 0.2  # weight of the newest sample in a replica's prefill rate


def derive_prompt_cache_key(namespace: str, family: str) -> str:
    """A stable `prompt_cache_key` for one tenant's prompt family (no prompt text in it)."""
    digest = hashlib.sha256(f"{namespace}\x00{family}".encode()).hexdigest()
    return f"pg-{digest[:24]}"


def _wants_cache_key(options: UpstreamOptions) -> bool:
    if options.derive_prompt_cache_key is not None:
        return options.derive_prompt_cache_key
    return _is_openai(options.url)


@functools.lru_cache(maxsize=256)
def _is_openai(url: str) -> bool:
    """True for api.openai.com URLs (parsed once per URL, not once per request)."""
    return httpx.URL(url).host.endswith("openai.com")


def _sampling_fields(req: ChatRequest, options: UpstreamOptions) -> dict[str, Any]:
    """The sampling fields of a request from an Anthropic client, in OpenAI's names; `top_k`
    as vLLM's extension (api.openai.com has none: a 400 naming it, not a silent drop)."""
    o = req.options
    if o.top_k is not None and _is_openai(options.url):
        raise BackendError(400, "'top_k' is not supported by an api.openai.com upstream",
                           kind="invalid_request_error", param="top_k")
    fields: dict[str, Any] = {
        "max_tokens": o.max_tokens, "temperature": o.temperature, "top_p": o.top_p,
        "top_k": o.top_k, "seed": o.seed, "stop": list(o.stop) or None,
        "presence_penalty": o.presence_penalty or None,
        "frequency_penalty": o.frequency_penalty or None,
    }
    return {k: v for k, v in fields.items() if v is not None}


THINKING_TYPES = ("enabled", "between_tools")  # an Anthropic client asking for thinking


def _anthropic_fields(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic client's output format and tool choice in OpenAI's fields
    (`output_config.format` -> `response_format` json_schema; `tool_choice` auto / any / tool /
    none -> auto / required / a named function / none, `disable_parallel_tool_use` ->
    `parallel_tool_calls` false; the parser has checked the shapes). Extended thinking has no
    OpenAI field: a 400 naming it, not a silent drop."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in THINKING_TYPES:
        raise BackendError(400, "'thinking' is not supported by an OpenAI-compatible upstream",
                           kind="invalid_request_error", param="thinking")
    fields: dict[str, Any] = {}
    fmt = (body.get("output_config") or {}).get("format")
    if fmt:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": fmt["schema"]}}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and body.get("tools"):
        kind = str(choice.get("type"))
        fields["tool_choice"] = _OPENAI_CHOICE.get(kind) or {
            "type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use") and kind != "none":
            fields["parallel_tool_calls"] = False
    return fields


_OPENAI_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # Messages -> OpenAI


def uncarried_media(body: dict[str, Any]) -> None:
    """400 naming the first block of an Anthropic client's messages that chat completions
    cannot carry: a document (OpenAI's chat has no faithful equivalent of its sources, title
    and citations), an image by file id, an image or document inside a tool_result (a tool
    message carries only text). Images from base64 or a URL are sent as image_url parts."""
    for i, message in enumerate(body.get("messages") or ()):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            why = _uncarried(block)
            if why is not None:
                path = f"messages[{i}].content[{j}]"
                raise BackendError(400, f"'{path}' is not supported by an OpenAI-compatible "
                                   f"upstream: {why}", kind="invalid_request_error", param=path)


def _uncarried(block: Any) -> str | None:
    """Why a Messages block cannot be sent as chat completions content, or None."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "document":
        return "it takes no document blocks"
    if kind == "image" and (block.get("source") or {}).get("type") not in ("base64", "url"):
        return "it takes images as base64 data or a URL, not a file id"
    if kind == "tool_result" and isinstance(block.get("content"), list) and any(
            isinstance(b, dict) and b.get("type") in ("image", "document")
            for b in block["content"]):
        return "a tool message carries only text (send the image in a user message)"
    return None


def _continuation(req: ChatRequest, options: UpstreamOptions,
                  server: str | None) -> dict[str, Any]:
    """An Anthropic client's prefill (a final assistant message) is the start of the answer:
    vLLM and SGLang continue it when asked (`continue_final_message`, no generation prompt),
    llama.cpp's server does by itself; api.openai.com has no way to, so a 400 there rather than
    an answer in a new turn. Other servers get the messages as sent."""
    if not (req.messages and req.messages[-1].get("role") == "assistant"):
        return {}
    if server in ("vllm", "sglang"):
        return {"continue_final_message": True, "add_generation_prompt": False}
    if _is_openai(options.url):
        raise BackendError(400, "a final assistant message (a prefill) is not supported by an "
                           "api.openai.com upstream: it cannot continue a message",
                           kind="invalid_request_error", param="messages")
    return {}


def build_body(req: ChatRequest, options: UpstreamOptions,
               server: str | None = None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for the upstream: `/chat/completions` or `/completions`; `server` is
    the replica's kind where known (vllm, sglang, llamacpp)."""
    path = "/completions" if req.prompt is not None else "/chat/completions"
    if req.provider == "openai":
        body = dict(req.body)
        body["model"] = req.model
    elif req.prompt is not None:
        body = {"model": req.model, "prompt": req.prompt, **_sampling_fields(req, options)}
    else:
        uncarried_media(req.body)
        body = {"model": req.model, "messages": list(req.messages),
                **_sampling_fields(req, options), **_anthropic_fields(req.body),
                **_continuation(req, options, server)}
        if req.tools:
            body["tools"] = list(req.tools)
    body["stream"] = req.stream
    if req.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    else:
        body.pop("stream_options", None)
    body.update(req.upstream_fields)
    mode: SaltMode = "prompt_cache_key" if _wants_cache_key(options) else "cache_salt"
    salt_upstream_body(body, req.upstream_salt, mode, req.family)  # tenant isolation upstream
    wants_key = req.prompt is None and req.family and mode == "prompt_cache_key"
    if wants_key and "prompt_cache_key" not in body:
        body["prompt_cache_key"] = derive_prompt_cache_key(req.namespace, str(req.family))
    return path, body


class OpenAIUpstream(UpstreamBackend):
    """One OpenAI-compatible replica: builds `/chat/completions` or `/completions` bodies and
    reads their answers (see `UpstreamBackend` for the shared lifecycle)."""

    name = "openai"

    def __init__(
        self, options: UpstreamOptions, *, transport: httpx.AsyncBaseTransport | None = None,
        models: tuple[str, ...] = (),
    ) -> None:
        super().__init__(options, transport=transport, models=models)
        # the server: the pool's named kind, the detected one (`auto`), or "llamacpp" once its
        # responses say so
        self.server_kind: str | None = None
        self.prefill_ms_per_token: float | None = None  # from llama.cpp's timings (_final)
        self._posts = {path: self._template(httpx.URL(self._base + path))
                       for path in ("/chat/completions", "/completions")}

    async def total_slots(self) -> int | None:
        """A llama.cpp server's slot count (`GET /props`), or None when it does not say."""
        props = await self.get_json(self._base.removesuffix("/v1") + "/props")
        slots = props.get("total_slots") if isinstance(props, dict) else None
        return slots if isinstance(slots, int) and slots > 0 else None

    async def count_tokens(self, req: ChatRequest) -> int | None:
        """The server's own count of the prompt `req` is sent as, where it has a way to say:
        llama.cpp (`POST /apply-template` renders the chat body, `POST /tokenize` counts the
        prompt as its chat path does) and vLLM (`POST /tokenize` with the messages and tools);
        None for other servers, or when the server does not answer with a count."""
        _, body = build_body(dataclasses.replace(req, stream=False), self.options,
                             self.server_kind)
        root = api_root(self.options.url)
        try:
            if self.server_kind == "llamacpp":
                rendered = await self._post_json(root + "/apply-template", body)
                prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
                if not isinstance(prompt, str):
                    return None
                answer = await self._post_json(root + "/tokenize", {
                    "content": prompt, "add_special": True, "parse_special": True})
                tokens = answer.get("tokens") if isinstance(answer, dict) else None
                return len(tokens) if isinstance(tokens, list) else None
            if self.server_kind == "vllm":
                fields = {k: body[k] for k in _VLLM_TOKENIZE_FIELDS if k in body}
                answer = await self._post_json(root + "/tokenize",
                                               {"add_generation_prompt": True, **fields})
                count = answer.get("count") if isinstance(answer, dict) else None
                return count if isinstance(count, int) and count >= 0 else None
        except BackendError:
            return None
        return None

    def _headers(self) -> dict[str, str]:
        headers = super()._headers()
        if self.options.api_key:
            headers["authorization"] = f"Bearer {self.options.api_key}"
        return headers

    def family_in_body(self, req: ChatRequest) -> bool:
        """api.openai.com (or `derive_prompt_cache_key`): the tenant's `prompt_cache_key` is
        scoped by the prompt family."""
        return _wants_cache_key(self.options)

    def _request(self, req: ChatRequest) -> httpx.Request:
        path, body = build_body(req, self.options, self.server_kind)
        return self._post(self._posts[path], dumps_body(body))

    async def _read_stream(
        self, response: httpx.Response, clock: StreamClock, req: ChatRequest
    ) -> AsyncGenerator[TextDelta | Final, None]:
        state = StreamState()
        async for event in iter_sse(response):
            if event.data.strip() == "[DONE]":
                state.done = True
                break
            chunk = loads_event(event.data, self.replica)
            if event.event == "error" or "error" in chunk:
                raise stream_error_event(chunk, self.replica)
            text = state.take_chunk(chunk)
            if text or state.calls or state.thought:
                clock.mark()
                if text:  # chunks of text count a token each when no usage comes
                    state.deltas += 1
                    state.text.append(text)
                yield TextDelta(text, tool_calls=tuple(state.calls), reasoning=state.thought)
                state.calls.clear()
        if not state.done and state.finish is None:
            raise BackendError(502, "upstream stream was cut mid-way",
                               kind="upstream_stream_cut", replica=self.replica)
        yield self._final(state, clock)

    def _final(self, state: StreamState, clock: StreamClock) -> Final:
        if state.finish in ABORTED:
            raise BackendError(502, f"upstream aborted the answer (finish_reason "
                               f"{state.finish!r})", kind="upstream_aborted",
                               replica=self.replica)
        self.server_kind = "llamacpp" if state.llamacpp else self.server_kind
        completion = state.usage.completion_tokens or state.deltas or estimate(state)
        ttft, tpot = clock.timings(completion)
        for call in state.tools.values():  # a call never announced may still lack its id
            call["id"] = call["id"] or call_id()
        tools = tuple(state.tools.values())  # in the order the calls came
        finish = _FINISH.get(state.finish or "stop", "stop")
        cached = state.usage.reported_cached_tokens or 0
        return Final("".join(state.text), tools, finish, Usage(
            prompt_tokens=state.usage.prompt_tokens, completion_tokens=completion,
            cached_tokens=cached, reported_cached_tokens=state.usage.reported_cached_tokens,
            ttft=ttft, tpot=tpot, estimated=not state.usage_seen,
            prefill_saved_ms=cached * self._learn_prefill_rate(state.prefill_rate),
        ), replica=self.replica,
            stop_sequence=state.stop_string if finish == "stop" and not tools else None,
            refusal="".join(state.refusal) or None, reasoning="".join(state.reasoning) or None)

    def prefill_saved_ms(self, cached_tokens: int) -> float:
        """`cached_tokens` times this server's own prefill ms per token, as learnt so far from
        llama.cpp's timings (0 before one was timed, and for servers that do not time)."""
        return cached_tokens * (self.prefill_ms_per_token or 0.0)

    def _learn_prefill_rate(self, sample: float | None) -> float:
        """Fold `sample` into this replica's prefill ms per prompt token (a moving average of
        llama.cpp's own timings) and return it; 0 until a server that reports them has timed
        one (then nothing is claimed saved)."""
        if sample is not None:
            old = self.prefill_ms_per_token
            self.prefill_ms_per_token = sample if old is None else (
                old + PREFILL_EWMA * (sample - old))
        return self.prefill_ms_per_token or 0.0

    def _read_whole(self, payload: Any, clock: StreamClock, req: ChatRequest) -> Final:
        if isinstance(payload, dict) and not payload.get("choices") and "error" in payload:
            # a 200 whose body is the upstream's error (some servers answer so): its message
            raise stream_error_event(payload, self.replica)
        if not isinstance(payload, dict) or not payload.get("choices"):
            raise BackendError(502, "upstream sent no choices",
                               kind="upstream_error", replica=self.replica)
        choice = payload["choices"][0]
        state = StreamState()
        state.usage = read_usage(payload.get("usage"), payload.get("timings"))
        state.usage_seen = isinstance(payload.get("usage"), dict)
        state.llamacpp = "timings" in payload
        state.prefill_rate = prefill_rate(payload.get("timings"))
        state.finish = choice.get("finish_reason")
        state.take_stop(choice)
        message = choice.get("message")
        if message is None:  # /completions
            state.text.append(str(choice.get("text") or ""))
        else:
            state.text.append(str(message.get("content") or ""))
            if message.get("refusal"):
                state.refusal.append(str(message["refusal"]))
            state.reasoning.append(reasoning_text(message))
            for i, call in enumerate(message.get("tool_calls") or ()):
                state.tools[i] = tool_call(call)
        return self._final(state, clock)
