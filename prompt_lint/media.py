"""Media in a request (images, audio, files, documents): each inline payload stands as a digest.

An image, a sound or a file travels inside the body as base64 text: OpenAI's `image_url.url`
(a `data:` URL), `input_audio.data` and `file.file_data`; Anthropic's `base64` sources (the
`data` of an image's or a document's `source`, also inside a tool_result). Tokenized as text,
one screenshot would be hundreds of thousands of tiktoken tokens, nothing like what a provider
charges for it, and it would fill the shadow caches. So the token layout (`providers.segments`:
lint, the gateway's shadow caches, prefixgate's own token estimates) and the stored prompt text
see each payload as `sha256:<32 hex digits>` of its text instead: two requests with different
images differ at the image (no predicted cache hit past it), the same image is the same tokens,
URLs and text documents stay as they are (they are text).

What a provider charges for an image is not in its text (Anthropic: width x height / 750
tokens, at most about 1,600; OpenAI at high detail: 85 + 170 per 512-pixel tile, some 765 to
1,105 for a screenshot), so in the layout each image, document, audio or file block also counts
`MEDIA_TOKENS` (1,000) filler tokens after its JSON (`layout_text`): the token counts
prefixgate estimates, and the shadow caches' share of a prompt that lies before an image, stay
near what the provider counts instead of treating a screenshot as 30 tokens. Those are
estimates, marked so where they are reported; a PDF's pages are not counted one by one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

MEDIA_TYPES = frozenset({"image", "document", "image_url", "input_audio", "file"})
MEDIA_TOKENS = 1000  # filler tokens one media block counts in the layout (see above)
_FILLER = " img" * MEDIA_TOKENS  # one cl100k_base token a word, 4 characters (layout.estimate)
DIGEST_HEX = 32  # 128 bits of sha256: no two payloads of one body share a digest
#: object keys whose value holds a payload in its `data` field (OpenAI's input_audio), or
#: in the named field (OpenAI's file part's `file_data`, an image_url's `url` when a data URL)
_PAYLOAD_FIELDS = {"input_audio": "data", "file": "file_data", "image_url": "url"}


def digest(payload: str) -> str:
    """`sha256:<hex>` of a payload's text."""
    text = payload.encode("utf-8", "surrogatepass")
    return "sha256:" + hashlib.sha256(text).hexdigest()[:DIGEST_HEX]


def without_payloads(value: Any, key: str | None = None) -> Any:
    """`value` (a block, a content list, a message or a list of them) with every inline payload
    replaced by its digest; the very object when it holds none (nothing is copied then), else a
    copy of the containers on the way to a payload (the caller's value is never changed)."""
    if isinstance(value, list):
        items = [without_payloads(item) for item in value]
        changed = any(new is not old for new, old in zip(items, value, strict=True))
        return items if changed else value
    if not isinstance(value, dict):
        return value
    field = _payload_field(value, key)
    out: dict[str, Any] | None = None
    for name, item in value.items():
        if name == field and isinstance(item, str):
            new: Any = _stand_in(item, name)
        else:
            new = without_payloads(item, name) if isinstance(item, dict | list) else item
        if new is not item:
            out = dict(value) if out is None else out
            out[name] = new
    return value if out is None else out


def _payload_field(node: dict[str, Any], key: str | None) -> str | None:
    """The field of `node` (found under `key`) that holds a payload, if any."""
    if key == "source" and node.get("type") == "base64":  # Anthropic image / document
        return "data"
    return _PAYLOAD_FIELDS.get(key) if key is not None else None


def _stand_in(text: str, name: str) -> str:
    """The digest standing for a payload; a data URL keeps its head (`data:image/png;base64,`)
    and an http(s) URL is no payload (it is kept)."""
    if name != "url":
        return digest(text)
    if not text.startswith("data:"):
        return text
    head, _, data = text.partition(",")
    return f"{head},{digest(data)}"


def layout_text(block: Any, json_text: Callable[[Any], str]) -> str:
    """What the layout tokenizes for a content block that is not text: its JSON (`json_text`)
    with the payloads as digests, then `MEDIA_TOKENS` filler tokens for each image, document,
    audio or file in it (itself, or inside a tool_result); a block with none (a tool_use, a
    text-only tool_result) is its JSON, not walked for payloads."""
    count = media_blocks(block)
    if not count:
        return json_text(block)
    return json_text(without_payloads(block)) + _FILLER * count


def media_blocks(value: Any) -> int:
    """Image, document, audio and file blocks in a block or a content list (a tool_result's
    content is looked into; a media block's own source is not)."""
    if isinstance(value, list):
        return sum(media_blocks(item) for item in value)
    if not isinstance(value, dict):
        return 0
    if value.get("type") in MEDIA_TYPES:
        return 1
    content = value.get("content")
    return media_blocks(content) if isinstance(content, list) else 0
