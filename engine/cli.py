"""`prefixgate generate "prompt"`: generate from the embedded engine, print text and usage."""

from __future__ import annotations

import argparse
import sys

from engine.config import EngineConfig
from engine.linear import QUANTIZATIONS
from engine.llm_engine import Engine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate generate",
        description="Generate text with the embedded engine (default: SmolLM2-135M-Instruct).",
    )
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    p.add_argument("--system", help="a system message (chat mode)")
    p.add_argument("--model", help="a .gguf file or a Hugging Face folder")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="int4 (fastest CPU decode: the GGUF's Q4_1 blocks on native kernels), "
                        "int8, fp16")
    return p


def usage_line(out: RequestOutput) -> str:
    return (
        f"[prompt_tokens={out.prompt_tokens} cached_tokens={out.cached_tokens} "
        f"completion_tokens={out.completion_tokens} finish_reason={out.finish_reason} "
        f"ttft={out.ttft * 1e3:.0f}ms tpot={out.tpot * 1e3:.1f}ms]"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
        )  # fmt: skip
        engine = Engine(EngineConfig(model=args.model, quantization=args.quantization))
        if args.raw:
            out = engine.generate([args.prompt], params)[0]
        else:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            out = engine.chat(messages, params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"prefixgate generate: {exc}", file=sys.stderr)
        return 2
    print(out.text)
    print(usage_line(out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
