"""benchmarks.engine_rows: the compute ceiling of batched decode counts the model's own
multiply-adds (one per weight element of every projection and of the LM head, per token)."""

from __future__ import annotations

from benchmarks.engine_rows import token_flops
from engine.loader import LoadedModel
from engine.model import PROJECTIONS


def test_token_flops_counts_every_projection_weight_twice(loaded_model: LoadedModel) -> None:
    model = loaded_model.model
    elements = model.lm_head.weight.numel()
    for layer in model.blocks():
        elements += sum(getattr(layer, name).weight.numel() for name in PROJECTIONS)
    assert token_flops(loaded_model) == 2 * elements
