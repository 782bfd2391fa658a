"""Which server an `--upstream URL` (no `KIND=`) is, so its replica gets the right cache model.

The probes, in order, each a GET with a short timeout:
- the host: `api.openai.com` is OpenAI (its 1024/128 rule), `api.anthropic.com` Anthropic;
- `GET {url}/models`: vLLM and SGLang name themselves in `owned_by` ("vllm", "sglang") and
  give `max_model_len`; llama.cpp's server says "llamacpp" (with `meta.n_ctx`);
- `GET {root}/props` (root: the URL without `/v1`): llama.cpp's server answers with
  `total_slots` and `default_generation_settings` (its slot count, read for the slot model).
An upstream that answers none of them in a known way is served as the generic `openai` kind
(a radix shadow with 16-token pages, the safe default for a self-hosted server); the pool still
switches it to the slot model if its responses turn out to carry llama.cpp's `timings` block.
Every decision is logged once, with the evidence it rests on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import httpx

from gateway.config import UpstreamKind

logger = logging.getLogger("prefixgate.upstream")

FALLBACK_KIND: UpstreamKind = "openai"
SERVER_OWNERS: dict[str, UpstreamKind] = {"vllm": "vllm", "sglang": "sglang",
                                          "llamacpp": "llamacpp"}
OPENAI_OWNERS = frozenset({"openai", "system", "openai-internal"})


class Detection(NamedTuple):
    """What an upstream turned out to be: its kind, why we think so, and what it told us
    about its cache (llama.cpp: slots; vLLM/SGLang: the model's context length)."""

    kind: UpstreamKind
    evidence: str
    slots: int | None = None
    max_model_len: int | None = None

    @property
    def detected(self) -> bool:
        """False when nothing identified the server (the fallback kind is in use)."""
        return not self.evidence.startswith("fallback")


def kind_from_host(url: str) -> Detection | None:
    """The hosted APIs, known by their host name alone."""
    host = httpx.URL(url).host
    if host.endswith("api.openai.com"):
        return Detection("openai", f"host {host}")
    if host.endswith("api.anthropic.com"):
        return Detection("anthropic", f"host {host}")
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def kind_from_models(payload: Any) -> Detection | None:
    """A `/v1/models` answer: the first model's `owned_by` names the server."""
    data = payload.get("data") if isinstance(payload, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if first is None:
        return None
    owner = str(first.get("owned_by") or "").lower()
    meta = first.get("meta")
    n_ctx = _int(meta.get("n_ctx")) if isinstance(meta, dict) else None
    length = _int(first.get("max_model_len")) or n_ctx
    if owner in SERVER_OWNERS:
        return Detection(SERVER_OWNERS[owner], f"/v1/models owned_by={owner!r}",
                         max_model_len=length)
    if owner in OPENAI_OWNERS:
        return Detection("openai", f"/v1/models owned_by={owner!r}")
    return None


def kind_from_props(payload: Any) -> Detection | None:
    """A `/props` answer: llama.cpp's server reports its slots there."""
    if not isinstance(payload, dict):
        return None
    settings = payload.get("default_generation_settings")
    slots = _int(payload.get("total_slots"))
    if slots is None and not isinstance(settings, dict):
        return None
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return Detection("llamacpp", f"/props total_slots={slots}", slots=slots, max_model_len=n_ctx)


GetJson = Callable[[str], Awaitable[Any]]
"""Fetches `url` and returns its JSON, or None when it does not answer 200 with JSON."""


def api_root(url: str) -> str:
    """The server's root for `/props`: the API base without a trailing `/v1`."""
    return url.rstrip("/").removesuffix("/v1")


async def detect_kind(url: str, get_json: GetJson) -> Detection:
    """Probe the upstream at `url` (see the module docstring); never raises for a server that
    does not answer: the fallback kind comes back instead."""
    base = url.rstrip("/")
    found = kind_from_host(url)
    if found is not None:
        return found
    models = kind_from_models(await get_json(f"{base}/models"))
    if models is not None and models.kind != "llamacpp":
        return models
    props = kind_from_props(await get_json(f"{api_root(url)}/props"))
    if props is not None:
        evidence = f"{models.evidence}, {props.evidence}" if models else props.evidence
        return props._replace(evidence=evidence)
    if models is not None:  # llama.cpp without /props (an old build): slot count unknown
        return models
    return Detection(FALLBACK_KIND, "fallback: neither /v1/models nor /props named the server")


def log_detection(replica: str, url: str, found: Detection, model: str) -> None:
    """One line per replica: what it is, why, and the cache model it gets."""
    extra = "".join(f", {name} {value}" for name, value in (
        ("slots", found.slots), ("context", found.max_model_len)) if value)
    if found.detected:
        logger.info("upstream %s (%s): detected %s from %s%s; cache model %s",
                    replica, url, found.kind, found.evidence, extra, model)
    else:
        logger.warning("upstream %s (%s): kind not detected (%s); serving it as %r with cache "
                       "model %s (pass --upstream KIND=URL to choose)", replica, url,
                       found.evidence, found.kind, model)


__all__ = ["Detection", "api_root", "detect_kind", "kind_from_host", "kind_from_models",
           "kind_from_props", "log_detection"]
