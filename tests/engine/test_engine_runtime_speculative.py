"""N-gram speculative decoding on a tiny random Llama, against independent references.

Greedy outputs are compared with `engine.dense_reference` (no paging, no speculation) and with
the engine without speculation, across batch compositions that mix drafting and non-drafting
sequences, chunked prefill, preemption and staggered arrivals. The rejection rule is checked
by chi-square tests against the target distribution itself. `Engine.check()` verifies that no
page leaks after rollbacks, aborts and failures mid-speculation.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.loader import LoadedModel
from engine.speculative import (
    MIN_BACKOFF_STEPS,
    MIN_USEFUL_ACCEPTED,
    NgramIndex,
    SpecState,
    verify_greedy,
    verify_sampled,
)

from .engine_runtime_support import (
    chain_model,
    dense_greedy,
    one_torch_thread,
    random_prompts,
    tiny_model,
    watch_steps,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["one_torch_thread"]  # a fixture, imported for use

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PLAIN = SamplingParams(max_tokens=24, temperature=0.0, speculative=False)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so the model's continuation has something to copy."""
    base = random_prompts(6, 4, 40, seed=1)
    return [p + p[: len(p) // 2] + p for p in base]


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [dense_greedy(tiny, p, GREEDY.max_tokens) for p in prompts]


def make(tiny: LoadedModel, **kwargs: object) -> Engine:
    fields: dict[str, object] = {"num_pages": 96, "page_size": 8, "speculative": "ngram"}
    fields.update(kwargs)
    return Engine(EngineConfig(**fields), model=tiny)  # type: ignore[arg-type]


def assert_no_leaks(eng: Engine) -> None:
    eng.check()
    stats = eng.stats()
    assert stats.running == stats.waiting == stats.pages_used == 0
    assert stats.pages_free + stats.pages_cached == stats.pages_total


# ---------------------------------------------------------------------------- n-gram index
def naive_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Scan the whole context: latest earlier occurrence of the longest suffix."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        for follower in range(size - 1, n - 1, -1):
            if tokens[follower - n : follower] == suffix:
                return tokens[follower : follower + k]
    return []


@pytest.mark.parametrize(("n_min", "n_max"), [(1, 4), (2, 3), (3, 3)])
def test_ngram_index_matches_a_full_scan_as_tokens_arrive(n_min: int, n_max: int) -> None:
    rng = random.Random(n_min * 10 + n_max)
    for _ in range(30):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        index = NgramIndex(n_min, n_max)
        for _ in range(40):  # the index follows a growing list, synced only when asked
            k = rng.randint(0, 6)
            assert index.propose(tokens, k) == naive_propose(tokens, k, n_min, n_max)
            tokens.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
        assert len(index) <= len(tokens)


def test_ngram_index_prefers_the_longest_suffix_and_rejects_bad_use() -> None:
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 9, 7, 2, 8, 1, 2]  # suffix [1, 2] last followed by 9; [2] by 8
    assert NgramIndex(1, 4).propose(tokens, 3) == [9, 7, 2]
    assert NgramIndex(1, 1).propose(tokens, 3) == [8, 1, 2]
    assert NgramIndex(1, 4).propose([3, 4, 5], 3) == []
    index = NgramIndex(1, 2)
    index.sync(tokens)
    with pytest.raises(ValueError, match="shrank"):
        index.sync(tokens[:3])
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 2)


def test_backoff_pauses_drafting_longer_while_drafts_keep_failing() -> None:
    state = SpecState(NgramIndex(1, 1))
    tokens = [1, 2, 3, 1]  # always proposes [2, 3, 1]
    assert state.propose(tokens, 3) == [2, 3, 1]
    state.record(3, 0)
    assert state.propose(tokens, 3) == [2, 3, 1]  # one failure is not enough
    state.record(3, 1)  # one accepted token does not pay for a verification step
    paused = [state.propose(tokens, 3) for _ in range(MIN_BACKOFF_STEPS)]
    assert paused == [[]] * MIN_BACKOFF_STEPS
    assert state.propose(tokens, 3) == [2, 3, 1]
    state.record(3, 0)
    state.record(3, 0)
    paused = [state.propose(tokens, 3) for _ in range(2 * MIN_BACKOFF_STEPS)]
    assert paused == [[]] * (2 * MIN_BACKOFF_STEPS)  # the pause doubles
    state.record(3, MIN_USEFUL_ACCEPTED)  # a useful draft resets the back-off
    state.record(3, 0)
    state.record(3, 0)
    assert state.cooldown == MIN_BACKOFF_STEPS
    state.record(1, 1)  # a one-token draft fully accepted is a success
    assert state.failures == 0
    assert (state.draft_tokens, state.accepted_tokens, state.steps) == (22, 4, 8)


