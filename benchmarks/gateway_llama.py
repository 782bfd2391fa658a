"""The llama.cpp-server row of the gateway benchmark: real `llama-server` replicas upstream.

Two `llama-server` processes on the SmolLM2-135M-Instruct GGUF serve a small multi-session agent
trace through prefixgate's replica pool three ways: the slot model (`--upstream llamacpp=...`),
a radix shadow with prefix routing, and round robin; each with the servers set up two ways: as
llama-server starts by default (it picks the slot count, one KV buffer for all slots, idle slots
cleared once saved to its host prompt cache) and with `--parallel 2` (one KV buffer per slot,
idle slots kept); and each with one request at a time, then with the sessions at once (each
session's turns in order). Reported are the hit rate llama-server itself reports and the share
of warm requests whose prediction is within 5% of the prompt of what it reported (target >= 90%).
The binary: `--llama-server PATH`, `PREFIXGATE_BENCH_LLAMA_SERVER`, /work/llama-build/bin/
llama-server or `llama-server` on PATH; without one the row is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.gateway_servers import free_port, process
from gateway.agent_trace import agent_trace
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.router import RouterConfig
from gateway.backends.upstream_http import UpstreamOptions
from gateway.shadow import ShadowCache
from gateway.types import ChatRequest, Final, SamplingOptions

DEFAULT_BINARY = Path("/work/llama-build/bin/llama-server")


def find_binary(given: str | None) -> Path | None:
    """The llama-server executable, or None."""
    for name in (given, os.environ.get("PREFIXGATE_BENCH_LLAMA_SERVER"), str(DEFAULT_BINARY)):
        if name and Path(name).is_file():
            return Path(name)
    found = shutil.which("llama-server")
    return Path(found) if found else None


@contextlib.contextmanager
def llama_servers(binary: Path, model: Path, n: int, slots: int | None) -> Iterator[list[str]]:
    """`n` llama-server replicas (`slots` None: the server's own defaults); their `/v1` base
    URLs."""
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(n):
            port = free_port()
            sized = ["--parallel", str(slots), "-c", str(8192 * slots)] if slots else []
            cmd = [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
                   *sized, "-t", "1"]
            stack.enter_context(process(cmd, f"http://127.0.0.1:{port}/health"))
            urls.append(f"http://127.0.0.1:{port}/v1")
        yield urls


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A tool call or tool result as plain assistant / user text."""
    if message.get("tool_calls"):
        call = message["tool_calls"][0]["function"]
        return {"role": "assistant", "content": f"{call['name']}({call['arguments']})"}
    if message.get("role") == "tool":
        return {"role": "user", "content": str(message.get("content") or "")}
    return {"role": message["role"], "content": message.get("content") or ""}


def _request(body: dict[str, Any], i: int) -> ChatRequest:
    return ChatRequest(
        request_id=f"l{i}", provider="openai", model="smollm2", messages=tuple(body["messages"]),
        tools=(), options=SamplingOptions(max_tokens=4, temperature=0.0), stream=False,
        tenant="bench", namespace="bench",
        body={"model": "smollm2", "messages": body["messages"], "max_tokens": 4,
              "temperature": 0})


async def _replay(kind: str, policy: str, urls: list[str], trace: list[Any],
                  radix: bool, overlap: bool) -> dict[str, Any]:
    """The trace through a pool over `urls`: one request at a time, or (`overlap`) the
    sessions at once, each session's turns in order."""
    backends = [make_upstream(kind, UpstreamOptions(url=u, name=f"l{i}", timeout_s=600))
                for i, u in enumerate(urls)]
    shadows = [ShadowCache() for _ in urls] if radix else None
    pool = ReplicaPool(kind, backends, router=RouterConfig(policy=policy),  # type: ignore[arg-type]
                       shadow=shadows)
    done: dict[int, Final] = {}

    async def serve(items: list[tuple[int, Any]]) -> None:
        for i, item in items:
            final = [x async for x in pool.stream(_request(item.body, i))][-1]
            assert isinstance(final, Final)
            done[i] = final

    numbered = list(enumerate(trace))
    if overlap:
        sessions: dict[int, list[tuple[int, Any]]] = {}
        for i, item in numbered:
            sessions.setdefault(item.session, []).append((i, item))
        await asyncio.gather(*map(serve, sessions.values()))
    else:
        await serve(numbered)
    await pool.aclose()
    # the usage each record got (over one replica a whole answer goes out before the shadow's
    # prediction; the streams are closed by now, so it is in)
    finals = [dataclasses.replace(done[i], usage=done[i].settled_usage())
              for i in range(len(trace))]
    warm = [f for f, item in zip(finals, trace, strict=True) if item.turn > 0]
    close = [abs((f.usage.predicted_cached_tokens or 0) - (f.usage.reported_cached_tokens or 0))
             <= 0.05 * f.usage.prompt_tokens for f in warm]
    prompt = sum(f.usage.prompt_tokens for f in finals)
    rows = [{"session": item.session, "turn": item.turn, "replica": f.replica,
             "prompt": f.usage.prompt_tokens, "predicted": f.usage.predicted_cached_tokens,
             "reported": f.usage.reported_cached_tokens}
            for f, item in zip(finals, trace, strict=True)]
    return {"model": kind if not radix else "radix", "policy": policy,
            "sessions_at_once": overlap,
            "hit_rate": sum(f.usage.reported_cached_tokens or 0 for f in finals) / prompt,
            "cached_tokens": sum(f.usage.reported_cached_tokens or 0 for f in finals),
            "within_5pct": sum(close) / max(len(close), 1), "requests": rows}


def run_llama(quick: bool, binary: Path) -> dict[str, Any]:
    """The three runs over fresh llama-server replicas each."""
    from engine.loader import default_model_path

    sessions, turns = (4, 3) if quick else (6, 5)
    trace = agent_trace(sessions=sessions, turns=turns, system_words=300, task_words=100,
                        output_words=60, seed=5)
    for item in trace:  # plain chat: the GGUF's chat template has no tool support
        item.body.pop("tools", None)
        item.body["messages"] = [_plain(m) for m in item.body["messages"]]
    runs = []
    for overlap in (False, True):
        for setup, slots in SETUPS.items():
            for kind, policy, radix in (("llamacpp", "prefix", False),
                                        ("openai", "prefix", True),
                                        ("openai", "round_robin", True)):
                with llama_servers(binary, default_model_path(), 2, slots) as urls:
                    run = asyncio.run(_replay(kind, policy, urls, trace, radix, overlap))
                    runs.append({"server": setup, **run})
    return {"sessions": sessions, "turns": turns, "runs": runs}


# llama-server as it starts by default, and with two slots of their own KV buffer each
SETUPS: dict[str, int | None] = {"default": None, "--parallel 2": 2}


def llama_table(res: dict[str, Any]) -> list[list[str]]:
    """Table rows: sessions one request at a time or at once, server setup, cache model,
    routing, reported hit rate, predictions within 5%."""
    return [["at once" if r.get("sessions_at_once") else "one at a time",
             r.get("server", "--parallel 2"), r["model"], r["policy"],
             f"{100 * r['hit_rate']:.1f}%", f"{100 * r['within_5pct']:.0f}%"]
            for r in res["runs"]]


__all__ = ["find_binary", "llama_table", "run_llama"]
