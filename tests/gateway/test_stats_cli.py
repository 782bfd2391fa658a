"""`prefixgate stats` output as a terminal shows it: names that clients choose (a model id) or
that carry wide characters must neither drive the operator's terminal nor skew the tables."""

from __future__ import annotations

import unicodedata
from typing import Any

import httpx
import pytest

from gateway import stats_cli
from tests.support import free_port


def _group(name: str, value: str, requests: int) -> dict[str, Any]:
    """One breakdown row as /api/stats sends it."""
    return {name: value, "requests": requests, "client_errors": 0, "failures": 0,
            "prompt_tokens": 100, "cached_tokens": 50, "hit_rate": 0.5,
            "predicted_cached_tokens": 50, "reported_cached_tokens": 50,
            "prefill_saved_ms": 1.0, "cost_saved_usd": 0.0}


def _stats(models: list[str], tenants: list[str]) -> dict[str, Any]:
    """A minimal /api/stats answer whose model and tenant tables hold the given names."""
    totals = _group("x", "", len(models)) | {"cost_usd": 0.0}
    return {"generated_at": "2026-01-01T00:00:00+00:00", "window_s": 3600, "totals": totals,
            "by_tenant": [_group("tenant", t, 1) for t in tenants],
            "by_model": [_group("model", m, 1) for m in models], "by_replica": [],
            "families": [], "lint": []}


def test_control_characters_in_names_never_reach_the_terminal() -> None:
    """A client picks its request's `model`; an ESC, BEL or CR in it printed raw would recolour,
    retitle or overwrite the operator's terminal. They are shown as visible escapes instead."""
    evil = "evil\x1b[31mRED\x1b]0;owned\x07\r\x1b[2K\x9b2J\u202egnp.exe"
    out = stats_cli.render(_stats([evil, "gpt-4o"], ["acme"]))
    control = [ch for ch in out if ch != "\n"
               and (unicodedata.category(ch) == "Cc" or ch in "\u202a\u202b\u202c\u202d\u202e")]
    assert control == []
    assert "evil\\x1b[31mRED\\x1b]0;owned\\x07\\r\\x1b[2K\\x9b2J\\u202egnp.exe" in out
    assert "gpt-4o" in out and "acme" in out


def test_wide_and_combining_characters_keep_the_columns_aligned() -> None:
    """A tenant named in CJK or with an emoji takes two terminal columns a character; padding
    by `len` shifts that row's numbers right of every other row's."""
    # each name's terminal columns, counted by hand: 租 户 and the fullwidth letters take two,
    # the rocket two, a combining accent none (the reference the alignment is checked against)
    widths = {"acme": 4, "租户-ünïcødé": 12, "🚀-rocket": 9, "e\u0301te\u0301": 3, "ＦＵＬＬ": 8}
    names = list(widths)
    columns: list[stats_cli.Column] = [("tenant", "tenant", stats_cli._text),
                                       ("requests", "requests", stats_cli._num)]
    rows = [{"tenant": name, "requests": 10 ** i} for i, name in enumerate(names)]
    lines = stats_cli.format_table(rows, columns).splitlines()
    assert len(lines) == 2 + len(names)
    # the last column is right-aligned: every line ends in the same terminal column
    ends = [len(line) for line in lines[:2]]  # the header and its rule are ASCII
    ends += [widths[name] + len(line) - len(name) for line, name in zip(lines[2:], names,
                                                                        strict=True)]
    assert len(set(ends)) == 1, lines
    for line, name in zip(lines[2:], names, strict=True):
        assert line.startswith(name)


def test_a_gateway_that_does_not_answer_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """With several gateways in a script, "Connection refused" alone does not say which one:
    the message names the URL that did not answer, and the exit status is 1."""
    url = f"http://127.0.0.1:{free_port()}"
    assert stats_cli.main(["--url", url, "--admin-key", "k"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"prefixgate stats: cannot reach {url}/api/stats: ConnectError")


@pytest.mark.parametrize("body", ["<html>sign in to the proxy</html>", "[1, 2]", '{"ok": true}'])
def test_an_answer_that_is_not_gateway_stats_is_an_error_not_a_traceback(body: str) -> None:
    """A URL that reaches something else (a proxy's page, another service) answering 200 is
    reported as such, not a JSONDecodeError or KeyError traceback."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    with pytest.raises(RuntimeError, match="answered 200 with no gateway stats"):
        stats_cli.fetch("http://proxy", "k", 3600, transport=transport)
