"""OpenAI response bodies and SSE chunks for chat completions and legacy completions."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.types import ChatRequest, Final, TextDelta, ToolCallDelta, Usage
from gateway.usage_report import SUMMARY_FIELD, summary


def sse(data: dict[str, Any] | str) -> bytes:
    """One `data:` server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
#: neutral finish reasons OpenAI has no word for (an Anthropic upstream's): the nearest one
_FINISH = {"refusal": "content_filter", "pause_turn": "stop", "context_window": "length"}


def finish_reason(final: Final) -> str:
    """The answer's OpenAI finish_reason (a matched stop string is plain "stop")."""
    return _FINISH.get(final.finish_reason, final.finish_reason)


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def completion_id(req: ChatRequest) -> str:
    return f"chatcmpl-{req.request_id}"


def chat_response(req: ChatRequest, final: Final, created: int) -> dict[str, Any]:
    """A non-streaming chat.completion."""
    message: dict[str, Any] = {"role": "assistant", "content": final.text or None}
    if final.tool_calls:
        message["tool_calls"] = list(final.tool_calls)
    elif final.refusal is None:
        message["content"] = final.text
    if final.refusal is not None:  # structured outputs' refusal, content null, as OpenAI's
        message["refusal"] = final.refusal
    if final.reasoning is not None:  # a reasoning model's, as vLLM and DeepSeek send it
        message["reasoning_content"] = final.reasoning
    return {
        "id": completion_id(req),
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None,
             "finish_reason": finish_reason(final)}
        ],
        "usage": usage_body(final.usage),
    }


class ChatChunks:
    """chat.completion.chunk events for one streamed response."""

    def __init__(self, req: ChatRequest, include_usage: bool) -> None:
        self.req = req
        self.include_usage = include_usage
        self.created = int(time.time())
        self.streamed_calls = 0  # tool calls already sent piece by piece

    def _chunk(self, delta: dict[str, Any], finish: str | None = None,
               extra: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": completion_id(self.req),
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            body["usage"] = None
        return sse({**body, **extra} if extra else body)

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> bytes:
        return self._chunk({"content": text}) if text else b""

    def delta(self, item: TextDelta) -> bytes:
        """Reasoning, text, then tool-call pieces (`delta.tool_calls[].function.arguments`
        fragments)."""
        thought = self._chunk({"reasoning_content": item.reasoning}) if item.reasoning else b""
        return thought + self.text(item.text) + b"".join(
            self._tool_piece(p) for p in item.tool_calls)

    def _tool_piece(self, piece: ToolCallDelta) -> bytes:
        call: dict[str, Any] = {"index": piece.index}
        if piece.id is not None:
            self.streamed_calls = max(self.streamed_calls, piece.index + 1)
            call.update(id=piece.id, type="function")
            call["function"] = {"name": piece.name, "arguments": piece.arguments}
        elif piece.arguments:
            call["function"] = {"arguments": piece.arguments}
        else:
            return b""
        return self._chunk({"tool_calls": [call]})

    def final(self, final: Final) -> bytes:
        out = self._chunk({"refusal": final.refusal}) if final.refusal else b""
        for index, call in enumerate(final.tool_calls):
            if index < self.streamed_calls:
                continue
            out += self._chunk({"tool_calls": [{"index": index, **call}]})
        tail = {SUMMARY_FIELD: summary(final.usage)}  # on the last chunk
        if not self.include_usage:
            return out + self._chunk({}, finish_reason(final), tail) + DONE
        out += self._chunk({}, finish_reason(final))
        return out + sse({
            "id": completion_id(self.req),
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": [],
            "usage": usage_body(final.usage),
            **tail,
        }) + DONE


def text_completion(req: ChatRequest, final: Final, created: int) -> dict[str, Any]:
    """A non-streaming text_completion (/v1/completions)."""
    return {
        "id": f"cmpl-{req.request_id}",
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [{"index": 0, "text": final.text, "logprobs": None,
                     "finish_reason": finish_reason(final)}],
        "usage": usage_body(final.usage),
    }


class CompletionChunks:
    """text_completion events for one streamed /v1/completions response."""

    def __init__(self, req: ChatRequest, include_usage: bool) -> None:
        self.req = req
        self.include_usage = include_usage
        self.created = int(time.time())

    def _chunk(self, text: str, finish: str | None, usage: Usage | None = None,
               last: Usage | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": f"cmpl-{self.req.request_id}",
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        if usage is not None:
            body["choices"] = []
            body["usage"] = usage_body(usage)
        if last is not None:
            body[SUMMARY_FIELD] = summary(last)
        return sse(body)

    def start(self) -> bytes:
        return b""

    def text(self, text: str) -> bytes:
        return self._chunk(text, None) if text else b""

    def delta(self, item: TextDelta) -> bytes:
        return self.text(item.text)

    def final(self, final: Final) -> bytes:
        if not self.include_usage:
            return self._chunk("", finish_reason(final), last=final.usage) + DONE
        out = self._chunk("", finish_reason(final))
        return out + self._chunk("", None, final.usage, last=final.usage) + DONE


def error_event(body: dict[str, Any]) -> bytes:
    """A mid-stream error, as OpenAI-compatible servers send it."""
    return sse(body) + DONE
