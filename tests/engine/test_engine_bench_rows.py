"""benchmarks.engine_rows: the compute ceiling of batched decode counts the model's own
multiply-adds (one per weight element of every projection and of the LM head, per token), and
the stream rows compare each row with one stream and with that ceiling."""

from __future__ import annotations

import pytest

from benchmarks import engine_rows
from benchmarks.engine_rows import token_flops
from engine.loader import LoadedModel
from engine.model import PROJECTIONS
from engine.native import native_gemm


def test_token_flops_counts_every_projection_weight_twice(loaded_model: LoadedModel) -> None:
    model = loaded_model.model
    elements = model.lm_head.weight.numel()
    for layer in model.blocks():
        elements += sum(getattr(layer, name).weight.numel() for name in PROJECTIONS)
    assert token_flops(loaded_model) == 2 * elements


def test_stream_rows_compare_each_row_with_one_stream_and_the_products_ceiling(
    loaded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds: every stream count once per round, in alternating order, the ceiling timed
    once per round after them; each row's ratio is the median of its rounds' own ratios (here
    round 2 runs twice as fast for every row, so the rows' ratios stay those of one round while
    their rates' medians move)."""
    speed = iter([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0])
    rates = {1: 80.0, 4: 200.0, 8: 320.0}
    calls: list[int] = []

    def decode(loaded: object, streams: int, tokens: int, kv: str) -> float:
        calls.append(streams)
        return rates[streams] * next(speed)

    monkeypatch.setattr(engine_rows, "engine_decode", decode)
    flops = iter([1e11, 2e11, 1e11])
    monkeypatch.setattr(engine_rows, "product_rate", lambda threads, shape: engine_rows.ProductRate(
        next(flops), "native float panels"))
    rows = engine_rows.stream_rows(loaded_model, None, tokens=4, repeats=3)
    ceiling = 1e11 / token_flops(loaded_model)
    assert calls == [1, 4, 8, 8, 4, 1, 1, 4, 8]
    assert [r.engine for r in rows] == [80.0, 200.0, 320.0]
    assert rows[0].note == "1.00x one stream; median of 3 rounds"
    assert rows[1].note.startswith("2.50x one stream")
    assert rows[2].note.startswith("4.00x one stream; median of 3 rounds; the products' ceiling "
                                   f"{ceiling:.0f} tok/s = {ceiling / 80:.2f}x one stream "
                                   "(native float panels at 8 rows of the gate/up product: "
                                   "100 GFLOP/s in cache, timed once per round after the "
                                   "rounds)")


def test_product_rate_names_the_kernels_it_timed() -> None:
    rate = engine_rows.product_rate(1, (64, 32), repeats=2)
    gemm = native_gemm()
    expected = ("torch float32" if gemm is None else
                "native AVX-512 BF16 tiles" if gemm.bf16 else
                "native AVX-512 fused tiles" if gemm.avx512 else "native float panels")
    assert rate.source == expected and rate.flops > 0
