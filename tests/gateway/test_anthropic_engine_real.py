"""The Messages API over the real embedded engine (SmolLM2-135M-Instruct), through the official
`anthropic` SDK: what an agent framework relies on beyond the plain question and answer.

The independent references are the engine's own tokenizer and chat template (a prompt written
out by hand from the template's rendering of the turns before it), the engine itself run on
those ids (greedy decoding is deterministic), and the SDK's own parsing of every answer.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import anthropic
import jsonschema
import openai
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from gateway.app import create_app
from gateway.backends.embedded import EmbeddedBackend
from gateway.config import GatewayConfig
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


@pytest.fixture(scope="module")
def short_context_backend() -> Iterator[EmbeddedBackend]:
    """An engine of its own whose context is 256 tokens, so an answer reaches its end fast."""
    backend = EmbeddedBackend(GatewayConfig(engine=EngineConfig(num_pages=64,
                                                                max_model_len=256)))
    yield backend
    asyncio.run(backend.aclose())


def test_an_answer_cut_by_the_context_window_says_so(tmp_path, short_context_backend):
    """max_tokens beyond what the context has left: the answer runs to the end of the context
    and says `model_context_window_exceeded` (Anthropic's stop reason for it; before:
    "max_tokens", which the client had not reached); OpenAI says "length". An answer cut by
    max_tokens itself still says "max_tokens"."""
    limit = 256
    messages = [{"role": "user", "content": "hello " * (limit - 40)}]
    extra = greedy()
    app = create_app(GatewayConfig(db_url=f"sqlite:///{tmp_path / 'short.db'}", lint_mode="off"),
                     backend=short_context_backend)
    with serve(app) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        prompt = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
        room = limit - prompt
        assert 0 < room < 64
        whole = claude.messages.create(model=MODEL, max_tokens=room + 50, messages=messages,
                                       extra_body=extra)
        with claude.messages.stream(model=MODEL, max_tokens=room + 50, messages=messages,
                                    extra_body=extra) as stream:
            streamed = stream.get_final_message()
        short = claude.messages.create(model=MODEL, max_tokens=2, messages=messages,
                                       extra_body=extra)
        claude.close()
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        choice = oai.chat.completions.create(model=MODEL, max_tokens=room + 50,
                                             messages=messages, extra_body=extra).choices[0]
        oai.close()
    for answer in (whole, streamed):
        assert answer.stop_reason == "model_context_window_exceeded"
        assert answer.usage.output_tokens == room
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 2)
    assert choice.finish_reason == "length"
    app.state.store.close()


def test_a_tool_schema_with_local_definitions_is_enforced(make_real_app):
    """A pydantic-style input_schema: the nested model under `$defs`, referred to by
    `#/$defs/...`. Before: a 400 from inside the grammar ("Pointer '/$defs/City' does not
    exist": the schema was nested in the call's schema, where its pointers no longer
    resolved). Now the forced call's input validates against the schema (jsonschema)."""
    schema = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
              "required": ["city"], "additionalProperties": False,
              "$defs": {"City": {"type": "object", "additionalProperties": False,
                                 "properties": {"name": {"type": "string"},
                                                "country": {"type": "string"}},
                                 "required": ["name", "country"]}}}
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": schema}]
    with serve(make_real_app()) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        answer = claude.messages.create(
            model=MODEL, max_tokens=48, tools=tools, tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "What is the weather in Paris, France?"}],
            extra_body=greedy())
        claude.close()
    assert answer.stop_reason == "tool_use"
    (call,) = [b for b in answer.content if b.type == "tool_use"]
    jsonschema.validate(call.input, schema)


def test_max_tokens_zero_prewarms_the_cache(make_real_app, real_backend):
    """`max_tokens: 0` (the Messages API's cache pre-warming): the prompt is prefilled into
    the prefix cache and nothing is answered (no content, output_tokens 0, "max_tokens");
    the next request with that prompt reads it from the cache. Before: a 400 ("'max_tokens'
    must be >= 1")."""
    system = "You are a release manager. Keep every answer to one short line. " * 6
    messages = [{"role": "user", "content": "Is the build green?"}]
    prompt = len(real_backend.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *messages]))
    extra = greedy()
    with serve(make_real_app()) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        warm = claude.messages.create(model=MODEL, max_tokens=0, system=system,
                                      messages=messages, extra_body=extra)
        with claude.messages.stream(model=MODEL, max_tokens=0, system=system,
                                    messages=messages, extra_body=extra) as stream:
            events = [e.type for e in stream]
            streamed = stream.get_final_message()
        claude.close()
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == prompt
    assert events == ["message_start", "message_delta", "message_stop"]
    assert (streamed.content, streamed.stop_reason, streamed.usage.output_tokens) == (
        [], "max_tokens", 0)
    assert streamed.usage.cache_read_input_tokens >= prompt - 16  # all but the last page
