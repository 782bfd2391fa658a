"""The routing part of the gateway benchmark: prefix-aware vs round-robin over caching replicas.

A multi-session agent trace (sessions run concurrently, turns in order) over 4 fake replicas that
really cache and prefill one prompt at a time (simulated time per uncached token); sessions pause
a random think time between turns. Reported: the hit rate the replicas themselves report, the
shadow's prediction, the tokens they prefilled and the latency.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx
from tqdm import tqdm

from gateway.agent_trace import TraceRequest, agent_trace
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.router import RouterConfig
from gateway.backends.upstream_http import UpstreamOptions
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream
from gateway.types import ChatRequest, Final, SamplingOptions


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(  # noqa: E731
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _chat(item: TraceRequest) -> ChatRequest:
    body = item.body
    return ChatRequest(
        request_id=f"s{item.session}t{item.turn}", provider="openai", model="fake",
        messages=tuple(body["messages"]), tools=tuple(body["tools"]), options=SamplingOptions(),
        stream=False, tenant="bench", namespace="bench", body=body)


async def replay(policy: str, replicas: int, trace: list[TraceRequest],
                 prefill_us: float, think_ms: float = 20.0) -> dict[str, Any]:
    """Sessions concurrently, each session's turns in order; numbers the replicas report."""
    apps = [create_fake_upstream(FakeUpstreamConfig(
        name=f"r{i}", prefill_us_per_token=prefill_us, serial_prefill=True, keep_bodies=False))
        for i in range(replicas)]
    backends = [make_upstream("openai", UpstreamOptions(url=f"http://r{i}.bench/v1",
                                                        name=f"r{i}"),
                              transport=httpx.ASGITransport(app=app))
                for i, app in enumerate(apps)]
    pool = ReplicaPool("openai", backends, router=RouterConfig(policy=policy))  # type: ignore[arg-type]
    sessions: dict[int, list[TraceRequest]] = {}
    for item in trace:
        sessions.setdefault(item.session, []).append(item)
    latencies: list[float] = []
    predicted = 0
    bar = tqdm(total=len(trace), desc=f"{policy} x{replicas}", leave=False)

    async def run_session(items: list[TraceRequest]) -> None:
        nonlocal predicted
        think = random.Random(items[0].session)
        for item in items:
            await asyncio.sleep(think.uniform(0.0, think_ms) / 1000.0)
            start = time.perf_counter()
            final = [x async for x in pool.stream(_chat(item))][-1]
            latencies.append((time.perf_counter() - start) * 1000.0)
            assert isinstance(final, Final)
            predicted += final.settled_usage().predicted_cached_tokens or 0
            bar.update()

    await asyncio.gather(*(run_session(items) for items in sessions.values()))
    bar.close()
    await pool.aclose()
    fakes = [a.state.replica for a in apps]
    prompt = sum(f.prompt_tokens for f in fakes)
    return {"policy": policy, "replicas": replicas,
            "hit_rate": sum(f.cached_tokens for f in fakes) / prompt,
            "predicted_hit_rate": predicted / prompt,
            "prefilled_tokens": prompt - sum(f.cached_tokens for f in fakes),
            "mean_latency_ms": statistics.mean(latencies),
            "p50_latency_ms": _pct(latencies, 0.5),
            "requests_per_replica": [f.requests for f in fakes]}


def run_routing(quick: bool) -> dict[str, Any]:
    sessions, turns = (12, 5) if quick else (32, 10)
    trace = agent_trace(sessions=sessions, turns=turns, system_words=800, task_words=300,
                        output_words=120, seed=2)
    prefill_us = 100.0  # simulated prefill per uncached token (about 10k tokens/s)
    runs = [asyncio.run(replay(p, 4, trace, prefill_us)) for p in ("prefix", "round_robin")]
    return {"sessions": sessions, "turns": turns, "requests": len(trace),
            "prefill_us_per_token": prefill_us, "runs": runs}


def routing_table(res: dict[str, Any]) -> str:
    rows = [[r["policy"], f"{100 * r['hit_rate']:.1f}%", f"{100 * r['predicted_hit_rate']:.1f}%",
             f"{r['prefilled_tokens']:,}", f"{r['mean_latency_ms']:.1f}",
             "/".join(str(n) for n in r["requests_per_replica"])] for r in res["runs"]]
    header = ["routing", "hit rate (reported)", "predicted", "prefilled tokens",
              "mean latency ms", "requests per replica"]
    return _table(header, rows)
