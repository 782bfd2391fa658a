"""OpenAI Responses API bodies (POST /v1/responses) -> ChatRequest, validated.

The gateway is stateless: a Responses body is translated into the equivalent chat completions
body (`chat_body`: instructions first as the system message, `input` items as messages,
function tools, tool_choice, `text.format` as `response_format`, `max_output_tokens` as
`max_completion_tokens`), which the chat route's parser validates; the request then goes through
lint, the shadow caches and every backend exactly as a chat request does (an upstream gets a
chat completions body). The client's own body rides along (`ChatRequest.client_body`) for the
parameters a Response echoes. A chat parser's error names the Responses field it came from.

Refused with a 400 naming the field: `previous_response_id`, `conversation` and `background`
(they need stored responses), `prompt` (a stored prompt template), built-in tools (web_search,
file_search, computer, ...), `top_logprobs`, and any field the Responses API does not define.
Accepted and ignored: `store`, `include`, `truncation`, `reasoning`, `service_tier`,
`safety_identifier`, `stream_options`, `max_tool_calls`, `prompt_cache_retention`.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.errors import GatewayError, invalid
from gateway.evolve import evolve
from gateway.parse_openai import parse_chat
from gateway.responses_input import to_messages
from gateway.types import ApiError, ChatRequest
from gateway.validate import ParseContext, opt_dict

#: fields copied into the chat body as they are (the chat parser checks them)
SAME_FIELDS = ("model", "parallel_tool_calls", "temperature", "top_p", "stream", "metadata",
               "user", "prompt_cache_key")
#: fields a Response cannot honour without stored state or OpenAI's own tools
REFUSED = {
    "previous_response_id": "prefixgate keeps no responses (stateless): send the whole "
                            "conversation in 'input'",
    "conversation": "prefixgate keeps no conversations (stateless): send the whole "
                    "conversation in 'input'",
    "prompt": "prefixgate keeps no prompt templates: send 'instructions' and 'input'",
}
IGNORED = ("store", "include", "truncation", "reasoning", "service_tier", "safety_identifier",
           "stream_options", "max_tool_calls", "prompt_cache_retention")
KNOWN = frozenset({*SAME_FIELDS, *REFUSED, *IGNORED, "input", "instructions", "tools",
                   "tool_choice", "max_output_tokens", "text", "background", "top_logprobs"})
#: chat paths a Responses field of another name came from (longest prefix wins)
STATIC_PATHS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format",
    "tool_choice.function.name": "tool_choice.name",
    "tool_choice.function": "tool_choice",
}
#: the chat fields a backend's error may name that have another name in a Responses body
BACKEND_PATHS = {**STATIC_PATHS, "max_tokens": "max_output_tokens"}
_PATH_END = re.compile(r"[.\[]|$")


def parse_responses(body: dict[str, Any], ctx: ParseContext) -> ChatRequest:
    """A validated Responses request, as the equivalent chat request; raises GatewayError
    naming the Responses field."""
    chat, paths = chat_body(body)
    try:
        req = parse_chat(chat, ctx)
    except GatewayError as err:
        raise renamed(err, paths) from None
    return evolve(req, client_body=body)


def chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The equivalent chat completions body, and the chat paths it was made from."""
    _check_fields(body)
    converted = to_messages(body.get("instructions"), body.get("input"))
    chat: dict[str, Any] = {k: body[k] for k in SAME_FIELDS if body.get(k) is not None}
    chat["messages"] = converted.messages
    paths = {**STATIC_PATHS, **converted.paths}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("'tools' must be an array", "tools")
        if tools:  # (chat completions upstreams refuse an empty array)
            chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
        for i in range(len(tools)):
            paths[f"tools[{i}].function"] = f"tools[{i}]"
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if not chat.get("tools"):  # the Responses API takes these without tools, chat does not
        chat.pop("parallel_tool_calls", None)
        if chat.get("tool_choice") in ("auto", "none"):
            del chat["tool_choice"]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, paths


