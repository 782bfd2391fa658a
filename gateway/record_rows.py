"""Stored-field normalisation at the edge of the stats database.

Every value a request carries into its `RequestRecord` is made storable on every supported
database before it is queued: text loses NUL characters (PostgreSQL rejects them), lone UTF-16
surrogates become U+FFFD (no encoder accepts them), strings are cut to their column's length,
integers are clamped to a 32-bit column and non-finite floats become NULL (or 0.0 where the
column is not nullable). A row that still fails alone is isolated by the writer, never its batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import Boolean, DateTime, Float, Integer, String, Table

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


class ColumnRule(NamedTuple):
    """How one column's values are normalised."""

    kind: str  # "str" | "int" | "float" | "bool" | "datetime"
    length: int | None  # max characters of a String column; None: unbounded
    nullable: bool


def column_rules(table: Table) -> dict[str, ColumnRule]:
    """One rule per column of `table` (the primary key excluded)."""
    rules: dict[str, ColumnRule] = {}
    for column in table.columns:
        if column.primary_key:
            continue
        kind = _kind(column.type)
        length = getattr(column.type, "length", None) if kind == "str" else None
        rules[column.name] = ColumnRule(kind, length, bool(column.nullable))
    return rules


def _kind(sql_type: Any) -> str:
    if isinstance(sql_type, Boolean):
        return "bool"
    if isinstance(sql_type, Integer):
        return "int"
    if isinstance(sql_type, Float):
        return "float"
    if isinstance(sql_type, DateTime):
        return "datetime"
    if isinstance(sql_type, String):
        return "str"
    raise TypeError(f"no normalisation rule for column type {sql_type!r}")


def clean_text(value: object, length: int | None = None) -> str:
    """`value` as text any database stores: no NUL, no lone surrogate, at most `length` chars."""
    text = value if isinstance(value, str) else str(value)
    if "\x00" in text:
        text = text.replace("\x00", "")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text[:length] if length is not None else text


def _clean_int(value: object) -> int:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return 0
    return int(max(INT_MIN, min(INT_MAX, number)))


def _clean_float(value: object, nullable: bool) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if math.isfinite(number):
        return number
    return None if nullable else 0.0


def _clean_datetime(value: object) -> datetime:
    """`value` as an aware UTC datetime (naive: UTC). SQLite stores a datetime's fields and
    drops its offset, and every window compares and buckets those fields as UTC."""
    if isinstance(value, datetime):
        return value.astimezone(UTC) if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, str):
        try:
            return _clean_datetime(datetime.fromisoformat(value))
        except ValueError:
            pass
    return datetime.now(UTC)


def clean_value(value: object, rule: ColumnRule) -> Any:
    """One value made storable under `rule` (None stays None in a nullable column)."""
    if value is None and (rule.nullable or rule.kind == "datetime"):
        return None if rule.kind != "datetime" else datetime.now(UTC)
    if rule.kind == "str":
        return clean_text("" if value is None else value, rule.length)
    if rule.kind == "int":
        return _clean_int(value)
    if rule.kind == "float":
        return _clean_float(value, rule.nullable)
    if rule.kind == "bool":
        return bool(value)
    return _clean_datetime(value)


def normalise_row(row: Mapping[str, Any], rules: Mapping[str, ColumnRule]) -> dict[str, Any]:
    """Every column of `row` made storable (keys without a rule are dropped)."""
    return {name: clean_value(row.get(name), rule) for name, rule in rules.items()}


def to_json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A normalised row in JSON-safe form (datetimes as ISO 8601), for the spill file."""
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()}
