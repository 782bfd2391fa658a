"""AsyncEngine: streaming deltas, UTF-8 safety, stop strings, cancellation, abort, stats."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, Engine, EngineConfig, RequestError, SamplingParams, StreamDelta
from engine.loader import LoadedModel
from engine.rate_meter import RateMeter

from .engine_runtime_support import (
    STOP,
    chain_model,
    dense_greedy,
    one_torch_thread,
    random_prompts,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["one_torch_thread"]  # a fixture, imported for use


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_model(seed=2)


@pytest.fixture
async def aeng(tiny: LoadedModel):
    engine = AsyncEngine(engine=Engine(EngineConfig(num_pages=64, page_size=8), model=tiny))
    yield engine
    await engine.shutdown()
    engine.engine.check()


async def collect(aeng: AsyncEngine, prompt, params, **kwargs) -> list[StreamDelta]:
    return [d async for d in aeng.stream(prompt, params, **kwargs)]


async def test_concurrent_streams_match_the_dense_reference(aeng, tiny) -> None:
    prompts = random_prompts(4, 5, 40, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    streams = await asyncio.gather(*(collect(aeng, p, params) for p in prompts))
    for prompt, deltas in zip(prompts, streams, strict=True):
        final = deltas[-1]
        assert final.finished and final.output is not None
        assert not any(d.finished for d in deltas[:-1])
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == final.output.token_ids == dense_greedy(tiny, prompt, 12)[:12]
        assert "".join(d.text for d in deltas) == final.output.text
        assert final.output.completion_tokens == 12


CHAIN = "ab\u00e9\u4e16\U0001f642c"  # "abé世🙂c": 1, 1, 2, 3, 4, 1 bytes, all distinct


async def test_stream_text_is_utf8_safe_and_hides_partial_stop_strings() -> None:
    model = chain_model(CHAIN)
    aeng = AsyncEngine(engine=Engine(EngineConfig(num_pages=16, page_size=8), model=model))
    try:
        greedy = SamplingParams(max_tokens=20, temperature=0.0)
        deltas = await collect(aeng, [ord("a")], greedy)
        assert deltas[-1].output.token_ids == list(CHAIN[1:].encode()) + [STOP]
        assert deltas[-1].output.finish_reason == "stop"
        texts = [d.text for d in deltas if d.text]
        assert texts == ["b", "\u00e9", "\u4e16", "\U0001f642", "c"]  # whole characters only

        never = SamplingParams(max_tokens=20, temperature=0.0, stop=["\u4e16\U0001f642x"])
        held = [d.text for d in await collect(aeng, [ord("a")], never) if d.text]
        assert held == ["b", "\u00e9", "\u4e16\U0001f642c"]  # held while it could be a stop

        cut = SamplingParams(max_tokens=20, temperature=0.0, stop=["\U0001f642"])
        stopped = await collect(aeng, [ord("a")], cut)
        assert "".join(d.text for d in stopped) == "b\u00e9\u4e16" == stopped[-1].output.text
        assert stopped[-1].output.finish_reason == "stop"
    finally:
        await aeng.shutdown()
    aeng.engine.check()


async def test_cancelling_the_consumer_aborts_and_frees_pages(aeng) -> None:
    prompt = random_prompts(1, 30, 30, seed=8)[0]
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    got_first = asyncio.Event()

    async def consume() -> None:
        async for delta in aeng.stream(prompt, params, request_id="doomed"):
            if delta.token_ids:  # the prompt is prefilled (the first delta only admits it)
                got_first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):  # the loop thread processes the abort
        stats = aeng.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.pages_used == 0:
            break
        await asyncio.sleep(0.02)
    stats = aeng.stats()
    assert stats.running == stats.waiting == stats.pages_used == 0
    assert stats.pages_cached > 0  # its computed prompt pages stay reusable
    assert not await aeng.abort("doomed")  # already gone


async def test_abort_ends_the_stream_with_abort(aeng) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    stream = aeng.stream(random_prompts(1, 10, 10, seed=9)[0], params, request_id="r1")
    first = await anext(stream)
    assert not first.finished
    assert await aeng.abort("r1")
    rest = [d async for d in stream]
    assert rest[-1].finished and rest[-1].output.finish_reason == "abort"
    assert rest[-1].output.completion_tokens < 500


async def test_bad_input_raises_at_the_call(aeng) -> None:
    with pytest.raises(ValueError, match="empty"):
        await collect(aeng, [], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        await collect(aeng, [1, 2], SamplingParams(top_p=0.0))


async def test_stats_namespaces_and_prefill_rate(aeng) -> None:
    prompt = random_prompts(1, 40, 40, seed=10)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = await aeng.generate(prompt, params, namespace="t1")
    second = await aeng.generate(prompt, params, namespace="t1")
    other = await aeng.generate(prompt, params, namespace="t2")
    assert (first.cached_tokens, second.cached_tokens, other.cached_tokens) == (0, 32, 0)
    assert second.token_ids == first.token_ids == other.token_ids
    stats = aeng.stats()
    assert stats.prefix_cache_queries == 3 and stats.prefix_cache_hit_tokens == 32
    assert stats.pages_free + stats.pages_used + stats.pages_cached == stats.pages_total
    assert aeng.prefill_tokens_per_second is not None and aeng.prefill_tokens_per_second > 0


async def test_every_delta_carries_the_cached_tokens_of_its_request(aeng) -> None:
    """The gateway fills its usage headers from the first delta, before the request ends."""
    prompt = random_prompts(1, 40, 40, seed=11)[0]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    cold = await collect(aeng, prompt, params, namespace="t1")
    warm = await collect(aeng, prompt, params, namespace="t1")
    for deltas, expected in ((cold, 0), (warm, 32)):
        assert deltas[-1].output is not None and deltas[-1].output.cached_tokens == expected
        assert [d.cached_tokens for d in deltas] == [expected] * len(deltas)


async def test_shutdown_aborts_in_flight_streams(tiny) -> None:
    aeng = AsyncEngine(engine=Engine(EngineConfig(num_pages=32, page_size=8), model=tiny))
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    stream = aeng.stream([1, 2, 3], params)
    await anext(stream)
    await aeng.shutdown()
    rest = [d async for d in stream]
    assert rest[-1].output.finish_reason == "abort"
    aeng.engine.check()
    with pytest.raises(RuntimeError, match="shut down"):
        await collect(aeng, [1, 2], params)


async def test_a_failing_step_raises_request_error_and_the_loop_survives(aeng) -> None:
    real_run = aeng.engine.runner.run
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return real_run(inputs)

    aeng.engine.runner.run = flaky
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with pytest.raises(RequestError, match="simulated device fault") as info:
        await collect(aeng, [1, 2, 3, 4], params)
    assert info.value.output.finish_reason == "error"
    after = await aeng.generate([1, 2, 3, 4], params)  # the loop thread keeps serving
    assert after.completion_tokens == 6
    assert aeng.stats().pages_used == 0


async def test_first_delta_admits_with_cached_tokens_before_any_token(aeng) -> None:
    prompt = random_prompts(1, 40, 40, seed=11)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    await aeng.generate(prompt, params)  # warm the prefix cache
    deltas = [d async for d in aeng.stream(prompt, params)]
    head = deltas[0]
    assert head.token_ids == [] and head.text == "" and not head.finished
    final = deltas[-1].output
    assert final is not None and final.cached_tokens > 0
    assert head.cached_tokens == final.cached_tokens  # what a response head says is the usage


def test_prefill_rate_weighs_samples_by_their_size() -> None:
    """Small prefill steps (mostly fixed per-step cost) barely move a rate learned from full
    chunks; the meter equals a naive recomputation over the whole sample history."""
    samples = [(512, 1.0), (298, 0.7), (10, 0.1), (10, 0.1), (10, 0.1), (512, 1.2)]
    meter = RateMeter(half_life=4096)
    for amount, seconds in samples:
        meter.update(amount, seconds)
    amounts = seconds = 0.0
    for i, (a, s) in enumerate(samples):  # each sample decays by the amount that came after it
        decay = 0.5 ** (sum(later for later, _ in samples[i + 1 :]) / 4096)
        amounts, seconds = amounts + a * decay, seconds + s * decay
    assert meter.value == pytest.approx(amounts / seconds)

    swamped = RateMeter()
    swamped.update(512, 1.0)  # 512 tok/s on a full chunk
    for _ in range(3):
        swamped.update(10, 0.1)  # 100 tok/s on tiny steps
    assert swamped.value is not None and swamped.value > 400  # a per-sample average: 240
    assert RateMeter().value is None
