"""Tool calling for models whose chat template knows nothing of tools (the embedded engine).

The documented format (the Hermes/ChatML convention): the model calls a tool by answering

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

(whitespace and newlines around the JSON allowed; several calls are several blocks).
- Rendering: the engine's chat template (engine.chat_template) writes the tool definitions into
  the system message, after the system prompt, so the stable part stays first (good for the
  prefix cache), and renders an assistant message's `tool_calls` as `<tool_call>` blocks.
  `render_messages` below is a template-free rendering of the same convention for backends
  without a tokenizer (the tests' fake backend).
- Parsing (`parse_output`, `ToolCallFilter` for streams) is lenient: a missing closing tag at
  the end of the output, code fences around the JSON, `arguments` given as a JSON string or
  under `parameters`, and text before the call are all accepted. Output that does not parse
  stays ordinary text, and so does everything when the request had no tools.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)  # \Z: the very end
_FENCE = re.compile(r"^\s*```(?:json)?\s*|\s*```\s*$")

TOOL_PREAMBLE = (
    "You may call the tools below. To call a tool, answer with exactly\n"
    '<tool_call>{"name": "TOOL_NAME", "arguments": {ARGUMENTS AS JSON}}</tool_call>\n'
    "and nothing else; the result comes back in <tool_response> tags.\n<tools>\n"
)


def render_messages(
    messages: tuple[dict[str, Any], ...] | list[dict[str, Any]],
    tools: tuple[dict[str, Any], ...] | list[dict[str, Any]],
) -> list[dict[str, str]]:
    """OpenAI-shaped messages (+ tools) -> plain {role, content: str} messages for the template."""
    out: list[dict[str, str]] = []
    for msg in messages:
        out.append(_render_message(msg))
    if tools:
        block = TOOL_PREAMBLE + "\n".join(_tool_line(t) for t in tools) + "\n</tools>"
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return _merge_roles(out)


def content_text(content: Any) -> str:
    """A message content (string, text parts or None) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _render_message(msg: dict[str, Any]) -> dict[str, str]:
    role = msg["role"]
    text = content_text(msg.get("content"))
    if role == "developer":
        role = "system"
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>{text}</tool_response>"}
    calls = msg.get("tool_calls") or []
    for call in calls:
        fn = call.get("function", {})
        payload = {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments", "{}"))}
        text += ("\n" if text else "") + OPEN + json.dumps(payload, ensure_ascii=False) + CLOSE
    return {"role": role, "content": text}


def _merge_roles(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    # Several system messages (system + developer) become one, keeping order.
    if sum(m["role"] == "system" for m in messages) <= 1:
        return messages
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    return [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]


def _tool_line(tool: dict[str, Any]) -> str:
    return json.dumps(tool.get("function", tool), ensure_ascii=False)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """Model output split into visible text and OpenAI-shaped tool calls."""

    text: str
    tool_calls: tuple[dict[str, Any], ...]


def parse_output(text: str, request_id: str, cut: bool = False) -> ParsedOutput:
    """Split generated text into text and tool calls; unparseable blocks stay text, except an
    unterminated last block: a call cut short by max_tokens (with tools, the engine's grammar
    makes every block the model opens a call), which a stream may already have begun to send as
    a call; it is dropped, never turned into text. So is, in an output `cut` by max_tokens, an
    opening tag the cut left unfinished (`<tool_`)."""
    if OPEN not in text:
        return ParsedOutput(text[: len(text) - _partial_open_suffix(text)] if cut else text, ())
    calls: list[dict[str, Any]] = []
    for match in _BLOCK.finditer(text):
        call = _parse_call(match.group(1))
        if call is None and match.end() == len(text) and not match.group(0).endswith(CLOSE):
            break
        if call is None:
            return ParsedOutput(text, ())
        calls.append(_openai_call(call, request_id, len(calls)))
    visible = text[: text.index(OPEN)].rstrip()
    return ParsedOutput(visible, tuple(calls))


_ARGUMENTS_AT = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*')


def _parse_call(raw: str) -> tuple[str, dict[str, Any], str] | None:
    """(name, arguments, arguments as JSON text) of one call block; None if it is no call."""
    data = _loads_object(_FENCE.sub("", raw.strip()))
    if data is None:
        return None
    name = data.get("name")
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        args = _loads_object(args) if args.strip() else {}
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, args, _arguments_text(raw, args)


def _arguments_text(raw: str, args: dict[str, Any]) -> str:
    """The arguments as the model wrote them, when the block has the documented form (what a
    stream sends piece by piece, so a streamed call and a whole one carry the same string);
    else the parsed arguments as JSON."""
    head = _ARGUMENTS_AT.match(raw)
    if head is not None:
        try:
            value, end = json.JSONDecoder().raw_decode(raw, head.end())
        except json.JSONDecodeError:
            value = None
        if value == args:
            return raw[head.end():end]
    return json.dumps(args, ensure_ascii=False)


def _loads_object(raw: str) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        data = _first_object(raw)
    return data if isinstance(data, dict) else None


def _first_object(raw: str) -> Any:
    start = raw.find("{")
    if start < 0:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(raw[start:])
    except json.JSONDecodeError:
        return None
    return data


def call_id(request_id: str, index: int) -> str:
    """The id of a request's index-th tool call (the same when streamed and in the Final)."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def _openai_call(call: tuple[str, dict[str, Any], str], request_id: str, index: int
                 ) -> dict[str, Any]:
    name, _, arguments = call
    return {"id": call_id(request_id, index), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCallFilter:
    """Streams visible text, holding back everything from a `<tool_call>` opening onwards, and
    the blanks before it until text follows them (the whole answer drops the blanks between
    its text and a call, so the streamed text is the same)."""

    held: str = ""
    in_call: bool = False
    emitted: list[str] = field(default_factory=list)

    def feed(self, text: str) -> str:
        """Visible text that is safe to send now."""
        if self.in_call:
            self.held += text
            return ""
        buffer = self.held + text
        start = buffer.find(OPEN)
        if start >= 0:
            self.in_call = True
            self.held = buffer[start:]
            return self._emit(buffer[:start].rstrip())
        before = buffer[: len(buffer) - _partial_open_suffix(buffer)]
        safe = len(before.rstrip())
        self.held = buffer[safe:]
        return self._emit(buffer[:safe])

    def _emit(self, text: str) -> str:
        self.emitted.append(text)
        return text

    def finish(self, full_text: str, request_id: str, cut: bool = False
               ) -> tuple[str, ParsedOutput]:
        """(visible text not yet sent, the parsed whole output; `cut`: by max_tokens)."""
        parsed = parse_output(full_text, request_id, cut)
        sent = "".join(self.emitted)
        tail = parsed.text[len(sent):] if parsed.text.startswith(sent) else ""
        return tail, parsed


def _partial_open_suffix(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
