"""Provider-neutral types shared by every gateway module and backend.

A route parses the client's body (OpenAI or Anthropic format) into a `ChatRequest`;
a `Backend` turns it into a stream of `TextDelta`s followed by exactly one `Final`;
the route renders that stream back in the client's own format.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gateway.shadow import Prompt
    from prompt_lint.layout import TokenLayout

Provider = Literal["openai", "anthropic"]
#: Where `Usage.cached_tokens` comes from: the engine or provider ("reported"), or the
#: gateway's shadow cache ("predicted", e.g. in a stream's head before the upstream reports).
CachedSource = Literal["reported", "predicted"]


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling parameters, already validated by the parser."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # sample from the k most likely tokens; None: from every token
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs in id order


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What the embedded engine must generate (built by `gateway.structured`).

    grammar: an llguidance Lark grammar over the output text.
    tool_calls_required: the output is only tool calls (tool_choice required / any / named).
    json_document: the output is one JSON document (response_format json_object/json_schema,
        Anthropic's output_config.format).
    """

    grammar: str
    tool_calls_required: bool = False
    json_document: bool = False


class LayoutShare:
    """One request's token layout (prompt_lint's segments, their token counts and the tool
    set they were made with), laid out once for the shadow's tokens and lint: whichever runs
    first leaves it, the other takes it. Both run under prompt_lint's lock; the shadow's tokens
    come first when the request is sent before either, lint first when the answer goes out
    before the shadow's part (gateway.backends.pool). `body` is the body it was made from."""

    __slots__ = ("body", "layout")

    def __init__(self) -> None:
        self.body: dict[str, Any] | None = None
        self.layout: TokenLayout | None = None

    def take(self, body: dict[str, Any]) -> TokenLayout | None:
        """The layout left for `body` (the very object), if any."""
        return self.layout if self.body is body else None

    def leave(self, body: dict[str, Any], layout: TokenLayout) -> None:
        """Leave `body`'s layout for the other (unless one is left already)."""
        if self.layout is None:
            self.body, self.layout = body, layout


