"""The Messages API over the real embedded engine (SmolLM2-135M-Instruct), through the official
`anthropic` SDK: what an agent framework relies on beyond the plain question and answer.

The independent references are the engine's own tokenizer and chat template (a prompt written
out by hand from the template's rendering of the turns before it), the engine itself run on
those ids (greedy decoding is deterministic), and the SDK's own parsing of every answer.
"""

from __future__ import annotations

import asyncio
import uuid

import anthropic
import pytest

from engine.sampling_params import SamplingParams
from tests.support import serve

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(extra: dict | None = None) -> dict:
    return {"temperature": 0, "cache_salt": uuid.uuid4().hex[:12], **(extra or {})}


def test_a_final_assistant_message_is_the_start_of_the_answer(make_real_app, real_backend):
    """Anthropic's prefill: the answer continues the final assistant message. Before, the
    engine closed that message as a finished turn and began a new one (its end-of-turn and
    a second assistant header in the prompt), so the model ignored the prefill."""
    prefill = "The capital of France is"
    tokenizer = real_backend.engine.tokenizer
    ids = tokenizer.encode(tokenizer.render_chat(QUESTION) + prefill, allow_special=True)
    reference = asyncio.run(real_backend.engine.generate(
        ids, SamplingParams(max_tokens=6, temperature=0.0)))
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    with serve(make_real_app()) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        whole = claude.messages.create(model=MODEL, max_tokens=6, messages=messages,
                                       extra_body=greedy())
        with claude.messages.stream(model=MODEL, max_tokens=6, messages=messages,
                                    extra_body=greedy()) as stream:
            streamed = stream.get_final_message()
        counted = claude.messages.count_tokens(model=MODEL, messages=messages)
        claude.close()
    for answer in (whole, streamed):
        usage = answer.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(ids)
        assert answer.content[0].text == reference.text
    assert counted.input_tokens == len(ids)
