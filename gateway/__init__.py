"""prefixgate's gateway: OpenAI + Anthropic APIs in front of the embedded engine or upstreams.

    from gateway import GatewayConfig, create_app
    app = create_app(GatewayConfig())          # an ASGI app (Starlette)

`import gateway` stays light (the `prefixgate` CLI imports it for every sub-command): each
exported name is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.app import create_app
    from gateway.config import GatewayConfig, UpstreamSpec
    from gateway.errors import GatewayError
    from gateway.serve import BackgroundServer
    from gateway.types import ApiError, Backend, BackendError, ChatRequest, Final, TextDelta, Usage

_LAZY = {
    "create_app": "gateway.app",
    "GatewayConfig": "gateway.config",
    "UpstreamSpec": "gateway.config",
    "GatewayError": "gateway.errors",
    "BackgroundServer": "gateway.serve",
    "ApiError": "gateway.types",
    "Backend": "gateway.types",
    "BackendError": "gateway.types",
    "ChatRequest": "gateway.types",
    "Final": "gateway.types",
    "TextDelta": "gateway.types",
    "Usage": "gateway.types",
}


def __getattr__(name: str) -> Any:
    """The exported names, imported when first asked for."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")


__all__ = [
    "ApiError",
    "Backend",
    "BackendError",
    "BackgroundServer",
    "ChatRequest",
    "Final",
    "GatewayConfig",
    "GatewayError",
    "TextDelta",
    "UpstreamSpec",
    "Usage",
    "create_app",
]