class Dispatch:
    """Where one request was sent: the upstream replica the backend chose (the last one after
    a failover), left here by the backend so that the request's record names it even when no
    answer and no error does (a client that left mid-stream or before the answer)."""

    __slots__ = ("replica",)

    def __init__(self) -> None:
        self.replica: str | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One validated request, whichever route it came in on."""

    request_id: str
    provider: Provider  # the client's API format (which route it came in on)
    model: str
    messages: tuple[dict[str, Any], ...]  # OpenAI-shaped (role, content, tool_calls, tool_call_id)
    tools: tuple[dict[str, Any], ...]  # OpenAI function-tool shaped {"type":"function",...}
    options: SamplingOptions
    stream: bool
    tenant: str
    namespace: str  # cache namespace = tenant (+ "/" + cache_salt when given)
    body: dict[str, Any]  # the client body after lint rewrite, in the client's provider format
    prompt: str | None = None  # set for /v1/completions (raw text prompt, no chat template)
    lint_ids: tuple[str, ...] = ()
    family: str | None = None  # prompt family from prompt_lint's TemplateLearner
    upstream_salt: str | None = None  # server-derived per-namespace salt (gateway.salt)
    constraint: OutputConstraint | None = None  # structured output (tools / response_format)
    # body fields an upstream replica's cache model adds (llama.cpp: id_slot, cache_prompt)
    upstream_fields: Mapping[str, Any] = field(default_factory=dict)
    # the request's tokens for the upstream shadow caches, computed once off the event loop
    # by the backend's `prepare` (in the same worker-thread call as lint); None: not yet
    shadow_prompt: Prompt | None = None
    # the token layout shared by the shadow's tokenizing and lint (one per request)
    layout_share: LayoutShare | None = field(default=None, compare=False, repr=False)
    # the client's `anthropic-beta` header (messages route), passed on to an Anthropic upstream
    anthropic_beta: str | None = None
    # the request's ticket's note of where the backend sent it (one per request)
    dispatch: Dispatch | None = field(default=None, compare=False, repr=False)
    # the client's own body when the route translated it into `body` (the Responses API's,
    # sent on as a chat body): what the answer echoes
    client_body: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request; times in seconds."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    predicted_cached_tokens: int | None = None  # shadow-cache prediction (upstreams)
    reported_cached_tokens: int | None = None  # what the upstream itself reported
    ttft: float | None = None
    tpot: float | None = None
    prefill_saved_ms: float = 0.0
    cached_source: CachedSource = "reported"
    estimated: bool = False  # prompt/completion counts are the gateway's estimate (none sent)
    # prompt tokens the provider wrote to its cache on this request, billed apart as cache
    # writes (Anthropic's cache_creation_input_tokens): part of prompt_tokens, never cached
    cache_write_tokens: int = 0
    # speculative decoding (embedded engine): draft tokens verified / accepted; None = unknown
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of one tool call: the first piece of call `index` carries its `id` and
    `name` (and empty arguments); later pieces carry fragments of its JSON arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of generated text (tool-call markup already removed).

    `usage` is optional: a backend that knows the prompt and cached token counts when the first
    text arrives (after prefill) sets it on its first delta, so a streaming response can carry the
    x-prefixgate-* headers and Anthropic's message_start usage; later deltas leave it None.
    `tool_calls`: tool-call pieces streamed after `text` (the `Final` still lists whole calls).
    `tokens`: the completion tokens generated since the previous delta, when the backend knows
    them (the engine); None for an upstream's chunk, which a request cut short counts as one
    (an estimate, and recorded as one: `gateway.progress`).
    """

    text: str
    usage: Usage | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    tokens: int | None = None
    # Anthropic stream events (content_block_start / _delta / _stop) of blocks the neutral
    # stream has no field for (thinking, redacted_thinking), as an Anthropic upstream sent
    # them to an Anthropic client; rendered before `text`, re-indexed, by that route only
    provider_events: tuple[dict[str, Any], ...] = ()
    # an OpenAI-compatible reasoning model's reasoning text (vLLM's, DeepSeek's
    # `reasoning_content`), streamed before its answer: OpenAI clients get it as
    # `delta.reasoning_content`; it also sends a stream's head while the model still thinks
    reasoning: str = ""


class LateUsage:
    """A request's usage completed after its answer was sent: an upstream pool hands on a
    whole answer with the provider's own figures before its shadow cache has predicted the
    hit (gateway.backends.pool), then leaves the usage with the prediction here, before the
    backend stream is closed (the request's record is written after that)."""

    __slots__ = ("usage",)

    def __init__(self) -> None:
        self.usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Final:
    """The last item of every backend stream."""

    text: str  # full generated text (tool-call markup removed)
    tool_calls: tuple[dict[str, Any], ...]  # OpenAI shape {"id","type":"function","function":{..}}
    # OpenAI vocabulary: stop | length | tool_calls, plus Anthropic's refusal | pause_turn
    # (an Anthropic upstream's; rendered for OpenAI clients as content_filter / stop) and
    # context_window (the context ended the answer before max_tokens: Anthropic's
    # model_context_window_exceeded, OpenAI's length)
    finish_reason: str
    usage: Usage  # what the answer says
    replica: str | None = None
    late: LateUsage | None = field(default=None, compare=False, repr=False)
    # an Anthropic upstream's own content blocks, verbatim, for an Anthropic client when the
    # answer has blocks the neutral fields cannot carry (thinking, redacted_thinking): the
    # Messages route sends these instead of blocks rebuilt from `text` and `tool_calls`
    provider_content: tuple[dict[str, Any], ...] | None = None
    # the stop string that ended the text (finish_reason "stop"): Anthropic's stop_sequence
    stop_sequence: str | None = None
    # an OpenAI-compatible upstream's `refusal` (structured outputs: the model declined to
    # answer in the schema), in place of content: OpenAI's `message.refusal`
    refusal: str | None = None
    # an OpenAI-compatible upstream's reasoning text (`reasoning_content` or `reasoning`)
    reasoning: str | None = None

    def settled_usage(self) -> Usage:
        """The usage to record: completed after the answer (`late`) when it was, else the
        answer's own."""
        late = self.late.usage if self.late is not None else None
        return self.usage if late is None else late


