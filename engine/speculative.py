"""Prompt-lookup (n-gram) speculative decoding: draft from the context, verify in one pass.

A decoding sequence whose last tokens also occur earlier in its own prompt or output (a file
being echoed with an edit, a JSON value copied from a tool result) most likely continues the way
that earlier occurrence did. `NgramIndex` finds the latest earlier occurrence of the longest
suffix (ngram_max down to ngram_min tokens) with a few dict lookups, and proposes the tokens that
followed it as a draft. The scheduler runs the last real token plus the draft through the model
as one short prefill on the paged KV; `verify_greedy` / `verify_sampled` decide how much of the
draft the target model agrees with:

- temperature 0: a draft token is kept while it equals the argmax of its row; the first
  disagreement is replaced by the argmax (so the output is exactly the non-speculative one);
- temperature > 0: the draft is a point mass q = delta(d), so the standard rejection rule keeps
  d with probability min(1, p(d) / q(d)) = p(d); on rejection the replacement is drawn from
  norm(max(p - q, 0)), i.e. p without d, renormalised. Every emitted token is then distributed
  exactly as p (Leviathan et al., 2023; Chen et al., 2023).

Either way one more token follows: the correction after a rejection, or a bonus token sampled
from the row after the last accepted draft token. `SpecState` keeps a sequence's index and
counters and backs off (skips drafting for a growing number of steps) while drafts keep failing
(fewer than 2 tokens accepted: on CPU a verification step costs about two decode steps), so a
prompt with nothing to copy pays almost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.sampler import Sampler, SamplingRow

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.sequence import Sequence

# A verification step costs ~2 decode steps on CPU (a 6-row matmul vs a 1-row one), so a
# draft pays only when at least 2 of its tokens are accepted; fewer counts as a failure.
MIN_USEFUL_ACCEPTED = 2
FAILURES_BEFORE_BACKOFF = 2  # consecutive failed drafts before drafting pauses
MIN_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64


class NgramIndex:
    """Where each n-gram (n_min <= n <= n_max) of a growing token list was last followed.

    For every n, `_tables[n - n_min]` maps an n-gram to the position of the token that followed
    its latest occurrence. The index follows a token list that only grows (a sequence's
    token_ids): `propose` first indexes the tokens appended since the last call, so each token
    costs (n_max - n_min + 1) dict insertions once, and each lookup at most as many dict reads,
    whatever the context length.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_min, n_max + 1)]
        self._indexed = 0  # tokens[:_indexed] are in the tables (as followers)

    def __len__(self) -> int:
        return self._indexed

    def sync(self, tokens: Seq[int]) -> None:
        """Index the tokens appended since the last call (`tokens` only ever grows)."""
        if len(tokens) < self._indexed:
            raise ValueError(f"token list shrank from {self._indexed} to {len(tokens)}")
        for i in range(max(self._indexed, 1), len(tokens)):  # token i follows the n-grams before it
            for n, table in enumerate(self._tables, start=self.n_min):
                if i < n:
                    break
                table[tuple(tokens[i - n : i])] = i
        self._indexed = len(tokens)

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (n_max down to n_min tokens); [] when no suffix occurred before."""
        self.sync(tokens)
        size = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            start = self._tables[n - self.n_min].get(tuple(tokens[size - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []


@dataclass(slots=True)
class SpecState:
    """One sequence's drafting state: its n-gram index, counters and back-off."""

    index: NgramIndex
    draft_tokens: int = 0  # draft tokens verified so far
    accepted_tokens: int = 0  # of those, accepted into the output
    steps: int = 0  # verification steps
    failures: int = 0  # consecutive drafts with fewer than MIN_USEFUL_ACCEPTED accepted
    backoff: int = 0  # length of the current pause (steps); doubles while drafts keep failing
    cooldown: int = 0  # decode steps left before the next draft

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """A draft of at most k tokens, or [] while backing off or when nothing matches."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return []
        return self.index.propose(tokens, k)

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verification; pause drafting after repeated failed drafts."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.steps += 1
        if accepted >= min(MIN_USEFUL_ACCEPTED, drafted):
            self.failures = 0
            self.backoff = 0
            return
        self.failures += 1
        if self.failures >= FAILURES_BEFORE_BACKOFF:
            self.failures = 0
            self.backoff = min(max(2 * self.backoff, MIN_BACKOFF_STEPS), MAX_BACKOFF_STEPS)
            self.cooldown = self.backoff


@dataclass(slots=True)
class Speculator:
    """The engine's drafting policy: which sequences draft, and how many tokens.

    A sequence drafts when the engine has speculation on, its request did not opt out, it is
    decoding (one uncomputed token), and its draft would fit under the step's token budget,
    `max_tokens` and the sequence's length limit.
    """

    num_speculative_tokens: int
    ngram_min: int
    ngram_max: int
    states_created: int = field(default=0)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Speculator | None:
        if config.speculative is None:
            return None
        return cls(config.num_speculative_tokens, config.ngram_min, config.ngram_max)

    def draft(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """Draft tokens for `seq`'s next step; `room` = step budget left beyond its one token."""
        if not seq.params.speculative or seq.num_uncomputed_tokens != 1:
            return ()
        if seq.grammar is not None:  # a grammar's mask is computed for one row per step
            return ()
        k = min(
            self.num_speculative_tokens,
            room,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            seq.max_len - seq.num_tokens - 1,
        )
        if k <= 0:
            return ()
        if seq.spec is None:
            seq.spec = SpecState(NgramIndex(self.ngram_min, self.ngram_max))
            self.states_created += 1
        return tuple(seq.spec.propose(seq.token_ids, k))


