"""Template learning: the spans that vary inside a request's prompt family.

`TemplateLearner` finds a request's family through its `FamilyIndex`
(`prompt_lint.family_index`: masked line hashes and word-pair samples, matched
by Jaccard similarity, or a new family founded), then learns here. Each
family keeps, per path, the founding request's lines as a reference, and marks
reference words that were seen to differ as dynamic. A new request is aligned
to the reference line by line, then word by word inside changed lines; words
that differ, or sit on a known-dynamic word, are learned dynamic spans.
Pattern-detected values are compared like any other text: the family's
requests are the evidence.

Evidence per value (a run of reference words) also says how it varies: a value
that changed between two requests of one session varies per request; a value
that varies across sessions but never inside one is session-scoped (its learned
spans carry `scope="session"`), even on a line whose other value (a timestamp)
changes every request. Once a family has seen two sessions and two
requests of one session, a path whose template is known is *settled*:
anything on it that did not vary is stable, whatever it looks like
(FamilyMatch.settled); with two sessions but no repeat yet it is *partial*
(a value the same in both may still be a per-request counter), unless the
learner is frozen: then it has seen the whole log, and a value that is the
same in every request of the family is stable.

Memory is bounded by bytes (`LearnerConfig`: `family_bytes` for the families,
`memo_bytes` for the learner's memos, `session_bytes` for its SessionTracker)
and by counts: at most `max_families` families (least recently used is
dropped), `max_template_chars` characters of reference per family, and
`max_lines` indexed lines per family. Online: every `observe` call both
answers and learns, unless the learner is frozen (two-pass use on a log:
learn everything, `freeze()`, then lint). Not thread-safe: one learner per
thread or tenant.
"""

from __future__ import annotations

from itertools import compress
from operator import ne
from typing import Any

from prompt_lint.align import line_offsets, line_pairs, region, value_groups, word_opcodes, words
from prompt_lint.detectors import Span
from prompt_lint.family import (  # the learner's data types, re-exported here
    _SESSIONS_PER_FAMILY,
    Family,
    FamilyMatch,
    LearnedSpan,
    LearnerConfig,
    LineSpan,
    LineValues,
    TextSpan,
    _Template,
)
from prompt_lint.family_index import _HASH_BYTES, FamilyIndex, _Key, masked_text
from prompt_lint.incremental import shared_bounds
from prompt_lint.memo import LRU, caching, text_bytes
from prompt_lint.providers import Segment
from prompt_lint.session import SessionTracker

__all__ = ["Family", "FamilyMatch", "LearnedSpan", "LearnerConfig", "TemplateLearner",
           "masked_text", "template_key"]

_EVIDENCE_BYTES = 512  # one session's evidence entry: its dicts, before their lines
_VALUE_BYTES = 128  # one value of a changed line in it: (word, hash) tuple, its ints


def template_key(path: str, tool_names: list[str]) -> str:
    """`tools[2].description` -> `tool:<name>.description`; other paths unchanged."""
    if not path.startswith("tools["):
        return path
    index, _, rest = path[6:].partition("]")
    i = int(index)
    return f"tool:{tool_names[i]}{rest}" if i < len(tool_names) else path


