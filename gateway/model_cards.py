"""What `GET /v1/models` and `GET /v1/models/{id}` answer, in the client's format.

An Anthropic SDK (it sends `anthropic-version` on every request) reads Anthropic's shapes:
a model is `{"type": "model", "id", "display_name", "created_at"}` and a list carries
`has_more`, `first_id` and `last_id` (its pager reads them); every other client gets OpenAI's
`{"id", "object": "model", "created", "owned_by"}` in `{"object": "list", "data"}`. The gateway
knows no release date of a served model: both formats say the epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.types import Provider

EPOCH = "1970-01-01T00:00:00Z"


def client_format(headers: Mapping[str, str]) -> Provider:
    """"anthropic" for a request that names an Anthropic API version, else "openai"."""
    return "anthropic" if "anthropic-version" in headers else "openai"


def model_card(model: str, provider: Provider) -> dict[str, Any]:
    """One served model as the client's API describes a model."""
    if provider == "anthropic":
        return {"type": "model", "id": model, "display_name": model, "created_at": EPOCH}
    return {"id": model, "object": "model", "created": 0, "owned_by": "prefixgate"}


def model_list(models: list[str], provider: Provider) -> dict[str, Any]:
    """Every served model, as one page of the client's list."""
    data = [model_card(m, provider) for m in models]
    if provider == "anthropic":
        return {"data": data, "has_more": False, "first_id": models[0] if models else None,
                "last_id": models[-1] if models else None}
    return {"object": "list", "data": data}