class ApiError(Exception):
    """An error the client sees: an HTTP status, a message, an error kind and the offending field.

    Two families derive from it: `gateway.errors.GatewayError` (the gateway refuses the request:
    auth, parsing, validation, limits) and `BackendError` (the backend failed or refused). The
    request pipeline catches `ApiError` and renders either in the client's own format.
    """

    def __init__(
        self, status: int, message: str, *, kind: str = "api_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        # the error's code as the client sees it, when it is not `kind` (an upstream
        # provider's own code for a refusal it answered)
        self.code: str | None = None


class BackendError(ApiError):
    """A backend failure with the HTTP status and error kind the client should see; an
    upstream's names its `replica` (for the request's record) and passes on the provider's
    `retry_after` (seconds, for the response's header); `wait_s` is how long the provider asked
    not to be sent another request (the pool keeps the replica out of routing that long, up
    to its back-off cap). The message never names the replica:
    a tenant learns nothing of the deployment's hosts from it (the record and the gateway's log
    do name it)."""

    def __init__(self, status: int, message: str, *, kind: str = "api_error",
                 param: str | None = None, replica: str | None = None) -> None:
        super().__init__(status, message, kind=kind, param=param)
        self.replica = replica
        self.retry_after: int | None = None
        self.wait_s: float | None = None


class Backend(Protocol):
    """Where requests are served: the embedded engine or an upstream provider."""

    name: str  # "embedded" | "openai" | "anthropic"

    def models(self) -> list[str]:
        """Model ids this backend serves (GET /v1/models)."""
        ...

    def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        """Text deltas, then exactly one Final. Raises BackendError on failure."""
        ...

    def kv_pages(self) -> tuple[int, int] | None:
        """(used, total) KV pages for metrics; None for upstreams."""
        ...

    async def aclose(self) -> None:
        """Release resources (engine thread, HTTP clients)."""
        ...


@runtime_checkable
class PreparingBackend(Protocol):
    """A backend with CPU work to do per request before `stream` (upstream pools: tokenize
    and pack the prompt for the shadow caches, unless the pool does it while its upstream
    works). The gateway calls `prepare` under prompt_lint's lock (in a worker thread, or on the
    event loop for a small body: see gateway.pipeline), after lint or, for report-mode lint
    that can wait (`family_in_body` False), before it, and streams the request it returns."""

    def prepare(self, req: ChatRequest) -> ChatRequest:
        """`req` with its precomputed parts filled in (never changes what is served)."""
        ...

    def family_in_body(self, req: ChatRequest) -> bool:
        """True when what is sent for `req` depends on lint's prompt family (an upstream
        whose cache key is derived from it): lint must then finish before `stream`."""
        ...


class TokenCount(NamedTuple):
    """A prompt's size and whose count it is."""

    input_tokens: int
    estimated: bool  # prefixgate's own count, not the model's or the provider's


@runtime_checkable
class CountingBackend(Protocol):
    """A backend that counts a request's prompt tokens itself (the engine, upstream pools)."""

    async def count_tokens(self, req: ChatRequest) -> TokenCount:
        """The prompt tokens `req` would send; raises ApiError as `stream` would."""
        ...


@runtime_checkable
class WarmingBackend(Protocol):
    """A backend with one-time work that its first request would otherwise wait for."""

    async def warm_up(self) -> None:
        """Do it now (the app calls this while starting, before it serves)."""
        ...


@runtime_checkable
class ListingBackend(Protocol):
    """A backend whose model list is asked of its upstreams (a pool with no configured ids)."""

    async def list_models(self) -> list[str]:
        """The model ids GET /v1/models lists."""
        ...


#: Set around `Backend.stream` by work that waits until the request is on its way
#: (gateway.overlap: report-mode lint, a one-replica pool's shadow tokens): a backend that sends
#: over the network calls it once the request bytes are handed to the socket, so the work runs
#: while the upstream works. Work for a backend that never calls it runs after its first item,
#: which is as correct, only not overlapped.
REQUEST_SENT: ContextVar[Callable[[], None] | None] = ContextVar("prefixgate_request_sent",
                                                                 default=None)