class Verdict(NamedTuple):
    """The outcome of verifying one draft: `tokens` = the accepted draft tokens, then one token
    from the target model (the correction, or the bonus token after a fully accepted draft)."""

    tokens: list[int]
    num_accepted: int
    num_drafted: int


def verify_greedy(targets: Seq[int], draft: Seq[int]) -> Verdict:
    """targets[j] = the argmax after draft[:j] (len(draft) + 1 of them)."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"{len(targets)} target tokens for a draft of {len(draft)}")
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return Verdict([*draft[:accepted], targets[accepted]], accepted, len(draft))


def verify_sampled(
    probs: torch.Tensor,  # [k + 1, V] float32: the target distribution after draft[:j], row j
    draft: Seq[int],  # k draft tokens
    generator: torch.Generator,
) -> Verdict:
    """The rejection rule for a point-mass draft: keep draft[j] with probability p_j(draft[j]);
    on rejection draw from p_j without draft[j]; after a full acceptance draw from p_k."""
    k = len(draft)
    if probs.shape[0] != k + 1:
        raise ValueError(f"{probs.shape[0]} distributions for a draft of {k}")
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    for j, token in enumerate(draft):
        p = float(probs[j, token])
        if uniforms[j] < p:
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p(token) rounded to < 1 but nothing else has mass
            return Verdict([*draft[:j], int(token)], j, k)
        pick = torch.multinomial(residual, 1, generator=generator)
        return Verdict([*draft[:j], int(pick)], j, k)
    bonus = torch.multinomial(probs[k], 1, generator=generator)
    return Verdict([*draft, int(bonus)], k, k)


def verify_draft(
    sampler: Sampler,
    seq: Sequence,
    draft: Seq[int],
    logits: torch.Tensor,  # [k + 1, V]: row j = the model's logits after draft[:j]
) -> Verdict:
    """Verify `seq`'s draft with its own sampling params: row j is adjusted (penalties) as if
    draft[:j] had been generated, then judged greedily or by the rejection rule."""
    out = seq.output_token_ids
    rows = [
        SamplingRow(seq.params, out + list(draft[:j]), seq.generator)
        for j in range(len(draft) + 1)
    ]
    adjusted = sampler.adjust(logits, rows)
    if seq.params.greedy:
        return verify_greedy(adjusted.argmax(dim=-1).tolist(), draft)
    return verify_sampled(sampler.probabilities(adjusted, rows), draft, seq.generator)
