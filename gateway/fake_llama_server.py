"""A fake llama.cpp server (`llama-server`) whose KV cache behaves like the real one's slots.

llama-server runs each request on one of `--parallel` slots; a slot keeps the tokens of its last
request and reuses their longest common prefix with the next one (`cache_prompt`). A request
names its slot with `id_slot`; otherwise the server takes the idle slot whose cached tokens share
the largest fraction of the prompt (above `slot_prompt_similarity`), else the least recently used
idle slot. So two sessions that share a system prompt can land on one slot and overwrite each
other's history; the server's host-memory prompt cache (`--cache-ram`, on by default) then keeps
it: when a request would keep under half of its slot's tokens (or the slot is empty, or shares at
most `slot_prompt_similarity` of the prompt), the slot's tokens are saved there and the saved
prompt that fits the request better is loaded back; every idle slot is saved when a request
starts (and, with one KV buffer for all slots, `unified_kv`, cleared). A request pinned to an
empty slot loads nothing from the host cache (the real server's share kept of an empty slot is
0/0, so it skips the load). Hits are reported as `usage.prompt_tokens_details.cached_tokens` and
`timings.cache_n`; `GET /props` reports `total_slots` and `default_generation_settings.n_ctx`
(per slot), and `GET /v1/models` lists the model `owned_by: "llamacpp"` with `meta.n_ctx`, as
llama-server does. Tokens: tiktoken over the whole rendered
prompt (independent of the gateway's layout), as in `gateway.fake_upstream`; `POST
/apply-template` answers that rendered prompt and `POST /tokenize` its tokens, as llama-server's
endpoints of those names do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.fake_upstream import render_prompt
from prompt_lint.tokens import get_encoding


@dataclass
class FakeLlamaConfig:
    """`slots`: the server's `--parallel`; `similarity`: its `--slot-prompt-similarity`."""

    slots: int = 2
    similarity: float = 0.1
    reply: str = "Done. The next step is ready."
    n_ctx: int = 8192  # per slot
    host_cache: bool = True  # llama-server's --cache-ram prompt cache (default on)
    # one KV buffer for all slots (llama-server's default when it picks the slot count): the
    # idle slots are then cleared once saved, as each request starts
    unified_kv: bool = False
    busy_s: float = 0.0  # how long a request keeps its slot busy after its prompt (decoding)
    prompt_ms_per_token: float = 0.5  # what `timings.prompt_ms` says prefill took per token


class LlamaSlot:
    """One slot: the tokens it holds, when it was last used, and whether it is busy."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.tokens: list[int] = []
        self.used = 0.0
        self.lock = asyncio.Lock()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class FakeLlamaServer:
    """The slots and counters of one fake llama-server."""

    def __init__(self, config: FakeLlamaConfig) -> None:
        self.config = config
        self.slots = [LlamaSlot(i) for i in range(config.slots)]
        self.requests = 0
        self.chosen: list[int] = []
        self.saved: list[list[int]] = []  # the host prompt cache, oldest first

    def pick(self, prompt: list[int], id_slot: int) -> LlamaSlot:
        """The slot a request runs on (see the module docstring)."""
        if 0 <= id_slot < len(self.slots):
            return self.slots[id_slot]
        idle = [s for s in self.slots if not s.lock.locked()] or self.slots
        best, best_sim = None, self.config.similarity
        for slot in idle:
            if slot.tokens:
                sim = common_prefix(slot.tokens, prompt) / max(len(prompt), 1)
                if sim > best_sim:
                    best, best_sim = slot, sim
        return best or min(idle, key=lambda s: (s.used, -s.index))  # of equals, the last

    def save(self, tokens: list[int]) -> None:
        """Keep a slot's tokens in the host cache (unless already there as a prefix of an
        entry; entries that are prefixes of them are dropped)."""
        if not tokens or any(entry[: len(tokens)] == tokens for entry in self.saved):
            return
        self.saved = [e for e in self.saved if tokens[: len(e)] != e]
        self.saved.append(list(tokens))

    def swap(self, slot: LlamaSlot, prompt: list[int], pinned: bool) -> None:
        """Before running `prompt` on `slot`: save the slot and load a better saved prompt
        when the slot would keep too little of itself. A request pinned to an empty slot loads
        nothing (the server's share kept of an empty slot is 0/0, which no test passes)."""
        if pinned and not slot.tokens:
            return
        lcp = common_prefix(slot.tokens, prompt)
        keep = lcp / len(slot.tokens) if slot.tokens else -1.0
        sim = lcp / max(len(prompt), 1)
        if slot.tokens and sim > self.config.similarity and keep >= 0.5:
            return
        self.save(slot.tokens)
        best: list[int] | None = None
        for entry in self.saved:
            n = common_prefix(entry, prompt)
            if n / len(entry) >= 0.25 and n / len(entry) > keep and n / max(len(prompt), 1) > sim:
                best, keep, sim = entry, n / len(entry), n / max(len(prompt), 1)
        if best is not None:
            self.saved.remove(best)
            slot.tokens = best

    async def run(self, body: dict[str, Any]) -> tuple[int, int, int, list[str]]:
        """(prompt tokens, cached tokens, slot, reply words) of one request."""
        encoding = get_encoding()
        prompt = encoding.encode_ordinary(render_prompt(body))
        id_slot = int(body.get("id_slot", -1))
        slot = self.pick(prompt, id_slot)
        async with slot.lock:
            if self.config.host_cache:
                self.swap(slot, prompt, pinned=0 <= id_slot < len(self.slots))
                for other in self.slots:
                    if other is not slot and not other.lock.locked():
                        self.save(other.tokens)
                        if self.config.unified_kv:
                            other.tokens = []
            cached = common_prefix(slot.tokens, prompt) if body.get("cache_prompt", True) else 0
            cached = min(cached, len(prompt) - 1)  # the last prompt token is always evaluated
            words = [w + " " for w in self.config.reply.split()]
            slot.tokens = prompt + encoding.encode_ordinary("".join(words))
            slot.used = time.monotonic()
            self.requests += 1
            self.chosen.append(slot.index)
            if self.config.busy_s:
                await asyncio.sleep(self.config.busy_s)
        return len(prompt), max(cached, 0), slot.index, words


def _usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _chunk(body: dict[str, Any], delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": "llama-1", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.get("model", "llama"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def _sse(body: dict[str, Any], words: list[str], usage: dict[str, Any],
               timings: dict[str, Any]) -> AsyncIterator[bytes]:
    for word in words:
        yield f"data: {json.dumps(_chunk(body, {'content': word}, None))}\n\n".encode()
    last = {**_chunk(body, {}, "stop"), "timings": timings}
    if (body.get("stream_options") or {}).get("include_usage"):
        last["usage"] = usage
    yield f"data: {json.dumps(last)}\n\n".encode()
    yield b"data: [DONE]\n\n"


MODEL_PATH = "models/fake.gguf"


def _props(config: FakeLlamaConfig) -> dict[str, Any]:
    """`/props` as llama-server answers it (the fields the gateway and a client read)."""
    return {"default_generation_settings": {"n_ctx": config.n_ctx, "params": {"n_predict": -1}},
            "total_slots": config.slots, "model_alias": MODEL_PATH, "model_path": MODEL_PATH,
            "build_info": "b1-fake", "endpoint_slots": True, "endpoint_props": False,
            "is_sleeping": False}


def _model_card(config: FakeLlamaConfig) -> dict[str, Any]:
    """One `/v1/models` entry as llama-server writes it."""
    return {"id": MODEL_PATH, "aliases": [MODEL_PATH], "tags": [], "object": "model",
            "created": int(time.time()), "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 100277, "n_ctx": config.n_ctx,
                     "n_ctx_train": 8192}}


