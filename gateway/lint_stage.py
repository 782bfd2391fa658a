"""The lint step of a request: off | report | rewrite, with online template learning per tenant.

report: prompt_lint's findings are attached (x-prefixgate-lint header, stats) and the body is
served unchanged. rewrite: the body that reaches the backend is prompt_lint's rewrite (stable
parts first, dynamic parts after the cache boundary). A failure inside prompt_lint never fails a
request: it is logged and the original body is served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import prompt_lint
from gateway.config import LINT_MODES, LintMode
from gateway.errors import invalid
from gateway.types import LayoutShare, Provider
from prompt_lint.checks import min_cacheable_tokens
from prompt_lint.layout import TokenLayout, rule_layout, token_layout
from prompt_lint.templates import LearnerConfig
from prompt_lint.tokens import DEFAULT_ENCODING, shared_counter

log = logging.getLogger("prefixgate.lint")
MODE_HEADER = "x-prefixgate-lint-mode"


@dataclass(frozen=True, slots=True)
class LintOutcome:
    """What the lint step decided for one request."""

    body: dict[str, Any]  # the body to serve (rewritten in rewrite mode)
    lint_ids: tuple[str, ...]  # distinct rule ids of the findings, sorted
    family: str | None
    changed: bool  # True when the rewrite changed the body


def request_mode(header: str | None, default: LintMode) -> LintMode:
    """The lint mode of one request: the header when present, else the gateway's default."""
    if header is None or header == "":
        return default
    mode = header.strip().lower()
    if mode not in LINT_MODES:
        raise invalid(f"header {MODE_HEADER} must be one of {LINT_MODES}", MODE_HEADER)
    return mode  # type: ignore[return-value]


def learner_config(learner_bytes: int) -> LearnerConfig:
    """A learner's byte budgets from its total: 3/5 families, 1/5 memos, 1/5 sessions."""
    if learner_bytes < 8:
        raise ValueError(f"learner_bytes must be >= 8, got {learner_bytes}")
    fifth = learner_bytes // 5
    return LearnerConfig(family_bytes=learner_bytes - 2 * fifth, memo_bytes=fifth,
                         session_bytes=fifth)


class LintStage:
    """Runs prompt_lint over live traffic, one TemplateLearner per tenant, each within
    `learner_bytes` (tenants are the configured API keys' tenants, so their count is bounded)."""

    def __init__(self, learner_bytes: int = 20 << 20) -> None:
        self.learners: dict[str, prompt_lint.TemplateLearner] = {}
        self.config = learner_config(learner_bytes)

    def learner(self, tenant: str) -> prompt_lint.TemplateLearner:
        """The tenant's learner (made on first use)."""
        if tenant not in self.learners:
            self.learners[tenant] = prompt_lint.TemplateLearner(config=self.config)
        return self.learners[tenant]

    def run(
        self, body: dict[str, Any], provider: Provider, tenant: str, mode: LintMode,
        share: LayoutShare | None = None,
    ) -> LintOutcome:
        """Lint (and in rewrite mode rewrite) one client body (`share`: where the request's
        token layout is taken from when its tokens were counted already, else left for the
        shadow's tokens that come after)."""
        if mode == "off" or "messages" not in body:  # a legacy completion's prompt: no layout
            return LintOutcome(body, (), None, False)
        try:
            return self._run(body, provider, tenant, mode, share)
        except Exception:  # noqa: BLE001 - linting must never break serving
            log.exception("prompt_lint failed; serving the request unchanged")
            return LintOutcome(body, (), None, False)

    def _run(
        self, body: dict[str, Any], provider: Provider, tenant: str, mode: LintMode,
        share: LayoutShare | None,
    ) -> LintOutcome:
        learner = self.learner(tenant)
        layout = share.take(body) if share is not None else None
        if layout is None and share is not None:  # the first to lay the body out
            layout = self._layout(body, provider, mode)
            share.leave(body, layout)
        # the route's parser validated the body, more strictly than prompt_lint would
        report = prompt_lint.lint_request(body, provider, learner=learner, layout=layout,
                                          validated=True)
        ids = tuple(sorted({f.rule for f in report.findings}))
        family = report.family
        if mode != "rewrite":
            return LintOutcome(body, ids, family, False)
        result = prompt_lint.rewrite_request(body, provider, report=report, learner=learner)
        return LintOutcome(result.body, ids, family, bool(result.changed))

    @staticmethod
    def _layout(body: dict[str, Any], provider: Provider, mode: LintMode) -> TokenLayout:
        """The body's token layout for lint: in report mode only the rule ids are kept, so the
        messages past the provider's minimum are estimated, neither tokenized nor looked up
        (`rule_layout`; the shadow's tokens, after the answer, tokenize what is new); a rewrite
        counts every segment."""
        counter = shared_counter(DEFAULT_ENCODING)
        if mode != "report":
            return token_layout(body, provider, counter)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return rule_layout(body, provider, counter, min_cacheable_tokens(provider, model))