# ---------------------------------------------------------------------------- verification
def test_greedy_verification_keeps_the_agreeing_prefix_then_the_target() -> None:
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]).tokens == [4, 5, 6, 7]
    assert verify_greedy([4, 9, 6, 7], [4, 5, 6]) == ([4, 9], 1, 3)
    assert verify_greedy([3, 5, 6, 7], [4, 5, 6]) == ([3], 0, 3)
    with pytest.raises(ValueError, match="target"):
        verify_greedy([1, 2], [1, 2])


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square(df) at alpha ~= 1e-4 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(observed: Counter[int], probs: dict[int, float], total: int) -> tuple[float, int]:
    stat = sum((observed.get(t, 0) - total * p) ** 2 / (total * p) for t, p in probs.items())
    assert set(observed) <= set(probs), "a token with probability 0 was emitted"
    return stat, len(probs) - 1


def test_rejection_rule_emits_the_target_distribution() -> None:
    """Rows j of a 2-token draft have different targets; the first emitted token must follow
    p_0, and the second (when the first draft token was accepted) must follow p_1."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([
        [0.35, 0.05, 0.20, 0.25, 0.15, 0.00],  # draft[0] = 1 is unlikely: mostly rejected
        [0.10, 0.30, 0.05, 0.15, 0.10, 0.30],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    ])  # fmt: skip
    draft = [1, 5]
    trials = 6_000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(trials):
        verdict = verify_sampled(p, draft, gen)
        first[verdict.tokens[0]] += 1
        if verdict.tokens[0] == draft[0]:
            second[verdict.tokens[1]] += 1
    for observed, row in ((first, p[0]), (second, p[1])):
        probs = {t: float(q) for t, q in enumerate(row) if q > 0}
        stat, df = chi_square(observed, probs, sum(observed.values()))
        assert stat < chi_square_critical(df), (stat, df, observed)
    assert 150 < sum(second.values()) < 450  # about 5% of the trials accepted draft[0]


def test_rejection_rule_with_a_one_hot_target_is_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.zeros(3, 4)
    p[0, 2] = p[1, 3] = p[2, 0] = 1.0
    assert verify_sampled(p, [2, 3], gen) == ([2, 3, 0], 2, 2)
    assert verify_sampled(p, [1, 3], gen) == ([2], 0, 2)


# ---------------------------------------------------------------------------- engine: greedy
def test_speculation_is_greedy_exact_batched_and_one_by_one(tiny, prompts, reference) -> None:
    eng = make(tiny)
    batched = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == reference
    drafted = sum(o.draft_tokens for o in batched)
    accepted = sum(o.accepted_tokens for o in batched)
    assert drafted > 0 and 0 < accepted <= drafted  # drafts were made, some kept, some not
    stats = eng.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (drafted, accepted)
    solo = make(tiny, enable_prefix_caching=False)
    assert [solo.generate([p], GREEDY)[0].token_ids for p in prompts] == reference
    assert_no_leaks(eng)
    assert_no_leaks(solo)


def test_drafting_and_plain_sequences_share_steps(tiny, prompts, reference) -> None:
    eng = make(tiny)
    per = [GREEDY if i % 2 else PLAIN for i in range(len(prompts))]
    penalised = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.2,
                               presence_penalty=0.1)  # fmt: skip
    per[1] = penalised

    def drafting(out):  # (sequences drafting, sequences not drafting) per step
        n = sum(1 for s in out.scheduled if s.draft)
        return n, len(out.scheduled) - n

    steps = watch_steps(eng, drafting)
    outs = eng.generate(prompts, per)
    assert any(d > 0 and p > 0 for d, p in steps)  # mixed steps happened
    for i, out in enumerate(outs):
        if i != 1:
            assert out.token_ids == reference[i]
        assert (out.draft_tokens > 0) == (i % 2 == 1)  # opted-out requests never draft
    plain = make(tiny, speculative=None).generate([prompts[1]], penalised)[0]
    assert outs[1].token_ids == plain.token_ids != reference[1]
    assert_no_leaks(eng)


@pytest.mark.parametrize("budget", [3, 7, 20])
def test_chunked_prefill_and_drafts_in_one_step(tiny, prompts, reference, budget) -> None:
    eng = make(tiny, max_num_batched_tokens=budget)
    sizes = watch_steps(eng, lambda out: out.num_tokens)
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert max(sizes) <= budget  # drafts stay inside the step's token budget
    assert sum(o.accepted_tokens for o in outs) > 0
    assert_no_leaks(eng)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_a_tiny_pool_with_drafts(tiny, prompts, reference, caching) -> None:
    eng = make(tiny, num_pages=14, enable_prefix_caching=caching, max_num_batched_tokens=32)
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert eng.stats().preemptions > 0 and eng.stats().spec_accepted_tokens > 0
    assert_no_leaks(eng)


def test_stops_inside_an_accepted_draft(tiny, prompts, reference) -> None:
    eng = make(tiny)
    ref = reference[2]
    for cut in (3, 9, 17):
        out = eng.generate([prompts[2]], SamplingParams(
            max_tokens=24, temperature=0.0, stop_token_ids=[ref[cut]]))[0]  # fmt: skip
        assert out.token_ids == ref[: ref.index(ref[cut]) + 1] and out.finish_reason == "stop"
        short = eng.generate([prompts[2]], SamplingParams(max_tokens=cut, temperature=0.0))[0]
        assert short.token_ids == ref[:cut] and short.finish_reason == "length"
    assert_no_leaks(eng)


def test_rejected_tokens_never_reach_the_prefix_cache(tiny, prompts, reference) -> None:
    """Continue every finished sequence from the cache: a cached page holding a rejected
    draft token's KV would change the continuation."""
    eng = make(tiny, page_size=8)
    outs = eng.generate(prompts, GREEDY)
    rejected = sum(o.draft_tokens - o.accepted_tokens for o in outs)
    assert rejected > 0
    follow = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    again = eng.generate(follow, SamplingParams(max_tokens=6, temperature=0.0, speculative=False))
    for prompt, out in zip(follow, again, strict=True):
        assert out.cached_tokens >= (len(prompt) - 1) // 8 * 8 - 8  # the cache was used
        assert out.token_ids == dense_greedy(tiny, prompt, 6)
    assert_no_leaks(eng)