def _check_fields(body: dict[str, Any]) -> None:
    for name in body:
        if name not in KNOWN:
            raise invalid(f"Unrecognized request argument supplied: {name}", name)
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise invalid(f"'{name}' is not supported: {why}", name)
    if body.get("background") not in (None, False):
        raise invalid("'background' is not supported: prefixgate keeps no responses to poll "
                      "(stateless); stream the answer instead", "background")
    if body.get("top_logprobs") not in (None, 0):
        raise invalid("'top_logprobs' is not supported: token log-probabilities are not "
                      "returned", "top_logprobs")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise invalid("'store' must be a boolean", "store")
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or not all(isinstance(x, str) for x in include)):
        raise invalid("'include' must be an array of strings", "include")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise invalid("'truncation' must be auto or disabled", "truncation")
    opt_dict(body, "reasoning")


def _tool(tool: Any, path: str) -> dict[str, Any]:
    """A Responses function tool {type, name, description, parameters, strict} as a chat
    tool; a built-in tool type is a 400 naming it."""
    if not isinstance(tool, dict):
        raise invalid(f"'{path}' must be an object", path)
    kind = tool.get("type")
    if kind != "function":
        raise invalid(f"'{path}.type' {kind!r} is not supported: prefixgate serves function "
                      "tools only (no built-in tools such as web_search, file_search or "
                      "computer)", f"{path}.type")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
          if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    """"auto" / "none" / "required", or {type: "function", name} as chat's named choice."""
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise invalid(f"'tool_choice' must be none, auto, required or {{type: function, name}}"
                  f"{f', not type {kind!r}' if kind else ''}", "tool_choice")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (`text.verbosity` is accepted and ignored)."""
    text = opt_dict(body, "text")
    if text is None:
        return None
    for name in text:
        if name not in ("format", "verbosity"):
            raise invalid(f"Unrecognized request argument supplied: text.{name}", f"text.{name}")
    fmt = opt_dict(text, "format", "text.format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise invalid("'text.format.type' must be text, json_object or json_schema",
                      "text.format.type")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    if "schema" not in spec:
        raise invalid("'text.format.schema' is required for type json_schema",
                      "text.format.schema")
    return {"type": "json_schema", "json_schema": spec}


def renamed(err: GatewayError, paths: dict[str, str]) -> GatewayError:
    """`err` naming the Responses field its chat path came from (longest known prefix)."""
    new = _renamed_path(err.param, paths)
    if new is None or err.param is None:
        return err
    out = GatewayError(err.status, err.message.replace(err.param, new), kind=err.kind,
                       param=new)
    out.code = err.code
    return out


def _renamed_path(param: str | None, paths: dict[str, str]) -> str | None:
    """`param`'s Responses path when a known chat path (`paths`) begins it, else None."""
    if param is None:
        return None
    best = max((p for p in paths if param.startswith(p) and _PATH_END.match(param, len(p))),
               key=len, default=None)
    if best is None:
        return None
    new = paths[best] + param[len(best):]
    if new.endswith(".image_url.url"):  # a Responses image part holds its URL itself
        new = new[: -len(".url")]
    return new


_TOOL_FUNCTION = re.compile(r"^tools\[(\d+)\]\.function")


def client_error(err: ApiError, req: ChatRequest | None = None) -> ApiError:
    """A backend's error (the backend saw the chat request) naming the Responses field, in
    place: `messages[...]` as the `input` item it came from (as `input` alone when lint
    rewrote the messages, which then no longer map to items one to one), `response_format` as
    `text.format`, a tool's `function` as the tool. A parser's error, already renamed, is left
    as it is."""
    param = err.param
    if param is None:
        return err
    if param.startswith("messages"):
        new = _renamed_path(param, _message_paths(req)) or "input"
    else:
        new = _renamed_path(param, BACKEND_PATHS) or param
    new = _TOOL_FUNCTION.sub(r"tools[\1]", new)
    if new != param:
        err.message, err.param = err.message.replace(param, new), new
    return err


def _message_paths(req: ChatRequest | None) -> dict[str, str]:
    """Where each chat message `req` sent came from in its Responses body, when the messages
    sent are the body's own translation; else none."""
    if req is None or req.client_body is None:
        return {}
    try:
        chat, paths = chat_body(dict(req.client_body))
    except ApiError:
        return {}
    return paths if chat["messages"] == req.body.get("messages") else {}
