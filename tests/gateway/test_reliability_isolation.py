"""Issue 17, items 1 and 6: tenants are isolated in the upstream's prefix cache (the caching
fake honours `cache_salt` as vLLM does), and every cache is bounded by bytes."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.fake_upstream import FakeReplica, FakeUpstreamConfig
from gateway.salt import SALT_PREFIX, UpstreamSalter
from prompt_lint.budgets import MemoBudgets
from prompt_lint.memo import LRU, approx_bytes
from prompt_lint.tokens import TokenCounter

from .upstream_helpers import fake_replicas, gateway_app, pool_over, pool_over_handler

SECRET = "a-test-secret-of-enough-length"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
LONG = " ".join(f"rule {i}: always answer politely and cite the policy." for i in range(120))


def chat(salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "system", "content": LONG}, {"role": "user", "content": "hello"}]}
    if salt is not None:
        body["cache_salt"] = salt
    return body


async def _cached(http: httpx.AsyncClient, key: str, salt: str | None = None) -> int:
    r = await http.post("/v1/chat/completions", json=chat(salt),
                        headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_fake_upstream_partitions_by_cache_salt_like_vllm() -> None:
    replica = FakeReplica(FakeUpstreamConfig())
    from gateway.fake_upstream import salt_namespace

    def run(body: dict[str, Any]) -> int:
        tokens, _, cached = replica.lookup(body, salt_namespace(body))
        replica.store(tokens, cached, salt_namespace(body))
        return cached

    assert run(chat()) == 0 and run(chat()) > 0  # unsalted requests share
    assert run(chat("s1")) == 0 and run(chat("s1")) > 0  # one salt shares with itself
    assert run(chat("s2")) == 0  # never across salts, nor with the unsalted prefix
    assert run({**chat(), "user": "someone"}) > 0  # `user` does not partition (as in vLLM)


async def test_tenants_never_share_the_upstreams_prefix_cache(tmp_path: Path) -> None:
    apps = fake_replicas(1)
    app = gateway_app(tmp_path, pool_over(apps), api_keys=KEYS, salt_secret=SECRET)
    bodies = apps[0].state.replica.config.bodies
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        assert await _cached(http, "key-a") == 0
        assert await _cached(http, "key-a") > 1000  # a tenant reuses its own prefix
        assert await _cached(http, "key-b") == 0  # another tenant does not
        a_salt = bodies[0]["cache_salt"]
        # b cannot reach a's prefix by choosing a salt, not even a's own upstream salt
        for guess in ("tenant-a", a_salt, "x"):
            assert await _cached(http, "key-b", guess) == 0
        assert await _cached(http, "key-a", "narrow") == 0  # a client salt narrows...
        assert await _cached(http, "key-a", "narrow") > 1000  # ...and is reused within it
    salts = [b["cache_salt"] for b in bodies]
    assert all(s.startswith(SALT_PREFIX) for s in salts)
    assert len({salts[0], salts[1]}) == 1 and salts[2] != salts[0]
    assert "narrow" not in salts and "tenant-a" not in salts  # the client's salt never leaves
    app.state.store.close()


async def test_long_client_salts_still_partition_but_are_not_kept(tmp_path: Path) -> None:
    """A client salt of any length names one namespace of its tenant's (reused by the same
    salt, never by another), while the gateway keeps no copy of it: the salts memo and the
    shadow caches key on the namespace, and 20 distinct 1 MiB salts must not stay in
    memory (before, every one did: a tenant could fill the memory with salts alone)."""
    apps = fake_replicas(1)
    app = gateway_app(tmp_path, pool_over(apps), api_keys=KEYS, salt_secret=SECRET)
    long_salt = "L" * (1 << 20)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        assert await _cached(http, "key-a", long_salt) == 0
        assert await _cached(http, "key-a", long_salt) > 1000  # the same salt shares
        assert await _cached(http, "key-a", long_salt + "2") == 0  # another does not
        assert await _cached(http, "key-b", long_salt) == 0  # nor another tenant's
        tracemalloc.start()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            await _cached(http, "key-a", f"{i:03d}{long_salt}")
        gc.collect()  # what is still reachable, not garbage awaiting a collection
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    assert kept < 20 * len(long_salt) // 4  # far less than the salts it was sent
    app.state.store.close()


def test_the_salt_is_an_hmac_of_the_namespace_under_the_secret() -> None:
    import hashlib
    import hmac

    salter = UpstreamSalter(SECRET)
    expected = hmac.new(SECRET.encode(), b"tenant-a/s1", hashlib.sha256).hexdigest()[:40]
    assert salter.salt("tenant-a/s1") == SALT_PREFIX + expected
    assert UpstreamSalter(SECRET).salt("t") == salter.salt("t")  # replicas agree
    assert UpstreamSalter(SECRET + "!").salt("t") != salter.salt("t")
    assert SECRET not in repr(salter)


def test_remembered_salts_stay_the_hmac_and_the_memo_stays_bounded() -> None:
    """Salts are remembered per namespace (a client's `cache_salt` picks namespaces, so the
    memo is bounded): every answer, remembered or not, is the HMAC itself."""
    import hashlib
    import hmac

    from gateway.salt import SALT_MEMO

    salter = UpstreamSalter(SECRET)
    names = [f"tenant-a/s{i}" for i in range(SALT_MEMO + 50)] + ["tenant-a/s3", "tenant-a/s3"]
    for name in names:
        expected = hmac.new(SECRET.encode(), name.encode(), hashlib.sha256).hexdigest()[:40]
        assert salter.salt(name) == SALT_PREFIX + expected
        assert len(salter._known) <= SALT_MEMO


async def test_openai_gets_a_per_tenant_prompt_cache_key_not_a_salt(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1}})

    pool = pool_over_handler(handler, url="https://api.openai.com/v1")
    app = gateway_app(tmp_path, pool, api_keys=KEYS, salt_secret=SECRET)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        for key, salt in (("key-a", None), ("key-a", None), ("key-b", None), ("key-b", "s")):
            await _cached(http, key, salt)
    keys = [b["prompt_cache_key"] for b in seen]
    assert all("cache_salt" not in b for b in seen)  # OpenAI rejects unknown fields
    assert keys[0] == keys[1] and len({keys[0], keys[2], keys[3]}) == 3
    app.state.store.close()


# ------------------------------------------------------------------ 6: bounded by bytes


class NaiveLRU:
    """Reference: an ordered list of (key, value, weight), oldest first."""

    def __init__(self, cap: int, budget: int) -> None:
        self.cap, self.budget = cap, budget
        self.items: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def get(self, key: str) -> str | None:
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key][0]

    def put(self, key: str, value: str) -> None:
        weight = approx_bytes(key) + approx_bytes(value)
        if weight > self.budget:
            return
        self.items.pop(key, None)
        self.items[key] = (value, weight)
        while len(self.items) > self.cap or sum(w for _, w in self.items.values()) > self.budget:
            self.items.popitem(last=False)


def test_lru_matches_a_naive_model_and_stays_within_its_byte_budget() -> None:
    rng = random.Random(7)
    lru: LRU[str, str] = LRU(16, max_weight=4000)
    ref = NaiveLRU(16, 4000)
    for _ in range(3000):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.5:
            value = "v" * rng.choice([1, 10, 100, 1000, 5000])
            lru.put(key, value)
            ref.put(key, value)
        else:
            assert lru.get(key) == ref.get(key)
        assert lru.weight <= 4000 and len(lru) == len(ref.items)
        assert lru.weight == sum(w for _, w in ref.items.values())


@pytest.mark.slow
def test_token_counter_memory_is_bounded_under_large_distinct_prompts() -> None:
    """The shadow caches and prompt_lint tokenize through a TokenCounter: its three caches
    stay within their weight budget, and the memory they hold with it."""
    budget = 1 << 20  # bytes per cache
    counter = TokenCounter(budgets=MemoBudgets(**{
        name: budget for name in ("token_chunks", "token_texts", "token_counts", "token_pieces")}))
    rng = random.Random(1)
    base = " ".join(f"w{rng.randrange(5000)}" for _ in range(42_000))  # ~256 kB
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        held: list[int] = []
        for i in range(24):  # 24 distinct ~256 kB system prompts, 6 MB of text in all
            text = f"prompt {i}: {base}"
            assert len(counter.encode(text)) > 40_000 and counter.count(text) > 40_000
            for cache in (counter._cache, counter._counts, counter._ids):
                assert cache.weight <= budget
            held.append(tracemalloc.get_traced_memory()[0] - start)
    finally:
        tracemalloc.stop()
    # the memory held stops growing once the caches are full: the last 12 prompts add
    # (almost) nothing to what the first 12 left, though each brought new text
    assert held[-1] < held[11] * 1.15 + (1 << 20), [h >> 20 for h in held]


@pytest.mark.parametrize("size", [1, 1000])
def test_approx_bytes_counts_strings_and_token_lists(size: int) -> None:
    assert approx_bytes("x" * size) >= size
    assert approx_bytes(list(range(300, 300 + size))) >= 32 * size
