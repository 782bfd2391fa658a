"""Sampler against a naive per-token reference: penalties, top-k, top-p, greedy, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_logit_bias,
    apply_penalties,
    apply_top_k_top_p,
)
from engine.sampling_params import SamplingParams


def naive_penalties(logits: list[float], generated: list[int], presence: float, freq: float):
    out = list(logits)
    for token in set(generated):
        count = generated.count(token)
        out[token] -= freq * count + presence
    return out


def naive_keep(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """Token ids kept by top-k (ties at the k-th value kept) then top-p, one row, by hand."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order
    if top_k > 0:
        kth = logits[order[min(top_k, len(order)) - 1]]
        kept = [i for i in order if logits[i] >= kth]
    if top_p >= 1.0:
        return set(kept)
    peak = max(logits[i] for i in kept)
    weights = {i: math.exp(logits[i] - peak) for i in kept}
    total = sum(weights.values())
    chosen, mass = set(), 0.0
    for i in kept:
        if mass >= top_p:
            break
        chosen.add(i)
        mass += weights[i] / total
    return chosen


def rows_of(params: list[SamplingParams], outputs: list[list[int]] | None = None):
    outputs = outputs or [[] for _ in params]
    return [
        SamplingRow(p, out, torch.Generator().manual_seed(i))
        for i, (p, out) in enumerate(zip(params, outputs, strict=True))
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_naive(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 40, generator=gen)
    generated = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in (0, 7, 25)]
    presence = torch.tensor([0.5, -1.0, 2.0])
    frequency = torch.tensor([1.5, 0.25, -0.5])
    got = apply_penalties(logits, generated, presence, frequency)
    for row in range(3):
        want = naive_penalties(
            logits[row].tolist(), generated[row], float(presence[row]), float(frequency[row])
        )
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(0, 0.5), (5, 1.0), (1, 1.0), (3, 0.9), (0, 0.05), (50, 0.99), (7, 0.3)]
)
def test_top_k_top_p_mask_matches_naive(top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = 2 * torch.randn(4, 33, generator=gen)
    logits[1, 3] = logits[1, 4] = logits[1].max() + 1  # a tie at the top
    masked = apply_top_k_top_p(
        logits, torch.full((4,), top_k, dtype=torch.int64), torch.full((4,), top_p)
    )
    for row in range(4):
        kept = {i for i, v in enumerate(masked[row].tolist()) if v != float("-inf")}
        assert kept == naive_keep(logits[row].tolist(), top_k, top_p)
        for i in kept:  # kept logits are untouched
            assert masked[row, i] == logits[row, i]


def test_mixed_rows_in_one_batch_each_follow_their_params() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 50, generator=gen)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=1),  # top-k 1 is greedy whatever the draw
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
    ]
    top = int(logits[2].argmax())
    tokens = Sampler()(logits, rows_of(params, [[], [], [top, top]]))
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == int(logits[1].argmax())
    penalised = naive_penalties(logits[2].tolist(), [top, top], 2.0, 2.0)
    assert tokens[2] == max(range(50), key=lambda i: penalised[i])
    assert tokens[2] != top  # the penalty moved the choice off the raw argmax


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.75)  # keeps tokens 0 and 1
    sampler = Sampler()
    generator = torch.Generator().manual_seed(0)
    row = SamplingRow(params, [], generator)
    draws = [sampler(logits, [row])[0] for _ in range(2000)]
    assert set(draws) == {0, 1}
    share = draws.count(0) / len(draws)
    assert share == pytest.approx(0.5 / 0.8, abs=0.05)


def test_temperature_sharpens_toward_argmax() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    sampler = Sampler()
    cold = SamplingRow(SamplingParams(temperature=0.05), [], torch.Generator().manual_seed(1))
    assert {sampler(logits, [cold])[0] for _ in range(200)} == {0}


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=11)

    def run(batch_logits: torch.Tensor, n: int) -> list[int]:
        gens = [torch.Generator().manual_seed(11) for _ in range(n)]
        rows = [SamplingRow(params, [], g) for g in gens]
        return [Sampler()(batch_logits, rows)[0] for _ in range(20)]

    alone = run(logits[:1], 1)
    in_batch = run(logits[[0, 0]], 2)  # row 0 draws the same sequence beside another row
    assert alone == in_batch
    assert len(set(alone)) > 1


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        Sampler()(torch.zeros(2, 5), rows_of([SamplingParams()]))


def test_logit_bias_adds_to_each_rows_own_tokens() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    biases = (((2, 5.0), (7, -1.5)), (), ((19, 100.0),))
    got = apply_logit_bias(logits, biases)
    want = logits.clone()
    for row, pairs in enumerate(biases):
        for token, bias in pairs:
            want[row, token] += bias
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # a new tensor: the model's logits are left alone


def test_logit_bias_steers_greedy_and_sampled_rows_but_not_past_a_grammar() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(9))
    params = [
        SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={12: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
    ]
    sampler = Sampler()
    for _ in range(20):
        tokens = sampler(logits, rows_of(params))
        assert tokens[:2] == [11, 12]
        assert tokens[2] != int(logits[2].argmax())  # banned: the next best is taken
    bits = torch.zeros(3, 2, dtype=torch.int32)
    bits[:, 0] = 1 << 3  # the grammar allows only token 3
    assert sampler(logits, rows_of(params), bits) == [3, 3, 3]
