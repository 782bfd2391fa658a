"""The embedded backend: prefixgate's own paged-KV engine (SmolLM2-135M-Instruct by default).

Messages and tools go through the model's chat template (`engine`'s tokenizer writes tool
definitions into the system message when the template has no tool support, in the
`<tool_call>{json}</tool_call>` convention); the output is parsed back into OpenAI tool calls by
`gateway.tool_calls`; streamed calls come out as `ToolCallDelta` pieces (`gateway.tool_stream`).
A request's `OutputConstraint` (tool_choice, response_format) becomes the engine's grammar, so
forced tool calls and JSON documents always parse. `cached_tokens` is what the engine actually
reused from its radix cache in the request's namespace. Closing the stream early (client
disconnect) aborts the engine request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from gateway.config import GatewayConfig
from gateway.tool_stream import ToolCallStream
from gateway.types import BackendError, ChatRequest, Final, TextDelta, Usage

log = logging.getLogger("prefixgate.embedded")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


def engine_config(config: GatewayConfig) -> Any:
    """The EngineConfig for a GatewayConfig."""
    from engine import EngineConfig

    values: dict[str, Any] = {"model": config.model_path, "num_pages": config.engine_num_pages,
                              "quantization": config.engine_quantization}
    if config.engine_max_num_seqs is not None:
        values["max_num_seqs"] = config.engine_max_num_seqs
    if config.engine_device is not None:
        values["device"] = config.engine_device
    return EngineConfig(**values)


class EmbeddedBackend:
    """Serves ChatRequests from an in-process `engine.AsyncEngine`."""

    name = "embedded"

    def __init__(self, config: GatewayConfig, *, async_engine: Any | None = None) -> None:
        from engine import AsyncEngine

        self.config = config
        self.owns_engine = async_engine is None
        self.engine = async_engine or AsyncEngine(engine_config(config))

    def models(self) -> list[str]:
        return list(self.config.served_models)

    def kv_pages(self) -> tuple[int, int] | None:
        """(pages held by running requests or the prefix cache, pages in the pool)."""
        stats = self.engine.stats()
        return stats.pages_total - stats.pages_free, stats.pages_total

    def engine_stats(self) -> Any:
        return self.engine.stats()

    async def aclose(self) -> None:
        if self.owns_engine:
            await self.engine.shutdown()

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        """Token ids of the request: the raw prompt, or messages + tools through the template."""
        tokenizer = self.engine.tokenizer
        try:
            if req.prompt is not None:
                return list(tokenizer.encode(req.prompt))
            tools = list(req.tools) or None
            return list(tokenizer.apply_chat_template(list(req.messages), tools=tools,
                                                      add_generation_prompt=True))
        except Exception as exc:  # template errors (role order, ...) are the client's input
            raise BackendError(400, f"cannot render the prompt: {exc}", param="messages") from exc

    def sampling_params(self, req: ChatRequest) -> Any:
        from engine import SamplingParams

        o = req.options
        try:
            return SamplingParams(
                max_tokens=o.max_tokens or self.config.default_max_tokens,
                temperature=1.0 if o.temperature is None else o.temperature,
                top_p=1.0 if o.top_p is None else o.top_p,
                seed=None if o.seed is None else o.seed % (2**63),
                stop=o.stop,
                presence_penalty=o.presence_penalty,
                frequency_penalty=o.frequency_penalty,
                grammar=req.constraint.grammar if req.constraint is not None else None,
            )
        except ValueError as exc:
            raise BackendError(400, str(exc), param="sampling") from exc

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        from engine import RequestError

        ids = self.prompt_ids(req)
        params = self.sampling_params(req)
        filt = ToolCallStream(req.request_id) if _calls_possible(req) else None
        first = True
        try:
            async for delta in self.engine.stream(ids, params, namespace=req.namespace,
                                                  request_id=req.request_id):
                text, calls = filt.feed(delta.text) if filt else (delta.text, [])
                final = None
                if delta.output is not None:
                    tail, final = self._final(req, delta.output, filt)
                    text += tail
                if text or calls or first:
                    early = self._early_usage(len(ids), delta) if first else None
                    yield TextDelta(text, usage=early, tool_calls=tuple(calls))
                    first = False
                if final is not None:
                    yield final
                    return
        except ValueError as exc:
            raise BackendError(400, str(exc), param=_param_of(str(exc))) from exc
        except RequestError as exc:
            raise BackendError(500, f"engine error: {exc}") from exc
        except RuntimeError as exc:
            raise BackendError(503, f"engine unavailable: {exc}") from exc

    def _early_usage(self, prompt_tokens: int, delta: Any) -> Usage:
        """Usage known after prefill: prompt and cached tokens (for headers, message_start)."""
        cached = delta.output.cached_tokens if delta.output is not None else delta.cached_tokens
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=cached,
                     prefill_saved_ms=self._saved_ms(cached))

    def _saved_ms(self, cached_tokens: int) -> float:
        rate = self.engine.prefill_tokens_per_second
        return cached_tokens / rate * 1000.0 if rate and cached_tokens else 0.0

    def _final(self, req: ChatRequest, out: Any, filt: ToolCallStream | None) -> tuple[str, Final]:
        tail = ""
        if filt is not None:
            tail, parsed = filt.finish(out.text)
            text, calls = parsed.text, parsed.tool_calls
        else:
            text, calls = out.text, ()
        finish = FINISH_REASONS.get(out.finish_reason, "stop")
        if calls and finish == "stop":
            finish = "tool_calls"
        usage = Usage(
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens, ttft=out.ttft, tpot=out.tpot,
            prefill_saved_ms=self._saved_ms(out.cached_tokens),
        )
        return tail, Final(text=text, tool_calls=calls, finish_reason=finish, usage=usage)


def _calls_possible(req: ChatRequest) -> bool:
    """Tools given and tool_choice not "none" (OpenAI) / {"type": "none"} (Anthropic)."""
    choice = req.body.get("tool_choice")
    none = choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")
    return bool(req.tools) and not none


def _param_of(message: str) -> str:
    return "messages" if "prompt" in message else "sampling"


__all__ = ["EmbeddedBackend", "engine_config"]
