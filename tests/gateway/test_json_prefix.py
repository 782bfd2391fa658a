"""JsonPrefix: the start of one JSON value, checked a piece at a time."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.json_prefix import JsonPrefix

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


def fed(text: str, size: int) -> bool:
    """`JsonPrefix.ok` after `text` is fed in pieces of `size` characters."""
    prefix = JsonPrefix()
    for i in range(0, len(text), size):
        prefix.feed(text[i:i + size])
    return prefix.ok


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES, st.integers(1, 7), st.booleans())
def test_every_cut_of_a_json_document_is_a_prefix(value: Any, size: int, indent: bool) -> None:
    """Every prefix of what `json.dumps` writes (the reference) is a JSON prefix, whatever the
    pieces it is fed in; the document with another closer after it is not."""
    text = json.dumps(value, indent=2 if indent else None)
    assert all(fed(text[:cut], size) for cut in range(1, len(text) + 1))
    assert not fed(text + "]", size)


@pytest.mark.parametrize("text", [
    "{'city': 'Paris'}", '{"a": 1,}', '{"a" 1}', "[1,]", '{"a": 01}', '{"a": tru }',
    '{"a": "b\x01"}', '{"a": "\\q"}', '{"a": -}', '{"a": 1} x', '{"a": 1}}', "[1 2]"])
def test_text_json_refuses_is_no_prefix(text: str) -> None:
    """Texts the reference parser refuses, whose error is already written (no ending could
    mend them), are no prefix."""
    with pytest.raises(ValueError):
        json.loads(text)
    assert not fed(text, 3)
