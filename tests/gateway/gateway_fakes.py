"""Gateway test helpers: a deterministic fake backend and an in-process client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.config import GatewayConfig
from gateway.tool_calls import ToolCallFilter, render_messages
from gateway.types import BackendError, ChatRequest, Final, TextDelta, Usage

FAKE_MODEL = "fake-echo"
FAKE_PAGE = 4  # words per cache page in the fake


def words_of(req: ChatRequest) -> list[str]:
    """The fake's 'tokens': words of the rendered prompt (one marker word per message)."""
    if req.prompt is not None:
        return req.prompt.split()
    out: list[str] = []
    for msg in render_messages(req.messages, req.tools):
        out.append(f"<{msg['role']}>")
        out.extend(msg["content"].split())
    return out


@dataclass
class FakeBackend:
    """Echoes the last user message word by word, with a page-aligned prefix cache per namespace.

    A user message containing `CALL name {json}` makes it answer with a tool call in the
    documented `<tool_call>` format; `FAIL nnn` raises BackendError(nnn) before any output;
    `BREAK ...` raises BackendError(502) after its first two words.
    """

    name: str = "embedded"
    delay: float = 0.0
    cache: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    seen: list[ChatRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    generated: dict[str, int] = field(default_factory=dict)  # request id -> pieces made
    closed: bool = False

    def models(self) -> list[str]:
        return [FAKE_MODEL]

    def kv_pages(self) -> tuple[int, int] | None:
        return (sum(len(v) for v in self.cache.values()), 1000)

    async def aclose(self) -> None:
        self.closed = True

    def cached_prefix(self, namespace: str, words: list[str]) -> int:
        pages = self.cache.setdefault(namespace, set())
        hit = 0
        for end in range(FAKE_PAGE, len(words) + 1, FAKE_PAGE):
            if tuple(words[:end]) not in pages:
                break
            hit = end
        for end in range(FAKE_PAGE, len(words) + 1, FAKE_PAGE):
            pages.add(tuple(words[:end]))
        return hit

    def reply(self, req: ChatRequest) -> str:
        last = req.prompt or ""
        for msg in reversed(req.messages):
            if msg["role"] in ("user", "tool"):
                content = msg.get("content") or ""
                last = content if isinstance(content, str) else " ".join(
                    p["text"] for p in content)
                break
        if last.startswith("FAIL "):
            raise BackendError(int(last.split()[1]), "fake failure", param="messages")
        if last.startswith("CALL "):
            _, name, args = last.split(" ", 2)
            return f'Calling.<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
        return "echo: " + last

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        self.seen.append(req)
        text = self.reply(req)
        words = words_of(req)
        cached = self.cached_prefix(req.namespace, words)
        limit = req.options.max_tokens or 64
        words_out = text.split(" ")
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words_out)][:limit]
        usage = Usage(prompt_tokens=len(words), completion_tokens=len(pieces),
                      cached_tokens=cached, ttft=0.001, tpot=0.001,
                      prefill_saved_ms=float(cached) * 0.5)
        filt = ToolCallFilter()
        held = 0  # pieces (one token each) generated since the last delta yielded
        try:
            for i, piece in enumerate(pieces):
                if i == 3 and text.startswith("echo: BREAK"):
                    raise BackendError(502, "upstream cut the stream")
                if self.delay:
                    await asyncio.sleep(self.delay)
                visible = filt.feed(piece)
                held += 1
                self.generated[req.request_id] = i + 1
                if visible or i == 0:
                    yield TextDelta(visible, usage=usage if i == 0 else None, tokens=held)
                    held = 0
            full = "".join(pieces)
            tail, parsed = filt.finish(full, req.request_id)
            if tail:
                yield TextDelta(tail, tokens=held)
            finish = "tool_calls" if parsed.tool_calls else (
                "length" if len(pieces) < len(words_out) else "stop")
            self.finished.append(req.request_id)
            yield Final(parsed.text, parsed.tool_calls, finish, usage)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(req.request_id)
            raise


def fake_config(tmp_path: Path, **changes: Any) -> GatewayConfig:
    values: dict[str, Any] = {
        "db_url": f"sqlite:///{tmp_path / 'stats.db'}",
        "model_name": FAKE_MODEL,
        "lint_mode": "off",
        "stats_flush_interval_s": 0.02,
    }
    values.update(changes)
    return GatewayConfig(**values)


def asgi_client(app: Any, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                             base_url="http://gateway", **kwargs)
