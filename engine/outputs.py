"""Named result types the engine hands out: per-request results, step deltas, statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.errors import RequestField

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The result of one finished request.

    prompt_tokens: tokens of the prompt. cached_tokens: prompt tokens whose KV was reused from
    the prefix cache (not recomputed). completion_tokens: generated tokens (a stop token counts).
    finish_reason: "stop" (stop token or stop string), "length" (max_tokens or the context
    limit), "abort", or "error" (then `error` says why).
    ttft: seconds from arrival to the first generated token. tpot: mean seconds per generated
    token after the first. prefill_time: seconds of model steps spent on this request's prompt.
    draft_tokens: speculative draft tokens verified for this request; accepted_tokens: those
    the model agreed with (each saved one decode step). Both 0 without speculation.
    stop_string: the stop string (of `SamplingParams.stop`) that ended the text, when one did
    (finish_reason "stop"); None for a stop token, a grammar's end or any other reason.
    error_field: with finish_reason "error", the request field whose content caused it, when
    one did ("grammar": an output grammar past the matcher's limits, found only as it parses);
    the async front raises such an error as the `InvalidRequest` it is.
    """

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    ttft: float
    tpot: float
    prefill_time: float
    namespace: str = ""
    error: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    stop_string: str | None = None
    error_field: RequestField | None = None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one engine step did for one request; the one output type of `Engine.step()` and
    `AsyncEngine.stream()`.

    text: the new printable (UTF-8-complete) text. token_ids: the new token ids. finished: the
    request is done; then `output` carries the full `RequestOutput` (usage, timings).
    cached_tokens: prompt tokens reused from the prefix cache (known after matching, on every
    delta). prefill_saved_ms: the prefill time those cached tokens saved, estimated from the
    engine's measured prefill throughput (0.0 before any prefill was measured).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    output: RequestOutput | None
    cached_tokens: int = 0
    prefill_saved_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's KV pool, prefix cache and queues.

    pages_free + pages_used + pages_cached == pages_total: pages_used are private to running
    requests, pages_cached belong to the radix cache (evictable unless a running request
    locks them).
    prefix_cache_queries: requests matched against the cache; prefix_cache_hit_tokens: prompt
    tokens reused; prefix_cache_query_tokens: prompt tokens looked up.
    prefill_tokens_computed: tokens run through the model outside decode (prompt chunks,
    recomputation after preemption).
    prefill_tokens_per_second: EWMA of measured prefill throughput (None before any prefill).
    spec_draft_tokens / spec_accepted_tokens: speculative draft tokens verified and accepted
    since start; spec_steps: sequence-steps that verified a draft.
    """

    page_size: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    prefix_cache_queries: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    running: int
    waiting: int
    preemptions: int
    prefill_tokens_computed: int
    prefill_tokens_per_second: float | None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
