"""The non-text content parts an OpenAI client may send in a user message to an upstream
(`image_url`, `input_audio`, `file`), their shapes checked as OpenAI checks them; the embedded
model reads only text, so for it (`role` None) each is a 400."""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid


def check_media_part(part: Any, kind: Any, path: str, role: str | None) -> None:
    """Check a part that is not text: an upstream's user message may carry image_url,
    input_audio and file parts (their shapes checked as OpenAI checks them); the embedded
    model reads only text, and OpenAI's other roles take only text parts."""
    if role is None:
        raise invalid(f"'{path}' must be a text part (only text is supported)", path)
    if role != "user":
        raise invalid(f"'{path}' must be a text part: only a user message may carry "
                      f"{', '.join(_MEDIA_CHECKS)} parts", path)
    if not isinstance(part, dict):
        raise invalid(f"'{path}' must be a content part object", path)
    check = _MEDIA_CHECKS.get(kind) if isinstance(kind, str) else None
    if check is None:
        kinds = ", ".join(["text", *_MEDIA_CHECKS])
        raise invalid(f"'{path}.type' must be one of {kinds}", f"{path}.type")
    inner = part.get(kind)
    if not isinstance(inner, dict):
        raise invalid(f"'{path}.{kind}' must be an object", f"{path}.{kind}")
    check(inner, f"{path}.{kind}")


def _image_url(image: dict[str, Any], path: str) -> None:
    """`image_url`: {url: an http(s) URL or a base64 data URL, detail?: a string}."""
    url = image.get("url")
    if not isinstance(url, str) or not (url.startswith(("http://", "https://"))
                                        or _base64_data_url(url)):
        raise invalid(f"'{path}.url' must be an http(s) URL or a base64 data URL "
                      "(data:<media type>;base64,<data>)", f"{path}.url")
    if image.get("detail") is not None and not isinstance(image["detail"], str):
        raise invalid(f"'{path}.detail' must be a string (auto, low or high)", f"{path}.detail")


def _base64_data_url(url: str) -> bool:
    head, comma, data = url.partition(",")
    return bool(comma and data) and head.startswith("data:") and head.endswith(";base64")


def _input_audio(audio: dict[str, Any], path: str) -> None:
    """`input_audio`: {data: base64 audio, format: e.g. wav or mp3}."""
    for name in ("data", "format"):
        if not isinstance(audio.get(name), str) or not audio[name]:
            raise invalid(f"'{path}.{name}' must be a non-empty string", f"{path}.{name}")


def _file(file: dict[str, Any], path: str) -> None:
    """`file`: {file_data: a base64 data URL, or file_id: an uploaded file's id; filename?}."""
    for name in ("file_data", "file_id", "filename"):
        if file.get(name) is not None and not isinstance(file[name], str):
            raise invalid(f"'{path}.{name}' must be a string", f"{path}.{name}")
    if not file.get("file_data") and not file.get("file_id"):
        raise invalid(f"'{path}' must have 'file_data' or 'file_id'", path)


_MEDIA_CHECKS = {"image_url": _image_url, "input_audio": _input_audio, "file": _file}
