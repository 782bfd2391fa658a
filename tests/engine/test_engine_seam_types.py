"""The engine's side of the gateway seam: typed errors with fields, one delta type that carries
the prefill time its cached tokens saved, and a config that imports without torch."""

from __future__ import annotations

import pytest

from engine import (
    AsyncEngine,
    Engine,
    EngineConfig,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    RequestTooLong,
    SamplingParams,
    StreamDelta,
)
from engine.loader import LoadedModel
from tests.support import run_fresh_python

from .engine_runtime_support import one_torch_thread, random_prompts, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["one_torch_thread"]  # a fixture, imported for use
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_model(seed=3)


def test_bad_input_raises_typed_errors_with_fields(tiny: LoadedModel) -> None:
    eng = Engine(EngineConfig(num_pages=4, page_size=8, max_model_len=40), model=tiny)
    with pytest.raises(RequestTooLong) as long_:
        eng.add_request(list(range(32)), GREEDY)  # the 4 x 8 token pool holds 31 + 1
    assert (long_.value.prompt_tokens, long_.value.limit, long_.value.field) == (32, 31, "prompt")
    assert isinstance(long_.value, InvalidRequest) and isinstance(long_.value, ValueError)
    for bad in ("", [], [1, 2, 10_000]):
        with pytest.raises(InvalidRequest) as info:
            eng.add_request(bad, GREEDY)
        assert info.value.field == "prompt" and not isinstance(info.value, RequestTooLong)
    eng.add_request([1, 2, 3], GREEDY, request_id="same")
    with pytest.raises(InvalidRequest) as dup:
        eng.add_request([1, 2, 3], GREEDY, request_id="same")
    assert dup.value.field == "request_id"
    while eng.has_unfinished():
        eng.step()
    eng.check()


def test_logit_bias_is_checked_against_the_vocabulary_and_steers_output(
        tiny: LoadedModel) -> None:
    eng = Engine(EngineConfig(num_pages=16, page_size=8), model=tiny)
    vocab = tiny.config.vocab_size
    with pytest.raises(InvalidRequest) as outside:
        eng.add_request([1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert outside.value.field == "logit_bias" and str(vocab) in str(outside.value)
    forced = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            logit_bias={vocab - 1: 100.0})
    [out] = eng.generate([[1, 2, 3]], forced)
    assert out.token_ids == [vocab - 1] * 4
    eng.check()


def test_step_returns_stream_deltas_with_the_saved_prefill_time(tiny: LoadedModel) -> None:
    eng = Engine(EngineConfig(num_pages=64, page_size=8), model=tiny)
    prompt = random_prompts(1, 40, 40, seed=4)[0]
    eng.generate([prompt], GREEDY)  # cold: measures the prefill rate, fills the cache
    rid = eng.add_request(prompt, GREEDY)
    deltas: list[StreamDelta] = []
    while eng.has_unfinished():
        deltas += [d for d in eng.step() if d.request_id == rid]
    rate = eng.prefill_tokens_per_second
    assert rate is not None and rate > 0
    assert all(isinstance(d, StreamDelta) and d.cached_tokens == 32 for d in deltas)
    # Independent of the engine's helper: cached tokens over the measured rate, in ms.
    assert deltas[-1].prefill_saved_ms == pytest.approx(32 / rate * 1000.0)
    assert deltas[-1].finished and deltas[-1].output is not None
    assert [d.finished for d in deltas[:-1]] == [False] * (len(deltas) - 1)


async def test_a_shut_down_engine_raises_engine_unavailable(tiny: LoadedModel) -> None:
    aeng = AsyncEngine(engine=Engine(EngineConfig(num_pages=16, page_size=8), model=tiny))
    await aeng.shutdown()
    with pytest.raises(EngineUnavailable, match="shut down") as info:
        await anext(aeng.stream([1, 2], GREEDY))
    assert isinstance(info.value, EngineError) and isinstance(info.value, RuntimeError)


def test_engine_config_and_errors_import_without_torch() -> None:
    """The gateway nests an EngineConfig in its config; an upstream-only gateway skips torch."""
    code = ("import sys, engine, engine.config, gateway.config; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "engine.EngineConfig(page_size=32); engine.InvalidRequest('x', field='prompt')")
    run = run_fresh_python(code, timeout=120)
    assert run.returncode == 0, run.stderr
