"""The embedded engine's settings outside code: `PREFIXGATE_ENGINE_<FIELD>` variables and
`--engine-<field>` flags, one for every `engine.EngineConfig` field, read by the field's own
type and described by its own docstring (so a new engine field needs no gateway change).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, get_args, get_type_hints

from engine.config import EngineConfig


def parse_bool(text: str) -> bool:
    """`1/true/yes/on` or `0/false/no/off`, case-insensitive."""
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")



ENGINE_ENV_PREFIX = "PREFIXGATE_ENGINE_"
ENGINE_ENV_ALIASES: dict[str, str] = {"PREFIXGATE_MODEL_PATH": "model"}
"""Older names kept for engine fields (read before the PREFIXGATE_ENGINE_* name)."""
ENGINE_FLAG_ALIASES: dict[str, str] = {
    "model": "--model", "num_pages": "--num-pages", "device": "--device",
    "quantization": "--quantization", "kv_cache_dtype": "--kv-cache-dtype",
}
"""Short `prefixgate serve` flags kept beside `--engine-<field>` for these engine fields."""


def _engine_parser(hint: Any) -> Callable[[str], Any]:
    """How an engine field's value is read from text, by its type: bool, int, else str
    (Literal values and paths are checked by EngineConfig itself)."""
    options = get_args(hint) or (hint,)
    if bool in options:
        return parse_bool
    if int in options:
        return int
    return str


def engine_fields() -> dict[str, Callable[[str], Any]]:
    """EngineConfig's field names and the parser of each."""
    hints = get_type_hints(EngineConfig)
    return {f.name: _engine_parser(hints[f.name]) for f in fields(EngineConfig)}


def engine_env_vars() -> dict[str, str]:
    """Every PREFIXGATE_* variable that sets an engine field: name -> EngineConfig field."""
    names = {f"{ENGINE_ENV_PREFIX}{name.upper()}": name for name in engine_fields()}
    return {**ENGINE_ENV_ALIASES, **names}


def engine_from_env(env: Mapping[str, str]) -> EngineConfig:
    """The EngineConfig set by PREFIXGATE_ENGINE_* variables (defaults for the rest)."""
    parsers = engine_fields()
    values: dict[str, Any] = {}
    named: list[str] = []
    for name, field_name in engine_env_vars().items():
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            values[field_name] = parsers[field_name](raw)
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from exc
        named.append(f"{name}={raw!r}")
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{', '.join(named)}: {exc}") from exc


_FIELD_DOC = re.compile(r"^    (\w+(?: / \w+)*): (.+(?:\n {8}.+)*)", re.MULTILINE)
_SENTENCE_END = re.compile(r"\.\s+(?=\S)")


def engine_field_help() -> dict[str, str]:
    """Each field's description in EngineConfig's docstring (`name: text`, continued on lines
    indented deeper; `a / b: text` for two fields), up to the end of its first sentence."""
    helps: dict[str, str] = {}
    for names, text in _FIELD_DOC.findall(EngineConfig.__doc__ or ""):
        described = _SENTENCE_END.split(" ".join(text.split()), maxsplit=1)[0].rstrip(".")
        helps.update(dict.fromkeys(names.split(" / "), described))
    return helps


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """`--engine-<field>` for every EngineConfig field (plus the short aliases)."""
    group = parser.add_argument_group("embedded engine (EngineConfig, also PREFIXGATE_ENGINE_*)")
    described = engine_field_help()
    for name, parse in engine_fields().items():
        flags = [f"--engine-{name.replace('_', '-')}"]
        if name in ENGINE_FLAG_ALIASES:
            flags.insert(0, ENGINE_FLAG_ALIASES[name])
        group.add_argument(*flags, dest=f"engine__{name}", type=parse, default=None,
                           metavar=name.upper(),
                           help=described.get(name, f"EngineConfig.{name}").replace("%", "%%"))


def engine_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields given on the command line (flags added by `add_engine_flags`)."""
    prefix = "engine__"
    return {k[len(prefix):]: v for k, v in vars(args).items()
            if k.startswith(prefix) and v is not None}
