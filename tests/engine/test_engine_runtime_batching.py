"""Scheduler + block manager on a tiny random Llama against the dense reference forward.

Every greedy output is compared with `engine.dense_reference` (whole sequence recomputed, no
paging, no kernels): continuous batching, staggered arrivals, chunked prefill, preemption under
a tiny page pool, prefix caching, namespaces, aborts and failures. `Engine.check()` verifies
after each run that every page is free or held by the cache.
"""

from __future__ import annotations

import random

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.cli import main as cli_main
from engine.loader import LoadedModel
from engine.plan import plan_memory, shape_from_config

from .engine_runtime_support import (
    STOP,
    dense_greedy,
    one_torch_thread,
    random_prompts,
    tiny_model,
    watch_steps,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["one_torch_thread"]  # a fixture, imported for use


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 3, 70, seed=1)


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [dense_greedy(tiny, p, GREEDY.max_tokens) for p in prompts]


def make(tiny: LoadedModel, **kwargs: object) -> Engine:
    fields: dict[str, object] = {"num_pages": 64, "page_size": 8}
    fields.update(kwargs)
    return Engine(EngineConfig(**fields), model=tiny)  # type: ignore[arg-type]


def assert_all_pages_accounted(eng: Engine) -> None:
    eng.check()
    stats = eng.stats()
    assert stats.running == stats.waiting == stats.pages_used == 0
    assert stats.pages_free + stats.pages_cached == stats.pages_total


