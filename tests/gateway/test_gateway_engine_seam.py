"""The gateway's side of the engine seam: engine errors map to client errors by type, and every
EngineConfig field is settable from the gateway (env var and serve flag)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engine import (
    EngineConfig,
    EngineUnavailable,
    InvalidRequest,
    RequestError,
    RequestOutput,
    RequestTooLong,
)
from gateway.config import GatewayConfig
from gateway.engine_flags import engine_env_vars, engine_field_help, engine_fields
from gateway.serve import build_parser, config_from_args

# A valid non-default text value for the EngineConfig fields known when this was written; a
# field added later still has to be reachable (the coverage tests below), this only checks values.
SAMPLES: dict[str, str] = {
    "model": "/models/x.gguf", "dtype": "float16", "quantization": "fp16", "page_size": "32",
    "num_pages": "64", "memory_budget_bytes": "1000000", "max_num_seqs": "3",
    "max_num_batched_tokens": "128", "max_model_len": "256", "enable_prefix_caching": "false",
    "seed": "7", "device": "cuda", "kernel_backend": "triton",
}
EXPECTED: dict[str, object] = {
    "model": "/models/x.gguf", "dtype": "float16", "quantization": "fp16", "page_size": 32,
    "num_pages": 64, "memory_budget_bytes": 1_000_000, "max_num_seqs": 3,
    "max_num_batched_tokens": 128, "max_model_len": 256, "enable_prefix_caching": False,
    "seed": 7, "device": "cuda", "kernel_backend": "triton",
}


def _output(error: str) -> RequestOutput:
    return RequestOutput(request_id="r", text="", token_ids=[], prompt_token_ids=[1],
                         prompt_tokens=1, cached_tokens=0, completion_tokens=0,
                         finish_reason="error", ttft=0.0, tpot=0.0, prefill_time=0.0,
                         error=error)


def test_engine_errors_map_to_client_errors_by_type() -> None:
    embedded = pytest.importorskip("gateway.backends.embedded")
    long_ = embedded.engine_error(RequestTooLong(prompt_tokens=900, limit=511))
    assert (long_.status, long_.kind, long_.param) == (400, "context_length_exceeded", "messages")
    assert "900" in long_.message and "511" in long_.message
    bad = embedded.engine_error(InvalidRequest("prompt must not be empty", field="prompt"))
    assert (bad.status, bad.param) == (400, "messages")
    dup = embedded.engine_error(InvalidRequest("already running", field="request_id"))
    assert (dup.status, dup.param) == (400, "request_id")
    # The text never decides: a failure whose message mentions a prompt stays a 500.
    failed = embedded.engine_error(RequestError(_output("the prompt broke a kernel")))
    assert (failed.status, failed.param) == (500, None)
    assert embedded.engine_error(EngineUnavailable("AsyncEngine is shut down")).status == 503
    with pytest.raises(TypeError):
        embedded.engine_error(ValueError("prompt"))


@pytest.mark.parametrize("name", [f.name for f in fields(EngineConfig)])
def test_every_engine_field_has_an_env_var_and_a_serve_flag(name: str) -> None:
    env_name = f"PREFIXGATE_ENGINE_{name.upper()}"
    assert engine_env_vars()[env_name] == name
    flag = f"--engine-{name.replace('_', '-')}"
    assert flag in build_parser()._option_string_actions  # argparse's table of flags
    if name not in SAMPLES:
        return
    from_env = GatewayConfig.from_env({env_name: SAMPLES[name]})
    assert getattr(from_env.engine, name) == EXPECTED[name]
    from_flag = config_from_args(build_parser().parse_args([flag, SAMPLES[name]]), {})
    assert getattr(from_flag.engine, name) == EXPECTED[name]
    assert from_env.engine == from_flag.engine == EngineConfig(**{name: EXPECTED[name]})


@pytest.mark.parametrize("name", [f.name for f in fields(EngineConfig)])
def test_every_engine_flag_is_described_by_whole_sentences(name: str) -> None:
    """A flag's help is its field's description in EngineConfig's docstring, cut at the end
    of a sentence, never mid-way through a line that continues."""
    doc = " ".join((EngineConfig.__doc__ or "").split())
    described = engine_field_help()[name]
    assert described and f"{described}." in doc
    assert described.count("(") == described.count(")")
    assert not described.endswith((",", ";", "(", ":"))


def test_flags_override_engine_env_and_old_names_still_work() -> None:
    env = {"PREFIXGATE_ENGINE_PAGE_SIZE": "32", "PREFIXGATE_MODEL_PATH": "/m.gguf",
           "PREFIXGATE_ENGINE_NUM_PAGES": "100"}
    args = build_parser().parse_args(["--num-pages", "7", "--engine-max-num-seqs", "2"])
    config = config_from_args(args, env)
    assert config.engine == EngineConfig(model="/m.gguf", page_size=32, num_pages=7,
                                         max_num_seqs=2)
    assert set(engine_fields()) == {f.name for f in fields(EngineConfig)}


def test_bad_engine_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="PREFIXGATE_ENGINE_PAGE_SIZE='twelve'"):
        GatewayConfig.from_env({"PREFIXGATE_ENGINE_PAGE_SIZE": "twelve"})
    with pytest.raises(ValueError, match="PREFIXGATE_ENGINE_PAGE_SIZE='12'.*power of two"):
        GatewayConfig.from_env({"PREFIXGATE_ENGINE_PAGE_SIZE": "12"})
    with pytest.raises(ValueError, match="engine must be an EngineConfig"):
        GatewayConfig(engine={"page_size": 16})  # type: ignore[arg-type]
