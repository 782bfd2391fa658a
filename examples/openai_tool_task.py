"""A two-step tool task through prefixgate with the official openai SDK.

Step 1: the model must call a tool (`tool_choice="required"`); the gateway's grammar makes the
call parse and its arguments match the tool's JSON schema, even with the 135M model.
Step 2: the script runs the tool locally, sends its result back as a `tool` message and asks
for the final answer (`tool_choice="none"`), streamed.

    python examples/openai_tool_task.py                      # starts an embedded gateway
    python examples/openai_tool_task.py --base-url http://127.0.0.1:8000/v1

Exits 0 when the call validated and the final answer quotes the tool's result (as text, with
no tool-call markup).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import openai

MODEL = "smollm2-135m-instruct"
WAREHOUSE = {"paris": 42, "oslo": 7, "lima": 19}
TOOLS = [{"type": "function", "function": {
    "name": "stock_level", "description": "Units of garden chairs in stock at a city's store.",
    "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": sorted(c.title() for c in WAREHOUSE)}},
        "required": ["city"], "additionalProperties": False}}}]
QUESTION = "How many garden chairs are in stock at the Paris store?"


@dataclass(frozen=True)
class TaskResult:
    """What the agent did: its tool call, the tool's answer, and the model's final words."""

    call_name: str
    call_arguments: dict[str, Any]
    tool_result: str
    answer: str

    @property
    def ok(self) -> bool:
        return (self.call_name == "stock_level" and self.tool_result in self.answer
                and "<tool_call" not in self.answer)


def stock_level(city: str) -> str:
    """The local tool."""
    return str(WAREHOUSE.get(city.lower(), 0))


def run_task(client: openai.OpenAI) -> TaskResult:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a store assistant. Use the tools for stock."},
        {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=40, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    result = stock_level(arguments["city"])
    messages.append({"role": "assistant", "content": "", "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": f"{result} garden chairs in stock"})
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=40, temperature=0,
                                            stream=True)
    answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return TaskResult(call.function.name, arguments, result, answer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running gateway; default: start one in-process")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            from gateway.config import GatewayConfig
            from gateway.serve import BackgroundServer

            folder = stack.enter_context(tempfile.TemporaryDirectory())
            config = GatewayConfig(db_url=f"sqlite:///{folder}/task.db", lint_mode="off")
            print("starting an embedded gateway (loading SmolLM2-135M-Instruct) ...", flush=True)
            base_url = stack.enter_context(BackgroundServer(config)).url + "/v1"
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
        result = run_task(client)
    print(f"tool call : {result.call_name}({json.dumps(result.call_arguments)})")
    print(f"tool said : {result.tool_result}")
    print(f"answer    : {result.answer.strip()}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
