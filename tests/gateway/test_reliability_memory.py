"""Issue 17 item 6: memory stays bounded by bytes under distinct large prompts.

RSS is a behaviour, not a timing: once every cache is full, more distinct large prompts through
the whole gateway (lint on, the shadow cache, the fake upstream) must not grow the process."""

from __future__ import annotations

import gc
import platform
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.body import INLINE_BYTES
from gateway.config import GatewayConfig
from gateway.llama_slots import SlotShadow
from gateway.memory import rss_bytes, tune_malloc
from gateway.shadow import Prompt, ShadowCache, ShadowConfig
from gateway.shadow_models import BreakpointShadow
from prompt_lint.budgets import BUDGETS, MemoBudgets
from prompt_lint.memo import LOCK
from prompt_lint.memory import apply_budgets, process_memos
from radix_cache import PackedTokens
from tests.gateway.upstream_helpers import fake_replicas, gateway_app, pool_over
from tests.support import run_fresh_python

MB = 1 << 20
#: a leak of one copy of each prompt's text alone would add 24 MB in the second round
ROUND_PROMPTS = 24
GROWTH_BOUND = 16 * MB  # measured: ~5 MB; with budgets 8x as large (not yet full) ~24 MB


@pytest.fixture()
def small_budgets() -> Iterator[MemoBudgets]:
    """Process-wide memos at 1/8 of their default budgets (so a few prompts fill them)."""
    small = MemoBudgets(**{name: max(getattr(BUDGETS, name) // 8, 1)
                           for name in process_memos()})
    with LOCK:
        apply_budgets(small)
    yield small
    with LOCK:
        apply_budgets(BUDGETS)


def _prompt(rng: random.Random, i: int) -> str:
    """A distinct ~1 MB system prompt (new words throughout, so no two share chunks)."""
    return f"prompt {i}\n" + "\n".join(
        " ".join(f"w{rng.randrange(100_000)}" for _ in range(120)) for _ in range(140))


async def _send(http: httpx.AsyncClient, text: str) -> None:
    body = {"model": "fake", "max_tokens": 4, "messages": [
        {"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    r = await http.post("/v1/chat/completions", json=body,
                        headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200, r.text


def _held(budgets: MemoBudgets) -> dict[str, int]:
    """Accounted bytes per process-wide memo, checked against its budget on the way."""
    out = {}
    for name, memo in process_memos().items():
        assert memo.weight <= getattr(budgets, name), name
        assert memo.weight == sum(memo.weights().values()), name
        out[name] = memo.weight
    return out


@pytest.mark.slow
async def test_rss_stops_growing_once_caches_are_full(tmp_path: Path,
                                                      small_budgets: MemoBudgets) -> None:
    pool = pool_over(fake_replicas(1, keep_bodies=False, cache=False))
    config = GatewayConfig(db_url=f"sqlite:///{tmp_path / 'gw.db'}", lint_mode="report",
                           api_keys={"key-a": "tenant-a"}, max_body_bytes=4 << 20,
                           lint_max_bytes=4 << 20, lint_learner_bytes=4 * MB)
    app = create_app(config, backend=pool)
    rng = random.Random(17)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                 timeout=120) as http:
        for i in range(ROUND_PROMPTS // 2):  # fill every cache
            await _send(http, _prompt(rng, i))
        gc.collect()
        full, filled = rss_bytes(), _held(small_budgets)
        for i in range(ROUND_PROMPTS // 2, ROUND_PROMPTS // 2 + ROUND_PROMPTS):
            await _send(http, _prompt(rng, i))
        gc.collect()
        grown = rss_bytes() - full
    app.state.store.close()
    held = _held(small_budgets)
    assert sum(filled.values()) > small_budgets.total // 4, filled  # the caches were in use
    assert grown < GROWTH_BOUND, (grown // MB, held)
    learner = app.state.gateway.lint.learner("tenant-a")
    for name, memo in learner.memos().items():
        assert memo.weight <= memo.max_weight, name
    shadow = pool.router.replicas[0].shadow
    assert shadow.pages * shadow.config.page_bytes() <= shadow.config.max_bytes


def test_tune_malloc_applies_on_glibc_and_ignores_zero() -> None:
    assert tune_malloc(0) is False
    glibc = platform.libc_ver()[0] == "glibc"
    assert tune_malloc(128 << 10) is glibc  # a no-op on a C library without mallopt


_FAULTS = """
import random, resource, orjson
from gateway.body import INLINE_BYTES, parse_body
from gateway.config import DEFAULT_MALLOC_THRESHOLD
from gateway.memory import tune_malloc

def faults(raw, times=20):
    parse_body(raw)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(times):
        parse_body(raw)
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / times

rng = random.Random(5)
messages = [{"role": "user", "content": " ".join(f"w{rng.randrange(9999)}" for _ in range(900))}
            for _ in range(11)]
raw = orjson.dumps({"model": "m", "messages": messages})
assert 48 << 10 < len(raw) <= INLINE_BYTES
assert tune_malloc(128 << 10)
low = faults(raw)
assert tune_malloc(DEFAULT_MALLOC_THRESHOLD)
print(low, faults(raw))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_default_threshold_keeps_a_loop_parsed_body_in_the_heap() -> None:
    """orjson's parse buffer is about 16 times the body: under a low threshold each parse of a
    body the event loop parses maps fresh pages; under the default it reuses the heap (in a
    fresh process, as a server's: a long-lived heap may hold a free chunk that large)."""
    run = run_fresh_python(_FAULTS)
    assert run.returncode == 0, run.stderr[-2000:]
    low, default = map(float, run.stdout.split())
    assert low >= 8  # the reference: a mapping per parse
    assert default < 1


class _EmbeddedLike:
    """Only what create_app reads of a backend before serving: an in-process engine's name."""

    name = "embedded"

    def models(self) -> list[str]:
        return ["m"]


@pytest.mark.parametrize(("configured", "embedded", "expected"), [
    (None, False, 1 << 20),  # in front of upstreams: freed large bodies leave RSS
    (None, True, 0),  # beside the engine: glibc's adaptive threshold keeps tensors in the heap
    (1 << 20, True, 1 << 20),  # an explicit setting always wins
    (0, False, 0),
])
def test_malloc_threshold_follows_the_backend(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, configured: int | None,
        embedded: bool, expected: int) -> None:
    applied: list[int] = []
    monkeypatch.setattr("gateway.memory.tune_malloc", lambda value: applied.append(value))
    config = GatewayConfig(db_url=f"sqlite:///{tmp_path / 'gw.db'}",
                           malloc_threshold_bytes=configured)
    backend: Any = _EmbeddedLike() if embedded else pool_over(fake_replicas(1))
    create_app(config, backend=backend)
    assert applied == [expected]


async def test_a_large_upstream_body_is_serialised_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[tuple[int, bool]] = []
    loop_thread = threading.get_ident()  # in-process ASGI: the app runs on the test's loop
    pool = pool_over(fake_replicas(1, keep_bodies=False))
    backend = pool.router.replicas[0].backend
    build = type(backend)._request

    def recording(self: Any, req: Any) -> Any:
        seen.append((len(req.messages[0]["content"]), threading.get_ident() != loop_thread))
        return build(self, req)

    monkeypatch.setattr(type(backend), "_request", recording)
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw", timeout=60) as http:
        for size in (100, INLINE_BYTES * 2):
            await _send(http, "x" * size)
    app.state.store.close()
    assert seen == [(100, False), (INLINE_BYTES * 2, True)]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_shadow_cache_pages_fit_its_byte_budget(page_size: int) -> None:
    config = ShadowConfig(page_size=page_size, max_bytes=256 * 1024)
    shadow = ShadowCache(config)
    for tokens in _prompts(40, 3000, page_size):
        shadow.record(tokens, "t")
        assert shadow.pages * config.page_bytes() <= config.max_bytes
    last = tokens
    assert shadow.match_length(last, "t") > 0  # the most recent prompt is still cached


def test_breakpoint_and_slot_shadows_fit_their_byte_budgets() -> None:
    budget = 64 * 1024
    breakpoints = BreakpointShadow(ShadowConfig(page_size=1, min_cached_tokens=16,
                                                max_bytes=budget))
    slots = SlotShadow(ShadowConfig(page_size=1, slots=4, max_bytes=budget))
    for tokens in _prompts(30, 6000, 9):
        prompt = Prompt(PackedTokens(tokens), (3000, 6000))
        breakpoints.record(prompt, "t")
        slots.upstream_fields(prompt, "t")
        slots.record(prompt, "t")
        slots.finished(prompt, "t")
        held = 0  # both of its models (idle slots cleared, and kept) together
        for model in slots.models:
            assert model.host is not None
            held += sum(len(s.data) for s in model.slots if s is not None)
            held += sum(len(e.data) for e in model.host.entries)
        assert held <= budget
        assert breakpoints._tree.stats.total_pages * ShadowConfig(page_size=1).page_bytes() \
            <= budget
    # a kept prefix still predicts: each model's 4 slots hold the first (budget/2/2)/4 bytes
    assert slots.predict(prompt, "t") == budget // 2 // 2 // 4 // 4
