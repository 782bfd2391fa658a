"""The engine runtime on the real SmolLM2-135M-Instruct against the dense reference forward.

Greedy outputs through batching, chunked prefill, preemption and prefix caching must equal
`engine.dense_reference.greedy_generate` (no paging, whole sequence recomputed per token).
"""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from engine.dense_reference import greedy_generate
from engine.loader import LoadedModel

pytestmark = pytest.mark.slow

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0)
SYSTEM = "You help a bakery. Open 7am-3pm, Tuesday to Sunday. We sell rye and buns."
QUESTIONS = ["When do you open on Sunday?", "Do you sell rye bread?", "Can I order 30 buns?"]


def chat_ids(loaded: LoadedModel, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return loaded.tokenizer.apply_chat_template(messages)


@pytest.fixture(scope="module")
def prompts(loaded_model: LoadedModel) -> list[list[int]]:
    return [chat_ids(loaded_model, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(loaded_model: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    stops = loaded_model.tokenizer.stop_token_ids
    return [greedy_generate(loaded_model.model, p, NEW, stops) for p in prompts]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chunked_preempted_batch_equals_dense(loaded_model, prompts, reference) -> None:
    # a pool one page larger than the largest request holds any one of them but not all
    # three: preemption by recompute; 16-token chunks: chunked prefill
    largest = max(-(-(len(p) + NEW) // 16) for p in prompts)
    config = EngineConfig(
        num_pages=largest + 1, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    eng = Engine(config, model=loaded_model)
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = eng.stats()
    assert stats.preemptions > 0
    eng.check()
    assert stats.pages_free == stats.pages_total


def test_prefix_cache_hit_is_the_shared_full_pages(loaded_model, prompts, reference) -> None:
    eng = Engine(EngineConfig(num_pages=64), model=loaded_model)
    first = eng.generate([prompts[0]], GREEDY)[0]
    second = eng.generate([prompts[1]], GREEDY)[0]
    shared = common_prefix(prompts[0], prompts[1])
    assert first.cached_tokens == 0
    assert second.cached_tokens == shared // 16 * 16 > 0
    assert [first.token_ids, second.token_ids] == reference[:2]
    text = loaded_model.tokenizer.decode(
        [t for t in second.token_ids if t not in loaded_model.tokenizer.stop_token_ids]
    )
    assert second.text == text
    eng.check()


def test_capital_of_france_is_paris(loaded_model) -> None:
    eng = Engine(EngineConfig(num_pages=32), model=loaded_model)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = eng.chat(messages, SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.text
    assert out.prompt_tokens == len(loaded_model.tokenizer.apply_chat_template(messages))


def test_async_stream_joins_to_the_final_text(loaded_model, prompts, reference) -> None:
    async def run() -> list:
        aeng = AsyncEngine(engine=Engine(EngineConfig(num_pages=32), model=loaded_model))
        try:
            return [d async for d in aeng.stream(prompts[2], GREEDY, namespace="tenant")]
        finally:
            await aeng.shutdown()

    deltas = asyncio.run(run())
    final = deltas[-1].output
    assert final.token_ids == reference[2]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
