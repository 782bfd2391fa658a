"""Typed field readers for request bodies: each names the offending field in its error."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.errors import invalid, model_not_found


@dataclass(frozen=True, slots=True)
class ParseContext:
    """What a parser needs beyond the body: who is asking and what is served."""

    request_id: str
    tenant: str
    models: tuple[str, ...]  # served model ids; "*" accepts any
    default_max_tokens: int = 256
    # the backend constrains its output with the grammar the parser builds (the embedded
    # engine); an upstream gets tools and response formats in its body and enforces them
    # itself, so neither the grammar nor the grammar engine's view of a schema applies there
    grammar: bool = True
    # the embedded engine serves the request: a field it cannot honour (best_of > 1, a suffix,
    # extended thinking) is a 400 here; an upstream gets the client's body and answers for
    # such fields itself, so they are only checked for their shape there
    embedded: bool = True


SALT_CHARS = 128  # a longer client salt is named in the namespace by its SHA-256
#: an OpenAI name (response_format.json_schema.name): a-z, A-Z, 0-9, _ and -, at most 64
OPENAI_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def namespace_for(tenant: str, salt: str | None) -> str:
    """Cache namespace: the tenant, plus "/" + salt when the client sent a cache_salt. A salt
    longer than SALT_CHARS is replaced by its SHA-256 (still one namespace per salt): the
    namespace is a key of the gateway's caches (salts, shadows, the engine's radix tree),
    which bound how many they hold, not how long each is."""
    if not salt:
        return tenant
    if len(salt) > SALT_CHARS:
        digest = hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()
        salt = f"sha256:{digest}"
    return f"{tenant}/{salt}"


def is_served(model: object, models: tuple[str, ...] | list[str]) -> TypeGuard[str]:
    """True when `model` is a model id among `models` ("*" serves any non-empty id)."""
    return isinstance(model, str) and bool(model) and ("*" in models or model in models)


def check_model(body: dict[str, Any], ctx: ParseContext) -> str:
    model = req_str(body, "model")
    if not is_served(model, ctx.models):
        served = ", ".join(ctx.models)
        raise model_not_found(f"model {model!r} does not exist; served: {served}")
    return model


def req_str(body: dict[str, Any], name: str, path: str | None = None) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"'{path or name}' must be a non-empty string", path or name)
    return value


def opt_str(body: dict[str, Any], name: str, path: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(f"'{path or name}' must be a string", path or name)
    return value


def req_openai_name(body: dict[str, Any], name: str, path: str) -> str:
    """A required name as OpenAI's reference defines one (`OPENAI_NAME`)."""
    value = body.get(name)
    if not isinstance(value, str) or OPENAI_NAME.fullmatch(value) is None:
        raise invalid(f"'{path}' is required: 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                      path)
    return value


def opt_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean", name)
    return value


def opt_number(
    body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    """A number in [low, high] (or (low, high] with low_open); None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a number", name)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)
    return float(value)


def opt_int(body: dict[str, Any], name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer", name)
    if low is not None and value < low:
        raise invalid(f"'{name}' must be >= {low}, got {value}", name)
    return value


def opt_dict(body: dict[str, Any], name: str, path: str | None = None) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"'{path or name}' must be an object", path or name)
    return value


def req_list(body: dict[str, Any], name: str, *, non_empty: bool = True) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list) or (non_empty and not value):
        what = "a non-empty array" if non_empty else "an array"
        raise invalid(f"'{name}' must be {what}", name)
    return value


def opt_list(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"'{name}' must be an array", name)
    return value


def stop_strings(value: Any, name: str, limit: int, *, single: bool = True
                 ) -> tuple[str, ...]:
    """`stop`: a list of up to `limit` non-empty strings, or (`single`) one string."""
    if value is None:
        return ()
    items = [value] if single and isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > limit:
        what = "a string or an array" if single else "an array"
        raise invalid(f"'{name}' must be {what} of at most {limit} strings", name)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise invalid(f"'{name}[{i}]' must be a non-empty string", f"{name}[{i}]")
    return tuple(items)


def check_tool_schema(fn: dict[str, Any], path: str, schema_key: str) -> None:
    """A function tool: a name and an optional JSON-schema object."""
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 128:
        raise invalid(f"'{path}.name' must be a non-empty string", f"{path}.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise invalid(f"'{path}.description' must be a string", f"{path}.description")
    schema = fn.get(schema_key)
    if schema is not None and not isinstance(schema, dict):
        raise invalid(f"'{path}.{schema_key}' must be an object", f"{path}.{schema_key}")


def tool_round_trip_break(messages: Sequence[Mapping[str, Any]]) -> tuple[int, str] | None:
    """The first break in a conversation's tool round trips (OpenAI-shaped messages), which
    OpenAI and Anthropic refuse: (index of a `tool` message, its tool_call_id) when the id
    names no call of the assistant message that its run of tool messages follows, or (index
    of an assistant message, a call id) when the message after its run of tool messages comes
    before that call was answered, or when the conversation ends on a run of tool messages
    that leaves one of its calls unanswered. None when every round trip closes; the calls of
    a last assistant message need no answers yet. OpenAI and Anthropic both refuse such a
    conversation, and the engine must too: it renders results in order, without their ids, so
    a stray or missing one would reach the model as the answer to another call."""
    calls: tuple[str, ...] = ()  # the ids of the assistant message the tool messages answer
    owner, answered = -1, set[str]()
    for i, msg in enumerate(messages):
        if msg.get("role") == "tool":
            call_id = str(msg.get("tool_call_id"))
            if call_id not in calls:
                return i, call_id
            answered.add(call_id)
            continue
        missing = [call_id for call_id in calls if call_id not in answered]
        if missing:
            return owner, missing[0]
        calls = _call_ids(msg) if msg.get("role") == "assistant" else ()
        owner, answered = i, set()
    missing = [call_id for call_id in calls if call_id not in answered]
    return (owner, missing[0]) if answered and missing else None


def _call_ids(msg: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(call.get("id")) for call in msg.get("tool_calls") or ()
                 if isinstance(call, Mapping))