# ---------------------------------------------------------------------------- aborts, failures
def test_abort_mid_speculation_frees_every_page(tiny, prompts, reference) -> None:
    eng = make(tiny, max_num_seqs=4)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.stats().spec_steps == 0 or len(eng.scheduler.running) < 2:
        eng.step()
        eng.check()
    victim = next(s for s in eng.scheduler.running if s.spec and s.spec.draft_tokens)
    out = eng.abort(victim.request_id)
    assert out is not None and out.finish_reason == "abort" and out.draft_tokens > 0
    assert out.token_ids == reference[ids.index(victim.request_id)][: out.completion_tokens]
    eng.check()
    for rid in ids:  # abort everything else, whatever state it is in
        eng.abort(rid)
    assert not eng.has_unfinished()
    assert_no_leaks(eng)


def test_a_failing_verification_step_frees_the_draft_pages(tiny, prompts, reference) -> None:
    eng = make(tiny)
    real_run = eng.runner.run

    def flaky(inputs):
        if eng.stats().spec_steps >= 3 and len(inputs.logit_rows) > len(inputs.sampling):
            raise RuntimeError("simulated kernel failure")  # a step with drafts in it
        return real_run(inputs)

    eng.runner.run = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        eng.generate(prompts, GREEDY)
    assert_no_leaks(eng)
    eng.runner.run = real_run  # type: ignore[method-assign]
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == reference
    assert_no_leaks(eng)


# ---------------------------------------------------------------------------- engine: sampling
def chain_prefix(tokens: list[int], chain: list[int]) -> tuple[int, int]:
    """(how many leading tokens follow `chain`, the first one that does not, mod 4 or -1)."""
    n = 0
    while n < len(tokens) and tokens[n] == chain[n]:
        n += 1
    return n, tokens[n] % 4 if n < len(tokens) else -1


def test_sampled_speculation_matches_plain_sampling_in_distribution() -> None:
    """A model that continues "abcdefghij" with probability ~0.6 per token; the prompt holds
    the text, so drafts copy it. Over 1200 seeds, with and without speculation, the first 4
    tokens are bucketed by how far they follow the text and which token broke away (mod 4);
    a chi-square homogeneity test compares the two histograms."""
    text = "abcdefghij"
    loaded = chain_model(text)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(0.025)  # soften: the successor gets ~60% of the mass
    prompt = list((text + "a").encode())
    chain = list(text[1:].encode())
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s) for s in range(1200)]
    counts = []
    for spec in ("ngram", None):
        eng = make(loaded, speculative=spec, max_num_seqs=64, num_pages=512)
        outs = eng.generate([prompt] * len(params), params)
        counts.append(Counter(chain_prefix(o.token_ids, chain) for o in outs))
        if spec:
            accepted = sum(o.accepted_tokens for o in outs)
            assert 0.3 < accepted / sum(o.draft_tokens for o in outs) < 0.95
        assert_no_leaks(eng)
    a, b = counts
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 20]
    table = [(a[k], b[k]) for k in keys]
    table.append((a.total() - sum(x for x, _ in table), b.total() - sum(y for _, y in table)))
    table = [row for row in table if sum(row) > 0]
    assert len(table) >= 6
    stat = chi_square_homogeneity(table)
    assert stat < chi_square_critical(len(table) - 1), (stat, table)


def chi_square_homogeneity(table: list[tuple[int, int]]) -> float:
    total_a, total_b = sum(x for x, _ in table), sum(y for _, y in table)
    stat = 0.0
    for x, y in table:
        for observed, total in ((x, total_a), (y, total_b)):
            expected = (x + y) * total / (total_a + total_b)
            stat += (observed - expected) ** 2 / expected
    return stat


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speculative": "eagle"}, "speculative"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"ngram_min": 0}, "ngram_min"),
        ({"ngram_min": 5, "ngram_max": 4}, "ngram_min"),
    ],
)
def test_bad_speculative_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_speculative_sampling_param_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")  # type: ignore[arg-type]
