"""An OpenAI SDK agent loop through prefixgate: hit rate per turn, lint off vs rewrite.

The agent does what agent frameworks do: its system prompt starts with the current time,
it offers tools, and every turn resends the whole history. With lint off the timestamp at the
top changes every turn and kills the prefix cache; with `x-prefixgate-lint-mode: rewrite` the
gateway moves it after the cache boundary and the history is served from cache.

    python examples/openai_agent_loop.py                      # starts an embedded gateway
    python examples/openai_agent_loop.py --base-url http://127.0.0.1:8000/v1

Each mode runs in its own cache namespace (`cache_salt`), so neither run warms the other's cache.
Exits 0 when rewrite's overall hit rate beats lint off's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import openai

MODEL = "smollm2-135m-instruct"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_orders", "description": "Find a customer's orders by keyword.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]
QUESTIONS = [
    "What is the weather in Paris?",
    "Do I have any open orders for garden chairs?",
    "Should I take an umbrella tomorrow?",
    "Summarise what we talked about.",
    "Thanks! Anything else I should know?",
    "What was the first city I asked about?",
]
SYSTEM = ("Current time: {now}\n"
          "You are ShopBot, the assistant of a garden store. Be brief and friendly. Use the tools "
          "when a question needs live data, and never invent order numbers.")


@dataclass(frozen=True)
class Turn:
    """One model call of the agent."""

    turn: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    lint: str


def run_tool(name: str, arguments: str) -> str:
    """Deterministic stand-ins for real tools."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        args = {}
    if name == "get_weather":
        return json.dumps({"city": args.get("city", "?"), "sky": "light rain", "celsius": 14})
    return json.dumps({"orders": [{"id": "A-1001", "item": "garden chairs", "status": "shipped"}]})


def agent_run(client: openai.OpenAI, mode: str, turns: int, max_tokens: int) -> list[Turn]:
    """Run the agent for `turns` user turns in lint mode `mode`; one Turn per model call."""
    clock = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
    salt = f"{mode}-{uuid.uuid4().hex[:8]}"
    history: list[dict[str, Any]] = []
    out: list[Turn] = []
    for i in range(turns):
        history.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        for _ in range(2):  # at most one tool round per user turn
            clock += timedelta(seconds=47)
            system = {"role": "system", "content": SYSTEM.format(now=clock.isoformat())}
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[system, *history], tools=TOOLS, max_tokens=max_tokens,
                temperature=0, extra_headers={"x-prefixgate-lint-mode": mode},
                extra_body={"cache_salt": salt})
            reply = raw.parse()
            h = raw.headers
            out.append(Turn(len(out) + 1, int(h["x-prefixgate-prompt-tokens"]),
                            int(h["x-prefixgate-cached-tokens"]),
                            float(h["x-prefixgate-hit-rate"]), h.get("x-prefixgate-lint", "")))
            message = reply.choices[0].message
            history.append(message.model_dump(exclude_none=True, include={
                "role", "content", "tool_calls"}) | {"content": message.content or ""})
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                history.append({"role": "tool", "tool_call_id": call.id,
                                "content": run_tool(call.function.name, call.function.arguments)})
    return out


def overall(turns: list[Turn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0


def print_table(results: dict[str, list[Turn]]) -> None:
    modes = list(results)
    print(f"{'call':>4} | " + " | ".join(f"{m:^24}" for m in modes))
    print(f"{'':>4} | " + " | ".join(f"{'prompt':>7} {'cached':>7} {'hit':>6}  " for _ in modes))
    for i in range(max(len(r) for r in results.values())):
        cells = []
        for m in modes:
            t = results[m][i] if i < len(results[m]) else None
            cells.append(f"{t.prompt_tokens:>7} {t.cached_tokens:>7} {t.hit_rate:>6.1%}  "
                         if t else " " * 24)
        print(f"{i + 1:>4} | " + " | ".join(cells))
    print(f"{'all':>4} | " + " | ".join(f"{'':>15} {overall(results[m]):>6.1%}  "
                                         for m in modes))
    lint = sorted({i for t in results[modes[-1]] for i in t.lint.split(",") if i})
    print(f"lint findings (rule ids): {', '.join(lint) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="a running gateway (default: start an embedded one)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--turns", type=int, default=4, help="user turns per run")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per model call")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            from gateway.config import GatewayConfig
            from gateway.serve import BackgroundServer

            folder = stack.enter_context(tempfile.TemporaryDirectory())
            config = GatewayConfig(db_url=f"sqlite:///{folder}/agent.db", lint_mode="report")
            print("starting an embedded gateway (loading SmolLM2-135M-Instruct) ...", flush=True)
            base_url = stack.enter_context(BackgroundServer(config)).url + "/v1"
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0,
                               timeout=600)
        results = {mode: agent_run(client, mode, args.turns, args.max_tokens)
                   for mode in ("off", "rewrite")}
    print_table(results)
    off, rewrite = overall(results["off"]), overall(results["rewrite"])
    verdict = "rewrite wins" if rewrite > off else "rewrite does NOT win"
    print(f"overall hit rate: lint off {off:.1%}, rewrite {rewrite:.1%} -> {verdict}")
    return 0 if rewrite > off else 1


if __name__ == "__main__":
    sys.exit(main())
