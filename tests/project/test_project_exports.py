"""Each package's curated public names: `__all__` is exactly this list, every name resolves,
and the names a light import promises stay light (no torch for the gateway's config)."""

from __future__ import annotations

import importlib
import inspect

import pytest

EXPORTS: dict[str, set[str]] = {
    "gateway": {
        "ApiError", "Backend", "BackendError", "BackgroundServer", "ChatRequest", "Final",
        "GatewayConfig", "GatewayError", "TextDelta", "UpstreamSpec", "Usage", "create_app",
    },
    "engine": {
        "AsyncEngine", "Engine", "EngineConfig", "EngineError", "EngineStats",
        "EngineUnavailable", "InvalidRequest", "RequestError", "RequestOutput",
        "RequestTooLong", "SamplingParams", "StreamDelta",
    },
    "prompt_lint": {
        "RULES", "Finding", "LintReport", "RequestError", "RewriteResult", "Rule",
        "SessionTracker", "TemplateLearner", "detect_provider", "learn_request",
        "lint_request", "request_tokens", "rewrite_request",
    },
    "radix_cache": {
        "CacheStats", "Handle", "InsertResult", "MatchResult", "PackedTokens", "RadixCache",
        "pack_tokens",
    },
    "paged_kernels": {
        "BACKENDS", "AttentionPlan", "Backend", "RotaryPlan", "paged_decode_attention",
        "paged_prefill_attention", "plan_attention", "plan_rotary", "resolve_backend",
        "rms_norm", "rotary", "rotary_cache", "silu_and_mul", "store_kv",
        "LayerGeometry", "NormedResidual", "QKV", "StepOps", "plan_step",
    },
}


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_all_is_the_curated_list_and_every_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == EXPORTS[package]
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        value = getattr(module, name)
        assert value is not None, name
        if inspect.isclass(value) or inspect.isfunction(value):
            origin = value.__module__
            assert origin.split(".")[0] == package, f"{package}.{name} comes from {origin}"


def test_unknown_names_raise_attribute_error() -> None:
    for package in ("gateway", "engine"):
        with pytest.raises(AttributeError, match="no attribute"):
            _ = importlib.import_module(package).not_a_name
