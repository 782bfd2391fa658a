"""What an OpenAI-compatible upstream answers, read: its `usage` (and llama.cpp's `timings`),
its tool calls, a reasoning model's reasoning, and `StreamState`, which folds a streamed
answer's chunks together and queues the tool-call pieces to pass on as they come.
`gateway.backends.openai_upstream` turns what it holds into the neutral `Final`.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from gateway.backends.upstream_errors import token_count
from gateway.types import ToolCallDelta
from prompt_lint.tokens import get_encoding

PREFILL_SAMPLE_TOKENS = 64  # prompt tokens a llama.cpp answer must have computed to time prefill


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


def prefill_rate(timings: Any) -> float | None:
    """ms per computed prompt token from llama.cpp server's `timings` (`prompt_ms` over
    `prompt_n`), when it computed enough tokens that its fixed costs do not dominate."""
    if not isinstance(timings, dict):
        return None
    computed, ms = timings.get("prompt_n"), timings.get("prompt_ms")
    if not isinstance(computed, int) or computed < PREFILL_SAMPLE_TOKENS:
        return None
    return float(ms) / computed if isinstance(ms, int | float) and ms > 0 else None


def call_id() -> str:
    """An id for a tool call the upstream sent without one (some OpenAI-compatible servers
    do): clients must send a call's id back with its result, and an empty one is refused."""
    return f"call_{os.urandom(12).hex()}"


def reasoning_text(message: dict[str, Any]) -> str:
    """A reasoning model's reasoning in a message or delta: `reasoning_content` (DeepSeek,
    vLLM) or `reasoning` (vLLM's newer name); "" when there is none."""
    value = message.get("reasoning_content") or message.get("reasoning")
    return value if isinstance(value, str) else ""


def tool_call(raw: dict[str, Any]) -> dict[str, Any]:
    fn = raw.get("function") or {}
    return {"id": str(raw.get("id") or "") or call_id(), "type": "function",
            "function": {"name": str(fn.get("name") or ""),
                         "arguments": str(fn.get("arguments") or "")}}


def estimate(state: StreamState) -> int:
    """Completion tokens of an answer whose upstream sent no usage and no streamed text to
    count (a whole answer, or only tool-call fragments): the answer's text and arguments in
    prefixgate's own tokens (tiktoken, thread-safe, no shared memo), marked estimated with the
    rest of its usage; 0 when the upstream did send usage."""
    if state.usage_seen:
        return 0
    text = "".join(state.text) + "".join(t["function"]["arguments"] for t in state.tools.values())
    return len(get_encoding().encode_ordinary(text)) if text else 0


class StreamState:
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
