"""An Anthropic client's image and document blocks, their sources checked as Anthropic checks
them, as neutral (OpenAI-shaped) parts for an upstream."""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid

#: the source types Anthropic takes for an image and for a document
MEDIA_SOURCES = {"image": ("base64", "url", "file"),
                 "document": ("base64", "url", "text", "content", "file")}
_SOURCE_FIELDS = {"base64": ("media_type", "data"), "url": ("url",), "text": ("data",),
                  "file": ("file_id",), "content": ()}


def media_block(block: dict[str, Any], path: str) -> dict[str, Any]:
    """An image or document block, checked as Anthropic checks its source, as a neutral part:
    an image from base64 or a URL becomes OpenAI's image_url part (a data URL for base64); any
    other (a document, an image by file id) stays as it came, for an Anthropic upstream (an
    OpenAI-compatible one refuses it: gateway.backends.openai_upstream)."""
    kind, source = block["type"], block.get("source")
    if not isinstance(source, dict) or source.get("type") not in MEDIA_SOURCES[kind]:
        field = f"{path}.source"
        raise invalid(f"'{field}' must be an object whose type is one of "
                      f"{', '.join(MEDIA_SOURCES[kind])}", field)
    for name in _SOURCE_FIELDS[source["type"]]:
        if not isinstance(source.get(name), str) or not source[name]:
            field = f"{path}.source.{name}"
            raise invalid(f"'{field}' must be a non-empty string", field)
    if source["type"] == "content" and not isinstance(source.get("content"), str | list):
        field = f"{path}.source.content"
        raise invalid(f"'{field}' must be a string or an array of blocks", field)
    if kind == "image" and source["type"] == "base64":
        url = f"data:{source['media_type']};base64,{source['data']}"
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "image" and source["type"] == "url":
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    return block
