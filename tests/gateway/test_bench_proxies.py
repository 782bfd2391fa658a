"""The benchmarks' pass-through proxies (the floor rows): each forwards a request unchanged and
answers what the upstream answered, as a client talking to the upstream directly gets it."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx

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