def test_batched_equals_dense_and_one_by_one(tiny, prompts, reference) -> None:
    batched = make(tiny).generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == reference
    solo = make(tiny, enable_prefix_caching=False)
    one_by_one = [solo.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert one_by_one == reference
    for out, prompt in zip(batched, prompts, strict=True):
        assert out.prompt_tokens == len(prompt) and out.completion_tokens == 10
        assert out.finish_reason == "length" and out.cached_tokens == 0
        assert out.ttft > 0 and out.tpot > 0 and out.prefill_time > 0


def test_requests_join_and_leave_at_every_step(tiny, prompts, reference) -> None:
    eng = make(tiny)
    budgets = [SamplingParams(max_tokens=n, temperature=0.0) for n in (3, 10, 5, 10, 1, 7)]
    results, pending, step = {}, list(range(len(prompts))), 0
    batch_sizes = []
    while pending or eng.has_unfinished():
        if pending and step % 2 == 0:  # a new request arrives every other step
            i = pending.pop(0)
            eng.add_request(prompts[i], budgets[i], request_id=f"r{i}")
        updates = eng.step()
        batch_sizes.append(len(updates))
        results.update({u.request_id: u.output for u in updates if u.output})
        step += 1
    for i, params in enumerate(budgets):
        assert results[f"r{i}"].token_ids == reference[i][: params.max_tokens]
    assert max(batch_sizes) >= 3  # several requests decoded together
    assert_all_pages_accounted(eng)


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_chunked_prefill_gives_the_same_tokens(tiny, prompts, reference, budget) -> None:
    eng = make(tiny, max_num_batched_tokens=budget)
    sizes = watch_steps(eng, lambda out: out.num_tokens)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == reference
    assert max(sizes) == budget  # prompts were split into chunks of at most the budget
    assert_all_pages_accounted(eng)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_a_tiny_pool_gives_the_same_tokens(tiny, caching) -> None:
    prompts = random_prompts(5, 8, 14, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [dense_greedy(tiny, p, 12) for p in prompts]
    eng = make(tiny, num_pages=6, enable_prefix_caching=caching)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.stats().preemptions > 0
    assert_all_pages_accounted(eng)


def test_prefix_cache_reuses_full_pages_and_matches_no_cache(tiny) -> None:
    shared = random_prompts(1, 40, 40, seed=9)[0]
    a, b = shared + [1, 2, 3], shared + [7, 8, 9, 10, 11]
    cold = make(tiny, page_size=16, enable_prefix_caching=False)
    want_a, want_b = (cold.generate([p], GREEDY)[0].token_ids for p in (a, b))
    eng = make(tiny, page_size=16)
    out_a = eng.generate([a], GREEDY)[0]
    out_b = eng.generate([b], GREEDY)[0]
    assert out_a.cached_tokens == 0 and out_a.token_ids == want_a
    assert out_b.cached_tokens == 32  # the two full 16-token pages of the 40 shared tokens
    assert out_b.token_ids == want_b == dense_greedy(tiny, b, 10)
    again = eng.generate([a], GREEDY)[0]  # fully cached prompt: its last page is recomputed
    assert again.cached_tokens == 32 and again.token_ids == want_a
    stats = eng.stats()
    assert stats.prefix_cache_hit_tokens == 64 and stats.prefix_cache_queries == 3
    assert_all_pages_accounted(eng)


def test_generated_tokens_are_cached_for_the_next_turn(tiny) -> None:
    eng = make(tiny)
    first = random_prompts(1, 21, 21, seed=3)[0]
    out = eng.generate([first], GREEDY)[0]
    turn2 = first + out.token_ids + [5, 6, 7]
    reply = eng.generate([turn2], GREEDY)[0]
    computed = len(first) + len(out.token_ids) - 1  # the last sampled token has no KV yet
    assert reply.cached_tokens == computed // 8 * 8
    assert reply.token_ids == dense_greedy(tiny, turn2, 10)


def test_namespaces_never_share_pages(tiny) -> None:
    eng = make(tiny)
    prompt = random_prompts(1, 30, 30, seed=4)[0]
    first = eng.generate([prompt], GREEDY, namespace="tenant-a")[0]
    other = eng.generate([prompt], GREEDY, namespace="tenant-b")[0]
    same = eng.generate([prompt], GREEDY, namespace="tenant-a")[0]
    assert first.cached_tokens == 0 and other.cached_tokens == 0
    assert same.cached_tokens == 24  # full pages of the first 29 tokens
    assert first.token_ids == other.token_ids == same.token_ids
    assert_all_pages_accounted(eng)


def test_aborts_free_their_pages(tiny, prompts, reference) -> None:
    eng = make(tiny, max_num_seqs=3, max_num_batched_tokens=16)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    finished = {}
    for _ in range(4):
        finished.update({u.request_id: u.output for u in eng.step() if u.output})
    assert eng.stats().waiting > 0 and eng.stats().running > 0
    running, waiting = eng.scheduler.running[0], eng.scheduler.waiting[-1]
    for seq in (running, waiting):
        out = eng.abort(seq.request_id)
        assert out is not None and out.finish_reason == "abort"
        assert reference[ids.index(seq.request_id)][: out.completion_tokens] == out.token_ids
    assert eng.abort(running.request_id) is None  # already gone
    eng.check()
    while eng.has_unfinished():
        finished.update({u.request_id: u.output for u in eng.step() if u.output})
    for rid, ref in zip(ids, reference, strict=True):
        if rid not in (running.request_id, waiting.request_id):
            assert finished[rid].token_ids == ref
    assert_all_pages_accounted(eng)


def test_bad_inputs_get_clear_errors_and_the_engine_keeps_working(tiny, prompts, reference):
    eng = make(tiny, num_pages=4, max_model_len=40)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([1, 2, 10_000], GREEDY)
    with pytest.raises(ValueError, match="at most 31 fit"):  # the 4 x 8 token pool
        eng.add_request(list(range(32)), GREEDY)
    eng2 = make(tiny, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len=20"):
        eng2.generate([list(range(25))], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate([[1, 2]], SamplingParams(max_tokens=0))
    assert not eng.has_unfinished() and not eng2.has_unfinished()
    i = min(range(len(prompts)), key=lambda j: len(prompts[j]))
    assert eng.generate([prompts[i]], GREEDY)[0].token_ids == reference[i][: 32 - len(prompts[i])]
    assert_all_pages_accounted(eng)


def test_context_limit_ends_generation_with_length(tiny) -> None:
    eng = make(tiny, max_model_len=20)
    out = eng.generate([list(range(15))], SamplingParams(max_tokens=50, temperature=0.0))[0]
    assert out.completion_tokens == 5 and out.finish_reason == "length"
    assert out.token_ids == dense_greedy(tiny, list(range(15)), 5)


def test_stop_tokens_and_stop_strings(tiny, prompts, reference) -> None:
    eng = make(tiny)
    ref = reference[1]
    by_token = eng.generate([prompts[1]], SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[ref[3]]))[0]  # fmt: skip
    cut = ref.index(ref[3]) + 1
    assert by_token.token_ids == ref[:cut] and by_token.finish_reason == "stop"
    assert by_token.stop_string is None  # a stop token, not a string
    text = bytes(t for t in ref if t < 256).decode("utf-8", errors="replace")
    stop = text[2:4]
    by_string = eng.generate([prompts[1]], SamplingParams(
        max_tokens=10, temperature=0.0, stop=[stop]))[0]  # fmt: skip
    assert by_string.finish_reason == "stop"
    assert by_string.text == text[: text.index(stop)]
    assert by_string.stop_string == stop  # the output says which string matched
    unmatched = eng.generate([prompts[1]], SamplingParams(
        max_tokens=3, temperature=0.0, stop=["\x00never"]))[0]  # fmt: skip
    assert unmatched.finish_reason == "length" and unmatched.stop_string is None
    assert STOP in eng.tokenizer.stop_token_ids
    assert_all_pages_accounted(eng)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny, prompts) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=123)
    alone = make(tiny).generate([prompts[2]], params)[0].token_ids
    crowd = make(tiny).generate(prompts, [SamplingParams(max_tokens=8, temperature=1.0)] * 2
                                + [params] + [SamplingParams(max_tokens=8)] * 3)  # fmt: skip
    assert crowd[2].token_ids == alone


def test_a_failing_step_fails_its_requests_and_frees_pages(tiny, prompts, reference) -> None:
    eng = make(tiny)
    real_run = eng.runner.run
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_run(inputs)

    eng.runner.run = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        eng.generate(prompts, GREEDY)
    assert_all_pages_accounted(eng)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == reference


def test_random_arrivals_aborts_and_preemptions_keep_the_books(tiny) -> None:
    rng = random.Random(0)
    eng = make(tiny, num_pages=6, max_num_batched_tokens=12, max_num_seqs=4)
    prompts = random_prompts(12, 2, 20, seed=11)
    want = {}
    done = {}
    live: list[str] = []
    for _ in range(200):
        if prompts and rng.random() < 0.6:
            p = prompts.pop()
            n = rng.randint(1, 16)
            rid = eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0))
            want[rid] = (p, n)
            live.append(rid)
        if live and rng.random() < 0.08:
            rid = live.pop(rng.randrange(len(live)))
            if eng.abort(rid) is not None:
                want.pop(rid)
        for u in eng.step():
            if u.output:
                done[u.request_id] = u.output.token_ids
        eng.check()
        if not prompts and not eng.has_unfinished():
            break
    assert eng.stats().preemptions > 0
    for rid, (p, n) in want.items():
        assert done[rid] == dense_greedy(tiny, p, n)
    assert_all_pages_accounted(eng)


