"""The gateway over the real embedded engine (SmolLM2-135M-Instruct), with the official SDKs.

One engine is shared by the whole session (conftest.real_backend); every test uses its own
cache namespace (tenant or cache_salt) so tests never see each other's cache. The independent
references are the engine's own tokenizer (prompt token counts, common-prefix lengths) and the
greedy determinism of the model (the same prompt through two routes gives the same text).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid

import anthropic
import httpx
import openai
import pytest
from sqlalchemy import select

from gateway.stats import RequestRecord
from tests.support import serve

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SYSTEM = ("You are a helpful assistant for a hardware store. You answer questions about tools, "
          "paint and garden supplies in one short sentence. ") * 2
QUESTION = "What is the capital of France?"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def salt() -> str:
    return uuid.uuid4().hex[:12]


def chat(question: str = QUESTION, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def template_len(real_backend, messages, tools=None) -> int:
    return len(real_backend.engine.tokenizer.apply_chat_template(messages, tools=tools))


def stored(app) -> list[RequestRecord]:
    app.state.store.flush()
    with app.state.store.session() as session:
        return list(session.scalars(select(RequestRecord).order_by(RequestRecord.id)))


def test_openai_sync_stream_and_anthropic_agree(make_real_app, real_backend):
    app = make_real_app()
    with serve(app) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        extra = {"cache_salt": salt()}
        whole = oai.chat.completions.create(model=MODEL, messages=chat(), max_tokens=8,
                                            temperature=0, extra_body=extra)
        text = whole.choices[0].message.content
        assert "Paris" in text
        assert whole.usage.prompt_tokens == template_len(real_backend, chat())
        assert 0 < whole.usage.completion_tokens <= 8
        stream = oai.chat.completions.create(
            model=MODEL, messages=chat(), max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text  # greedy: same prompt, same text
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # repeated prompt
        ant = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        body = {"model": MODEL, "max_tokens": 8, "system": SYSTEM,
                "messages": [{"role": "user", "content": QUESTION}],
                "extra_body": {"temperature": 0, "cache_salt": extra["cache_salt"]}}
        msg = ant.messages.create(**body)
        assert msg.content[0].text == text
        usage = msg.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == whole.usage.prompt_tokens
        assert usage.cache_read_input_tokens > 0
        with ant.messages.stream(**body) as events:
            assert "".join(events.text_stream) == text
        oai.close()
        ant.close()
    assert [r.status for r in stored(app)] == [200, 200, 200, 200]


async def test_openai_async_tools_round_trip(make_real_app, real_backend):
    app = make_real_app()
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(
                                    transport=httpx.ASGITransport(app=app),
                                    base_url="http://gateway"))
    messages = [
        {"role": "system", "content": "You call tools when useful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    out = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=32, temperature=0,
        extra_body={"cache_salt": salt()})
    # The tools and the tool call went through the model's chat template.
    assert out.usage.prompt_tokens == template_len(real_backend, messages, TOOLS)
    assert out.usage.prompt_tokens > template_len(real_backend, messages)
    choice = out.choices[0]
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    if choice.finish_reason == "tool_calls":  # a complete call parsed out of the text
        assert "<tool_call>" not in (choice.message.content or "")
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert not choice.message.tool_calls


async def test_repeated_prefix_is_cached_page_aligned(make_real_app, real_backend):
    app = make_real_app()
    page = real_backend.engine.stats().page_size
    tokenizer = real_backend.engine.tokenizer
    extra = {"cache_salt": salt()}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        results = []
        for question in ("Name one kind of paint.", "Which saw cuts metal?"):
            body = {"model": MODEL, "messages": chat(question), "max_tokens": 4,
                    "temperature": 0, **extra}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            results.append(response)
    first_ids = tokenizer.apply_chat_template(chat("Name one kind of paint."))
    second_ids = tokenizer.apply_chat_template(chat("Which saw cuts metal?"))
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False))
                  if a != b)
    usage = [r.json()["usage"] for r in results]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] == (common // page) * page > 0
    headers = results[1].headers
    assert int(headers["x-prefixgate-cached-tokens"]) == (common // page) * page
    assert float(headers["x-prefixgate-prefill-saved-ms"]) > 0


async def test_tenants_never_hit_each_others_prefix(make_real_app):
    suffix = salt()
    keys = {f"a-{suffix}": f"ta{suffix}", f"b-{suffix}": f"tb{suffix}"}
    app = make_real_app(api_keys=keys)
    transport = httpx.ASGITransport(app=app)

    async def ask(key: str) -> int:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            response = await http.post(
                "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                json={"model": MODEL, "messages": chat(), "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200
            return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    key_a, key_b = list(keys)
    assert await ask(key_a) == 0
    assert await ask(key_b) == 0  # same prompt, other tenant: no hit
    assert await ask(key_a) > 0


async def test_prompt_over_the_context_is_a_400(make_real_app, real_backend):
    app = make_real_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        huge = "hello " * 9000
        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "messages"
        assert (await http.get("/healthz")).json()["status"] == "ok"
    assert real_backend.engine.stats().running == 0


def test_a_legacy_prompt_over_the_context_names_prompt(make_real_app, real_backend):
    """The legacy route has no `messages`: its prompt over the context is a 400 whose `param`
    is "prompt", the field the client sent (before: "messages"), with OpenAI's code."""
    with serve(make_real_app()) as server, openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0
    ) as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=2)
    assert caught.value.param == "prompt"
    assert caught.value.code == "context_length_exceeded"
    assert real_backend.engine.stats().running == 0


