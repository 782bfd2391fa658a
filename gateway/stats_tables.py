"""The stats database's tables: one `RequestRecord` per request (gateway.stats writes them),
and beside them the per-minute, per-hour and per-day rollups of those rows (gateway.rollups
keeps them)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import BigInteger, Boolean, DateTime, Float, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """Declarative base of the gateway's tables."""


def utcnow() -> datetime:
    return datetime.now(UTC)


class RequestRecord(Base):
    """What the gateway remembers about one request (no prompt text unless --store-prompts)."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    request_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    model: Mapped[str] = mapped_column(String(256))
    backend: Mapped[str] = mapped_column(String(32))
    replica: Mapped[str | None] = mapped_column(String(512), nullable=True)
    provider: Mapped[str] = mapped_column(String(16))
    route: Mapped[str] = mapped_column(String(64))
    status: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    predicted_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reported_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    tpot_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    prefill_saved_ms: Mapped[float] = mapped_column(Float, default=0.0)
    # token counts are the gateway's estimate: the upstream sent no usage
    usage_estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    lint_ids: Mapped[str] = mapped_column(String(512), default="")
    family: Mapped[str | None] = mapped_column(String(128), nullable=True)
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_text: Mapped[str | None] = mapped_column(Text, nullable=True)


class RequestRollup(Base):
    """The sums of the requests of one period (a minute, an hour or a day: `period` seconds from
    `start`, an epoch second) with one (tenant, model, replica, backend, family, status).

    The key is the primary key, so gateway.rollups adds to a row with one SQL upsert. A primary
    key holds no NULL: a NULL replica or family is stored as '' with its bit set in `nulls`
    (1: replica, 2: family), so NULL and '' stay two groups."""

    __tablename__ = "stats_rollups"

    period: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    replica: Mapped[str] = mapped_column(String(512), primary_key=True)
    backend: Mapped[str] = mapped_column(String(32), primary_key=True)
    family: Mapped[str] = mapped_column(String(128), primary_key=True)
    status: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    nulls: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    predicted_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reported_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    predicted_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prefill_saved_ms: Mapped[float] = mapped_column(Float, default=0.0)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)


class LintRollup(Base):
    """How many of one period's requests one lint rule fired on."""

    __tablename__ = "stats_lint_rollups"

    period: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rule: Mapped[str] = mapped_column(String(512), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)


class RollupState(Base):
    """Which rollups were built, with which columns (rebuilt when these change), and up to
    which `requests.id` they hold every row (`watermark`; rows above it are read raw)."""

    __tablename__ = "stats_rollup_state"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    columns: Mapped[str] = mapped_column(Text)
    watermark: Mapped[int] = mapped_column(BigInteger, default=0)
