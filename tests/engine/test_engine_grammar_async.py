"""AsyncEngine with a grammar: compiling a request's grammar (seconds for a schema of thousands
of properties) leaves the event loop free for other requests."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from engine.grammar import GrammarSpec
from engine.loader import LoadedModel

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
          "required": ["city"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nName a city.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
async def test_a_grammar_is_compiled_while_the_loop_serves_others(
        loaded_model: LoadedModel, torch_single_thread: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile waits until a coroutine beside it has run: on the loop's own thread it would
    wait in vain (the gateway's other clients, /healthz included, stalled 3.8 s behind one
    json_schema of 5,000 required properties)."""
    aeng = AsyncEngine(engine=Engine(EngineConfig(num_pages=64), model=loaded_model))
    compiling, loop_ran = threading.Event(), threading.Event()
    waited: list[bool] = []
    real = aeng.engine.grammar.new_state

    def new_state(spec: GrammarSpec) -> Any:
        compiling.set()
        waited.append(loop_ran.wait(timeout=10))  # set by the loop, unless this blocks it
        return real(spec)

    monkeypatch.setattr(aeng.engine.grammar, "new_state", new_state)

    async def beside() -> None:
        while not compiling.is_set():
            await asyncio.sleep(0.001)
        loop_ran.set()

    try:
        helper = asyncio.ensure_future(beside())
        params = SamplingParams(max_tokens=24, temperature=0.0, json_schema=SCHEMA)
        text = "".join([d.text async for d in aeng.stream(PROMPT, params)])
        await helper
    finally:
        await aeng.shutdown()
    assert waited == [True]
    assert list(json.loads(text)) == ["city"]  # still constrained by the schema