async def _wait_idle(real_backend, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = real_backend.engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.pages_used == 0:
            return stats
        await asyncio.sleep(0.05)
    return real_backend.engine.stats()


def test_disconnect_aborts_the_engine_request(make_real_app, real_backend):
    app = make_real_app()
    body = {"model": MODEL, "messages": chat("Write a long poem about rain."), "stream": True,
            "max_tokens": 200, "temperature": 0, "cache_salt": salt()}
    with serve(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            head = response.headers
            data = [line for line in itertools.islice(response.iter_lines(), 8)
                    if line.startswith("data: {")]
        stats = asyncio.run(_wait_idle(real_backend))
    assert stats.running == 0 and stats.pages_used == 0
    rows = stored(app)
    assert [(r.status, r.stream) for r in rows] == [(499, True)]
    # the work done before the client left is recorded: the prompt as the engine's own
    # template counts it, the cached tokens the head reported, the tokens generated (at least
    # one per content chunk the client read, fewer than max_tokens)
    row, tokenizer = rows[0], real_backend.engine.tokenizer
    prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    assert row.prompt_tokens == len(prompt) == int(head["x-prefixgate-prompt-tokens"])
    assert row.cached_tokens == int(head["x-prefixgate-cached-tokens"])
    assert len(data) - 1 <= row.completion_tokens < 200 and not row.usage_estimated


async def test_load_64_concurrent_streams(make_real_app, real_backend):
    app = make_real_app()
    n = 64
    extra = {"cache_salt": salt(), "temperature": 0}
    with serve(app) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                    max_retries=0, timeout=300)

        async def one(i: int) -> tuple[str | None, int, str]:
            stream = await client.chat.completions.create(
                model=MODEL, messages=chat(f"Question {i}: what is {i} plus {i}?"),
                max_tokens=3, stream=True, stream_options={"include_usage": True},
                extra_body=extra)
            finish, cached, text = None, -1, ""
            async for chunk in stream:
                if chunk.usage is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    text += choice.delta.content or ""
            return finish, cached, text

        results = await asyncio.gather(*(one(i) for i in range(n)))
        await client.close()
    assert all(finish in {"stop", "length"} for finish, _, _ in results)
    assert all(cached >= 0 for _, cached, _ in results)
    assert sum(cached > 0 for _, cached, _ in results) > 0  # the shared system prompt
    rows = stored(app)
    assert len(rows) == n and all(r.status == 200 and r.stream for r in rows)
    assert len({r.request_id for r in rows}) == n
    stats = await _wait_idle(real_backend)
    assert stats.pages_used == 0  # no page held by a finished request
    assert stats.pages_free + stats.pages_cached == stats.pages_total


def _load_example(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"prefixgate_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_agent_loop_example_rewrite_beats_lint_off(make_real_app):
    """The example's agent (timestamp at the top of its system prompt, tools, several turns)
    against the real engine: rewrite's hit rate beats lint off's, turn after turn."""
    pytest.importorskip("prompt_lint")
    example = _load_example("openai_agent_loop")
    app = make_real_app(lint_mode="report")
    with serve(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        off = example.agent_run(client, "off", turns=3, max_tokens=4)
        rewrite = example.agent_run(client, "rewrite", turns=3, max_tokens=4)
        client.close()
    # Lint off: the changing timestamp near the top caps the hit at its first page or so;
    # rewrite: every later call reuses the whole stable history.
    assert min(t.cached_tokens for t in rewrite[1:]) > max(t.cached_tokens for t in off)
    assert example.overall(rewrite) > example.overall(off)
    assert all("PL001" in t.lint.split(",") for t in rewrite)  # the timestamp was found


async def test_stream_heads_carry_the_engines_final_figures(make_real_app, real_backend):
    """The head waits until the engine has scheduled the request (its cached tokens are known
    then, before the first token): on every stream, headers equal the final usage."""
    app = make_real_app()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", http_client=http,
                                max_retries=0)
    extra = {"cache_salt": salt()}
    seen_hit = False
    for question in ("Name one kind of paint.", "Name one kind of paint.", "Which saw cuts?"):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat(question), max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        chunks = [c async for c in raw.parse()]
        usage = chunks[-1].usage
        cached = usage.prompt_tokens_details.cached_tokens
        assert int(raw.headers["x-prefixgate-cached-tokens"]) == cached
        assert int(raw.headers["x-prefixgate-prompt-tokens"]) == usage.prompt_tokens
        assert raw.headers["x-prefixgate-cached-tokens-source"] == "reported"
        assert raw.headers["x-prefixgate-usage"] == "reported"
        summary = chunks[-1].model_extra["prefixgate"]
        assert (summary["prompt_tokens"], summary["cached_tokens"]) == (usage.prompt_tokens,
                                                                         cached)
        saved = float(raw.headers["x-prefixgate-prefill-saved-ms"])
        assert saved == pytest.approx(summary["prefill_saved_ms"], abs=0.051)
        seen_hit = seen_hit or cached > 0
    assert seen_hit
    await http.aclose()


async def test_count_tokens_is_what_the_same_request_prefills(make_real_app):
    """/v1/messages/count_tokens against the engine: exact (the model's template and tools),
    equal to the prompt size the same body then reports from /v1/messages."""
    app = make_real_app()
    tools = [{"name": "get_weather", "description": "Current weather for a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    body = {"model": MODEL, "system": SYSTEM, "tools": tools,
            "messages": [{"role": "user", "content": QUESTION}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        counted = await http.post("/v1/messages/count_tokens", json=body)
        sent = await http.post("/v1/messages", json={**body, "max_tokens": 2,
                                                     "cache_salt": salt()})
    assert counted.status_code == 200 and sent.status_code == 200
    assert counted.headers["x-prefixgate-usage"] == "reported"
    usage = sent.json()["usage"]
    prefilled = (usage["input_tokens"] + usage["cache_read_input_tokens"]
                 + usage["cache_creation_input_tokens"])
    assert counted.json() == {"input_tokens": prefilled}


async def test_top_k_one_is_greedy(make_real_app):
    """Anthropic's top_k reaches the engine's sampler: at temperature 1.0 with top_k 1 every
    answer is the greedy one (it was validated and dropped, so four runs gave four texts);
    vLLM's top_k extension on the OpenAI route does the same."""
    app = make_real_app()
    body = {"model": MODEL, "max_tokens": 6, "system": SYSTEM, "cache_salt": salt(),
            "messages": [{"role": "user", "content": "Name a colour."}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        greedy = await http.post("/v1/messages", json={**body, "temperature": 0})
        assert greedy.status_code == 200, greedy.text
        text = greedy.json()["content"][0]["text"]
        for _ in range(3):
            sampled = await http.post("/v1/messages", json={**body, "temperature": 1.0,
                                                            "top_k": 1})
            assert sampled.json()["content"][0]["text"] == text
        chat = await http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 6, "temperature": 1.0, "top_k": 1, "seed": 3,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Name a colour."}],
            "cache_salt": body["cache_salt"]})
        assert chat.json()["choices"][0]["message"]["content"] == text


async def test_logit_bias_steers_the_engine(make_real_app, real_backend):
    """logit_bias reaches the sampler (it was ignored): +100 on a token makes a greedy answer
    start with it; a token id outside the vocabulary is a 400 naming logit_bias."""
    app = make_real_app()
    [token] = real_backend.engine.tokenizer.encode(" banana")[:1]
    piece = real_backend.engine.tokenizer.decode([token])
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "cache_salt": salt(),
            "messages": chat()}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        plain = await http.post("/v1/chat/completions", json=body)
        forced = await http.post("/v1/chat/completions",
                                 json={**body, "logit_bias": {str(token): 100}})
        outside = await http.post("/v1/chat/completions",
                                  json={**body, "logit_bias": {"99999999": 5}})
    assert not plain.json()["choices"][0]["message"]["content"].startswith(piece)
    assert forced.json()["choices"][0]["message"]["content"].startswith(piece)
    assert outside.status_code == 400
    assert outside.json()["error"]["param"] == "logit_bias"


def test_a_matched_stop_sequence_is_the_anthropic_stop_reason(make_real_app):
    """The QA repro: the text stops before "4," and the answer says so (stop_reason
    "stop_sequence" and the string, whole and in the stream's message_delta; before:
    "end_turn" and null); OpenAI says finish_reason "stop"; without a match, end_turn / null."""
    app = make_real_app()
    ask = dict(model=MODEL, max_tokens=16, stop_sequences=["4,"], extra_body={
        "temperature": 0, "cache_salt": uuid.uuid4().hex[:12]},
        messages=[{"role": "user", "content": "List: 1, 2, 3, 4, 5, 6, 7, 8, continue the list"}])
    with serve(app) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        whole = claude.messages.create(**ask)
        with claude.messages.stream(**ask) as stream:
            events = list(stream)
            streamed = stream.get_final_message()
        unmatched = claude.messages.create(**{**ask, "stop_sequences": ["\x00never"]})
        claude.close()
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        choice = oai.chat.completions.create(
            model=MODEL, max_tokens=16, temperature=0, stop=["4,"], messages=ask["messages"],
            extra_body=ask["extra_body"]).choices[0]
        oai.close()
    for message in (whole, streamed):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "4,")
        assert "4," not in message.content[0].text
    deltas = [e.delta for e in events if e.type == "message_delta"]
    assert [(d.stop_reason, d.stop_sequence) for d in deltas] == [("stop_sequence", "4,")]
    assert unmatched.stop_sequence is None and unmatched.stop_reason in ("end_turn", "max_tokens")
    assert choice.finish_reason == "stop" and "4," not in (choice.message.content or "")


def test_a_refused_answer_sent_back_as_history_is_its_text(make_real_app, real_backend):
    """An agent resends a refused structured answer as the SDK gave it (`content` None beside
    `refusal`, or a refusal part): it was a 400 ('content' must be a string...). The engine
    reads the refusal as the assistant's text: the same prompt as that text sent plainly."""
    app = make_real_app()
    refusal = "I can't help with that request."
    turns = [[{"role": "assistant", "content": None, "refusal": refusal}],
             [{"role": "assistant", "refusal": refusal}],
             [{"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]}]]
    plain = [*chat(), {"role": "assistant", "content": refusal},
             {"role": "user", "content": "Then name a paint colour."}]
    with serve(app) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for turn in turns:
            messages = [*chat(), *turn, {"role": "user", "content": "Then name a paint colour."}]
            answer = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                 extra_body={"cache_salt": salt()})
            assert answer.usage.prompt_tokens == template_len(real_backend, plain)
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                *chat(), {"role": "assistant", "content": None, "refusal": 7},
                {"role": "user", "content": "Then?"}])
        assert bad.value.body["param"] == "messages[2].refusal"
