"""Sampler: turns one step's logits into one next token per sequence, each with its own params.

Order per row: the grammar mask (tokens a constrained row's grammar forbids -> -inf), then
the row's logit bias (a forbidden token stays -inf), then presence/frequency penalties (over
the generated tokens) -> greedy argmax when temperature is 0, else temperature -> top-k ->
top-p -> a draw from the row's own torch.Generator. The pure functions below are the whole
algorithm; `Sampler` only batches them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.grammar import apply_token_bitmask
from engine.sampling_params import SamplingParams


class SamplingRow(NamedTuple):
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    generator: torch.Generator


def apply_penalties(
    logits: torch.Tensor,  # [N, V] float32
    output_token_ids: Sequence[Sequence[int]],  # N lists of generated tokens
    presence: torch.Tensor,  # [N] float32
    frequency: torch.Tensor,  # [N] float32
) -> torch.Tensor:
    """OpenAI penalties: logit -= frequency * count + presence * (count > 0)."""
    vocab = logits.shape[-1]
    counts = torch.zeros_like(logits)  # [N, V]
    for row, ids in enumerate(output_token_ids):
        if ids:
            index = torch.as_tensor(list(ids), dtype=torch.int64, device=logits.device)
            counts[row] = torch.bincount(index, minlength=vocab).to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_logit_bias(
    logits: torch.Tensor,  # [N, V] float32
    biases: Sequence[tuple[tuple[int, float], ...]],  # N rows of (token id, bias) pairs
) -> torch.Tensor:
    """A copy of `logits` with each row's biases added to its tokens' logits."""
    rows = [row for row, pairs in enumerate(biases) for _ in pairs]
    tokens = [token for pairs in biases for token, _ in pairs]
    values = [bias for pairs in biases for _, bias in pairs]
    out = logits.clone()
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        out.index_put_(index, torch.tensor(values, dtype=out.dtype, device=device),
                       accumulate=True)
    return out


def apply_top_k_top_p(
    logits: torch.Tensor,  # [N, V] float32 (already divided by temperature)
    top_k: torch.Tensor,  # [N] int64, 0 = keep all
    top_p: torch.Tensor,  # [N] float32 in (0, 1], 1 = keep all
) -> torch.Tensor:
    """Mask (-inf) every token outside the row's top-k, then outside its top-p nucleus.

    Top-k keeps every token whose logit ties the k-th largest. Top-p keeps, in descending
    order of probability after top-k, each token whose preceding probability mass is < top_p
    (the smallest set that reaches top_p; the most likely token always stays).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
    keep = sorted_logits >= kth
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    masked_sorted = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked_sorted)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One multinomial draw per row [N, V] -> [N], each from its own generator."""
    picks = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    return torch.cat(picks)


class Sampler:
    """Samples the next token of each row of a batch, honouring per-row `SamplingParams`.

    `adjust` and `probabilities` are the two halves of `__call__`, public for speculative
    verification (engine.speculative), which needs the target distribution of several rows of
    one sequence rather than one draw per row. `argmax`, when given, replaces
    `logits.argmax(dim=-1)` for CPU logits (the native library's: torch's walks a row one
    element at a time, ~0.1 ms per row of a 49k-token vocabulary).
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._argmax = argmax

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> list[int]:
        """logits [N, V] float32, one row per sequence -> N token ids.

        bitmask: optional [N, ceil(V / 32)] int32 allowed-token bits (all ones for an
        unconstrained row), from `engine.grammar`."""
        logits = self.adjust(logits, rows, bitmask)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_rows) == len(rows):  # no greedy row: no argmax to take
            tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        elif self._argmax is not None and logits.is_cpu:
            tokens = self._argmax(logits)
        else:
            tokens = logits.argmax(dim=-1)  # [N]
        if random_rows:
            chosen = [rows[i] for i in random_rows]
            probs = self.probabilities(logits[random_rows], chosen)
            tokens[random_rows] = draw(probs, [r.generator for r in chosen]).to(torch.int64)
        return tokens.tolist()

    def adjust(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[N, V] logits -> float32 logits with each row's grammar mask, logit bias and
        penalties applied (a greedy row's token is their argmax)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sequences")
        logits = logits.float()
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits, [r.params.biases for r in rows])
        if any(r.params.has_penalties for r in rows):
            logits = self._penalise(logits, rows)
        return logits

    @staticmethod
    def _penalise(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        device = logits.device
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
        return apply_penalties(logits, [r.output_token_ids for r in rows], presence, frequency)

    @staticmethod
    def probabilities(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Adjusted [N, V] logits of non-greedy rows -> the distributions they are sampled
        from (temperature, then top-k, then top-p)."""
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        logits = logits / temperature[:, None]
        top_k = torch.tensor([r.params.top_k for r in rows], dtype=torch.int64, device=device)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=device)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)
