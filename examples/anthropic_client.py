"""The official Anthropic SDK pointed at prefixgate's /v1/messages.

Sends a conversation with a long system prompt (marked with `cache_control`, which prefixgate
accepts) twice, then streams a reply, and prints Anthropic-style usage: `input_tokens` (the
uncached part), `cache_read_input_tokens` (served from the prefix cache).

    python examples/anthropic_client.py                   # starts an embedded gateway
    python examples/anthropic_client.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import ExitStack

import anthropic

MODEL = "smollm2-135m-instruct"
SYSTEM = [
    {"type": "text", "text": (
        "You are the librarian of a small town library. You know its opening hours (9 to 17 on "
        "weekdays, 10 to 14 on Saturdays), its lending rules (four weeks, two renewals) and "
        "its events (a reading club every Thursday evening). Answer in one short sentence."),
     "cache_control": {"type": "ephemeral"}},
]


def ask(client: anthropic.Anthropic, question: str, max_tokens: int) -> None:
    msg = client.messages.create(
        model=MODEL, max_tokens=max_tokens, system=SYSTEM,
        messages=[{"role": "user", "content": question}],
        extra_body={"temperature": 0})  # this SDK version has no temperature argument
    u = msg.usage
    print(f"Q: {question}\nA: {msg.content[0].text!r}  [stop: {msg.stop_reason}]")
    print(f"   input_tokens={u.input_tokens} cache_read_input_tokens={u.cache_read_input_tokens} "
          f"cache_creation_input_tokens={u.cache_creation_input_tokens} "
          f"output_tokens={u.output_tokens}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="a running gateway (default: start an embedded one)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            from gateway.config import GatewayConfig
            from gateway.serve import BackgroundServer

            folder = stack.enter_context(tempfile.TemporaryDirectory())
            config = GatewayConfig(db_url=f"sqlite:///{folder}/anthropic.db")
            print("starting an embedded gateway (loading SmolLM2-135M-Instruct) ...", flush=True)
            base_url = stack.enter_context(BackgroundServer(config)).url
        client = anthropic.Anthropic(base_url=base_url, api_key=args.api_key, max_retries=0,
                                     timeout=600)
        ask(client, "When does the library open on Saturday?", args.max_tokens)
        ask(client, "How long can I keep a book?", args.max_tokens)
        print("streaming: ", end="", flush=True)
        with client.messages.stream(
            model=MODEL, max_tokens=args.max_tokens, system=SYSTEM,
            messages=[{"role": "user", "content": "Is there a reading club?"}],
            extra_body={"temperature": 0},
        ) as stream:
            for text in stream.text_stream:
                print(text, end="", flush=True)
            final = stream.get_final_message()
        print(f"\n   cache_read_input_tokens={final.usage.cache_read_input_tokens} "
              f"input_tokens={final.usage.input_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
