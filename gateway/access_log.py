"""Keep secrets out of access logs: query parameters that look like credentials are redacted.

uvicorn's access logger formats `(client, method, path?query, http_version, status)`; the
`RedactQuery` filter rewrites the path argument before any handler sees it, so
`/dashboard?key=ADMIN` is logged as `/dashboard?key=[redacted]`. The gateway itself never reads
a key from a URL; this guards clients that still put one there.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, urlencode

ACCESS_LOGGER = "uvicorn.access"
SECRET_NAMES = re.compile(r"key|token|secret|password|passwd|auth|session|signature|sig$",
                          re.IGNORECASE)
REDACTED = "[redacted]"


def redact_target(target: str) -> str:
    """`path?query` with every credential-looking parameter's value replaced."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    pairs = parse_qsl(query, keep_blank_values=True)
    if not pairs and query:  # not a parsable query: drop it whole rather than risk a leak
        return f"{path}?{REDACTED}"
    clean = [(k, REDACTED if SECRET_NAMES.search(k) else v) for k, v in pairs]
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


def install() -> None:
    """Attach the filter to uvicorn's access logger once (idempotent)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuery) for f in logger.filters):
        logger.addFilter(RedactQuery())
