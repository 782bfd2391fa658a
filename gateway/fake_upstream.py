"""A small OpenAI-compatible server that really caches prefixes, for tests, benchmarks and demos.

It keeps its own `RadixCache` over the tiktoken tokens of the whole rendered prompt (one string,
not the gateway's piece-by-piece tokenization, so it is an independent reference for the
gateway's shadow prediction) and reports hits in `usage.prompt_tokens_details.cached_tokens`,
as vLLM and SGLang do, partitioned by `cache_salt` as vLLM does; playing vLLM, `POST /tokenize`
counts a chat body's prompt as vLLM's endpoint does. Faults can be injected: a status code, a
delay, a stream cut mid-way.

Run one: `python -m gateway.fake_upstream --port 9001`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prompt_lint.tokens import get_encoding
from radix_cache import RadixCache

SERVERS = ("vllm", "sglang", "openai", "bare")  # whose /v1/models answer a fake replica gives


@dataclass
class FakeUpstreamConfig:
    """Behaviour of one fake replica (mutable so a test can inject a fault mid-way).

    `max_pages`: cache capacity (LRU eviction past it); `cache=False` skips tokenization
    (for latency benchmarks). `fail_status`: answer every request with this status.
    `delay_s`: wait before answering. `cut_after`: end a stream after this many chunks
    with no finish reason and no `[DONE]`. `prefill_us_per_token`: simulated prefill time
    per uncached prompt token (so cache hits also show up as lower latency); with
    `serial_prefill` one prefill runs at a time, as on one accelerator (load shows as queueing).
    `server`: whose `/v1/models` answer it gives ("vllm", "sglang", "openai", or "bare": an
    entry with no owner), for kind detection.
    """

    name: str = "fake"
    page_size: int = 16
    max_pages: int = 1 << 16
    cache: bool = True
    reply: str = "Done. The next step is ready."
    fail_status: int | None = None
    delay_s: float = 0.0
    cut_after: int | None = None
    prefill_us_per_token: float = 0.0
    serial_prefill: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    keep_bodies: bool = True
    server: str = "vllm"
    max_model_len: int = 32768


def salt_namespace(body: dict[str, Any]) -> str:
    """The cache partition of a request, as vLLM does it: `cache_salt` is mixed into the hash
    of the first block, so requests with different salts (or one salted, one not) share no
    prefix at all; equal salts share as usual. Nothing else (not `user`) partitions the cache."""
    salt = body.get("cache_salt")
    return f"salt:{salt}" if isinstance(salt, str) and salt else ""


def render_prompt(body: dict[str, Any]) -> str:
    """The whole prompt as one string, roughly as a chat template would lay it out."""
    if "prompt" in body:
        return str(body["prompt"])
    parts = [json.dumps(t, separators=(",", ":")) for t in body.get("tools") or ()]
    for m in body.get("messages") or ():
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        parts.append(f"<|{m.get('role')}|>\n{text or ''}")
        if m.get("tool_calls"):
            parts.append(json.dumps(m["tool_calls"], separators=(",", ":")))
    return "\n".join(parts)


class FakeReplica:
    """State of one fake replica: its cache and its counters."""

    def __init__(self, config: FakeUpstreamConfig) -> None:
        self.config = config
        self.cache = RadixCache(config.page_size)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.prefill_lock = asyncio.Lock()

    def lookup(self, body: dict[str, Any], namespace: str) -> tuple[list[int], int, int]:
        """(tokens, prompt tokens, cached tokens) of a body, before it is prefilled."""
        text = render_prompt(body)
        if not self.config.cache:
            return [], max(1, len(text) // 4), 0
        tokens = get_encoding().encode_ordinary(text)
        return tokens, len(tokens), self.cache.match(tokens, namespace).length

    def store(self, tokens: list[int], cached: int, namespace: str) -> None:
        """Cache a prefilled prompt (LRU eviction past capacity) and count it."""
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        if not tokens:
            return
        self.cache.insert(tokens, None, namespace)
        over = self.cache.stats.total_pages - self.config.max_pages
        if over > 0:
            self.cache.evict(over)


def _usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _chunk(body: dict[str, Any], text: str | None, finish: str | None) -> dict[str, Any]:
    if "prompt" in body:
        choice: dict[str, Any] = {"index": 0, "text": text or "", "finish_reason": finish}
    else:
        delta = {"content": text} if text is not None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "fake-1", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.get("model", "fake"), "choices": [choice]}


async def _sse(body: dict[str, Any], words: list[str], usage: dict[str, Any],
               cut_after: int | None) -> AsyncIterator[bytes]:
    for i, word in enumerate(words):
        if cut_after is not None and i >= cut_after:
            return
        yield f"data: {json.dumps(_chunk(body, word, None))}\n\n".encode()
    yield f"data: {json.dumps(_chunk(body, None, 'stop'))}\n\n".encode()
    if (body.get("stream_options") or {}).get("include_usage"):
        tail = {"id": "fake-1", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        yield f"data: {json.dumps(tail)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _whole(body: dict[str, Any], text: str, usage: dict[str, Any]) -> dict[str, Any]:
    if "prompt" in body:
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop"}
    else:
        choice = {"index": 0, "finish_reason": "stop",
                  "message": {"role": "assistant", "content": text}}
    return {"id": "fake-1", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "fake"), "choices": [choice], "usage": usage}


def model_card(config: FakeUpstreamConfig) -> dict[str, Any]:
    """One `/v1/models` entry shaped as `config.server` shapes it: vLLM adds `root`, `parent`,
    `max_model_len` and a permission list; SGLang `root` and `max_model_len`; OpenAI only its
    owner ("system")."""
    card: dict[str, Any] = {"id": "fake", "object": "model", "created": int(time.time())}
    if config.server == "vllm":
        permission = {"id": "modelperm-fake", "object": "model_permission",
                      "created": card["created"], "allow_create_engine": False,
                      "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None,
                      "is_blocking": False}
        card |= {"owned_by": "vllm", "root": "fake", "parent": None,
                 "max_model_len": config.max_model_len, "permission": [permission]}
    elif config.server == "sglang":
        card |= {"owned_by": "sglang", "root": "fake", "max_model_len": config.max_model_len}
    elif config.server == "openai":
        card["owned_by"] = "system"
    return card


def create_fake_upstream(config: FakeUpstreamConfig | None = None) -> Starlette:
    """The ASGI app; its `FakeReplica` is `app.state.replica`."""
    replica = FakeReplica(config or FakeUpstreamConfig())

    async def complete(request: Request) -> Response:
        cfg = replica.config
        body = json.loads(await request.body())
        if cfg.keep_bodies:
            cfg.bodies.append(body)
        if cfg.delay_s:
            await asyncio.sleep(cfg.delay_s)
        if cfg.fail_status is not None:
            return JSONResponse({"error": {"message": f"{cfg.name} injected failure",
                                           "type": "server_error"}}, status_code=cfg.fail_status)
        namespace = salt_namespace(body)
        tokens, prompt, cached = replica.lookup(body, namespace)
        if cfg.prefill_us_per_token:  # the prompt is cached once its prefill is done
            seconds = (prompt - cached) * cfg.prefill_us_per_token / 1e6
            if cfg.serial_prefill:
                async with replica.prefill_lock:
                    await asyncio.sleep(seconds)
            else:
                await asyncio.sleep(seconds)
        replica.store(tokens, cached, namespace)
        words = [w + " " for w in cfg.reply.split()]
        usage = _usage(prompt, cached, len(words))
        if body.get("stream"):
            return StreamingResponse(_sse(body, words, usage, cfg.cut_after),
                                     media_type="text/event-stream")
        return JSONResponse(_whole(body, "".join(words), usage))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(replica.config)]})

    async def tokenize(request: Request) -> Response:
        if replica.config.server != "vllm":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        tokens = get_encoding().encode_ordinary(render_prompt(json.loads(await request.body())))
        return JSONResponse({"count": len(tokens), "max_model_len": replica.config.max_model_len,
                             "tokens": tokens})

    app = Starlette(routes=[
        Route("/v1/chat/completions", complete, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
    ])
    app.state.replica = replica
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.fake_upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--no-cache", action="store_true", help="skip tokenization")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="answer each request this long after reading it")
    parser.add_argument("--server", choices=SERVERS, default=FakeUpstreamConfig.server,
                        help="whose /v1/models answer it gives (what kind detection reads)")
    args = parser.parse_args(argv)
    import uvicorn

    config = FakeUpstreamConfig(cache=not args.no_cache, keep_bodies=False,
                                delay_s=args.delay_ms / 1000.0, server=args.server)
    uvicorn.run(create_fake_upstream(config), host=args.host, port=args.port, log_level="warning",
                timeout_keep_alive=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
