"""`prefixgate stats`: print a running gateway's cache statistics as terminal tables.

    prefixgate stats --url http://127.0.0.1:8000 --admin-key KEY [--window 6h] [--json]

It reads `GET /api/stats` (the same numbers as the dashboard). The admin key may also come
from `PREFIXGATE_ADMIN_KEY`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

import httpx

Column = tuple[str, str, Callable[[Any], str]]
# C0 and C1 controls, DEL, and the bidirectional overrides and isolates that reorder a line
_WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _num(value: Any) -> str:
    return f"{int(value or 0):,}"


def _pct(value: Any) -> str:
    return f"{100 * float(value or 0):.1f}%"


def _usd(value: Any) -> str:
    return f"${float(value or 0):.4f}"


def _ms(value: Any) -> str:
    value = float(value or 0)
    return f"{value / 1000:.1f} s" if value >= 1000 else f"{value:.1f} ms"


def printable(text: str) -> str:
    """`text` with control characters written as visible escapes (`\\x1b`, `\\r`, `\\u202e`).

    Names reach the operator's terminal as they were stored, and a client chooses some of them
    (a request's `model`): a raw ESC, BEL or CR would recolour, retitle or overwrite the
    terminal, and a bidirectional override would show the name reversed."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def display_width(text: str) -> int:
    """Terminal columns `text` takes: two for an East Asian wide or fullwidth character (CJK,
    most emoji), none for a combining mark, one otherwise."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def _pad(text: str, width: int, *, left: bool) -> str:
    """`text` padded with spaces to `width` terminal columns (not characters)."""
    fill = " " * max(0, width - display_width(text))
    return text + fill if left else fill + text


def _text(value: Any) -> str:
    return "-" if value is None else printable(str(value))


GROUP_COLUMNS: list[Column] = [
    ("requests", "requests", _num), ("4xx", "client_errors", _num), ("5xx", "failures", _num),
    ("prompt", "prompt_tokens", _num), ("cached", "cached_tokens", _num),
    ("hit rate", "hit_rate", _pct), ("predicted", "predicted_cached_tokens", _num),
    ("reported", "reported_cached_tokens", _num), ("prefill saved", "prefill_saved_ms", _ms),
    ("$ saved", "cost_saved_usd", _usd),
]


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Rows as an aligned text table (first column left-aligned, numbers right-aligned)."""
    header = [title for title, _, _ in columns]
    cells = [[fmt(row.get(key)) for _, key, fmt in columns] for row in rows]
    widths = [max(display_width(c) for c in col) for col in zip(header, *cells, strict=True)]

    def line(values: Sequence[str]) -> str:
        first = _pad(values[0], widths[0], left=True)
        rest = (_pad(v, w, left=False) for v, w in zip(values[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(c) for c in cells)])


def render(stats: dict[str, Any]) -> str:
    """The whole report: totals, then one table per breakdown."""
    t = stats["totals"]
    hours = stats["window_s"] / 3600
    parts = [
        f"prefixgate stats: last {hours:g} h, generated {stats['generated_at']}",
        f"requests {_num(t['requests'])} (client errors {_num(t['client_errors'])}, "
        f"failures {_num(t['failures'])})   "
        f"hit rate {_pct(t['hit_rate'])}   cached {_num(t['cached_tokens'])} of "
        f"{_num(t['prompt_tokens'])} prompt tokens",
        f"prefill time saved {_ms(t['prefill_saved_ms'])}   cost saved {_usd(t['cost_saved_usd'])}"
        f" (of {_usd(t['cost_usd'] + t['cost_saved_usd'])})   predicted vs reported hits "
        f"{_num(t['predicted_cached_tokens'])} / {_num(t['reported_cached_tokens'])} tokens",
    ]
    for title, key, name in (("tenant", "by_tenant", "tenant"), ("model", "by_model", "model"),
                             ("replica", "by_replica", "replica"),
                             ("prompt family", "families", "family")):
        if stats.get(key):
            columns: list[Column] = [(title, name, _text), *GROUP_COLUMNS]
            parts += ["", format_table(stats[key], columns)]
    if stats.get("lint"):
        lint_cols: list[Column] = [("lint rule", "id", _text), ("requests", "requests", _num)]
        parts += ["", format_table(stats["lint"], lint_cols)]
    return "\n".join(parts)


def window_seconds(text: str) -> int:
    """`--window` in seconds: a number of seconds, or one with a unit (90m, 6h, 7d), the forms
    the dashboard's `?window=` takes."""
    match = re.fullmatch(r"([0-9]+)([smhd]?)", text.strip())
    if match is None or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(
            f"expected seconds or a number with s, m, h or d (6h, 7d), got {text!r}")
    return int(match[1]) * _WINDOW_UNITS[match[2] or "s"]


def fetch(url: str, admin_key: str | None, window_s: int,
          transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """GET /api/stats from a running gateway; a RuntimeError naming the URL when it does not
    answer or answers other than 200."""
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    with httpx.Client(base_url=url, timeout=30.0, transport=transport) as client:
        try:
            response = client.get("/api/stats", params={"window": window_s}, headers=headers)
        except httpx.TransportError as exc:  # refused, timed out, no such host: say which
            raise RuntimeError(f"cannot reach {url}/api/stats: {type(exc).__name__}: "
                               f"{printable(str(exc))}") from exc
    if response.status_code != 200:
        raise RuntimeError(f"{url}/api/stats answered {response.status_code}: "
                           f"{printable(response.text[:200])}")
    try:
        stats = response.json()
    except ValueError:  # another service on that port, or a proxy's page
        stats = None
    if not isinstance(stats, dict) or "totals" not in stats:
        raise RuntimeError(f"{url}/api/stats answered 200 with no gateway stats: "
                           f"{printable(response.text[:200])}")
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate stats", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--admin-key", default=os.environ.get("PREFIXGATE_ADMIN_KEY"))
    parser.add_argument("--window", type=window_seconds, default=86400,
                        help="history to show: seconds, or 90m / 6h / 7d (default 24h)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    args = parser.parse_args(argv)
    try:
        stats = fetch(args.url.rstrip("/"), args.admin_key, args.window)
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"prefixgate stats: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else render(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
