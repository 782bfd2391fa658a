"""Per-rule precision and recall on the labelled corpus (tests/prompt_lint/lint_corpus.py)."""

from __future__ import annotations

from collections import Counter

from prompt_lint import Finding

from .lint_corpus import Label
from .lint_linted import Linted

DYNAMIC_RULES = {"timestamp": "PL001", "identifier": "PL002", "nonce": "PL003",
                 "learned": "PL008"}
STRUCTURAL_RULES = ("PL004", "PL006", "PL009")


def _overlaps(f: Finding, label: Label) -> bool:
    return f.path == label.path and f.start is not None and f.end is not None and \
        f.start < label.end and label.start < f.end


def score(linted: Linted) -> dict[str, tuple[float, float, int]]:
    """rule -> (precision, recall, support); `dynamic` is every dynamic rule together.

    A dynamic finding is a true positive when it overlaps an injected value;
    a label is recalled for its rule when a finding of that rule overlaps it.
    Structural rules are scored per request.
    """
    tp, fp, fn, support = Counter(), Counter(), Counter(), Counter()
    for req, rep in zip(linted.corpus, linted.reports, strict=True):
        dyn = [f for f in rep.findings if f.rule in DYNAMIC_RULES.values()]
        for f in dyn:
            hit = any(_overlaps(f, lb) for lb in req.labels)
            for key in (f.rule, "dynamic"):
                (tp if hit else fp)[key] += 1
        for lb in req.labels:
            rule = DYNAMIC_RULES[lb.kind]
            hits = [f for f in dyn if _overlaps(f, lb)]
            support[rule] += 1
            support["dynamic"] += 1
            fn[rule] += not any(f.rule == rule for f in hits)
            fn["dynamic"] += not hits
        got = {f.rule for f in rep.findings}
        for rule in STRUCTURAL_RULES:
            support[rule] += rule in req.structural
            if rule in got:
                (tp if rule in req.structural else fp)[rule] += 1
            elif rule in req.structural:
                fn[rule] += 1
    out = {}
    for rule in sorted(support):
        found = tp[rule] + fp[rule]
        recalled = support[rule] - fn[rule]
        out[rule] = (tp[rule] / found if found else 1.0,
                     recalled / support[rule] if support[rule] else 1.0, support[rule])
    return out


def test_corpus_covers_every_rule_and_format(two_pass: Linted) -> None:
    kinds = Counter(lb.kind for req in two_pass.corpus for lb in req.labels)
    structural = Counter(r for req in two_pass.corpus for r in req.structural)
    providers = Counter(req.provider for req in two_pass.corpus)
    assert min(kinds[k] for k in DYNAMIC_RULES) >= 20, kinds
    assert min(structural[r] for r in STRUCTURAL_RULES) >= 5, structural
    assert providers["openai"] >= 50 and providers["anthropic"] >= 50, providers


def test_two_pass_precision_recall(two_pass: Linted) -> None:
    scores = score(two_pass)
    for rule, (precision, recall, support) in scores.items():
        print(f"{rule:8} precision {precision:.3f} recall {recall:.3f} support {support}")
    assert scores["dynamic"][0] >= 0.95 and scores["dynamic"][1] >= 0.95, scores["dynamic"]
    for rule in (*DYNAMIC_RULES.values(), *STRUCTURAL_RULES):
        assert scores[rule][0] >= 0.95 and scores[rule][1] >= 0.95, (rule, scores[rule])


def test_online_precision_recall(online: Linted) -> None:
    """One pass: learned spans are missed until a family has shown variation."""
    scores = score(online)
    for rule, (precision, recall, support) in scores.items():
        print(f"online {rule:8} precision {precision:.3f} recall {recall:.3f} support {support}")
    assert scores["dynamic"][0] >= 0.95 and scores["dynamic"][1] >= 0.95, scores["dynamic"]
    for rule in ("PL001", "PL002", "PL003"):
        assert scores[rule][1] >= 0.95, (rule, scores[rule])
    assert scores["PL008"][1] >= 0.6, scores["PL008"]


def test_stable_lookalikes_are_never_flagged(two_pass: Linted) -> None:
    """No dynamic finding lands on a stable line (versions, ports, code, ratios, RFCs)."""
    from prompt_lint.rewrite import get_path

    from .lint_corpus import FILLER, STABLE_LINES

    prefixes = tuple(p for p in (line.split("{")[0] for line in [*STABLE_LINES, FILLER]) if p)
    checked = 0
    for req, rep in zip(two_pass.corpus, two_pass.reports, strict=True):
        text = get_path(req.body, "system[0].text" if req.provider == "anthropic"
                        else "messages[0].content")
        checked += sum(line.startswith(prefixes) for line in text.split("\n"))
        for f in rep.findings:
            if f.start is None or f.rule not in DYNAMIC_RULES.values():
                continue
            source = get_path(req.body, f.path)
            line = source[source.rfind("\n", 0, f.start) + 1:].split("\n", 1)[0]
            assert not line.startswith(prefixes), (f, line)
    assert checked > 1000


def test_clean_family_has_no_dynamic_findings(two_pass: Linted) -> None:
    clean = [(req, rep) for req, rep in zip(two_pass.corpus, two_pass.reports, strict=True)
             if not req.labels]
    assert len(clean) >= 10
    for _, rep in clean:
        assert not [f for f in rep.findings if f.rule in DYNAMIC_RULES.values()], rep.findings


def test_families_match_generator_families(two_pass: Linted) -> None:
    """Each generated template maps to exactly one learned family and vice versa."""
    pairs = {(req.family, rep.family) for req, rep in zip(two_pass.corpus, two_pass.reports,
                                                          strict=True)}
    assert None not in {fam for _, fam in pairs}
    assert len(pairs) == len({g for g, _ in pairs}) == len({f for _, f in pairs})