class TemplateLearner:
    """Online prompt-family learner with bounded memory; also holds session state.

    `sessions` is the SessionTracker that lint_request and rewrite_request use
    for cross-request checks (history append-only) and for keeping rewritten
    history byte-identical; the gateway keeps one learner per tenant, the CLI
    one per log.
    """

    def __init__(self, max_families: int = 256, max_template_chars: int = 262_144,
                 max_lines: int = 4096, min_similarity: float = 0.5,
                 max_sessions: int = 4096, config: LearnerConfig | None = None) -> None:
        self.config = config or LearnerConfig(max_families, max_template_chars, max_lines,
                                              min_similarity, max_sessions)
        cfg = self.config
        self.index = FamilyIndex(cfg)  # finds and founds families; `families` is its store
        self.families: LRU[str, Family] = self.index.families
        self.sessions = SessionTracker(max_sessions=cfg.max_sessions,
                                       max_bytes=cfg.session_bytes)
        self.frozen = False

    def memos(self) -> dict[str, LRU[Any, Any]]:
        """The byte-bounded stores by name (for accounting and tests)."""
        return {**self.index.memos(), **self.sessions.memos()}

    def freeze(self) -> None:
        """Stop learning: later observe() calls answer but change no template."""
        self.frozen = True

    def observe(self, targets: list[Segment], spans: dict[str, list[Span]],
                tool_names: list[str], session: str | None = None) -> FamilyMatch:
        """Assign a request to a family and return its learned dynamic spans.

        `targets`: the request's template strings; `spans`: pattern spans per
        target path (masked before hashing); `tool_names`: as sent, so that a
        tool's description template follows the tool when the order changes;
        `session`: the conversation the request belongs to (within-session
        evidence; None learns no session evidence).
        """
        keys = {t.path: template_key(t.path, tool_names) for t in targets}
        lines: dict[str, list[str]] = {}
        parts: list[_Key] = []
        for target in targets:
            lines[target.path], part = self.index.masked(target, spans.get(target.path, []))
            parts.append(part)
        key = self.index.request_key(tool_names, parts)
        family = self.index.match(key)
        if family is None:
            if self.frozen:
                return FamilyMatch(None, [])
            family = self.index.found(key, targets, lines, keys)
        self.families.get(family.id)  # now the most recently used
        if not self.frozen:
            family.requests += 1
        for target in targets:
            self._align(family, target, keys[target.path])
        if session is not None and not self.frozen:
            self._session_evidence(family, session, [keys[t.path] for t in targets])
        out: list[LearnedSpan] = []
        settled: list[str] = []
        partial: list[str] = []
        for target in targets:
            template = family.templates.get(keys[target.path])
            if template is not None:
                out += _spans_of(template, target.path, family.settled)
                if family.settled and (template.repeats > 0 or self.frozen):
                    settled.append(target.path)
                elif family.settled:
                    partial.append(target.path)
        return FamilyMatch(family, out, frozenset(settled), frozenset(partial))

    def _session_evidence(self, family: Family, session: str, keys: list[str]) -> None:
        """Compare each template's differing lines with this session's last request:
        lines that changed inside the session vary per request."""
        if len(family.sessions) < 2:
            family.sessions.add(session)
        now = {key: family.templates[key].last_differ for key in keys
               if key in family.templates}
        before = family.session_lines.get(session)
        family.session_lines[session] = now
        family.session_lines.move_to_end(session)
        family.session_bytes[session] = text_bytes(session) + _EVIDENCE_BYTES + \
            sum(_evidence_bytes(lines) for lines in now.values() if lines)
        if len(family.session_lines) > _SESSIONS_PER_FAMILY:
            dropped, _ = family.session_lines.popitem(last=False)
            family.session_bytes.pop(dropped, None)
        self.families.reweigh(family.id, family.held_bytes)
        if before is None:
            return
        for key, lines in now.items():
            old = before.get(key, None)
            if lines is None or old is None:
                continue
            template = family.templates[key]
            template.repeats += 1
            if lines != old:
                for i, k in _changed_values(lines, old):
                    template.within.setdefault(i, set()).add(k)

    def _align(self, family: Family, target: Segment, key: str) -> None:
        """Diff the target against its template (learning), caching the answer on the text."""
        template = family.templates.get(key)
        if template is None:
            return
        if target.text != template.last_text or not template.last_text:
            found = self._diff_since(template, target.text)
            template.last_spans, template.last_differ = found or self._diff(template,
                                                                              target.text)
            template.last_text = target.text

    def _diff_since(self, template: _Template, text: str
                    ) -> tuple[list[TextSpan], dict[int, LineValues]] | None:
        """_diff by updating the last answer: only the lines that hold characters that
        changed since the last text are diffed again (a new timestamp re-diffs one line
        of a long prompt). None when the line count changed: then diff it whole."""
        old, before = template.last_text, template.last_differ
        if not old or before is None or not caching():
            return None
        a, b = shared_bounds(old, text)
        if old.count("\n", a, len(old) - b) != text.count("\n", a, len(text) - b):
            return None
        first = old.count("\n", 0, a)
        start = text.rfind("\n", 0, a) + 1
        stop = text.find("\n", len(text) - b)
        lines = text[start: len(text) if stop < 0 else stop].split("\n")
        last, delta = first + len(lines) - 1, len(text) - len(old)
        out = [(s, e, i, lo, hi) if i < first else (s + delta, e + delta, i, lo, hi)
               for s, e, i, lo, hi in template.last_spans if i < first or i > last]
        differ = dict(before)
        ref, pos = template.lines, start
        for i, line in enumerate(lines, start=first):
            differ.pop(i, None)
            if line != ref[i] or i in template.dynamic:
                found, values = self._diff_line(template, i, ref[i], line)
                out += [(pos + s, pos + e, i, lo, hi) for s, e, lo, hi in found]
                if line != ref[i]:
                    differ[i] = values
            pos += len(line) + 1
        return sorted(out), differ

    def _diff(self, template: _Template,
              text: str) -> tuple[list[TextSpan], dict[int, LineValues] | None]:
        """Learned spans (start, end, reference line or -1, the value's reference words)
        and, when the lines align one to one, the values of the lines that differ from the
        reference."""
        new = text.split("\n")
        ref = template.lines
        differ: dict[int, LineValues] | None = None
        if len(new) == len(ref):
            differ = {}
            unlike = compress(range(len(new)), map(ne, ref, new))
            pairs = [(i, i) for i in sorted(template.dynamic.keys() | set(unlike))]
            extra: list[int] = []
        else:
            pairs, extra = line_pairs(ref, new)
        if not pairs and not extra:
            return [], differ
        offsets = line_offsets(new)
        out = [(offsets[j], offsets[j] + len(new[j]), -1, -1, -1)
               for j in extra if new[j].strip()]
        for i, j in pairs:
            found, values = self._diff_line(template, i, ref[i], new[j])
            out += [(offsets[j] + s, offsets[j] + e, i, lo, hi) for s, e, lo, hi in found]
            if differ is not None and new[j] != ref[i]:
                differ[i] = values
        return sorted(out), differ

    def _diff_line(self, template: _Template, i: int, ref: str,
                   new: str) -> tuple[list[LineSpan], LineValues]:
        known = template.dynamic.get(i, set())
        if ref == new and not known:
            return [], ()
        memo = template.line_memo.get(i)
        if memo is not None and memo[0] == new and memo[1] == len(known) and caching():
            return memo[2]
        found = self._align_line(template, i, ref, new, known)
        template.line_memo[i] = (new, len(template.dynamic.get(i, ())), found)
        return found

    def _align_line(self, template: _Template, i: int, ref: str, new: str,
                    known: set[int]) -> tuple[list[LineSpan], LineValues]:
        """Word-align one changed line; learns its changed words unless frozen. Returns
        its spans and its values: per run of words unlike the reference, the first
        reference word it replaces and the hash of its text (the session evidence)."""
        rw, nw = words(ref), words(new)
        pieces: list[tuple[int, int, int]] = []  # (reference word, start, end) in `new`
        changed: set[int] = set()
        values: dict[int, int] = {}
        if ref == new:
            pieces = [(k, *nw[k]) for k in sorted(known) if k < len(nw)]
        for op, i1, i2, j1, j2 in word_opcodes(ref, new, rw, nw):
            if op == "equal":
                pieces += [(k, *nw[j1 + k - i1]) for k in range(i1, i2) if k in known]
                continue
            at = i1 if i2 > i1 else max(i1 - 1, 0)
            changed.update(range(i1, i2) if i2 > i1 else [at])
            text = new[nw[j1][0]:nw[j2 - 1][1]] if j2 > j1 else ""
            values[at] = hash((values.get(at), text))
            if j2 > j1:
                pieces.append((i1, nw[j1][0], nw[j2 - 1][1]))
        if not self.frozen and changed:
            template.dynamic.setdefault(i, set()).update(changed)
        dynamic = known | changed
        groups = value_groups(pieces, dynamic)
        found = region(rw, nw, ref, new, dynamic) if len(groups) < 2 else None
        spans = [(*found, min(dynamic), max(dynamic))] if found is not None else [
            (min(s for _, s, _ in g), max(e for _, _, e in g), lo, hi) for (lo, hi), g in groups]
        return [span for span in spans if span[1] > span[0]], tuple(sorted(values.items()))


