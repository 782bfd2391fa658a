"""The result type of the corpus fixtures, in a module of its own so tests can import it
(a `conftest` module name is shared by every test folder)."""

from __future__ import annotations

from typing import NamedTuple

from prompt_lint import LintReport, TemplateLearner

from .lint_corpus import CorpusRequest


class Linted(NamedTuple):
    """The corpus with one report per request and the learner that made them."""

    corpus: list[CorpusRequest]
    reports: list[LintReport]
    learner: TemplateLearner
