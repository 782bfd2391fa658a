"""The gateway's online lint learns from live traffic like `prefixgate lint` does.

The hand-built prompt family of tests/support/lint_family.py
goes through the gateway in report mode: once two sessions have shown two
requests each, the findings are the evidence-based ones (timestamp PL001,
session handle PL013, rotating tip PL008) and the stable look-alikes are gone.
"""

from __future__ import annotations

import pytest

from tests.support.lint_family import LOG

from .gateway_fakes import FAKE_MODEL, FakeBackend, asgi_client


async def test_online_lint_settles_on_the_family_evidence(make_fake_app,
                                                          fake_backend: FakeBackend) -> None:
    pytest.importorskip("prompt_lint")
    app = make_fake_app(lint_mode="report")
    headers = []
    async with asgi_client(app) as http:
        for body in LOG:
            response = await http.post("/v1/chat/completions", json={**body, "model": FAKE_MODEL})
            assert response.status_code == 200
            headers.append(set(response.headers["x-prefixgate-lint"].split(",")))
    assert "PL013" not in headers[0]  # one request: nothing shows a session-scoped value yet
    assert headers[-1] == {"PL001", "PL008", "PL013"}
    (learner,) = app.state.learners.values()  # one tenant, one learner, one family
    assert len(learner.families) == 1
