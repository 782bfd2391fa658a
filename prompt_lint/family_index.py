"""Finding a request's prompt family: the keys requests are matched by, and the indexes.

A request's template material (system prompt, tool descriptions, tool names)
is cut into lines. Lines with pattern-detected values masked are hashed, a long
line's two ends on their own as well (a value no pattern names changes a line's
hash, not its ends), and so is a sample of the masked text's word pairs
(`prompt_lint.pairs`: a value changes only the pairs around it, wherever it sits
on its line). A request joins the family whose hashes it shares most (Jaccard
similarity >= `min_similarity` of the line hashes and pair samples together, or
of the line hashes alone where that is higher), or founds a new one.

`FamilyIndex` owns what that takes: the families (an LRU bounded by
`LearnerConfig.max_families` and `family_bytes`), the indexes from a line hash or
a pair hash to the families holding it (a dropped family leaves them), and the
memos of masked texts, request keys and recent matches (`memo_bytes`). It is
apart from `prompt_lint.templates`, which learns what varies inside a family
once one is found, because finding a family needs none of that alignment: the
learner asks for a request's family and gets one, a new one founded with the
request's texts as its templates' references.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from prompt_lint.detectors import Span
from prompt_lint.family import Family, LearnerConfig, _Template
from prompt_lint.memo import LRU, text_bytes
from prompt_lint.pairs import merge_samples, pair_sample
from prompt_lint.providers import Segment

__all__ = ["FamilyIndex", "masked_text"]

#: Similarity a family with other tool names needs to take a request (one with the same tools
#: needs `LearnerConfig.min_similarity`): the same prompt up to its values, not a shared part.
OTHER_TOOLS_SIMILARITY = 0.9
#: Line hashes probed in the index to find candidate families (then scored exactly).
_PROBES = 48
#: Characters at each end of a long line that are hashed on their own (`_line_hashes`).
_END_CHARS = 32
_MASK_CACHE = 4096
#: Byte estimates: a line (str header, list slot), a line hash (boxed int, set slot), a
#: family's fixed part, and the copies of a reference text a template may hold (its lines,
#: the last text aligned, one remembered line per changed line). A family's weight grows
#: with its session evidence (`Family.held_bytes`).
_LINE_BYTES = 64
_HASH_BYTES = 56
_FAMILY_BYTES = 4096
_TEMPLATE_COPIES = 3


class _Key(NamedTuple):
    """What a request (or one of its strings) is matched to families by: its line hashes
    and its word-pair sample; for a request, also the set of its tool names (`tools`): only
    a family with the same tools can hold it."""

    lines: frozenset[int]
    pairs: frozenset[int]
    tools: frozenset[str] = frozenset()


def masked_text(text: str, spans: list[Span]) -> str:
    """`text` with pattern spans replaced by their kind."""
    if not spans:
        return text
    parts, pos = [], 0
    for s in spans:
        parts += [text[pos:s.start], f"\x00{s.kind}\x00"]
        pos = s.end
    return "".join(parts) + text[pos:]


def _line_hashes(lines: list[str]) -> frozenset[int]:
    """The hashes a request is matched to families by: each non-blank line's, and for a line
    longer than two ends, its first and its last `_END_CHARS` characters' too. A line whose
    middle holds a value no pattern names (a user handle, an account number) differs by its
    whole hash from request to request, but keeps its ends: without them a one-line system
    prompt with such a value matched no family at all (each request founded its own, and the
    value was never seen to vary)."""
    out = set()
    for line in lines:
        if not line.strip():
            continue
        out.add(hash(line))
        if len(line) > 2 * _END_CHARS:
            out.add(hash(("head", line[:_END_CHARS])))
            out.add(hash(("tail", line[-_END_CHARS:])))
    return frozenset(out)


class FamilyIndex:
    """A learner's families, found by line and pair hashes; bounded by `config`.

    `families` is state, not a memo: set_caching(False) leaves it on, and a family it
    drops leaves the indexes `lines` and `pairs` (hash -> ids of the families holding it).
    """

    def __init__(self, config: LearnerConfig) -> None:
        self.config = config
        self.families: LRU[str, Family] = LRU(config.max_families, config.family_bytes,
                                              evicted=self._unindex, switchable=False)
        self.lines: dict[int, set[str]] = {}
        self.pairs: dict[int, set[str]] = {}
        self._recent: LRU[_Key, str] = LRU(4 * config.max_families, config.memo_bytes // 4)
        self._masks: LRU[str, tuple[list[str], _Key]] = LRU(_MASK_CACHE,
                                                            config.memo_bytes // 2)
        self._sets: LRU[tuple[tuple[str, ...], tuple[_Key, ...]], _Key] = \
            LRU(_MASK_CACHE, config.memo_bytes // 4)

    def memos(self) -> dict[str, LRU[Any, Any]]:
        """The byte-bounded stores by name: the families and the matching memos."""
        return {"families": self.families, "recent": self._recent, "masks": self._masks,
                "sets": self._sets}

    def masked(self, target: Segment, spans: list[Span]) -> tuple[list[str], _Key]:
        """Masked lines of a target, their hashes and its word-pair sample, cached on the
        masked text (tool texts repeat; a system prompt that differs only in detected
        values masks the same)."""
        text = masked_text(target.text, spans)
        found = self._masks.get(text)
        if found is None:
            masked = text.split("\n")
            found = (masked, _Key(_line_hashes(masked), pair_sample(text)))
            # the text, its lines (as many characters again, a header each), the hash sets
            weight = 2 * text_bytes(text) + _LINE_BYTES * len(masked) + \
                _HASH_BYTES * (len(found[1].lines) + len(found[1].pairs))
            self._masks.put(text, found, weight)
        return found

    def request_key(self, tool_names: list[str], parts: list[_Key]) -> _Key:
        """The request's line hashes (tool names and masked lines, at most `max_lines`) and
        word-pair sample, cached on the per-target keys (the same objects while the masks
        memo holds them)."""
        key = (tuple(tool_names), tuple(parts))
        found = self._sets.get(key)
        if found is not None:
            return found
        hashes: set[int] = {hash("\x00tool\x00" + name) for name in tool_names}
        for part in parts:
            hashes |= part.lines
        if len(hashes) > self.config.max_lines:
            hashes = set(list(hashes)[: self.config.max_lines])
        found = _Key(frozenset(hashes), merge_samples(part.pairs for part in parts),
                     frozenset(tool_names))
        weight = sum(map(text_bytes, tool_names)) + _HASH_BYTES * (
            _key_size(found) + sum(map(_key_size, parts)))
        return self._sets.put(key, found, weight)

    def match(self, key: _Key) -> Family | None:
        """_match, memoised on the exact key (requests of a family mostly repeat it)."""
        fid = self._recent.get(key)
        found = self.families.peek(fid) if fid is not None else None
        if found is not None:
            return found
        family = self._match(key)
        if family is not None:
            self._recent.put(key, family.id, _HASH_BYTES * _key_size(key) + 256)
        return family

    def _match(self, key: _Key) -> Family | None:
        """The family most like the request among those with its tool names: the Jaccard
        similarity of their line hashes and word-pair samples together, or of their line
        hashes alone where that is higher (the samples only add matches: a request that
        shares enough lines joins as it did without them, whatever its value does to the
        pairs). A family with other tools takes the request only at `OTHER_TOOLS_SIMILARITY`:
        two agents whose prompts share a long preamble and differ in their first words (a
        coder and a reviewer) were one family, where each agent's own words, the same in all
        its sessions, were a session-scoped value that fix moved out of the system prompt;
        an agent that adds a tool to one request keeps its prompt, and its family."""
        candidates: set[str] = set()
        for h in sorted(key.lines)[:_PROBES]:
            candidates.update(self.lines.get(h, ()))
        for h in key.pairs:
            candidates.update(self.pairs.get(h, ()))
        best: dict[bool, tuple[float, str]] = {}  # same tools or not -> (score, family id)
        for fid, family in zip(candidates, map(self.families.peek, candidates), strict=True):
            if family is None:
                continue
            score = _similarity(key, _Key(family.line_hashes, family.pair_sample))
            same = family.tools == key.tools
            if same not in best or (-score, fid) < (-best[same][0], best[same][1]):
                best[same] = (score, fid)
        for same, floor in ((True, self.config.min_similarity), (False, OTHER_TOOLS_SIMILARITY)):
            if same in best and best[same][0] >= floor:
                return self.families.peek(best[same][1])
        return None

    def found(self, key: _Key, targets: list[Segment],
              lines: dict[str, list[str]], keys: dict[str, str]) -> Family:
        """Found a family on this request: its masked `lines` name it, its targets (at most
        `max_template_chars` of them) are its templates' references, under `keys`."""
        skeleton = "\x01".join(f"{p}\x02" + "\n".join(ls) for p, ls in sorted(lines.items()))
        # lone surrogates (a library caller's dict may hold one) hash like other text
        fid = hashlib.blake2b(skeleton.encode("utf-8", "surrogatepass"),
                              digest_size=6).hexdigest()
        while fid in self.families:  # same skeleton but below similarity: keep ids unique
            fid = hashlib.blake2b(fid.encode(), digest_size=6).hexdigest()
        hashes = key.lines
        family = Family(fid, hashes, pair_sample=key.pairs, tools=key.tools)
        for target in targets:
            if family.chars + len(target.text) <= self.config.max_template_chars:
                family.templates[keys[target.path]] = _Template(target.text.split("\n"))
                family.chars += len(target.text)
                family.bytes += _TEMPLATE_COPIES * text_bytes(target.text) + \
                    2 * _LINE_BYTES * (target.text.count("\n") + 1)
        family.bytes += _FAMILY_BYTES + 2 * _HASH_BYTES * _key_size(key)  # its hashes, the index
        for h in hashes:
            self.lines.setdefault(h, set()).add(fid)
        for h in key.pairs:
            self.pairs.setdefault(h, set()).add(fid)
        self.families.put(fid, family, family.held_bytes)
        if fid not in self.families:  # heavier than the whole budget: not kept
            self._unindex(fid, family)
        return family

    def _unindex(self, fid: str, family: Family) -> None:
        """Remove a dropped family from the line and pair indexes."""
        for index, hashes in ((self.lines, family.line_hashes),
                              (self.pairs, family.pair_sample)):
            for h in hashes:
                owners = index.get(h)
                if owners is not None:
                    owners.discard(fid)
                    if not owners:
                        del index[h]


def _similarity(a: _Key, b: _Key) -> float:
    """max(Jaccard of the line hashes, Jaccard of line hashes and pair samples together);
    0.0 for two empty keys."""
    lines = len(a.lines & b.lines)
    both = lines + len(a.pairs & b.pairs)
    return max(lines / max(len(a.lines) + len(b.lines) - lines, 1),
               both / max(_key_size(a) + _key_size(b) - both, 1))


def _key_size(key: _Key) -> int:
    """Hashes in a key (its line hashes and its sample)."""
    return len(key.lines) + len(key.pairs)
