"""The README's OpenAI snippet runs as written against a gateway (only the port differs).

The model behind it is the gateway tests' deterministic fake backend, so this checks the
snippet's code (client setup, request, the usage fields it prints), not the model's answer.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from gateway.app import create_app
from tests.gateway.gateway_fakes import FakeBackend, fake_config
from tests.support import serve

ROOT = Path(__file__).resolve().parents[2]
README_MODEL = "smollm2-135m-instruct"


class ReadmeBackend(FakeBackend):
    """The fake echo backend, answering to the model id the README uses."""

    def models(self) -> list[str]:
        return [README_MODEL]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_openai_snippet_runs_and_uses_greedy_decoding(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    [snippet] = [b for b in python_blocks((ROOT / "README.md").read_text()) if "OpenAI(" in b]
    assert "temperature=0" in snippet  # the README explains why
    app = create_app(fake_config(tmp_path, model_name=README_MODEL), backend=ReadmeBackend())
    out = io.StringIO()
    try:
        with serve(app) as server, contextlib.redirect_stdout(out):
            exec(snippet.replace("http://127.0.0.1:8000", server.url), {})  # noqa: S102
    finally:
        app.state.store.close()
    printed = out.getvalue().split()
    assert printed[:2] == ["echo:", "What"]  # the fake echoes the question back
    assert printed[-1].isdigit()  # prompt_tokens_details.cached_tokens
