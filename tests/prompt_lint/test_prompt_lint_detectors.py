"""Pattern detectors on real formats and stable look-alikes; chunked tokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_lint.detectors import detect
from prompt_lint.tokens import chunks, get_encoding, shared_counter

POSITIVE = [
    ("Current time: 2026-11-29T14:03:07.123Z", "timestamp", "2026-11-29T14:03:07.123Z"),
    ("now 2026-11-29T14:03:07+01:00 local", "timestamp", "2026-11-29T14:03:07+01:00"),
    ("logged 2026-11-29 14:03:07 by cron", "timestamp", "2026-11-29 14:03:07"),
    ("Today is 2026-11-29.", "timestamp", "2026-11-29"),
    ("Date: Sun, 29 Nov 2026 14:03:07 +0000", "timestamp", "Sun, 29 Nov 2026 14:03:07 +0000"),
    ("It is Monday, November 29, 2026.", "timestamp", "Monday, November 29, 2026"),
    ("Due 29 November 2026, 14:03 sharp", "timestamp", "29 November 2026, 14:03"),
    ("Last login 29/11/2026 14:03 from web", "timestamp", "29/11/2026 14:03"),
    ("epoch=1795960987;", "timestamp", "1795960987"),
    ("ts 1795960987123 ms", "timestamp", "1795960987123"),
    ("The clock shows 14:03 now", "timestamp", "14:03"),
    ("meet at 9:30 AM", "timestamp", "9:30 AM"),
    ("Thursday at 17:45 UTC", "timestamp", "Thursday at 17:45 UTC"),
    ("trace 123e4567-e89b-12d3-a456-426614174000 open", "identifier",
     "123e4567-e89b-12d3-a456-426614174000"),
    ("sha d41d8cd98f00b204e9800998ecf8427e ok", "identifier", "d41d8cd98f00b204e9800998ecf8427e"),
    ("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3",
     "identifier",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3"),
    ("key sk-proj-abcDEF1234567890xyzABC in env", "identifier", "sk-proj-abcDEF1234567890xyzABC"),
    ("mail jane.doe+ops@example.co.uk now", "identifier", "jane.doe+ops@example.co.uk"),
    ("session_id: s-88412", "identifier", "s-88412"),
    ("Request ID = req_7f3k2", "identifier", "req_7f3k2"),
    ('{"trace_id": "tr-00af93"}', "identifier", "tr-00af93"),
    ("nonce: 8f3kQ9zX", "nonce", "8f3kQ9zX"),
    ("This is Request #42 today", "nonce", "42"),
    ("cache_buster=77812", "nonce", "77812"),
    ("blob 9fK2pQ7xLm3Nv8Rt5Wy1Zb4Hc end", "nonce", "9fK2pQ7xLm3Nv8Rt5Wy1Zb4Hc"),
]

NEGATIVE = [
    "Version 1.2.3 of the client, release v2026.11 and Python 3.11.",
    "Node 20.10.0 and Go 1.22 are supported.",
    "def f(x): return x[1:3] + y[2:10]",
    "Screens use a 16:9 ratio; John 3:16 is a quote.",
    "Listen on port 8080 and 127.0.0.1:8000.",
    "Follow RFC 2822 and ISO 8601 when you write dates.",
    "Call getUserAccountSettingsHandler from the service layer.",
    "See /usr/local/lib/python3.11/site-packages and https://example.com/a/b/c.",
    "Step 3: run the tests. Step 4: commit.",
    "Return HTTP 404 or 409; tickets look like ENG-1234.",
    "Budget: 1024 tokens, 200 words, 7 bullets.",
    "The user is friendly and the session is long.",
    "Escalate refunds above 500 EUR; call 555-123-4567 only in emergencies.",
]


@pytest.mark.parametrize(("text", "kind", "value"), POSITIVE)
def test_detects_real_formats(text: str, kind: str, value: str) -> None:
    spans = detect(text)
    assert [(s.kind, s.value) for s in spans] == [(kind, value)]
    assert text[spans[0].start:spans[0].end] == value


@pytest.mark.parametrize("text", NEGATIVE)
def test_ignores_stable_lookalikes(text: str) -> None:
    assert detect(text) == []


def test_offsets_span_lines() -> None:
    text = "stable line\nuser_id: alice_77\nCurrent time: 2026-11-29T14:03:07Z\n"
    for span in detect(text):
        assert text[span.start:span.end] == span.value
    assert [s.value for s in detect(text)] == ["alice_77", "2026-11-29T14:03:07Z"]


_TEXT = st.lists(st.sampled_from(list("ab Z9.:-_\n\t\r") + ["\n\n", "  x", "é", "中", "\u00a0"]),
                 max_size=60).map("".join)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
def test_chunked_tokens_equal_whole_text_tokens(text: str) -> None:
    """Cutting at newline-then-non-space never changes cl100k tokens (reference: tiktoken)."""
    encoding = get_encoding()
    assert "".join(chunks(text)) == text
    assert shared_counter().encode(text) == encoding.encode_ordinary(text)


@settings(max_examples=100, deadline=None)
@given(_TEXT, st.integers(min_value=0, max_value=80))
def test_count_prefix_matches_tiktoken(text: str, end: int) -> None:
    end = min(end, len(text))
    expected = len(get_encoding().encode_ordinary(text[:end]))
    assert shared_counter().count_prefix(text, end) == expected
