"""prefixgate's paged-KV inference engine with radix prefix caching.

    from engine import Engine, EngineConfig, SamplingParams
    eng = Engine(EngineConfig())
    outs = eng.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

The config, output and error types import without torch (the gateway's config nests an
`EngineConfig`); `Engine` and `AsyncEngine` load torch on first use of the name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.errors import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    RequestError,
    RequestTooLong,
)
from engine.outputs import EngineStats, RequestOutput, StreamDelta
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import Engine

_LAZY = {"AsyncEngine": "engine.async_engine", "Engine": "engine.llm_engine"}


def __getattr__(name: str) -> Any:
    """`Engine` and `AsyncEngine`, imported (with torch) when first asked for."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "EngineUnavailable",
    "InvalidRequest",
    "RequestError",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
    "StreamDelta",
]
