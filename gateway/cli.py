"""The `prefixgate` command: one entry point, sub-commands owned by their packages.

Each sub-command lives beside the code it drives and is imported lazily, so
`prefixgate lint` never pays for importing torch. A sub-command is a function
`main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway (OpenAI + Anthropic APIs) under uvicorn"),
    "lint": ("prompt_lint.cli:lint_main", "find prefix-cache killers in prompt logs"),
    "fix": ("prompt_lint.cli:fix_main", "rewrite prompt logs stable-first"),
    "generate": ("engine.cli", "generate text from the embedded engine"),
    "plan": ("engine.plan", "memory plan: weights + KV cache + overhead"),
    "bench": ("gateway.bench", "run a benchmark under benchmarks/"),
    "stats": ("gateway.stats_cli", "print a running gateway's cache statistics"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: prefixgate <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _resolve(target: str) -> Callable[[list[str]], int | None]:
    """The `main(argv)` function named by `module` or `module:function`."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    func: Callable[[list[str]], int | None] = getattr(module, attr or "main")
    return func


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"prefixgate: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    func = _resolve(COMMANDS[name][0])
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
