"""The shadow cache's prediction beside an upstream's report, in each side's token units.

The shadow counts tiktoken tokens, an upstream its own tokenizer's: a prediction is carried
over as the same fraction of the prompt (`in_upstream_tokens`, and back: `in_shadow_tokens`),
so predicted and reported hits compare whatever the tokenizer. `head_usage` is what a stream's
head says before the upstream has reported, `final_usage` the answer's usage with the
prediction beside the report (counts the upstream did not send are the gateway's, marked so).
`predicted_hit` is a route's prediction, and `answers_first` whether an answer needs one at all
(`reports_figures`).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING

from gateway.evolve import evolve
from gateway.shadow import Prompt
from gateway.types import ChatRequest, Final, TextDelta, Usage

if TYPE_CHECKING:
    from gateway.backends.router import Replica, Route


def head_usage(early: Usage | None, prompt: Prompt, predicted: int) -> Usage:
    """What a stream's head says: the upstream's early report (Anthropic's message_start)
    beside the prediction, else the prediction itself, marked predicted and estimated."""
    if early is not None:
        scaled = in_upstream_tokens(predicted, len(prompt), early.prompt_tokens)
        return evolve(early, predicted_cached_tokens=scaled)
    return Usage(prompt_tokens=len(prompt), completion_tokens=0, cached_tokens=predicted,
                 predicted_cached_tokens=predicted, cached_source="predicted", estimated=True)


def final_usage(usage: Usage, prompt: Prompt, predicted: int) -> Usage:
    """The upstream's usage with the prediction beside it; counts the upstream did not send
    are the gateway's, and marked so (estimated prompt tokens, predicted cached tokens)."""
    prompt_tokens = usage.prompt_tokens or len(prompt)
    scaled = in_upstream_tokens(predicted, len(prompt), usage.prompt_tokens)
    reported = usage.reported_cached_tokens is not None
    return evolve(
        usage, predicted_cached_tokens=scaled, prompt_tokens=prompt_tokens,
        cached_tokens=usage.cached_tokens if reported else scaled,
        cached_source="reported" if reported else "predicted",
        estimated=usage.estimated or not usage.prompt_tokens)


def in_upstream_tokens(predicted: int, tokens: Sized | int, upstream_prompt: int) -> int:
    """The shadow's prediction (tiktoken tokens) in the upstream's own token units: the same
    fraction of the prompt, so predicted and reported hits compare whatever the tokenizer."""
    n = tokens if isinstance(tokens, int) else len(tokens)
    if not upstream_prompt or not n:
        return predicted
    return min(upstream_prompt, round(predicted * upstream_prompt / n))


def in_shadow_tokens(reported: int, shadow_prompt: int, upstream_prompt: int) -> int:
    """The upstream's reported hit in the shadow's token units (inverse of the above)."""
    if not upstream_prompt:
        return reported
    return min(shadow_prompt, round(reported * shadow_prompt / upstream_prompt))


def stream_head_usage(item: TextDelta, replica: Replica, prompt: Prompt, predicted: int) -> Usage:
    """What a stream's head says (`head_usage`), with the prefill time its hit saves on the
    replica (llama.cpp's own rate; 0 where the upstream does not time its prefill), so the
    head and the record of a stream cut after it claim what the final would."""
    usage = head_usage(item.usage, prompt, predicted)
    saved = replica.backend.prefill_saved_ms(usage.cached_tokens)
    return evolve(usage, prefill_saved_ms=saved) if saved else usage


def predicted_hit(replica: Replica, route: Route) -> int:
    """The hit the route's score predicts (the router scored the prompt with this replica's
    model); 0 below the provider's minimum."""
    matched = route.matched
    return matched if matched >= replica.shadow.config.min_cached_tokens else 0


def answers_first(req: ChatRequest, replica: Replica) -> bool:
    """Whether a request's whole answer goes out before the shadow's tokens are computed: a
    non-streaming one to a replica whose last answer reported its own figures (the answer
    carries the reported ones; only a stream's head or an answer without them needs the
    prediction)."""
    return not req.stream and replica.reports_figures


def reports_figures(item: TextDelta | Final | None) -> bool:
    """Whether `item` is an answer with the upstream's own prompt and cached token counts."""
    if not isinstance(item, Final):
        return False
    usage = item.usage
    return bool(usage.prompt_tokens) and usage.reported_cached_tokens is not None \
        and not usage.estimated
