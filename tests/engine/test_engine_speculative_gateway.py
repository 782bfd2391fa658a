"""Speculative decoding seen from the gateway: the embedded backend over a tiny chain model.

The model continues "abcdefghij" one byte per token; the prompt holds the text, so n-gram
drafts copy it. The reference is the same engine without speculation (same text), and the
header must agree with the Prometheus counters and the engine's own statistics.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from gateway.app import create_app
from gateway.backends.embedded import EmbeddedBackend
from gateway.config import GatewayConfig

from .engine_runtime_support import chain_model

TEXT = "abcdefghij"


@pytest.mark.parametrize("speculative", ["ngram", None])
async def test_spec_header_and_counters_follow_the_engine(tmp_path: Path, speculative) -> None:
    loaded = chain_model(TEXT)
    engine_config = EngineConfig(num_pages=32, page_size=8, speculative=speculative)
    config = GatewayConfig(db_url=f"sqlite:///{tmp_path / 's.db'}", lint_mode="off",
                           engine=engine_config)  # fmt: skip
    engine = Engine(config.engine, model=loaded)
    backend = EmbeddedBackend(config, async_engine=AsyncEngine(engine=engine))
    app = create_app(config, backend=backend)
    body = {"model": config.model_name, "prompt": TEXT + "a", "max_tokens": 8, "temperature": 0}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as http:  # fmt: skip
            response = await http.post("/v1/completions", json=body)
            metrics = (await http.get("/metrics")).text
    finally:
        await backend.aclose()
        app.state.store.close()
    assert response.status_code == 200
    plain = Engine(EngineConfig(num_pages=32, page_size=8), model=loaded)
    want = plain.generate(TEXT + "a", SamplingParams(max_tokens=8, temperature=0.0))[0].text
    assert response.json()["choices"][0]["text"] == want == TEXT[1:9]
    stats = engine.stats()
    accepted = int(response.headers["x-prefixgate-spec-accepted"])
    drafted = int(response.headers["x-prefixgate-spec-draft"])
    assert (drafted, accepted) == (stats.spec_draft_tokens, stats.spec_accepted_tokens)
    if speculative:
        assert 0 < accepted <= drafted
        assert (f'prefixgate:spec_decode_num_accepted_tokens_total{{backend="embedded"}} '
                f"{accepted}") in metrics  # fmt: skip
        assert (f'prefixgate:spec_decode_num_draft_tokens_total{{backend="embedded"}} '
                f"{drafted}") in metrics  # fmt: skip
    else:
        assert accepted == drafted == 0


def test_gateway_config_reads_speculation_from_the_environment() -> None:
    env = {"PREFIXGATE_ENGINE_SPECULATIVE": "ngram", "PREFIXGATE_ENGINE_NGRAM_MAX": "3"}
    engine = GatewayConfig.from_env(env).engine
    assert (engine.speculative, engine.ngram_max) == ("ngram", 3)
    assert GatewayConfig.from_env({}).engine.speculative is None
    with pytest.raises(ValueError, match="speculative"):
        GatewayConfig.from_env({"PREFIXGATE_ENGINE_SPECULATIVE": "medusa"})
