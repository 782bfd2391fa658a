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
import os
from collections.abc import AsyncGenerator
from typing import Any, NamedTuple

import httpx

from gateway.backends.upstream import StreamClock, UpstreamBackend
from gateway.backends.upstream_http import (
    UpstreamOptions,
    dumps_body,
    iter_sse,
    loads_event,
    stream_error_event,
    token_count,
)
from gateway.salt import SaltMode, salt_upstream_body
from gateway.types import (
    BackendError,
    ChatRequest,
    Final,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.upstream_detect import api_root
from prompt_lint.tokens import get_encoding

# OpenAI finish reasons -> the neutral vocabulary; a content filter's stop is the neutral
# "refusal", so an OpenAI client still reads "content_filter" and an Anthropic one "refusal"
# (an agent must not take a filtered answer for a finished one)
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
           "function_call": "tool_calls", "content_filter": "refusal"}


# finish reasons of an answer the server gave up on (vLLM's and SGLang's "abort", an
# "error"): what came is not the whole answer, so the client gets an error, never a "stop"
ABORTED = frozenset({"abort", "error"})


class OpenAIUsage(NamedTuple):
    """Token counts as an OpenAI-compatible upstream reports them."""

    prompt_tokens: int
    completion_tokens: int
    reported_cached_tokens: int | None


def read_usage(usage: Any, timings: Any = None) -> OpenAIUsage:
    """Parse a `usage` object; the cached count is None when the upstream does not report one.
    `timings` is llama.cpp server's block (`cache_n`: prompt tokens reused from the slot)."""
    if not isinstance(usage, dict):
        return OpenAIUsage(0, 0, None)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None:
        cached = usage.get("prompt_cache_hit_tokens")  # DeepSeek
    if cached is None and isinstance(timings, dict):
        cached = timings.get("cache_n")  # llama.cpp server
    return OpenAIUsage(
        token_count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        token_count(usage.get("completion_tokens"), "usage.completion_tokens"),
        None if cached is None else token_count(cached, "usage's cached tokens"),
    )


# what vLLM's `/tokenize` takes of a chat body to render the prompt its chat path would
_VLLM_TOKENIZE_FIELDS = ("model", "messages", "tools", "chat_template", "chat_template_kwargs")
PREFILL_SAMPLE_TOKENS = 64  # prompt tokens a llama.cpp answer must have computed to time prefill
PREFILL_EWMA = 0.2  # weight of the newest sample in a replica's prefill rate


def prefill_rate(timings: Any) -> float | None:
    """ms per computed prompt token from llama.cpp server's `timings` (`prompt_ms` over
    `prompt_n`), when it computed enough tokens that its fixed costs do not dominate."""
    if not isinstance(timings, dict):
        return None
    computed, ms = timings.get("prompt_n"), timings.get("prompt_ms")
    if not isinstance(computed, int) or computed < PREFILL_SAMPLE_TOKENS:
        return None
    return float(ms) / computed if isinstance(ms, int | float) and ms > 0 else None


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


def build_body(req: ChatRequest, options: UpstreamOptions) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for the upstream: `/chat/completions` or `/completions`."""
    path = "/completions" if req.prompt is not None else "/chat/completions"
    if req.provider == "openai":
        body = dict(req.body)
        body["model"] = req.model
    elif req.prompt is not None:
        body = {"model": req.model, "prompt": req.prompt, **_sampling_fields(req, options)}
    else:
        uncarried_media(req.body)
        body = {"model": req.model, "messages": list(req.messages),
                **_sampling_fields(req, options), **_anthropic_fields(req.body)}
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


def call_id() -> str:
    """An id for a tool call the upstream sent without one (some OpenAI-compatible servers
    do): clients must send a call's id back with its result, and an empty one is refused."""
    return f"call_{os.urandom(12).hex()}"


def reasoning_text(message: dict[str, Any]) -> str:
    """A reasoning model's reasoning in a message or delta: `reasoning_content` (DeepSeek,
    vLLM) or `reasoning` (vLLM's newer name); "" when there is none."""
    value = message.get("reasoning_content") or message.get("reasoning")
    return value if isinstance(value, str) else ""


def _tool_call(raw: dict[str, Any]) -> dict[str, Any]:
    fn = raw.get("function") or {}
    return {"id": str(raw.get("id") or "") or call_id(), "type": "function",
            "function": {"name": str(fn.get("name") or ""),
                         "arguments": str(fn.get("arguments") or "")}}


def _estimate(state: _StreamState) -> int:
    """Completion tokens of an answer whose upstream sent no usage and no streamed text to
    count (a whole answer, or only tool-call fragments): the answer's text and arguments in
    prefixgate's own tokens (tiktoken, thread-safe, no shared memo), marked estimated with the
    rest of its usage; 0 when the upstream did send usage."""
    if state.usage_seen:
        return 0
    text = "".join(state.text) + "".join(t["function"]["arguments"] for t in state.tools.values())
    return len(get_encoding().encode_ordinary(text)) if text else 0


