"""Grammar-constrained decoding in the engine (llguidance matcher, batch bitmask, sampler hook).

References: the unconstrained greedy output of the same model (a mask that allows the greedy
path must not change it, and must not touch an unconstrained neighbour in the batch), the
matcher's own token-by-token `validate_draft` for the packed bitmask, and `json`/`re`.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.grammar import (
    GrammarCompiler,
    GrammarSpec,
    allocate_bitmask,
    apply_token_bitmask,
    bitmask_to_bool,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nWeather in Paris for three days?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(loaded_model, torch_single_thread) -> Engine:
    return Engine(EngineConfig(num_pages=128), model=loaded_model)


def greedy(n: int, **constraint: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **constraint)  # type: ignore[arg-type]


@pytest.mark.slow
def test_mask_that_allows_the_greedy_path_changes_nothing(engine):
    plain = engine.generate(PROMPT, greedy(10))[0]
    exact = engine.generate(PROMPT, greedy(12, regex=re.escape(plain.text)))[0]
    assert exact.token_ids[:10] == plain.token_ids
    assert exact.text == plain.text and exact.finish_reason == "stop"  # then only a stop token


@pytest.mark.slow
def test_json_schema_batch_beside_an_unconstrained_row(engine):
    alone = engine.generate(PROMPT, greedy(8))[0]
    outs = engine.generate([PROMPT, PROMPT, "Name a city:"],
                           [greedy(8), greedy(30, json_schema=SCHEMA),
                            SamplingParams(max_tokens=30, temperature=0.9, seed=3,
                                           json_schema=json.dumps(SCHEMA))])
    assert outs[0].token_ids == alone.token_ids  # the unconstrained row is untouched
    for out in outs[1:]:
        doc = json.loads(out.text)
        assert set(doc) == {"city", "days"} and 1 <= doc["days"] <= 9
        assert isinstance(doc["city"], str) and len(doc["city"]) <= 16
        assert out.finish_reason == "stop"
    engine.check()


def test_bitmask_agrees_with_token_by_token_validation(engine):
    state = engine.grammar.new_state(GrammarSpec.json_schema(SCHEMA))
    for token in engine.tokenizer.encode('{"city": "Pa'):
        assert state.accept(token)
    bitmask = allocate_bitmask(1, engine.tokenizer.vocab_size)
    state.fill_mask(bitmask, 0)
    allowed = bitmask_to_bool(bitmask, engine.tokenizer.vocab_size)[0]
    generator = torch.Generator().manual_seed(0)
    sample = torch.randint(0, engine.tokenizer.vocab_size, (400,), generator=generator).tolist()
    sample += engine.tokenizer.encode('ris"') + engine.tokenizer.encode("}")
    stops = engine.tokenizer.stop_token_ids
    for token in (t for t in sample if t not in stops):
        assert bool(allowed[token]) == (state.validate_draft([token]) == 1), token
    assert 0 < int(allowed.sum()) < engine.tokenizer.vocab_size


def test_apply_bitmask_sets_exactly_the_forbidden_logits_to_minus_inf():
    vocab = 70  # not a multiple of 32
    bitmask = allocate_bitmask(2, vocab)
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 3  # only token 35 allowed in row 0
    logits = torch.randn(2, vocab)
    out = apply_token_bitmask(logits, bitmask)
    assert torch.isinf(out[0]).sum() == vocab - 1 and out[0, 35] == logits[0, 35]
    assert torch.equal(out[1], logits[1])


def test_rollback_restores_the_earlier_mask(engine):
    state = engine.grammar.new_state(GrammarSpec.json_schema(SCHEMA))
    vocab = engine.tokenizer.vocab_size
    before, after = allocate_bitmask(1, vocab), allocate_bitmask(1, vocab)
    prefix = engine.tokenizer.encode('{"city": "')
    draft = engine.tokenizer.encode('Rome", "days": 3')
    for token in prefix:
        assert state.accept(token)
    state.fill_mask(before, 0)
    assert state.validate_draft(draft) == len(draft)
    assert state.validate_draft(engine.tokenizer.encode('Rome", "weeks"')) < len(draft)
    for token in draft:
        assert state.accept(token)
    state.rollback(len(draft))
    state.fill_mask(after, 0)
    assert torch.equal(before, after)


def test_bad_constraints_fail_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(json_schema=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="dependentSchemas"):
        engine.add_request(PROMPT, greedy(4, json_schema={"type": "object",
                                                          "dependentSchemas": {}}))
    with pytest.raises(ValueError, match="regex"):
        engine.add_request(PROMPT, greedy(4, regex="(unclosed"))
    assert not engine.has_unfinished()
    engine.check()


def test_warm_builds_one_tokenizer_that_serves_every_thread(engine):
    """`warm` (a server's start) and requests on other threads share one llguidance
    tokenizer, and a matcher built after it masks as the engine's own lazily built one."""
    compiler = GrammarCompiler(engine.tokenizer, sorted(engine.tokenizer.special_token_ids))
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(compiler.warm)] + [
            pool.submit(lambda: compiler.tokenizer) for _ in range(3)]
        built = [f.result() for f in futures[1:]]
    assert all(t is built[0] for t in built)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    ours, theirs = compiler.new_state(spec), engine.grammar.new_state(spec)
    masks = allocate_bitmask(2, engine.grammar.vocab_size)
    ours.fill_mask(masks, 0)
    theirs.fill_mask(masks, 1)
    allowed = bitmask_to_bool(masks[:1], engine.grammar.vocab_size)
    assert torch.equal(masks[0], masks[1]) and 0 < int(allowed.sum()) < allowed.numel()
