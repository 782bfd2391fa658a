"""Anthropic Messages response bodies and streaming events.

Usage mapping: `cache_read_input_tokens` = tokens served from the prefix cache;
`input_tokens` = the uncached rest of the prompt (Anthropic counts input after the cached part);
`cache_creation_input_tokens` = the tokens an Anthropic upstream says it wrote to its cache
(billed apart, outside `input_tokens`); 0 elsewhere (the engine caches every full page at no
extra price, so nothing is billed as a cache write).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.json_prefix import JsonPrefix
from gateway.types import ChatRequest, Final, TextDelta, ToolCallDelta, Usage
from gateway.usage_report import SUMMARY_FIELD, summary

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "refusal": "refusal", "pause_turn": "pause_turn",
                "context_window": "model_context_window_exceeded"}


def stop_fields(final: Final) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence`: "stop_sequence" and the string when one ended the
    text, else the finish reason's Anthropic name and null. An answer that ends in tool calls
    is "tool_use" even when the upstream said "stop" (OpenAI and vLLM do for a forced
    `tool_choice`): an agent loop runs its tools on "tool_use" and ends on "end_turn"."""
    if final.stop_sequence is not None and final.finish_reason == "stop":
        return {"stop_reason": "stop_sequence", "stop_sequence": final.stop_sequence}
    finish = "tool_calls" if final.tool_calls and final.finish_reason == "stop" \
        else final.finish_reason
    return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One named server-sent event."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def usage_body(usage: Usage | None, output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's usage object: the prompt split into uncached input, cache writes and
    cache reads (the three add up to the prompt)."""
    prompt = usage.prompt_tokens if usage else 0
    cached = usage.cached_tokens if usage else 0
    written = min(usage.cache_write_tokens, max(prompt - cached, 0)) if usage else 0
    out = usage.completion_tokens if usage and output_tokens is None else (output_tokens or 0)
    return {
        "input_tokens": max(prompt - cached - written, 0),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": out,
    }


def message_id(req: ChatRequest) -> str:
    return f"msg_{req.request_id}"


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}


def message_response(req: ChatRequest, final: Final) -> dict[str, Any]:
    """A non-streaming Messages response."""
    content: list[dict[str, Any]] = []
    if final.provider_content is not None:  # an Anthropic upstream's, with thinking blocks
        content.extend(final.provider_content)
    else:
        text = final.text or final.refusal  # a refusal is the answer's text to Messages
        if text:  # no empty text block (the API never sends one, nor takes one back)
            content.append({"type": "text", "text": text})
        content.extend(_tool_use_block(call) for call in final.tool_calls)
    return {
        "id": message_id(req),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        **stop_fields(final),
        "usage": usage_body(final.usage),
    }


class MessageEvents:
    """message_start, content blocks with deltas, message_delta, message_stop."""

    def __init__(self, req: ChatRequest) -> None:
        self.req = req
        self.index = 0
        self.text_open = False
        self.tool_open = False
        self.passed_open = False  # a block passed on as the upstream sent it (thinking)
        self.streamed_calls = 0  # tool_use blocks already sent piece by piece
        self.tool_json = JsonPrefix()  # the open tool_use block's input so far
        self.early: Usage | None = None

    def start(self, early: Usage | None = None) -> bytes:
        self.early = early
        message: dict[str, Any] = {
            "id": message_id(self.req), "type": "message", "role": "assistant",
            "model": self.req.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_body(early, output_tokens=0),
        }
        return event("message_start", {"type": "message_start", "message": message})

    def _open_text(self) -> bytes:
        out = self._close_open()  # a text block never follows itself open
        self.text_open = True
        block = {"type": "text", "text": ""}
        return out + event("content_block_start",
                     {"type": "content_block_start", "index": self.index, "content_block": block})

    def _close_open(self) -> bytes:
        """The open block's stop event, if one is open."""
        return self._close_block() if self.text_open or self.tool_open or self.passed_open \
            else b""

    def _close_block(self) -> bytes:
        out = event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.index += 1
        self.text_open = self.tool_open = self.passed_open = False
        return out

    def text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if self.text_open else self._open_text()
        delta = {"type": "text_delta", "text": text}
        return out + event("content_block_delta",
                           {"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, item: TextDelta) -> bytes:
        """Passed-on blocks' events, text deltas, then tool_use blocks streamed as
        `input_json_delta` fragments."""
        out = b"".join(self._passed(e) for e in item.provider_events) if item.provider_events \
            else b""
        return out + self.text(item.text) + b"".join(self._tool_piece(p) for p in item.tool_calls)

    def _passed(self, data: dict[str, Any]) -> bytes:
        """An upstream's content block event (thinking, redacted_thinking) as it came, at
        this stream's block index."""
        kind = str(data.get("type"))
        if kind == "content_block_stop":
            return self._close_block() if self.passed_open else b""
        out = b""
        if kind == "content_block_start":
            out = self._close_open()
            self.passed_open = True
        elif not self.passed_open:
            return b""
        return out + event(kind, {**data, "index": self.index})

    def _tool_piece(self, piece: ToolCallDelta) -> bytes:
        out = b""
        if piece.id is not None:
            out += self._close_open()
            self.tool_open, self.streamed_calls = True, piece.index + 1
            self.tool_json = JsonPrefix()
            block: dict[str, Any] = {"type": "tool_use", "id": piece.id, "name": piece.name,
                                     "input": {}}
            out += event("content_block_start", {"type": "content_block_start",
                                                 "index": self.index, "content_block": block})
        # a fragment goes to the open tool_use block only if it is that call's (a fragment of
        # an earlier call, after a later one opened, has no block left to go to), and only
        # while the input stays a JSON prefix: the SDK parses it after every fragment and
        # ends the stream at one that is not (an upstream model's invalid arguments)
        if self.tool_open and piece.index == self.streamed_calls - 1:
            return out + self._input_piece(piece.arguments)
        return out

    def _input_piece(self, text: str) -> bytes:
        """The open block's `input_json_delta` for `text` (blank before the input starts:
        none), or nothing once its input is no JSON prefix."""
        if not self.tool_json.started:
            text = text.lstrip()  # the SDK refuses an input of only whitespace
        if not text or not self.tool_json.feed(text):
            return b""
        delta = {"type": "input_json_delta", "partial_json": text}
        return event("content_block_delta",
                     {"type": "content_block_delta", "index": self.index, "delta": delta})

    def final(self, final: Final) -> bytes:
        out = self.text(final.refusal) if final.refusal and not final.text else b""
        out += self._close_open()
        for call in final.tool_calls[self.streamed_calls :]:
            out += self._tool_use(call)
        delta = stop_fields(final)
        out += event("message_delta", {"type": "message_delta", "delta": delta,
                                       "usage": usage_body(final.usage),
                                       SUMMARY_FIELD: summary(final.usage)})
        return out + event("message_stop", {"type": "message_stop"})

    def _tool_use(self, call: dict[str, Any]) -> bytes:
        block = _tool_use_block(call)
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        return (
            event("content_block_start",
                  {"type": "content_block_start", "index": self.index, "content_block": start})
            + event("content_block_delta",
                    {"type": "content_block_delta", "index": self.index, "delta": delta})
            + self._close_block()
        )


def error_event(body: dict[str, Any]) -> bytes:
    """A mid-stream error event."""
    return event("error", body)
