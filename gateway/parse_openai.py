"""OpenAI request bodies (/v1/chat/completions, /v1/completions) -> ChatRequest, validated.

Accepted: messages (system, developer, user, assistant with tool_calls, tool), content as a string
or text parts (for an upstream, a user message's image_url, input_audio and file parts too, their
shapes checked as OpenAI checks them; the embedded model reads only text), tools (function
tools, `strict`), tool_choice, parallel_tool_calls, response_format
(text, json_object, json_schema), stream, stream_options.include_usage, temperature, top_p,
top_k (vLLM's extension: -1 or 0 for every token), max_tokens / max_completion_tokens, stop,
seed, n=1, presence/frequency penalties, logit_bias (token id text -> [-100, 100]), user,
metadata (string values), cache_salt; /v1/completions: prompt, best_of=1, an empty suffix (an
upstream gets other values), max_tokens 16 when absent (OpenAI's default there). Refused with
a 400 naming the field: n > 1, logprobs / top_logprobs, echo, and for the embedded engine the
legacy `functions` / `function_call`. Unknown extra fields are ignored, as the SDKs add new ones.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gateway.errors import invalid
from gateway.openai_messages import check_round_trips, message
from gateway.structured import (
    ToolChoice,
    build_constraint,
    check_named_tool,
    document_schema,
    tool_schemas,
)
from gateway.types import ChatRequest, OutputConstraint, SamplingOptions
from gateway.validate import (
    ParseContext,
    check_model,
    check_tool_schema,
    namespace_for,
    opt_bool,
    opt_dict,
    opt_int,
    opt_list,
    opt_number,
    opt_str,
    req_list,
    req_openai_name,
    stop_strings,
)

# a legacy completion without max_tokens stops after 16 tokens: OpenAI's documented default
# for /v1/completions (vLLM's too), not the gateway's chat default
COMPLETION_MAX_TOKENS = 16

def parse_chat(body: dict[str, Any], ctx: ParseContext) -> ChatRequest:
    """A validated chat request; raises GatewayError naming the bad field."""
    model = check_model(body, ctx)
    media = not ctx.embedded
    messages = tuple(message(m, i, media) for i, m in enumerate(req_list(body, "messages")))
    tools = tuple(_tool(t, i) for i, t in enumerate(opt_list(body, "tools")))
    constraint = _constraint(body, tools, ctx.grammar)
    _metadata(body)
    if ctx.embedded:
        no_legacy_functions(body)
        check_round_trips(messages)
    return ChatRequest(
        request_id=ctx.request_id,
        provider="openai",
        model=model,
        messages=messages,
        tools=tools,
        options=sampling_options(body, ctx),
        stream=_stream(body),
        tenant=ctx.tenant,
        namespace=namespace_for(ctx.tenant, opt_str(body, "cache_salt")),
        body=body,
        constraint=constraint,
    )


def parse_completion(body: dict[str, Any], ctx: ParseContext) -> ChatRequest:
    """A validated legacy completion request (raw prompt, no chat template)."""
    model = check_model(body, ctx)
    _completion_fields(body, ctx)
    options = sampling_options(body, ctx)
    if options.max_tokens is None:
        options = replace(options, max_tokens=COMPLETION_MAX_TOKENS)
    return ChatRequest(
        request_id=ctx.request_id,
        provider="openai",
        model=model,
        messages=(),
        tools=(),
        options=options,
        stream=_stream(body),
        tenant=ctx.tenant,
        namespace=namespace_for(ctx.tenant, opt_str(body, "cache_salt")),
        body=body,
        prompt=_prompt(body.get("prompt")),
    )


def _completion_fields(body: dict[str, Any], ctx: ParseContext) -> None:
    """Legacy fields the answer cannot honour: `echo` (never returned), and for the embedded
    engine `best_of` > 1 (it samples one completion) and a `suffix` (it only appends to the
    prompt); an upstream gets those two in the body and answers for them."""
    if opt_bool(body, "echo"):
        raise invalid("'echo' is not supported", "echo")
    best_of = opt_int(body, "best_of", low=1)
    suffix = opt_str(body, "suffix")
    if not ctx.embedded:
        return
    if best_of not in (None, 1):
        raise invalid("only best_of=1 is supported: one completion is sampled", "best_of")
    if suffix:
        raise invalid("'suffix' is not supported: a completion only continues the prompt",
                      "suffix")


LEGACY_FUNCTION_FIELDS = (("functions", "tools"), ("function_call", "tool_choice"))


def no_legacy_functions(body: dict[str, Any]) -> None:
    """`functions` / `function_call`, the deprecated form of `tools` / `tool_choice`: the
    answer carries calls only as `tool_calls`, so either one is a 400 naming it and its
    replacement, never silently ignored (the model answered as if it had no functions). An
    OpenAI-compatible upstream gets them in the body and answers for them."""
    for name, replacement in LEGACY_FUNCTION_FIELDS:
        if body.get(name) not in (None, []):
            raise invalid(f"'{name}' is not supported: send '{replacement}' instead (the "
                          "answer's calls come back as 'tool_calls')", name)


def _metadata(body: dict[str, Any]) -> None:
    """`metadata`: an object of string values (not used for the answer), or null."""
    for key, value in (opt_dict(body, "metadata") or {}).items():
        if not isinstance(value, str):
            raise invalid(f"'metadata.{key}' must be a string", f"metadata.{key}")


def include_usage(body: dict[str, Any]) -> bool:
    """stream_options.include_usage (already validated by the parser)."""
    options = body.get("stream_options") or {}
    return bool(options.get("include_usage", False))


def sampling_options(body: dict[str, Any], ctx: ParseContext) -> SamplingOptions:
    n = opt_int(body, "n", low=1)
    if n not in (None, 1):
        raise invalid("only n=1 is supported", "n")
    _no_logprobs(body)
    max_tokens = opt_int(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", low=1)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=opt_number(body, "temperature", 0.0, 2.0),
        top_p=opt_number(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=_top_k(body),
        stop=stop_strings(body.get("stop"), "stop", 4),
        seed=opt_int(body, "seed"),
        presence_penalty=opt_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=opt_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        logit_bias=_logit_bias(body),
    )


MAX_TOKEN_ID_DIGITS = 10  # token ids are decimal text; no vocabulary has 10**10 tokens


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: an object of token ids (decimal text) to biases in [-100, 100], as
    id-ordered pairs; null or {} is no bias. Ids past the vocabulary are the engine's 400."""
    pairs = []
    for key, bias in (opt_dict(body, "logit_bias") or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS \
                or str(int(key)) != key:
            raise invalid(f"'logit_bias' keys must be token ids (decimal integers), got {key!r}",
                          "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} "
                          f"for token {key}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _top_k(body: dict[str, Any]) -> int | None:
    """`top_k`, vLLM's extension (OpenAI has none): k >= 1, or -1 / 0 for every token."""
    k = opt_int(body, "top_k", low=-1)
    return k if k is not None and k > 0 else None


def _no_logprobs(body: dict[str, Any]) -> None:
    """Token log-probabilities are not returned: asking for them is a 400, not a silent null
    (chat: `logprobs` true or `top_logprobs` > 0; legacy completions: `logprobs` > 0)."""
    for name in ("logprobs", "top_logprobs"):
        value = body.get(name)
        if value is None or value is False or value == 0:
            continue
        if not isinstance(value, bool | int):
            raise invalid(f"'{name}' must be a boolean or an integer", name)
        raise invalid(f"'{name}' is not supported: token log-probabilities are not returned",
                      name)


def _stream(body: dict[str, Any]) -> bool:
    stream = opt_bool(body, "stream")
    options = opt_dict(body, "stream_options")
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed with stream=true", "stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise invalid(
                "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
            )
    opt_str(body, "user")
    return stream


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise invalid("'prompt' must be a non-empty string (or an array of one string)", "prompt")
    return value


def _tool(tool: Any, i: int) -> dict[str, Any]:
    path = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid(f"'{path}' must be a function tool", path)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"'{path}.function' must be an object", f"{path}.function")
    check_tool_schema(fn, f"{path}.function", "parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid(f"'{path}.function.strict' must be a boolean", f"{path}.function.strict")
    return {"type": "function", "function": fn}


def _constraint(body: dict[str, Any], tools: tuple[dict[str, Any], ...], grammar: bool
                ) -> OutputConstraint | None:
    """The output grammar of tools + tool_choice + response_format (400s name the field);
    none without `grammar` (an upstream's request: the fields are still checked)."""
    schemas = tool_schemas(tools, [f"tools[{i}].function.parameters" for i in range(len(tools))])
    choice = _tool_choice(body.get("tool_choice"), bool(tools))
    choice = ToolChoice(choice.mode, choice.name, opt_bool(body, "parallel_tool_calls", True))
    if choice.name is not None:
        check_named_tool(choice.name, schemas, "tool_choice.function.name")
    return build_constraint(schemas, choice, _response_format(body, grammar), grammar)


def _tool_choice(choice: Any, has_tools: bool) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if has_tools else "none")
    if choice in ("none", "auto", "required"):
        if choice == "required" and not has_tools:
            raise invalid("'tool_choice' is 'required' but 'tools' is empty", "tool_choice")
        return ToolChoice(choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(fn, dict):
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("'tool_choice.function.name' must be a non-empty string",
                          "tool_choice.function.name")
        return ToolChoice("required", name)
    raise invalid("'tool_choice' must be none, auto, required or a function object", "tool_choice")


def _response_format(body: dict[str, Any], grammar: bool) -> dict[str, Any] | None:
    """The JSON document schema response_format asks for; None for text."""
    fmt = opt_dict(body, "response_format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") != "json_schema":
        raise invalid("'response_format.type' must be text, json_object or json_schema",
                      "response_format.type")
    spec = opt_dict(fmt, "json_schema", "response_format.json_schema")
    if spec is None:
        raise invalid("'response_format.json_schema' is required for type json_schema",
                      "response_format.json_schema")
    req_openai_name(spec, "name", "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("'response_format.json_schema.strict' must be a boolean",
                      "response_format.json_schema.strict")
    return document_schema(spec.get("schema"), "response_format.json_schema.schema", grammar)
