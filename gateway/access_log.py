"""Keep secrets out of access logs: query parameters that look like credentials are redacted.

uvicorn's access logger formats `(client, method, path?query, http_version, status)`; the
`RedactQuery` filter rewrites the path argument before any handler sees it, so
`/dashboard?key=ADMIN` is logged as `/dashboard?key=[redacted]`. A parameter is redacted when
its name says credential (`key`, `token`, `auth`, ...), when its value has the form of one
(`sk-...`, `Bearer ...`, a JWT, a GitHub or AWS key) or when its value is one of the gateway's
own keys (`install(secrets)`), whatever the name (`?q=sk-...`). The gateway itself never reads
a key from a URL; this guards clients that still put one there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

ACCESS_LOGGER = "uvicorn.access"
SECRET_NAMES = re.compile(r"key|token|secret|password|passwd|auth|session|signature|sig$",
                          re.IGNORECASE)
SECRET_VALUES = re.compile(
    r"^(?:sk|pk|rk)[-_]|^(?:ghp|gho|ghs|ghu|github_pat)_|^xox[abprs]-|^AKIA[0-9A-Z]{12}"
    r"|^eyJ[\w-]+\.[\w-]+|^bearer\s", re.IGNORECASE)
REDACTED = "[redacted]"
_KNOWN: set[str] = set()  # the gateway's own keys: redacted wherever they appear as a value


def _secret(name: str, value: str) -> bool:
    return bool(SECRET_NAMES.search(name) or SECRET_VALUES.search(value.strip())
                or value in _KNOWN)


def redact_target(target: str) -> str:
    """`path?query` with every credential-looking parameter's value replaced."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    pairs = parse_qsl(query, keep_blank_values=True)
    if not pairs and query:  # not a parsable query: drop it whole rather than risk a leak
        return f"{path}?{REDACTED}"
    clean = [(k, REDACTED if _secret(k, v) else v) for k, v in pairs]
    return f"{path}?{urlencode(clean, safe='[]')}"


class RedactQuery(logging.Filter):
    """A logging filter that redacts credential-looking query parameters in any str argument
    of a record that contains a `?` (uvicorn's access line carries the request target)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(redact_target(a) if isinstance(a, str) and "?" in a else a
                                for a in record.args)
        elif isinstance(record.msg, str) and "?" in record.msg and not record.args:
            record.msg = " ".join(redact_target(w) if "?" in w else w
                                  for w in record.msg.split(" "))
        return True


def install(secrets: Iterable[str] = ()) -> None:
    """Attach the filter to uvicorn's access logger once (idempotent); `secrets` (the
    gateway's API and admin keys) are redacted as values under any parameter name."""
    _KNOWN.update(s for s in secrets if s)
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuery) for f in logger.filters):
        logger.addFilter(RedactQuery())