def create_fake_llama_server(config: FakeLlamaConfig | None = None) -> Starlette:
    """The ASGI app; its `FakeLlamaServer` is `app.state.server`."""
    server = FakeLlamaServer(config or FakeLlamaConfig())

    async def complete(request: Request) -> Response:
        body = json.loads(await request.body())
        prompt, cached, slot, words = await server.run(body)
        usage = _usage(prompt, cached, len(words))
        computed = prompt - cached
        timings = {"cache_n": cached, "prompt_n": computed, "predicted_n": len(words),
                   "prompt_ms": computed * server.config.prompt_ms_per_token}
        if body.get("stream"):
            return StreamingResponse(_sse(body, words, usage, timings),
                                     media_type="text/event-stream")
        message = {"role": "assistant", "content": "".join(words)}
        return JSONResponse({
            "id": "llama-1", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "llama"), "usage": usage, "timings": timings,
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}]})

    async def props(request: Request) -> Response:
        return JSONResponse(_props(server.config))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(server.config)]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def apply_template(request: Request) -> Response:
        return JSONResponse({"prompt": render_prompt(json.loads(await request.body()))})

    async def tokenize(request: Request) -> Response:
        content = json.loads(await request.body()).get("content")
        return JSONResponse({"tokens": get_encoding().encode_ordinary(str(content))})

    app = Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"]),
                            Route("/props", props), Route("/v1/models", models),
                            Route("/health", health),
                            Route("/apply-template", apply_template, methods=["POST"]),
                            Route("/tokenize", tokenize, methods=["POST"])])
    app.state.server = server
    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m gateway.fake_llama_server --port 9002 --slots 2`: serve it."""
    parser = argparse.ArgumentParser(prog="python -m gateway.fake_llama_server",
                                     description="a fake llama-server with its KV slots")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument("--slots", type=int, default=FakeLlamaConfig.slots,
                        help="llama-server's --parallel")
    parser.add_argument("--similarity", type=float, default=FakeLlamaConfig.similarity,
                        help="llama-server's --slot-prompt-similarity")
    parser.add_argument("--no-host-cache", action="store_true",
                        help="without llama-server's --cache-ram prompt cache")
    args = parser.parse_args(argv)
    import uvicorn

    config = FakeLlamaConfig(slots=args.slots, similarity=args.similarity,
                             host_cache=not args.no_host_cache)
    uvicorn.run(create_fake_llama_server(config), host=args.host, port=args.port,
                log_level="warning", timeout_keep_alive=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
