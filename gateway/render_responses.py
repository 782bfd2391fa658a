"""OpenAI Responses API answers: a whole Response object, and its semantic SSE events.

A Response's `output` holds a reasoning model's reasoning (an OpenAI-compatible upstream's
`reasoning_content`: a `reasoning` item with one `reasoning_text` part), the assistant's message
(one `output_text` part, and a `refusal` part when an upstream refused a structured answer) and
one `function_call` item per tool call;
its status is `completed`, or `incomplete` when the answer was cut (`max_output_tokens`, or
`content_filter` for a refusal stop). The request parameters it echoes are the client's own
(`ChatRequest.client_body`).

A stream is `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its content (`response.content_part.added`,
`response.reasoning_text.delta`..., `response.output_text.delta`..., or
`response.function_call_arguments.delta`...), its `.done`
events and `response.output_item.done`, and last `response.completed` (or
`response.incomplete`: its Response carries the `prefixgate` summary, as a whole one does),
every event numbered (`sequence_number`). A failure after the first event is
`response.failed` with the error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from gateway.errors import error_body
from gateway.parse_responses import client_error
from gateway.types import ApiError, ChatRequest, Final, TextDelta, ToolCallDelta, Usage
from gateway.usage_report import SUMMARY_FIELD, summary

#: a neutral finish reason that leaves a Response incomplete -> incomplete_details.reason
INCOMPLETE = {"length": "max_output_tokens", "context_window": "max_output_tokens",
              "refusal": "content_filter"}


def response_id(req: ChatRequest) -> str:
    return f"resp_{req.request_id}"


def message_id(req: ChatRequest) -> str:
    return f"msg_{req.request_id}"


def reasoning_id(req: ChatRequest) -> str:
    return f"rs_{req.request_id}"


def call_item_id(req: ChatRequest, index: int) -> str:
    return f"fc_{req.request_id}_{index}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                 "cache_write_tokens": usage.cache_write_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def incomplete_reason(final: Final) -> str | None:
    """Why the answer is incomplete, or None when it is complete."""
    return INCOMPLETE.get(final.finish_reason)


def envelope(req: ChatRequest, created: int, status: str, output: list[dict[str, Any]],
             usage: Usage | None = None, *, reason: str | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response object: its state, output and usage, and the parameters the client sent."""
    body: Mapping[str, Any] = req.client_body or {}
    text: dict[str, Any] = {"format": (body.get("text") or {}).get("format") or {"type": "text"}}
    if (body.get("text") or {}).get("verbosity") is not None:
        text["verbosity"] = body["text"]["verbosity"]
    parallel = body.get("parallel_tool_calls")
    return {
        "id": response_id(req), "object": "response", "created_at": created,
        "status": status, "background": False, "error": error,
        "incomplete_details": None if reason is None else {"reason": reason},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "model": req.model, "output": output,
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": None, "reasoning": body.get("reasoning"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": text, "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or []),
        "truncation": body.get("truncation") or "disabled",
        "usage": None if usage is None else usage_body(usage),
        "user": body.get("user"), "metadata": body.get("metadata") or {},
        "prompt_cache_key": body.get("prompt_cache_key"),
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(req: ChatRequest, content: list[dict[str, Any]], status: str
                 ) -> dict[str, Any]:
    return {"type": "message", "id": message_id(req), "status": status, "role": "assistant",
            "content": content}


def reasoning_item(req: ChatRequest, content: list[dict[str, Any]], status: str
                   ) -> dict[str, Any]:
    return {"type": "reasoning", "id": reasoning_id(req), "summary": [], "content": content,
            "status": status}


def call_item(req: ChatRequest, index: int, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": call_item_id(req, index), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _message_content(final: Final) -> list[dict[str, Any]]:
    """The message's parts: its text (unless it is only a refusal), its refusal."""
    parts = [text_part(final.text)] if final.text or final.refusal is None else []
    if final.refusal is not None:
        parts.append({"type": "refusal", "refusal": final.refusal})
    return parts


def _has_message(final: Final) -> bool:
    """An answer of tool calls alone has no message item."""
    return bool(final.text) or final.refusal is not None or not final.tool_calls


def response_body(req: ChatRequest, final: Final, created: int) -> dict[str, Any]:
    """The whole Response (`prefixgate`'s summary is added by the pipeline)."""
    reason = incomplete_reason(final)
    status = "completed" if reason is None else "incomplete"
    output = [reasoning_item(req, [{"type": "reasoning_text", "text": final.reasoning}], status)
              ] if final.reasoning else []
    if _has_message(final):
        output.append(message_item(req, _message_content(final), status))
    for i, call in enumerate(final.tool_calls):
        fn = call["function"]
        output.append(call_item(req, i, call["id"], fn["name"], fn["arguments"], "completed"))
    return envelope(req, created, status, output, final.usage, reason=reason)


class ResponseEvents:
    """The semantic events of one streamed Response. Output items are numbered as they open
    (the message when its first text comes, each call when its first piece comes); every
    item still open is finished when the Final comes, with the Final's own text and
    arguments (a call streamed in part and cut by max_output_tokens, which the Final leaves
    out, is finished `incomplete` with the arguments streamed)."""

    def __init__(self, req: ChatRequest) -> None:
        self.req = req
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items, in the order they opened
        self.message: dict[str, Any] | None = None
        self.reasoning: dict[str, Any] | None = None
        self.thought = ""  # the reasoning streamed so far
        self.text = ""  # the message's text streamed so far
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> its item

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def _envelope(self, status: str, usage: Usage | None = None, **extra: Any) -> dict[str, Any]:
        return envelope(self.req, self.created, status, self.items, usage, **extra)

    def start(self) -> bytes:
        head = self._envelope("in_progress")
        return self._event("response.created", response=head) + \
            self._event("response.in_progress", response=head)

    def delta(self, item: TextDelta) -> bytes:
        """The reasoning, the text, then the tool-call pieces."""
        out = self._thought(item.reasoning) if item.reasoning else b""
        out += self._text(item.text) if item.text else b""
        return out + b"".join(self._piece(p) for p in item.tool_calls)

    def _open_message(self, with_text: bool) -> bytes:
        self.message = message_item(self.req, [], "in_progress")
        self.items.append(self.message)
        out = self._event("response.output_item.added", output_index=len(self.items) - 1,
                          item=self.message)
        return out + (self._add_part(text_part("")) if with_text else b"")

    def _add_part(self, part: dict[str, Any]) -> bytes:
        assert self.message is not None
        self.message["content"].append(part)
        return self._event("response.content_part.added", **self._where(),
                           content_index=len(self.message["content"]) - 1, part=part)

    def _where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        item = self.message if item is None else item
        assert item is not None
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _text(self, text: str) -> bytes:
        out = self._open_message(True) if self.message is None else b""
        assert self.message is not None
        self.text += text
        self.message["content"][0]["text"] = self.text
        return out + self._event("response.output_text.delta", **self._where(),
                                 content_index=0, delta=text, logprobs=[])

    def _thought(self, text: str) -> bytes:
        out = b""
        if self.reasoning is None:
            self.reasoning = reasoning_item(self.req, [], "in_progress")
            self.items.append(self.reasoning)
            out = self._event("response.output_item.added", output_index=len(self.items) - 1,
                              item=self.reasoning)
            part = {"type": "reasoning_text", "text": ""}
            self.reasoning["content"].append(part)
            out += self._event("response.content_part.added", **self._where(self.reasoning),
                               content_index=0, part=part)
        self.thought += text
        self.reasoning["content"][0]["text"] = self.thought
        return out + self._event("response.reasoning_text.delta", **self._where(self.reasoning),
                                 content_index=0, delta=text)

    def _finish_reasoning(self, final: Final, status: str) -> bytes:
        """The reasoning's remaining text and its `.done` events."""
        text = final.reasoning or self.thought
        rest = text[len(self.thought):] if text.startswith(self.thought) else ""
        out = self._thought(rest) if rest or self.reasoning is None else b""
        assert self.reasoning is not None
        part = {"type": "reasoning_text", "text": text}
        self.reasoning.update(content=[part], status=status)
        where = self._where(self.reasoning)
        out += self._event("response.reasoning_text.done", **where, content_index=0, text=text)
        out += self._event("response.content_part.done", **where, content_index=0, part=part)
        return out + self._event("response.output_item.done", output_index=where["output_index"],
                                 item=self.reasoning)

    def _piece(self, piece: ToolCallDelta) -> bytes:
        out = b""
        if piece.id is not None and piece.index not in self.calls:
            out = self._open_call(piece.index, piece.id, piece.name or "")
        item = self.calls.get(piece.index)
        if item is None or not piece.arguments:
            return out
        item["arguments"] += piece.arguments
        return out + self._event("response.function_call_arguments.delta", **self._where(item),
                                 delta=piece.arguments)

    def _open_call(self, index: int, call_id: str, name: str) -> bytes:
        item = call_item(self.req, index, call_id, name, "", "in_progress")
        self.calls[index] = item
        self.items.append(item)
        return self._event("response.output_item.added", output_index=len(self.items) - 1,
                           item=dict(item))

    def final(self, final: Final) -> bytes:
        reason = incomplete_reason(final)
        status = "completed" if reason is None else "incomplete"
        out = self._finish_reasoning(final, status) \
            if final.reasoning or self.reasoning is not None else b""
        # (no empty message after a call cut short: the call is the output)
        if _has_message(final) and (final.text or final.refusal is not None or not self.calls):
            out += self._finish_message(final, status)
        for i, call in enumerate(final.tool_calls):
            out += self._finish_call(i, call)
        for index, item in self.calls.items():  # streamed, then cut: not among the answer's
            if index >= len(final.tool_calls):
                item["status"] = "incomplete"
                out += self._event("response.output_item.done",
                                   output_index=self.items.index(item), item=item)
        response = self._envelope(status, final.usage, reason=reason)
        response[SUMMARY_FIELD] = summary(final.usage)  # as the whole Response carries it
        kind = "response.completed" if reason is None else "response.incomplete"
        return out + self._event(kind, response=response)

    def _finish_message(self, final: Final, status: str) -> bytes:
        """The message's remaining text, its refusal, and its `.done` events."""
        out = b""
        if self.message is None:
            out = self._open_message(bool(final.text) or final.refusal is None)
        assert self.message is not None
        if final.text.startswith(self.text) and len(final.text) > len(self.text):
            out += self._text(final.text[len(self.text):])
        if self.message["content"]:
            part = text_part(final.text)
            self.message["content"][0] = part
            out += self._event("response.output_text.done", **self._where(), content_index=0,
                               text=final.text, logprobs=[])
            out += self._event("response.content_part.done", **self._where(), content_index=0,
                               part=part)
        if final.refusal is not None:
            out += self._refusal(final.refusal)
        self.message["status"] = status
        return out + self._event("response.output_item.done",
                                 output_index=self.items.index(self.message), item=self.message)

    def _refusal(self, refusal: str) -> bytes:
        assert self.message is not None
        index = len(self.message["content"])
        out = self._add_part({"type": "refusal", "refusal": ""})
        self.message["content"][index] = part = {"type": "refusal", "refusal": refusal}
        out += self._event("response.refusal.delta", **self._where(), content_index=index,
                           delta=refusal)
        out += self._event("response.refusal.done", **self._where(), content_index=index,
                           refusal=refusal)
        return out + self._event("response.content_part.done", **self._where(),
                                 content_index=index, part=part)

    def _finish_call(self, index: int, call: dict[str, Any]) -> bytes:
        fn = call["function"]
        out = self._open_call(index, call["id"], fn["name"]) if index not in self.calls else b""
        item = self.calls[index]
        args: str = fn["arguments"]
        if args.startswith(item["arguments"]) and len(args) > len(item["arguments"]):
            out += self._piece(ToolCallDelta(index, args[len(item["arguments"]):]))
        item.update(arguments=args, status="completed")
        out += self._event("response.function_call_arguments.done", **self._where(item),
                           arguments=args)
        return out + self._event("response.output_item.done",
                                 output_index=self.items.index(item), item=item)

    def failed(self, err: ApiError, status: int) -> bytes:
        """`response.failed`: the error after the stream began (`status`: the client's)."""
        err = client_error(err, self.req)
        code = "rate_limit_exceeded" if status == 429 else "server_error"
        own = error_body(err, "openai")["error"]  # its type: the chat route's code, if any
        error = {"code": code, "message": err.message, "type": own["code"] or own["type"],
                 "param": err.param}
        return self._event("response.failed", response=self._envelope("failed", error=error))
