"""`Sequence`: one request's tokens, pages, progress, timings and detokenization state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestField
from engine.grammar import GrammarState
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.speculative import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Mutable state of one request inside the engine.

    token_ids = prompt + generated tokens. KV of token_ids[:num_computed_tokens] is in the
    cache, in `pages` (page i holds tokens [i * page_size, (i + 1) * page_size)). The first
    `num_cached_pages` pages belong to the radix cache (locked through `cache_handle`); the
    others belong to this sequence until the block manager releases them.
    `spec` (speculative decoding) holds the n-gram index over token_ids and the draft counters;
    draft tokens themselves never enter token_ids: only verified tokens are appended.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str
    generator: torch.Generator
    max_len: int  # most total tokens (prompt + generated)
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    num_cached_pages: int = 0
    cache_handle: object = None
    cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    prefill_time: float = 0.0
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_field: RequestField | None = None  # the request field that caused `error`, if any
    spec: SpecState | None = None
    grammar: GrammarState | None = None  # constrained decoding: advanced on committed tokens

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        """Record a sampled token and its time; the caller then checks `stop_reason`."""
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        if token_id not in self.stop_token_ids:
            self.detokenizer.add(token_id)

    def stop_reason(self) -> FinishReason | None:
        """Why generation must end after the last token, or None to continue."""
        last = self.token_ids[-1]
        if last in self.stop_token_ids or self.detokenizer.stopped:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_len:
            return "length"
        return None

    def to_output(self) -> RequestOutput:
        """The finished request's result (call after `finish_reason` is set)."""
        assert self.finish_reason is not None, "to_output of an unfinished sequence"
        n_out = self.num_output_tokens
        first, last = self.first_token_time, self.last_token_time
        ttft = (first - self.arrival_time) if first is not None else 0.0
        tpot = ((last - first) / (n_out - 1)) if first is not None and last and n_out > 1 else 0.0
        return RequestOutput(
            request_id=self.request_id,
            text=self.detokenizer.text,
            token_ids=self.output_token_ids,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=n_out,
            finish_reason=self.finish_reason,
            ttft=ttft,
            tpot=tpot,
            prefill_time=self.prefill_time,
            namespace=self.namespace,
            error=self.error,
            error_field=self.error_field,
            draft_tokens=self.spec.draft_tokens if self.spec else 0,
            accepted_tokens=self.spec.accepted_tokens if self.spec else 0,
            stop_string=self.detokenizer.stop_string if self.finish_reason == "stop" else None,
        )
