"""Per-tenant upstream cache salt: tenants never share a provider's prefix cache.

The salt is derived on the server: HMAC-SHA256 of the request's cache namespace (the tenant,
plus "/" + the client's own `cache_salt` when it sent one) under a server secret. The tenant is
inside the HMAC, so a client salt can only split its own tenant's cache further, never name
another tenant's: whatever a client sends, it cannot produce another tenant's salt without the
secret. The secret comes from `PREFIXGATE_SALT_SECRET` (set the same value on every gateway
replica so they share upstream caches); without it a random per-process secret is used (with a
warning): still isolated, but a restart starts every upstream cache cold.

How each upstream kind receives it (`salt_upstream_body`, called from the OpenAI-compatible
backend's body builder, the one place a body leaves for an upstream):
- vLLM / SGLang / other OpenAI-compatible servers: `cache_salt` (vLLM mixes it into the hash of
  the first KV block, so salted prefixes never match across salts). The client's own
  `cache_salt` is replaced by the derived one.
- api.openai.com: `prompt_cache_key` derived from the salt (and the prompt family). OpenAI caches
  per organization; the key only steers routing, so tenants sharing one OpenAI organization
  are isolated only in routing, not strictly.
- Anthropic: no salt field exists; prompt caching is per organization/workspace, so tenants
  sharing one Anthropic key cannot be isolated by salt (use one workspace key per tenant).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any, Literal

log = logging.getLogger("prefixgate.salt")
SaltMode = Literal["cache_salt", "prompt_cache_key"]
SALT_PREFIX = "pg1-"


_WARNED: set[str] = set()


def _warn_once(logger: logging.Logger, message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


SALT_MEMO = 4096  # namespaces whose salt is remembered


class UpstreamSalter:
    """Derives the upstream salt of a cache namespace under the server secret."""

    def __init__(self, secret: str | None) -> None:
        if secret is None:
            _warn_once(log, "PREFIXGATE_SALT_SECRET is not set: using a random per-process salt "
                        "secret (upstream caches start cold on restart and are not shared "
                        "between gateway replicas)")
            secret = secrets.token_hex(32)
        self._key = secret.encode()
        self._known: dict[str, str] = {}  # namespace -> salt (bounded: SALT_MEMO entries)

    def __repr__(self) -> str:  # never show the secret
        return "UpstreamSalter()"

    def salt(self, namespace: str) -> str:
        """The salt sent upstream for `namespace` (tenant or tenant/client_salt); remembered
        for the next request of the namespace (a client's `cache_salt` chooses namespaces, so
        the memo is emptied when it reaches SALT_MEMO entries)."""
        found = self._known.get(namespace)
        if found is None:
            digest = hmac.new(self._key, namespace.encode("utf-8", "surrogatepass"),
                              hashlib.sha256).hexdigest()
            found = SALT_PREFIX + digest[:40]
            if len(self._known) >= SALT_MEMO:
                self._known.clear()
            self._known[namespace] = found
        return found


def prompt_cache_key(salt: str, family: str | None) -> str:
    """OpenAI's `prompt_cache_key` for one tenant (salt) and prompt family: no prompt text."""
    digest = hashlib.sha256(f"{salt}\x00{family or ''}".encode()).hexdigest()
    return f"pg-{digest[:24]}"


def salt_upstream_body(body: dict[str, Any], salt: str | None, mode: SaltMode,
                       family: str | None = None) -> None:
    """Put the tenant's salt into an outgoing OpenAI-format `body` (in place), replacing
    whatever the client sent in `cache_salt` / `prompt_cache_key`."""
    client_salt = body.pop("cache_salt", None)
    if salt is None:  # no tenant salt known (a backend used outside the gateway)
        if client_salt is not None and mode == "cache_salt":
            body["cache_salt"] = client_salt
        return
    if mode == "cache_salt":
        body["cache_salt"] = salt
        return
    client_key = body.get("prompt_cache_key")
    scope = f"{family or ''}\x00{client_key}" if isinstance(client_key, str) else family
    body["prompt_cache_key"] = prompt_cache_key(salt, scope)
