"""GatewayConfig, the gateway's frozen config, and the one typed place for PREFIXGATE_* env vars.

Precedence: defaults < `PREFIXGATE_*` environment variables < command-line flags.
A bad value fails loudly with the variable or flag named.

The embedded engine's settings are an `engine.EngineConfig` nested whole in `GatewayConfig.engine`:
every one of its fields is settable as `PREFIXGATE_ENGINE_<FIELD>` and as `--engine-<field>`
(`gateway.engine_flags`), so a new engine field needs no gateway change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from engine.config import EngineConfig
from gateway.engine_flags import engine_from_env, parse_bool

LintMode = Literal["off", "report", "rewrite"]
UpstreamKind = Literal["openai", "vllm", "sglang", "llamacpp", "anthropic"]
LINT_MODES: tuple[str, ...] = get_args(LintMode)
UPSTREAM_KINDS: tuple[str, ...] = get_args(UpstreamKind)
AUTO_KIND = "auto"  # `--upstream URL`: the kind is detected (gateway.upstream_detect)
DEFAULT_TENANT = "default"
DEFAULT_DB_URL = "sqlite:///prefixgate.db"
DEFAULT_MALLOC_THRESHOLD = 1 << 20  # glibc mmap/trim threshold in front of upstreams


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream replica: `--upstream openai=http://host:port/v1`, or `--upstream URL` (kind
    "auto": detected from the server at first use, see `gateway.upstream_detect`)."""

    kind: UpstreamKind | Literal["auto"]
    url: str

    def __post_init__(self) -> None:
        if self.kind not in (*UPSTREAM_KINDS, AUTO_KIND):
            raise ValueError(f"upstream kind must be one of {UPSTREAM_KINDS} (or none, to "
                             f"detect it), got {self.kind!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {self.url!r}")

    @classmethod
    def parse(cls, text: str) -> UpstreamSpec:
        """Parse `kind=URL`, or a bare `URL` (kind "auto")."""
        if text.strip().startswith(("http://", "https://")):
            return cls(kind="auto", url=text.strip())
        kind, sep, url = text.partition("=")
        if not sep:
            raise ValueError(f"upstream must look like URL or kind=URL, got {text!r}")
        return cls(kind=kind.strip(), url=url.strip())  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything `create_app` needs. Checked in `__post_init__`."""

    host: str = "127.0.0.1"
    port: int = 8000
    db_url: str = DEFAULT_DB_URL
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant; empty = open
    admin_key: str | None = None
    lint_mode: LintMode = "report"
    store_prompts: bool = False
    upstreams: tuple[UpstreamSpec, ...] = ()
    upstream_api_keys: Mapping[str, str] = field(default_factory=dict)  # kind -> key
    # how long an upstream may stay silent (no byte of its answer): the SDKs' own 600 s, since
    # a whole (non-streamed) answer sends nothing until its last token is generated
    upstream_timeout_s: float = 600.0
    price_table: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    # Embedded engine: the whole EngineConfig (model None: SmolLM2-135M-Instruct from the wheel).
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_name: str = "smollm2-135m-instruct"  # the id clients send as `model`
    model_aliases: tuple[str, ...] = ()  # extra ids accepted for the embedded model
    default_max_tokens: int = 256
    # Stats writer.
    stats_flush_interval_s: float = 0.25
    stats_batch_size: int = 256
    stats_max_queue: int = 10_000  # in-memory records; past it they spill to disk
    stats_spill_path: str | None = None  # None: beside the SQLite file / ./prefixgate-stats...
    # Reliability: upstream salt, admission, bounded work per request.
    salt_secret: str | None = field(default=None, repr=False)  # None: random per process
    max_tokens_cap: int = 4096  # a request's max_tokens is clamped to this
    max_concurrency: int = 256  # requests served at once (the rest wait, fairly by tenant)
    max_queue: int = 1024  # requests waiting for a slot; past it 503
    # on SIGTERM / Ctrl+C, requests in flight get this long to finish, then are cancelled and
    # recorded (499 "cancelled") before the process exits: inside Kubernetes' default 30 s
    graceful_timeout_s: int = 25
    tenant_max_concurrency: int | None = None  # per tenant in flight; past it 429
    tenant_rate_per_s: float | None = None  # per tenant requests/s (token bucket); past it 429
    tenant_burst: int | None = None  # bucket size (default: max(1, rate))
    lint_max_messages: int = 2000  # bodies with more messages are served unlinted
    lint_max_bytes: int = 1 << 20  # bodies larger than this are served unlinted
    max_json_depth: int = 64  # deeper request JSON is a 400
    # Bodies up to this size are linted and tokenized on the event loop when prompt_lint's lock
    # is free (that work is shorter than a worker-thread hop: measured with bench_gateway's
    # 4k-token requests), larger ones in a worker thread; 0: always in a worker thread.
    inline_prepare_bytes: int = 64 << 10
    # Memory: per-tenant template learner budget; glibc mmap/trim threshold (0: glibc default;
    # None: 128 KiB in front of upstreams, glibc's default beside the embedded engine).
    # The gateway's caches: prompt_lint's memos (MemoBudgets: 124 MiB), one learner per tenant
    # (lint_learner_bytes), one shadow per upstream replica (ShadowConfig.max_bytes: 16 MiB).
    lint_learner_bytes: int = 20 << 20
    malloc_threshold_bytes: int | None = None
    # Failed authentication (gateway.auth_limit): a client address whose presented keys were
    # wrong this many times within the window of the first is refused (429) for a window;
    # 0: no limit.
    auth_max_failures: int = 10
    auth_failure_window_s: float = 300.0
    # `Host` names answered besides loopback ones (gateway.host_guard); None: every name
    allowed_hosts: frozenset[str] | None = None
    # Other origins (names) whose web pages may POST to a gateway with no keys
    # (gateway.host_guard); None: any
    page_origins: frozenset[str] | None = frozenset()

    def __post_init__(self) -> None:
        if self.lint_mode not in LINT_MODES:
            raise ValueError(f"lint_mode must be one of {LINT_MODES}, got {self.lint_mode!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        _positive(self, "upstream_timeout_s", "max_body_bytes", "default_max_tokens")
        _positive(self, "stats_flush_interval_s", "stats_batch_size", "stats_max_queue",
                  "graceful_timeout_s")
        _positive(self, "max_tokens_cap", "max_concurrency", "max_queue", "lint_max_messages",
                  "lint_max_bytes", "max_json_depth", "lint_learner_bytes")
        if self.auth_max_failures < 0:
            raise ValueError(f"auth_max_failures must be >= 0, got {self.auth_max_failures}")
        _positive(self, "auth_failure_window_s")
        if self.inline_prepare_bytes < 0:
            raise ValueError(f"inline_prepare_bytes must be >= 0, got {self.inline_prepare_bytes}")
        threshold = self.malloc_threshold_bytes
        if threshold is not None and not 0 <= threshold <= 1 << 30:
            raise ValueError("malloc_threshold_bytes must be in 0..1 GiB, "
                             f"got {self.malloc_threshold_bytes}")
        for name in ("tenant_max_concurrency", "tenant_rate_per_s", "tenant_burst"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive when set, got {value}")
        if self.salt_secret is not None and len(self.salt_secret) < 16:
            raise ValueError("salt_secret must be at least 16 characters")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if not self.db_url or "://" not in self.db_url:
            raise ValueError(f"db_url must be an SQLAlchemy URL, got {self.db_url!r}")
        if self.admin_key is not None and not self.admin_key.strip():
            # an empty key would be the key of an empty sign-in form and sign sessions anyone
            # can forge: refuse it rather than open the stats to everyone
            raise ValueError("admin_key must not be empty (leave it unset for no admin key)")
        for key, tenant in self.api_keys.items():
            if not key or not tenant or "/" in tenant:
                raise ValueError(f"bad api key mapping {key[:4]}...->{tenant!r} (no '/' in tenant)")
        if not self.model_name:
            raise ValueError("model_name must not be empty")

    @property
    def served_models(self) -> tuple[str, ...]:
        """Model ids the embedded backend answers to."""
        return (self.model_name, *self.model_aliases)

    def with_overrides(self, **changes: Any) -> GatewayConfig:
        """A copy with some fields changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def malloc_threshold(self, *, embedded: bool) -> int:
        """The glibc mmap/trim threshold to set: the configured one, else 1 MiB in front of
        upstreams (freed megabyte bodies go back to the system, while orjson's parse buffer of
        a body parsed on the event loop, about 16 times its size, stays in the heap: below the
        threshold every parse mapped fresh pages, 9 page faults and 52 us for a 24 KiB body
        against 0.4 and 22 us) and 0, glibc's own adaptive threshold, beside the embedded
        engine. A fixed low threshold there serves every activation tensor with a fresh mmap,
        zeroed page by page: an 810-token prefill took 4.7 s instead of 2.7-3.8 s."""
        if self.malloc_threshold_bytes is not None:
            return self.malloc_threshold_bytes
        return 0 if embedded else DEFAULT_MALLOC_THRESHOLD

    def with_engine(self, **changes: Any) -> GatewayConfig:
        """A copy whose EngineConfig has some fields changed (None values are ignored)."""
        kept = {k: v for k, v in changes.items() if v is not None}
        return replace(self, engine=replace(self.engine, **kept)) if kept else self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
        """Defaults, then PREFIXGATE_* variables, then `overrides` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {"engine": engine_from_env(env)}
        for name, (field_name, parse) in ENV_VARS.items():
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                values[field_name] = parse(raw)
            except ValueError as exc:
                raise ValueError(f"{name}={raw!r}: {exc}") from exc
        if "keys_file" in values:
            keys = dict(values.pop("keys_file"))
            keys.update(values.get("api_keys", {}))
            values["api_keys"] = keys
        upstream_keys = {
            kind: env[var] for kind, var in UPSTREAM_KEY_ENV.items() if env.get(var)
        }
        if upstream_keys:
            values["upstream_api_keys"] = upstream_keys
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _positive(config: GatewayConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def parse_api_key(text: str) -> tuple[str, str]:
    """`KEY` (tenant "default") or `KEY=TENANT`. The tenant follows the last "=", so a key may
    hold "=" itself: base64 keys end in "=" padding (`openssl rand -base64 32`), and a key
    that ends in "=" has no tenant."""
    text = text.strip()
    key, sep, tenant = text.rpartition("=")
    if not sep or not tenant.strip():
        key, tenant = text, DEFAULT_TENANT
    if not key:
        raise ValueError("empty api key")
    return key, tenant.strip()


def parse_api_keys(text: str) -> dict[str, str]:
    """Comma-separated `KEY` or `KEY=TENANT` items; at least one (a value of commas and
    blanks would leave the gateway open to anyone)."""
    keys = dict(parse_api_key(item) for item in text.split(",") if item.strip())
    if not keys:
        raise ValueError("no API key in the list (the gateway would be open to anyone)")
    return keys


def load_keys_file(path: str | Path) -> dict[str, str]:
    """A keys file: JSON {key: tenant}, or lines `KEY TENANT` / `KEY=TENANT` (# comments).
    A file with no key is an error: it would leave the gateway open to anyone."""
    keys = _read_keys_file(path)
    if not keys:
        raise ValueError(f"{path}: the keys file holds no key (the gateway would be open to "
                         "anyone)")
    return keys


def _read_keys_file(path: str | Path) -> dict[str, str]:
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: keys file JSON must map string keys to string tenants")
        return dict(data)
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pair = _key_line(line)
        if pair is None:
            raise ValueError(f"{path}:{number}: expected 'KEY TENANT', got {line!r}")
        keys[pair[0]] = pair[1]
    return keys


def _key_line(line: str) -> tuple[str, str] | None:
    """`KEY TENANT`, `KEY = TENANT` or `KEY=TENANT` (the key keeps any "=" of its own, as in
    `parse_api_key`); None for anything else."""
    parts = line.split()
    if len(parts) == 3 and parts[1] == "=":
        parts = [parts[0], parts[2]]
    if len(parts) == 2:
        return parts[0], parts[1]
    if len(parts) == 1:
        key, sep, tenant = line.rpartition("=")
        return (key, tenant) if sep and key and tenant else None
    return None


def parse_lint_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in LINT_MODES:
        raise ValueError(f"expected one of {LINT_MODES}, got {text!r}")
    return mode


def _parse_upstreams(text: str) -> tuple[UpstreamSpec, ...]:
    return tuple(UpstreamSpec.parse(item) for item in text.split(",") if item.strip())


ENV_VARS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "PREFIXGATE_HOST": ("host", str),
    "PREFIXGATE_PORT": ("port", int),
    "PREFIXGATE_DB": ("db_url", str),
    "PREFIXGATE_API_KEYS": ("api_keys", parse_api_keys),
    "PREFIXGATE_KEYS_FILE": ("keys_file", load_keys_file),
    "PREFIXGATE_ADMIN_KEY": ("admin_key", str),
    "PREFIXGATE_LINT_MODE": ("lint_mode", parse_lint_mode),
    "PREFIXGATE_STORE_PROMPTS": ("store_prompts", parse_bool),
    "PREFIXGATE_UPSTREAMS": ("upstreams", _parse_upstreams),
    "PREFIXGATE_UPSTREAM_TIMEOUT_S": ("upstream_timeout_s", float),
    "PREFIXGATE_PRICE_TABLE": ("price_table", str),
    "PREFIXGATE_MAX_BODY_BYTES": ("max_body_bytes", int),
    "PREFIXGATE_MODEL_NAME": ("model_name", str),
    "PREFIXGATE_DEFAULT_MAX_TOKENS": ("default_max_tokens", int),
    "PREFIXGATE_STATS_MAX_QUEUE": ("stats_max_queue", int),
    "PREFIXGATE_STATS_SPILL_PATH": ("stats_spill_path", str),
    "PREFIXGATE_SALT_SECRET": ("salt_secret", str),
    "PREFIXGATE_MAX_TOKENS_CAP": ("max_tokens_cap", int),
    "PREFIXGATE_MAX_CONCURRENCY": ("max_concurrency", int),
    "PREFIXGATE_MAX_QUEUE": ("max_queue", int),
    "PREFIXGATE_GRACEFUL_TIMEOUT_S": ("graceful_timeout_s", int),
    "PREFIXGATE_TENANT_MAX_CONCURRENCY": ("tenant_max_concurrency", int),
    "PREFIXGATE_TENANT_RATE": ("tenant_rate_per_s", float),
    "PREFIXGATE_TENANT_BURST": ("tenant_burst", int),
    "PREFIXGATE_LINT_MAX_MESSAGES": ("lint_max_messages", int),
    "PREFIXGATE_LINT_MAX_BYTES": ("lint_max_bytes", int),
    "PREFIXGATE_MAX_JSON_DEPTH": ("max_json_depth", int),
    "PREFIXGATE_INLINE_PREPARE_BYTES": ("inline_prepare_bytes", int),
    "PREFIXGATE_LINT_LEARNER_BYTES": ("lint_learner_bytes", int),
    "PREFIXGATE_MALLOC_THRESHOLD_BYTES": ("malloc_threshold_bytes", int),
    "PREFIXGATE_AUTH_MAX_FAILURES": ("auth_max_failures", int),
    "PREFIXGATE_AUTH_FAILURE_WINDOW_S": ("auth_failure_window_s", float),
}
"""The gateway's own PREFIXGATE_* variables: name -> (GatewayConfig field, parser). The engine's
are `engine_env_vars()`."""

UPSTREAM_KEY_ENV: dict[str, str] = {
    "openai": "PREFIXGATE_OPENAI_API_KEY",
    "anthropic": "PREFIXGATE_ANTHROPIC_API_KEY",
}
"""Upstream provider keys (never logged)."""
