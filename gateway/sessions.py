"""The dashboard's session cookie and sign-out's revocation list.

A session value is `expiry.id.signature`: a random id and its expiry time (`SESSION_TTL_S`
after sign-in), signed with HMAC-SHA256 under the admin key, so changing the admin key signs
every browser out. Signing out revokes the id: it is kept in this process's memory and in the
stats database's `revoked_sessions` table until the value would have expired anyway, so every
gateway process on that database refuses a copy of the cookie, also after a restart. While the
database does not answer, a process knows only its own sign-outs (and a sign-out it could not
write is kept in its memory alone); every row past its expiry is deleted at the next sign-out.
Database calls block: callers run them in a worker thread.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from sqlalchemy import BigInteger, Column, MetaData, String, Table, delete, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.schema import CreateTable

from gateway.config import GatewayConfig

log = logging.getLogger("prefixgate.sessions")
SESSION_COOKIE = "prefixgate_session"
SESSION_TTL_S = 12 * 3600
MAX_REVOKED = 10_000  # sign-outs remembered in memory (the database keeps every one)
_ID_CHARS = frozenset("0123456789abcdef")

_metadata = MetaData()
REVOKED = Table("revoked_sessions", _metadata,
                Column("session_id", String(64), primary_key=True),
                Column("expires", BigInteger, nullable=False))


class Session(NamedTuple):
    """A signed, unexpired session value's id and expiry (seconds since the epoch)."""

    session_id: str
    expires: int


def _signature(admin_key: str, expires: int, session_id: str) -> str:
    message = f"session:{expires}:{session_id}".encode()
    return hmac.new(admin_key.encode(), message, hashlib.sha256).hexdigest()


def session_token(config: GatewayConfig, now: float | None = None) -> str:
    """A fresh session value (`expiry.id.signature`); needs an admin key."""
    if config.admin_key is None:
        raise ValueError("sessions need an admin key")
    expires = int(now if now is not None else time.time()) + SESSION_TTL_S
    session_id = secrets.token_hex(16)
    return f"{expires}.{session_id}.{_signature(config.admin_key, expires, session_id)}"


def signed_session(token: str, config: GatewayConfig, now: float | None = None
                   ) -> Session | None:
    """The session of an unexpired value signed with the current admin key, else None
    (revocation is `Revocations`' question)."""
    if config.admin_key is None:
        return None
    expires_text, _, rest = token.partition(".")
    session_id, _, signature = rest.partition(".")
    if not expires_text.isdigit() or len(expires_text) > 12:
        return None
    if len(session_id) != 32 or not _ID_CHARS.issuperset(session_id):
        return None
    expires = int(expires_text)
    if expires < (now if now is not None else time.time()):
        return None
    expected = _signature(config.admin_key, expires, session_id)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    return Session(session_id, expires)


class Revocations:
    """Signed-out session ids until their expiry: in memory (at most `max_kept`, the oldest
    dropped) and in the `revoked_sessions` table of `engine`. Thread-safe; blocking."""

    def __init__(self, engine: Engine, *, max_kept: int = MAX_REVOKED,
                 clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.max_kept = max_kept
        self.clock = clock
        self._kept: dict[str, int] = {}  # session id -> expiry, oldest first
        self._lock = threading.Lock()
        self._table_ready = False

    def __len__(self) -> int:
        """Sign-outs held in memory now."""
        with self._lock:
            return len(self._kept)

    def revoke(self, session: Session) -> None:
        """Refuse `session` from now until its expiry."""
        with self._lock:
            self._forget_expired()
            self._kept[session.session_id] = session.expires
            if len(self._kept) > self.max_kept:
                del self._kept[next(iter(self._kept))]
        try:
            self._write(session)
        except SQLAlchemyError as exc:
            log.warning("sign-out not written to the stats database (%s): other gateway "
                        "processes accept that cookie until it expires", type(exc).__name__)

    def is_revoked(self, session: Session) -> bool:
        """True when `session` was signed out (here, or at any process whose sign-out reached
        the database); False when the database does not answer and this process did not."""
        with self._lock:
            if session.session_id in self._kept:
                return True
        try:
            self._ensure_table()
            query = select(REVOKED.c.session_id).where(
                REVOKED.c.session_id == session.session_id)
            with self.engine.connect() as conn:
                return conn.execute(query).first() is not None
        except SQLAlchemyError as exc:
            log.warning("could not ask the stats database whether a session was signed out "
                        "(%s)", type(exc).__name__)
            return False

    def _forget_expired(self) -> None:
        now = self.clock()
        for session_id in [s for s, expires in self._kept.items() if expires < now]:
            del self._kept[session_id]

    def _write(self, session: Session) -> None:
        self._ensure_table()
        with self.engine.begin() as conn:
            conn.execute(delete(REVOKED).where(REVOKED.c.expires < self.clock()))
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(REVOKED).values(session_id=session.session_id,
                                                    expires=session.expires))
        except IntegrityError:  # signed out twice: the row is there already
            pass

    def _ensure_table(self) -> None:
        """Make the table on first use (`IF NOT EXISTS`: processes starting together on one
        database may both try)."""
        if not self._table_ready:
            with self.engine.begin() as conn:
                conn.execute(CreateTable(REVOKED, if_not_exists=True))
            self._table_ready = True