def _spans_of(template: _Template, path: str, settled: bool) -> list[LearnedSpan]:
    """The template's last learned spans with their scope from the evidence so far: a
    value is session-scoped when no reference word of it changed inside a session."""
    session_ok = settled and template.repeats > 0
    return [LearnedSpan(path, s, e, "session" if session_ok and i >= 0 and
                        not _changed_within(template, i, lo, hi) else "request")
            for s, e, i, lo, hi in template.last_spans]


def _changed_within(template: _Template, line: int, first: int, last: int) -> bool:
    """Whether a value on `line` (reference words `first`..`last`) changed inside a session."""
    return any(first <= k <= last for k in template.within.get(line, ()))


def _changed_values(now: dict[int, LineValues],
                    old: dict[int, LineValues]) -> set[tuple[int, int]]:
    """(line, reference word) of each value that differs between two requests' evidence (a
    line unlike the reference in only one of them differs in all its values)."""
    a = {(i, k): h for i, values in now.items() for k, h in values}
    b = {(i, k): h for i, values in old.items() for k, h in values}
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


def _evidence_bytes(lines: dict[int, LineValues]) -> int:
    """Estimated bytes of one template's evidence in a session: its lines and their values."""
    return _HASH_BYTES * 2 * len(lines) + _VALUE_BYTES * sum(map(len, lines.values()))
