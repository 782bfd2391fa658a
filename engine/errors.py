"""The errors the engine raises on purpose, with the fields a caller needs to answer its client.

Every one derives from `EngineError`, so a server can tell "the engine refused or failed this
request" (map by type, never by message text) from a bug. Each also keeps the builtin base it
had before typing (`ValueError` for bad input, `RuntimeError` for failures), so plain
`except ValueError` callers keep working.

    EngineError
    ├── InvalidRequest (ValueError)     bad input; `.field` names it
    │   └── RequestTooLong              `.prompt_tokens` > `.limit`
    ├── RequestError (RuntimeError)     the engine failed one request; `.output` has its usage
    └── EngineUnavailable (RuntimeError) shut down, or the step loop itself failed
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

RequestField = Literal["prompt", "messages", "request_id", "grammar", "logit_bias"]
"""What an `InvalidRequest` is about: the prompt (text or token ids), the chat messages (or
tools) rendered through the chat template, the caller-chosen request id, the output grammar
(SamplingParams json_schema / regex / grammar), or SamplingParams.logit_bias (a token id
outside the vocabulary)."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot run as given; `field` says which part is wrong."""

    def __init__(self, message: str, *, field: RequestField) -> None:
        super().__init__(message)
        self.message = message
        self.field: RequestField = field


class RequestTooLong(InvalidRequest):
    """The prompt leaves no room to generate: `prompt_tokens` > `limit`."""

    def __init__(self, *, prompt_tokens: int, limit: int, detail: str = "") -> None:
        message = f"prompt has {prompt_tokens} tokens; at most {limit} fit"
        super().__init__(f"{message} ({detail})" if detail else message, field="prompt")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class RequestError(EngineError, RuntimeError):
    """A request failed inside the engine; `output` has its usage and `output.error`."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__(output.error or "request failed")
        self.output = output


class EngineUnavailable(EngineError, RuntimeError):
    """The engine takes no requests: it is shut down, or its step loop failed."""


__all__ = [
    "EngineError",
    "EngineUnavailable",
    "InvalidRequest",
    "RequestError",
    "RequestField",
    "RequestTooLong",
]
