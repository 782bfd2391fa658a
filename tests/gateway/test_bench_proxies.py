"""The benchmarks' pass-through proxies (the floor rows): each forwards a request unchanged and
answers what the upstream answered, as a client talking to the upstream directly gets it; and
the paired benchmark's summary (bench_pair)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import pytest

from benchmarks.bench_hop import raw_proxy
from benchmarks.gateway_servers import bare_proxy, fake_upstream

BODY = {"model": "fake", "messages": [{"role": "system", "content": "Be brief. " * 300},
                                      {"role": "user", "content": "Go: é ✓"}],
        "max_tokens": 8}


def _answer(url: str, body: bytes) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30.0)
    assert response.status_code == 200, response.text
    assert response.headers["content-length"] == str(len(response.content))
    data: dict[str, Any] = response.json()
    data.pop("id", None)
    data.pop("created", None)
    return data


def test_each_proxy_answers_as_the_upstream_does() -> None:
    bodies = [json.dumps(BODY, ensure_ascii=False).encode(),
              json.dumps({**BODY, "messages": BODY["messages"][1:]}).encode()]
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(fake_upstream())
        proxies = {"bare": stack.enter_context(bare_proxy(up)),
                   "bare on uvicorn's protocol": stack.enter_context(bare_proxy(up, "uvicorn")),
                   "raw transport": stack.enter_context(raw_proxy(up, "transport")),
                   "raw client": stack.enter_context(raw_proxy(up, "raw"))}
        direct = [_answer(up, body) for body in bodies]
        assert direct[0]["usage"] != direct[1]["usage"]  # the answer tells the bodies apart
        for _ in range(2):  # the second time over each proxy's kept connection
            for name, url in proxies.items():
                assert [_answer(url, body) for body in bodies] == direct, name


def test_a_pair_of_runs_cancels_the_first_started_builds_advantage() -> None:
    """Runs made of a true difference plus a bias toward whichever build started first: the
    summary recovers both (the reference: the numbers the runs were built from)."""
    from benchmarks.bench_pair import Run, summarise

    effect, bias = [0.02, -0.01, 0.05], 0.03
    runs = []
    for e in effect:
        runs.append(Run("A", 2.5, {"A": 1.5 - bias / 2, "B": 1.5 + e + bias / 2}))
        runs.append(Run("B", 2.6, {"A": 1.4 + bias / 2, "B": 1.4 + e - bias / 2}))
    out = summarise(runs)
    assert out["b_minus_a_per_round_ms"] == pytest.approx(effect)
    assert out["b_minus_a_mean_ms"] == pytest.approx(sum(effect) / 3)
    assert out["first_started_advantage_ms"] == pytest.approx(bias)
