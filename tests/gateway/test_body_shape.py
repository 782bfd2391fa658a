"""`check_shape` (the level-by-level walk) and `parse_body` against a plain recursive
reference."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.body import MAX_INT, check_shape, parse_body
from gateway.errors import GatewayError

MAX_DEPTH = 4


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def reference_ok(value: Any, max_depth: int, strings: bool, depth: int = 1) -> bool:
    """What check_shape accepts, written as the definition reads."""
    if isinstance(value, dict):
        keys_ok = not strings or all(_encodes(k) for k in value)
        return depth <= max_depth and keys_ok and all(
            reference_ok(v, max_depth, strings, depth + 1) for v in value.values())
    if isinstance(value, list):
        return depth <= max_depth and all(
            reference_ok(v, max_depth, strings, depth + 1) for v in value)
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -MAX_INT <= value < MAX_INT
    if isinstance(value, float):
        return math.isfinite(value) and -MAX_INT < value < MAX_INT
    if isinstance(value, str):
        return not strings or _encodes(value)
    return True


texts = st.sampled_from(["a", "b", "\ud800", "ok \U0001f600", ""])
scalars = st.one_of(
    st.none(), st.booleans(), texts,
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 9.3e18, 1e300,
                     -(2.0**63), 2**64 - 1, 2**64]),
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(texts, inner, max_size=3), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(value=json_values, strings=st.booleans())
def test_check_shape_agrees_with_the_recursive_reference(value: Any, strings: bool) -> None:
    body = {"x": value}
    if reference_ok(body, MAX_DEPTH, strings):
        check_shape(body, MAX_DEPTH, strings=strings)
    else:
        with pytest.raises(GatewayError) as caught:
            check_shape(body, MAX_DEPTH, strings=strings)
        assert caught.value.status == 400


def test_depth_bound_is_exact() -> None:
    at_bound: Any = {"x": [[[]]]}  # the dict is level 1, the innermost list level 4
    check_shape(at_bound, 4)
    with pytest.raises(GatewayError, match="deeper than 3 levels"):
        check_shape(at_bound, 3)


@settings(max_examples=400, deadline=None)
@given(value=json_values, ascii_only=st.booleans())
def test_parse_body_agrees_with_the_recursive_reference(value: Any, ascii_only: bool) -> None:
    """A body as a client's JSON encoder writes it (lone surrogates escaped as `\\udXXX`,
    NaN as a bare constant) is a 400 exactly when the reference refuses what it holds."""
    body = {"x": value}
    try:
        raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    except UnicodeEncodeError:  # pragma: no cover - surrogatepass encodes every str
        return
    if not ascii_only and not _encodes(raw.decode("utf-8", "surrogatepass")):
        raw = json.dumps(body).encode()  # raw UTF-8 cannot carry a lone surrogate
    if reference_ok(body, MAX_DEPTH, strings=True):
        assert parse_body(raw, MAX_DEPTH) == json.loads(raw)
    else:
        with pytest.raises(GatewayError) as caught:
            parse_body(raw, MAX_DEPTH)
        assert caught.value.status == 400


@pytest.mark.parametrize("text", ['"\\ud800"', '"\\uDBFF x"', '"x \\udc00"',
                                  '"\\ude00\\ud83d"'])
def test_a_lone_surrogate_escape_is_a_400_in_a_value_or_a_key(text: str) -> None:
    for raw in (f'{{"x": {text}}}', f'{{{text}: 1}}'):
        with pytest.raises(GatewayError, match="surrogate"):
            parse_body(raw.encode(), MAX_DEPTH)
    assert parse_body(b'{"x": "\\ud83d\\ude00"}', MAX_DEPTH) == {"x": "\U0001f600"}
