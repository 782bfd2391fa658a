"""Shared gateway fixtures: app builders over the fake backend, one real engine per session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig

from .gateway_fakes import FakeBackend, fake_config


@pytest.fixture
def fake_backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def make_fake_app(tmp_path: Path, fake_backend: FakeBackend) -> Iterator[Any]:
    apps: list[Any] = []

    def build(**changes: Any) -> Any:
        app = create_app(fake_config(tmp_path, **changes), backend=fake_backend)
        apps.append(app)
        return app

    yield build
    for app in apps:
        app.state.store.close()


# ---------------------------------------------------------------- the real embedded engine


@pytest.fixture(scope="session")
def real_backend() -> Iterator[Any]:
    """One EmbeddedBackend (SmolLM2 through `engine`) shared by every test of the session."""
    embedded = pytest.importorskip("gateway.backends.embedded")
    config = GatewayConfig(engine=EngineConfig(num_pages=512, max_num_seqs=64),
                           default_max_tokens=16)
    backend = embedded.EmbeddedBackend(config)
    yield backend
    asyncio.run(backend.aclose())


@pytest.fixture
def make_real_app(tmp_path: Path, real_backend: Any) -> Iterator[Any]:
    """Apps over the shared real engine (each with its own SQLite file)."""
    apps: list[Any] = []

    def build(**changes: Any) -> Any:
        values: dict[str, Any] = {"db_url": f"sqlite:///{tmp_path / 'real.db'}",
                                  "lint_mode": "off", "stats_flush_interval_s": 0.02,
                                  "default_max_tokens": 8}
        values.update(changes)
        app = create_app(GatewayConfig(**values), backend=real_backend)
        apps.append(app)
        return app

    yield build
    for app in apps:
        app.state.store.close()
