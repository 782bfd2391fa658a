"""The shadow cache's prediction beside an upstream's report, in each side's token units.

The shadow counts tiktoken tokens, an upstream its own tokenizer's: a prediction is carried
over as the same fraction of the prompt (`in_upstream_tokens`, and back: `in_shadow_tokens`),
so predicted and reported hits compare whatever the tokenizer. `head_usage` is what a stream's
head says before the upstream has reported, `final_usage` the answer's usage with the
prediction beside the report (counts the upstream did not send are the gateway's, marked so).
"""

from __future__ import annotations

from collections.abc import Sized

from gateway.evolve import evolve
from gateway.shadow import Prompt
from gateway.types import Usage


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
