"""Cache models of upstream replicas: learning, llama.cpp slots, Anthropic breakpoints.

References: the fake llama-server (`gateway.fake_llama_server`: slots chosen and reused as the
real server does, over its own tokenization of the whole rendered prompt) and the caching fake
upstream (`gateway.fake_upstream`: a radix cache with a capacity of its own) report the hits;
the models' predictions are checked against what those servers reported.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from gateway.agent_trace import agent_trace
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.router import RouterConfig
from gateway.backends.upstream_http import UpstreamOptions
from gateway.fake_llama_server import FakeLlamaConfig, create_fake_llama_server
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream
from gateway.llama_slots import SlotShadow, common_prefix_tokens
from gateway.shadow import Prompt, ShadowCache, ShadowConfig, as_prompt
from gateway.shadow_models import BreakpointShadow
from gateway.types import Final
from radix_cache import PackedTokens

from .upstream_helpers import chat_request


def _pool(kind: str, apps: list[Any], policy: str = "prefix",
          shadows: list[Any] | None = None) -> ReplicaPool:
    backends = [make_upstream(kind, UpstreamOptions(url=f"http://r{i}.test/v1", name=f"r{i}"),
                              transport=httpx.ASGITransport(app=app))
                for i, app in enumerate(apps)]
    return ReplicaPool(kind, backends, router=RouterConfig(policy=policy),  # type: ignore[arg-type]
                       shadow=shadows)


async def _replay(pool: ReplicaPool, trace: list[Any]) -> list[Final]:
    finals = []
    for item in trace:
        req = chat_request(item.body["messages"], tools=tuple(item.body["tools"]),
                           body=item.body)
        final = [x async for x in pool.stream(req)][-1]
        assert isinstance(final, Final)
        # the usage the request's record gets (a whole answer goes out before the shadow's
        # prediction once its replica reports its own figures; the stream is closed now)
        finals.append(dataclasses.replace(final, usage=final.settled_usage()))
    await pool.aclose()
    return finals


def _close(final: Final) -> bool:
    u = final.usage
    assert u.predicted_cached_tokens is not None and u.reported_cached_tokens is not None
    return abs(u.predicted_cached_tokens - u.reported_cached_tokens) <= 0.05 * u.prompt_tokens


TRACE = agent_trace(sessions=5, turns=5, system_words=300, task_words=120, output_words=60)


@pytest.mark.parametrize("unified_kv", [False, True])
async def test_slot_model_predicts_what_llama_server_reports(unified_kv: bool) -> None:
    """Both ways llama-server keeps its slots: one KV buffer per slot (`--parallel N`), and
    one for all whose idle slots are cleared as each request starts (its default)."""
    apps = [create_fake_llama_server(FakeLlamaConfig(slots=2, unified_kv=unified_kv))
            for _ in range(2)]
    finals = await _replay(_pool("llamacpp", apps), TRACE)
    warm = [f for f, item in zip(finals, TRACE, strict=True) if item.turn > 0]
    close = sum(_close(f) for f in warm)
    assert close >= 0.9 * len(warm), (close, len(warm))
    assert sum(a.state.server.requests for a in apps) == len(TRACE)


@pytest.mark.parametrize("unified_kv", [False, True])
async def test_slot_model_routing_costs_no_hits_against_round_robin(unified_kv: bool) -> None:
    def cached(finals: list[Final]) -> int:
        return sum(f.usage.reported_cached_tokens or 0 for f in finals)

    def servers() -> list[Any]:
        return [create_fake_llama_server(FakeLlamaConfig(slots=2, unified_kv=unified_kv))
                for _ in range(2)]

    radix = lambda: [ShadowCache(), ShadowCache()]  # noqa: E731 - a model that ignores slots
    modelled = cached(await _replay(_pool("llamacpp", servers()), TRACE))
    round_robin = cached(await _replay(_pool("openai", servers(), "round_robin", radix()), TRACE))
    radix_prefix = cached(await _replay(_pool("openai", servers(), shadows=radix()), TRACE))
    assert modelled >= round_robin, (modelled, round_robin)
    assert modelled >= radix_prefix, (modelled, radix_prefix)


async def test_a_request_pinned_to_a_cleared_slot_loses_its_prefix() -> None:
    """What the slot model avoids, as llama-server does it: with one KV buffer the idle slots
    are cleared as a request starts, and a request pinned to an empty slot loads nothing back
    from the host cache; left to the server, the same request gets its prefix back."""
    app = create_fake_llama_server(FakeLlamaConfig(slots=2, unified_kv=True))
    system = {"role": "system", "content": "You check every release twice. " * 40}
    first = {"model": "m", "messages": [system, {"role": "user", "content": "a"}]}
    other = {"model": "m", "messages": [{"role": "user", "content": "unrelated " * 50}]}
    again = {"model": "m", "messages": [system, {"role": "user", "content": "b"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://llama.test") as client:
        async def cached(body: dict[str, Any]) -> int:
            answer = (await client.post("/v1/chat/completions", json=body)).json()
            return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached({**first, "id_slot": 0}) == 0
        assert await cached({**other, "id_slot": 1}) == 0  # slot 0 saved and cleared
        assert await cached({**again, "id_slot": 0}) == 0  # pinned to the cleared slot
        assert await cached(again) > 200  # the server's own choice loads it back


async def test_a_generic_upstream_that_answers_like_llama_server_gets_the_slot_model() -> None:
    apps = [create_fake_llama_server(FakeLlamaConfig(slots=3))]
    pool = _pool("openai", apps)
    assert isinstance(pool.router.replicas[0].shadow, ShadowCache)
    await _replay(pool, TRACE[:2])
    shadow = pool.router.replicas[0].shadow
    assert isinstance(shadow, SlotShadow)
    assert [len(m.slots) for m in shadow.models] == [3, 3]  # read from /props


def test_without_a_host_cache_sessions_are_pinned_to_slots_empty_ones_first() -> None:
    shadow = SlotShadow(ShadowConfig(page_size=1, slots=2), host_cache=False)
    assert shadow.steers
    system = list(range(100))
    a, b = as_prompt(system + [1000] * 50), as_prompt(system + [2000] * 50)
    assert shadow.upstream_fields(a, "t") == {"id_slot": 0, "cache_prompt": True}
    assert shadow.upstream_fields(b, "t")["id_slot"] == 1  # an empty slot, not a's
    a2 = as_prompt(system + [1000] * 50 + [3] * 40)
    assert shadow.predict(a2, "t") == 150 and shadow.upstream_fields(a2, "t")["id_slot"] == 0
    assert shadow.predict(as_prompt(system + [2000] * 50), "other") == 0  # tenants never share


async def test_radix_shadow_learns_an_upstream_smaller_than_itself() -> None:
    trace = agent_trace(sessions=6, turns=6, system_words=200, task_words=150, output_words=80)

    class Stubborn(ShadowCache):
        def learn(self, *args: Any) -> None:  # the shadow before this change
            return None

    def errors(shadow: ShadowCache) -> list[float]:
        app = create_fake_upstream(FakeUpstreamConfig(max_pages=150))  # the provider is small
        return [shadow, app]  # type: ignore[return-value]

    out = {}
    for name, shadow in (("learning", ShadowCache()), ("stubborn", Stubborn())):
        shadow_, app = errors(shadow)
        finals = await _replay(_pool("openai", [app], shadows=[shadow_]), trace)
        late = finals[len(finals) // 2:]
        out[name] = sum(abs((f.usage.predicted_cached_tokens or 0) -
                            (f.usage.reported_cached_tokens or 0)) for f in late)
    assert out["learning"] < 0.5 * out["stubborn"], out


def test_learn_drops_what_extended_the_reported_prefix() -> None:
    shadow = ShadowCache(ShadowConfig(page_size=4))
    base = list(range(64))
    shadow.record(base + [1] * 32, "t")
    shadow.record(base + [2] * 32, "t")
    assert shadow.match_length(base + [2] * 32, "t") == 96
    shadow.learn(base + [1] * 32, "t", predicted=96, reported=32)  # the upstream kept 32
    # the sibling's own part went with it; the shared base is cached again by this request
    assert shadow.match_length(base + [2] * 32, "t") == 64
    assert shadow.match_length(base + [1] * 32, "t") == 96  # this prompt is cached again
    assert shadow.capacity < shadow.config.max_pages
    before = shadow.pages
    shadow.learn(base + [1] * 32, "t", predicted=96, reported=92)  # within noise: no change
    assert shadow.pages == before


def test_breakpoint_shadow_reads_live_entries_only() -> None:
    now = [0.0]
    shadow = BreakpointShadow(ShadowConfig(page_size=1, min_cached_tokens=1024, ttl_s=300),
                              clock=lambda: now[0])
    tokens = list(range(3000))
    first = Prompt(PackedTokens(tokens[:2000]), (1100, 1500))
    shadow.record(first, "t")
    second = Prompt(PackedTokens(tokens), (1100, 2500))  # extends the first
    assert shadow.predict(second, "t") == 1500  # the longest entry the first one wrote
    now[0] = 200.0
    shadow.record(second, "t")  # a hit refreshes 1500; 2500 is written
    now[0] = 450.0
    assert shadow.predict(Prompt(PackedTokens(tokens + [7]), (2900,)), "t") == 2500
    now[0] = 800.0  # everything has expired
    assert shadow.predict(Prompt(PackedTokens(tokens), (2900,)), "t") == 0
    assert shadow.predict(Prompt(PackedTokens(tokens[:900]), (800,)), "t") == 0  # under 1024


def test_common_prefix_tokens_matches_a_naive_scan() -> None:
    import random

    rng = random.Random(3)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 3000))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(4) for _ in range(50)]
        naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
        assert common_prefix_tokens(PackedTokens(a).data, PackedTokens(b).data) == naive


async def test_upstream_kinds_choose_their_cache_models() -> None:
    from gateway.backends.providers import ProviderPools, build_upstream_backend
    from gateway.config import GatewayConfig, UpstreamSpec

    specs = ("llamacpp=http://a.test:1/v1", "vllm=http://b.test:1/v1",
             "anthropic=https://api.anthropic.com", "openai=https://api.openai.com/v1")
    config = GatewayConfig(upstreams=tuple(UpstreamSpec.parse(s) for s in specs),
                           upstream_api_keys={"openai": "sk-o"})
    backend = build_upstream_backend(config)
    assert isinstance(backend, ProviderPools)
    shadow = {kind: pool.router.replicas[0].shadow for kind, pool in backend.pools.items()}
    assert isinstance(shadow["llamacpp"], SlotShadow)
    assert isinstance(shadow["anthropic"], BreakpointShadow)
    assert isinstance(shadow["vllm"], ShadowCache) and shadow["vllm"].config.page_size == 16
    openai_rule = shadow["openai"].config
    assert (openai_rule.page_size, openai_rule.min_cached_tokens) == (128, 1024)
    # every OpenAI-compatible kind takes the openai key; an OpenAI-format request goes to one
    assert backend.pools["vllm"].router.replicas[0].backend.options.api_key == "sk-o"
    await backend.aclose()


async def test_slot_model_follows_llama_servers_host_prompt_cache() -> None:
    """More sessions than slots: llama-server saves overwritten slots in its host prompt cache
    and loads them back; the slot model predicts those hits, a model without the host cache
    (the shadow before it knew) does not."""
    trace = agent_trace(sessions=6, turns=4, system_words=200, task_words=120, output_words=60,
                        seed=3)

    def server(host_cache: bool) -> list[Any]:
        return [create_fake_llama_server(FakeLlamaConfig(slots=2, host_cache=host_cache))]

    def warm(finals: list[Final]) -> list[Final]:
        return [f for f, item in zip(finals, trace, strict=True) if item.turn > 0]

    modelled = warm(await _replay(_pool("llamacpp", server(True)), trace))
    blind = warm(await _replay(_pool("llamacpp", server(True), shadows=[
        SlotShadow(ShadowConfig(page_size=1, slots=2), host_cache=False)]), trace))
    no_cache = warm(await _replay(_pool("llamacpp", server(False), shadows=[
        SlotShadow(ShadowConfig(page_size=1, slots=2), host_cache=False)]), trace))

    def reported(finals: list[Final]) -> int:
        return sum(f.usage.reported_cached_tokens or 0 for f in finals)

    assert sum(map(_close, modelled)) >= 0.9 * len(modelled)
    assert sum(map(_close, blind)) < sum(map(_close, modelled))
    assert sum(map(_close, no_cache)) >= 0.9 * len(no_cache)  # each model fits its server


def test_host_prompt_cache_saves_overwritten_slots_and_loads_them_back() -> None:
    shadow = SlotShadow(ShadowConfig(page_size=1, slots=1))
    system = list(range(100))
    a = as_prompt(system + [1000] * 300)
    b = as_prompt(system + [2000] * 300)
    shadow.upstream_fields(a, "t")
    assert shadow.predict(b, "t") == 100  # keeps 1/4 of a: a is saved first, nothing to load
    shadow.upstream_fields(b, "t")
    host = shadow.model.host
    assert host is not None and [len(e.data) // 4 for e in host.entries] == [400]
    a2 = as_prompt(system + [1000] * 300 + [7] * 20)
    assert shadow.predict(a2, "t") == 400  # a comes back from the host cache
    assert shadow.predict(a2, "other") == 0  # tenants never share


def test_with_a_host_cache_the_server_chooses_and_the_model_follows_it() -> None:
    """No `id_slot` is sent; the model takes the slot the server would (the one sharing most of
    the prompt, else the least recently used, whose saved prompt comes back from the host)."""
    shadow = SlotShadow(ShadowConfig(page_size=1, slots=2))
    system = list(range(100))
    a, b = as_prompt(system + [1000] * 300), as_prompt(system + [2000] * 300)
    assert shadow.upstream_fields(a, "t") == {}
    assert shadow.predict(b, "t") == 0  # a's slot is busy: b takes an empty one
    shadow.finished(a, "t")
    assert shadow.predict(b, "t") == 100  # shares the system prompt with a's idle slot
    shadow.upstream_fields(b, "t")  # keeps 1/4 of a's slot: a is saved to the host first
    shadow.finished(b, "t")
    a2 = as_prompt(system + [1000] * 300 + [3] * 40)
    assert shadow.predict(a2, "t") == 400  # b's slot again, a loaded back into it
    assert shadow.predict(a2, "other") == 0  # tenants never share
    short = SlotShadow(ShadowConfig(page_size=1, slots=2))
    for prompt in (as_prompt(system + [1000] * 50), as_prompt(system + [2000] * 50)):
        short.upstream_fields(prompt, "t")  # b keeps 2/3 of a's slot: a is not saved
        short.finished(prompt, "t")
    assert short.predict(as_prompt(system + [1000] * 50 + [3] * 40), "t") == 100


async def _overlapping(pool: ReplicaPool, trace: list[Any]) -> list[tuple[int, Final]]:
    """The sessions of `trace` at once (each one's turns in order): (turn, Final) in the
    order the answers ended."""
    sessions: dict[int, list[Any]] = {}
    for item in trace:
        sessions.setdefault(item.session, []).append(item)
    done: list[tuple[int, Final]] = []

    async def run(items: list[Any]) -> None:
        for item in items:
            req = chat_request(item.body["messages"], tools=tuple(item.body["tools"]),
                               body=item.body)
            final = [x async for x in pool.stream(req)][-1]
            assert isinstance(final, Final)
            done.append((item.turn, final))

    await asyncio.gather(*map(run, sessions.values()))
    await pool.aclose()
    return done


async def test_overlapping_sessions_are_predicted_with_busy_slots_passed_by() -> None:
    """Sessions that overlap on llama-server's default setup (idle slots cleared): a slot is
    busy until its answer ends and the server picks among the others, so a model that took
    every slot as free would guess wrong; within 5% of the prompt on >= 90% of warm requests."""
    trace = agent_trace(sessions=4, turns=5, system_words=200, task_words=120,
                        output_words=60, seed=11)
    app = create_fake_llama_server(FakeLlamaConfig(slots=4, unified_kv=True, busy_s=0.01))
    pool = _pool("llamacpp", [app])
    results = await _overlapping(pool, trace)
    warm = [f for turn, f in results if turn > 0]
    assert sum(map(_close, warm)) >= 0.9 * len(warm), [
        (f.usage.predicted_cached_tokens, f.usage.reported_cached_tokens) for f in warm]
    shadow = pool.router.replicas[0].shadow
    assert isinstance(shadow, SlotShadow)
    assert [m.busy for m in shadow.models] == [[0, 0, 0, 0]] * 2


async def test_the_slot_model_learns_whether_the_server_clears_idle_slots() -> None:
    """Sessions overlapping on llama-server with one KV buffer for all slots (its default:
    idle slots cleared as a request starts) and with `--parallel N` (kept): the server's
    choices differ once slots are busy, and nothing it serves says which setup it runs. The
    model that assumes the other setup is left behind once its guesses miss. The setups'
    choices first differ only once two sessions contend for a slot, which timing puts
    anywhere in the trace's first turns; the requests in flight then miss before the first
    report teaches the model, so the accuracy is read over the last half of a long trace."""
    trace = agent_trace(sessions=4, turns=10, system_words=200, task_words=120,
                        output_words=60, seed=11)
    for unified_kv in (True, False):
        app = create_fake_llama_server(FakeLlamaConfig(slots=2, unified_kv=unified_kv,
                                                       busy_s=0.01))
        pool = _pool("llamacpp", [app])
        results = await _overlapping(pool, trace)
        warm = [f for turn, f in results[len(results) // 2:] if turn > 0]  # once learnt
        assert sum(map(_close, warm)) >= 0.9 * len(warm), (unified_kv, [
            (f.usage.predicted_cached_tokens, f.usage.reported_cached_tokens) for f in warm])
        shadow = pool.router.replicas[0].shadow
        assert isinstance(shadow, SlotShadow)
        right = 0 if unified_kv else 1  # models[0] clears idle slots, models[1] keeps them
        assert shadow.errors[right] <= shadow.errors[1 - right], (unified_kv, shadow.errors)
        if shadow.errors[right] < shadow.errors[1 - right]:  # their guesses parted: it predicts
            assert shadow.active == right, (unified_kv, shadow.errors)


async def test_requests_wait_for_a_free_slot_only_once_the_count_is_known() -> None:
    shadow = SlotShadow(ShadowConfig(page_size=1, slots=1))
    first, second = as_prompt(list(range(50))), as_prompt(list(range(60)))
    shadow.upstream_fields(first, "t")
    await asyncio.wait_for(shadow.slot_free(), 1)  # a guessed count holds nothing back
    shadow.resize(1)  # /props: one slot, busy
    waiting = asyncio.ensure_future(shadow.slot_free())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    shadow.finished(first, "t")
    await asyncio.wait_for(waiting, 1)
    shadow.upstream_fields(second, "t")
    # every slot busy: the server will give the next request the one freed first, which
    # still holds `second`
    assert shadow.predict(as_prompt(list(range(70))), "t") == 60
