"""Shared fixtures for prompt_lint tests: the labelled corpus, linted two ways."""

from __future__ import annotations

import pytest

from prompt_lint import TemplateLearner, learn_request, lint_request

from .lint_corpus import CorpusRequest, build_corpus
from .lint_linted import Linted


@pytest.fixture(scope="session")
def corpus() -> list[CorpusRequest]:
    return build_corpus()


@pytest.fixture(scope="session")
def two_pass(corpus: list[CorpusRequest]) -> Linted:
    """What `prefixgate lint` does: learn the whole log, freeze, lint in order."""
    learner = TemplateLearner()
    for req in corpus:
        learn_request(req.body, learner)
    learner.freeze()
    return Linted(corpus, [lint_request(req.body, learner=learner) for req in corpus], learner)


@pytest.fixture(scope="session")
def held_out() -> Linted:
    """`prefixgate lint` on a corpus with another seed and the held-out phrasings."""
    corpus = build_corpus(seed=11, phrasing="holdout")
    learner = TemplateLearner()
    for req in corpus:
        learn_request(req.body, learner)
    learner.freeze()
    return Linted(corpus, [lint_request(req.body, learner=learner) for req in corpus], learner)


@pytest.fixture(scope="session")
def online(corpus: list[CorpusRequest]) -> Linted:
    """What the gateway does: one request at a time, learning as it goes."""
    learner = TemplateLearner()
    return Linted(corpus, [lint_request(req.body, learner=learner) for req in corpus], learner)
