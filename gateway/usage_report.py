"""What a response says about its own usage: the x-prefixgate-* headers and the `prefixgate`
summary field.

A response head goes out before a stream ends, so its figures may not be final:
- embedded engine: the head waits until the request is scheduled, when its cached tokens are
  known (`x-prefixgate-cached-tokens-source: reported`, equal to the final usage);
- upstream: the head carries the shadow cache's prediction
  (`x-prefixgate-cached-tokens-source: predicted`); the reported figures arrive in the final
  usage chunk and in the `prefixgate` field of the last event.
`x-prefixgate-usage: estimated` marks token counts the gateway computed itself because the
upstream sent none; the stats record says the same (`usage_estimated`).
"""

from __future__ import annotations

from typing import Any

from gateway.types import Usage

SUMMARY_FIELD = "prefixgate"


def hit_rate(usage: Usage) -> float:
    """Cached share of the prompt (0 for an empty prompt)."""
    return usage.cached_tokens / usage.prompt_tokens if usage.prompt_tokens else 0.0


def usage_headers(usage: Usage | None) -> dict[str, str]:
    """The usage half of the x-prefixgate-* headers (all zeros and `none` when unknown)."""
    if usage is None:
        return {"x-prefixgate-cached-tokens": "0", "x-prefixgate-prompt-tokens": "0",
                "x-prefixgate-hit-rate": "0.0000", "x-prefixgate-prefill-saved-ms": "0.0",
                "x-prefixgate-cached-tokens-source": "none", "x-prefixgate-usage": "none"}
    headers = {
        "x-prefixgate-cached-tokens": str(usage.cached_tokens),
        "x-prefixgate-prompt-tokens": str(usage.prompt_tokens),
        "x-prefixgate-hit-rate": f"{hit_rate(usage):.4f}",
        "x-prefixgate-prefill-saved-ms": f"{usage.prefill_saved_ms:.1f}",
        "x-prefixgate-cached-tokens-source": usage.cached_source,
        "x-prefixgate-usage": "estimated" if usage.estimated else "reported",
    }
    if usage.spec_accepted_tokens is not None:  # embedded engine, once generation is done
        headers["x-prefixgate-spec-accepted"] = str(usage.spec_accepted_tokens)
        headers["x-prefixgate-spec-draft"] = str(usage.spec_draft_tokens or 0)
    return headers


def summary(usage: Usage) -> dict[str, Any]:
    """The final figures of a response, as its `prefixgate` field carries them."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "completion_tokens": usage.completion_tokens,
        "hit_rate": round(hit_rate(usage), 4),
        "cached_tokens_source": usage.cached_source,
        "predicted_cached_tokens": usage.predicted_cached_tokens,
        "reported_cached_tokens": usage.reported_cached_tokens,
        "usage": "estimated" if usage.estimated else "reported",
        "prefill_saved_ms": round(usage.prefill_saved_ms, 1),
    }


def prefixgate_headers(usage: Usage | None, lint_ids: tuple[str, ...],
                       request_id: str) -> dict[str, str]:
    """The x-prefixgate-* headers of a response: `usage_headers`, the lint ids, the request id."""
    return {"x-request-id": request_id, **usage_headers(usage),
            "x-prefixgate-lint": ",".join(lint_ids)}
