"""Chat templates (jinja2, as shipped in a model's tokenizer metadata) rendered in a sandbox.

The environment mirrors what Hugging Face `apply_chat_template` offers a template: `trim_blocks`,
`lstrip_blocks`, the loop-control extension, a `tojson` filter that keeps non-ASCII text, and
`raise_exception` / `strftime_now` globals. Templates run in jinja2's immutable sandbox, so a
template from a model file cannot reach Python internals or mutate the caller's messages.

Tools: when the template itself never mentions `tools`, tool definitions would silently vanish.
In that case the definitions are written into the system message (appended to the first system
message, or as a new leading system message) in this fixed format, which tool-using agents can
follow (the Hermes/ChatML `<tool_call>` convention)::

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {one tool definition per line, JSON with sorted keys}
    </tools>

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

Messages are normalised first: `content=None` becomes "" (or the message's `refusal`, a refused
structured answer sent back as history), OpenAI content-part lists become their joined text
(a refusal part's refusal), and (for templates that do not mention `tool_calls`) an assistant
message's `tool_calls` are appended to its content as `<tool_call>{...}</tool_call>` blocks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The fixed text block that describes `tools` inside a system message."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False, sort_keys=True) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("refusal" if p.get("type") == "refusal" else "text", "")
                 for p in content if isinstance(p, Mapping)]
        return "\n".join(str(p) for p in parts)  # one part a line, as vLLM joins them
    raise TypeError(f"message content must be str, list of parts or None, got {type(content)}")


def _tool_call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    payload = {"name": function.get("name"), "arguments": arguments}
    return "<tool_call>\n" + json.dumps(payload, ensure_ascii=False) + "\n</tool_call>"


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if not source:
            raise ValueError("chat template source is empty")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)
        self._bos_token = bos_token
        self._eos_token = eos_token
        self.handles_tools = "tools" in source
        self.handles_tool_calls = "tool_calls" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render `messages` (OpenAI-style dicts with `role` and `content`) to prompt text."""
        prepared = [self._normalise(m) for m in messages]
        if tools and not self.handles_tools:
            prepared = self._with_tools_in_system(prepared, tools)
        return self._template.render(
            messages=prepared,
            tools=list(tools) if tools and self.handles_tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )

    def render_continued(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt whose answer continues the last message (an assistant's prefill, as
        Anthropic's Messages API reads a final assistant message): the conversation rendered
        whole, cut right after that message's text, so no end-of-turn follows it. An empty
        last message is the plain start of the answer."""
        *head, last = messages
        text = self._normalise(last)["content"]
        if not text:
            return self.render(head, tools, add_generation_prompt=True)
        whole = self.render(messages, tools, add_generation_prompt=False)
        end = whole.rfind(text)
        if end < 0:
            raise ValueError("the chat template does not keep the final message's text, so "
                             "the answer cannot continue it")
        return whole[: end + len(text)]

    def _normalise(self, message: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"each message needs a 'role', got {message!r}")
        out = dict(message)
        out["content"] = _content_text(message.get("content"))
        if not out["content"] and isinstance(message.get("refusal"), str):
            out["content"] = message["refusal"]  # a refused answer's text, sent back as history
        calls = message.get("tool_calls")
        if calls and not self.handles_tool_calls:
            blocks = [_tool_call_text(c) for c in calls]
            out["content"] = "\n".join(([out["content"]] if out["content"] else []) + blocks)
        return out

    @staticmethod
    def _with_tools_in_system(
        messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        block = tools_system_text(tools)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0])
            first["content"] = (first["content"] + "\n\n" + block) if first["content"] else block
            return [first, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]