class _StreamState:
    """Accumulates one streamed answer: text, tool-call fragments, finish reason, usage.

    Tool calls are passed on as they come (`calls`: the pieces of the last chunk), so a client
    sees a long call's arguments grow instead of nothing until the answer ends: a call is
    announced (id and name) once its name has come and every call before it is announced,
    with the arguments it has so far; later fragments follow as they arrive. Calls are
    numbered in the order they first appear (the upstream's `index` keys them)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.refusal: list[str] = []  # `delta.refusal` pieces (structured outputs' refusal)
        self.reasoning: list[str] = []  # reasoning text (vLLM's, DeepSeek's)
        self.thought = ""  # the last chunk's reasoning piece, to pass on
        self.tools: dict[int, dict[str, Any]] = {}  # by upstream index, in order of appearance
        self.order: list[int] = []  # upstream indexes in order of appearance
        self.announced = 0  # calls whose head has been passed on (the first ones in `order`)
        self.calls: list[ToolCallDelta] = []
        self.upstream_ids: dict[int, str] = {}  # the id the upstream gave each call
        self.finish: str | None = None
        self.stop_string: str | None = None  # vLLM's / SGLang's matched stop string
        self.usage = OpenAIUsage(0, 0, None)
        self.usage_seen = False
        self.llamacpp = False  # the server sent llama.cpp's `timings` block
        self.prefill_rate: float | None = None  # its ms per computed prompt token
        self.deltas = 0
        self.done = False

    def add_tool_delta(self, delta: dict[str, Any]) -> None:
        """Fold one `delta.tool_calls[]` fragment into its call and queue what can be passed
        on: the fragment itself once its call is announced, else any calls now announceable."""
        index = self.call_index(delta)
        slot = self.tools.get(index)
        if slot is None:
            slot = self.tools[index] = {
                "id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            self.order.append(index)
        if delta.get("id") and not slot["id"]:  # the first id stays
            slot["id"] = self.upstream_ids[index] = str(delta["id"])
        fn = delta.get("function") or {}
        slot["function"]["name"] += fn.get("name") or ""
        piece = str(fn.get("arguments") or "")
        slot["function"]["arguments"] += piece
        ordinal = self.order.index(index)
        if ordinal < self.announced:
            if piece:
                self.calls.append(ToolCallDelta(ordinal, piece))
        else:
            self.announce()

    def call_index(self, delta: dict[str, Any]) -> int:
        """The call a fragment belongs to: its `index`; a server that sends none (some
        OpenAI-compatible APIs stream parallel calls so) starts a new call with each new id,
        and a fragment without an id continues the last call."""
        if delta.get("index") is not None:
            return token_count(delta.get("index"), "tool_calls.index")
        new_id = delta.get("id")
        if not self.order or (new_id and new_id != self.upstream_ids.get(self.order[-1])):
            return max(self.tools, default=-1) + 1
        return self.order[-1]

    def announce(self) -> None:
        """Pass on the heads (and arguments so far) of the next calls in order whose names
        have come."""
        while self.announced < len(self.order):
            call = self.tools[self.order[self.announced]]
            fn = call["function"]
            if not fn["name"]:
                return
            call["id"] = call["id"] or call_id()
            self.calls.append(ToolCallDelta(self.announced, "", id=call["id"], name=fn["name"]))
            if fn["arguments"]:
                self.calls.append(ToolCallDelta(self.announced, fn["arguments"]))
            self.announced += 1

    def take_stop(self, choice: dict[str, Any]) -> None:
        """The stop string that ended the answer, where the server names it: vLLM's and
        SGLang's `stop_reason` (or `matched_stop`) is the string, or a stop token's id."""
        matched = choice.get("stop_reason", choice.get("matched_stop"))
        self.stop_string = matched if isinstance(matched, str) and matched else None

    def take_chunk(self, chunk: dict[str, Any]) -> str:
        """Fold one chunk in; return its new text."""
        self.llamacpp = self.llamacpp or "timings" in chunk
        if chunk.get("usage"):
            self.usage = read_usage(chunk["usage"], chunk.get("timings"))
            self.usage_seen = True
        if "timings" in chunk:
            self.prefill_rate = prefill_rate(chunk["timings"])
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
            self.take_stop(choice)
        delta = choice.get("delta")
        if delta is None:  # /completions stream
            return str(choice.get("text") or "")
        for call in delta.get("tool_calls") or ():
            self.add_tool_delta(call)
        if delta.get("refusal"):
            self.refusal.append(str(delta["refusal"]))
        self.thought = reasoning_text(delta)
        if self.thought:
            self.reasoning.append(self.thought)
        return str(delta.get("content") or "")


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
        _, body = build_body(dataclasses.replace(req, stream=False), self.options)
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
                                               {**fields, "add_generation_prompt": True})
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
        path, body = build_body(req, self.options)
        return self._post(self._posts[path], dumps_body(body))

    async def _read_stream(
        self, response: httpx.Response, clock: StreamClock, req: ChatRequest
    ) -> AsyncGenerator[TextDelta | Final, None]:
        state = _StreamState()
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

    def _final(self, state: _StreamState, clock: StreamClock) -> Final:
        if state.finish in ABORTED:
            raise BackendError(502, f"upstream aborted the answer (finish_reason "
                               f"{state.finish!r})", kind="upstream_aborted",
                               replica=self.replica)
        self.server_kind = "llamacpp" if state.llamacpp else self.server_kind
        completion = state.usage.completion_tokens or state.deltas or _estimate(state)
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
        state = _StreamState()
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
                state.tools[i] = _tool_call(call)
        return self._final(state, clock)