def test_concurrent_requests_share_pages_as_soon_as_they_are_computed(tiny) -> None:
    shared = random_prompts(1, 48, 48, seed=12)[0]
    a, b = shared + [1, 2], shared + [3, 4, 5]
    eng = make(tiny, max_num_batched_tokens=24)
    out_a, out_b = eng.generate([a, b], GREEDY)
    # steps 1-2 prefill 48 tokens of `a` in chunks of 24; `b` joins in step 3 and finds all
    # six 8-token pages of the shared prefix already cached, though `a` is still running
    assert (out_a.cached_tokens, out_b.cached_tokens) == (0, 48)
    assert out_a.token_ids == dense_greedy(tiny, a, 10)
    assert out_b.token_ids == dense_greedy(tiny, b, 10)
    assert_all_pages_accounted(eng)


def test_generate_cli_prints_text_and_usage(tiny, capsys, monkeypatch) -> None:
    monkeypatch.setattr("engine.llm_engine.load_model", lambda *args, **kwargs: tiny)
    prompt = "hello"
    assert cli_main([prompt, "--raw", "--max-tokens", "6"]) == 0
    captured = capsys.readouterr()
    want = dense_greedy(tiny, list(prompt.encode()), 6)
    assert captured.out.rstrip("\n") == tiny.tokenizer.decode([t for t in want if t != STOP])
    assert f"prompt_tokens=5 cached_tokens=0 completion_tokens={len(want)}" in captured.err
    assert cli_main(["", "--raw"]) == 2
    assert "empty" in capsys.readouterr().err
    assert cli_main(["hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_page_pool_is_sized_from_the_memory_budget_with_the_plan_formula(tiny) -> None:
    budget = 80 << 20  # 64 MiB runtime allowance + activations + some pages of 8 tokens
    eng = Engine(EngineConfig(memory_budget_bytes=budget, page_size=8), model=tiny)
    shape = shape_from_config(tiny.config)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x head_dim 16 x fp32
    assert eng.runner.kv_cache.nbytes == eng.num_pages * 8 * per_token
    plan = plan_memory(shape, "float32", context_len=eng.num_pages * 8)
    assert tiny.weight_bytes + plan.kv_cache + plan.overhead <= budget
    assert budget - (tiny.weight_bytes + plan.kv_cache + plan.overhead) < 8 * per_token
    with pytest.raises(ValueError, match="no room for the KV cache"):
        Engine(EngineConfig(memory_budget_bytes=1 << 20), model=tiny)


def test_similar_lengths_decode_padded_and_equal_dense(tiny) -> None:
    """Eight streams of similar length are read padded, one attention call per layer (the
    CPU float32 batch path); every stream's greedy tokens still equal the dense reference."""
    prompts = random_prompts(8, 20, 24, seed=5)
    eng = make(tiny, enable_prefix_caching=False)
    reads = []
    prepare = eng.runner.prepare

    def spy(batch):  # type: ignore[no-untyped-def]
        inputs = prepare(batch)
        if inputs.meta.is_decode and inputs.meta.plan is not None:
            reads.append(inputs.meta.plan.decode_reads)
        return inputs

    eng.runner.prepare = spy  # type: ignore[method-assign]
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [dense_greedy(tiny, p, 10) for p in prompts]
    assert reads and all(r is not None and r.pages is not None for r in reads)
    assert_all_pages_accounted(eng)
