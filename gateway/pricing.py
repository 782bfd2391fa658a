"""Prices per million tokens, to turn cached tokens into money saved.

The built-in table lists public list prices (USD per million tokens) of a few common models
and is only a default: pass `--price-table FILE` / `PREFIXGATE_PRICE_TABLE` with a JSON object
`{"model-prefix": {"input": 2.5, "cached_input": 1.25, "output": 10.0}, ...}` to use your own
(it replaces the built-in table). A model matches the longest key it starts with, so
`gpt-4o-2024-08-06` uses `gpt-4o`; a `"*"` key prices every other model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens: uncached input, cached (read) input, output."""

    input: float
    cached_input: float
    output: float

    def __post_init__(self) -> None:
        if min(self.input, self.cached_input, self.output) < 0:
            raise ValueError(f"prices must be non-negative, got {self}")

    def saved(self, cached_tokens: int) -> float:
        """USD saved because `cached_tokens` were billed at the cached rate."""
        return cached_tokens * (self.input - self.cached_input) / 1e6

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """USD billed for one request's tokens."""
        fresh = max(prompt_tokens - cached_tokens, 0)
        return (fresh * self.input + cached_tokens * self.cached_input
                + completion_tokens * self.output) / 1e6


DEFAULT_PRICES: dict[str, Price] = {
    "gpt-4o-mini": Price(0.15, 0.075, 0.60),
    "gpt-4o": Price(2.50, 1.25, 10.00),
    "gpt-4.1-nano": Price(0.10, 0.025, 0.40),
    "gpt-4.1-mini": Price(0.40, 0.10, 1.60),
    "gpt-4.1": Price(2.00, 0.50, 8.00),
    "o4-mini": Price(1.10, 0.275, 4.40),
    "claude-3-5-haiku": Price(0.80, 0.08, 4.00),
    "claude-3-7-sonnet": Price(3.00, 0.30, 15.00),
    "claude-sonnet-4": Price(3.00, 0.30, 15.00),
    "claude-opus-4": Price(15.00, 1.50, 75.00),
    "deepseek-chat": Price(0.27, 0.07, 1.10),
}


class PriceTable:
    """Model id -> Price by longest matching prefix (a `"*"` entry is the fallback)."""

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self.prices = dict(DEFAULT_PRICES if prices is None else prices)
        self._keys = sorted((k for k in self.prices if k != "*"), key=len, reverse=True)

    @classmethod
    def load(cls, path: str | Path | None) -> PriceTable:
        """The table in a JSON file, or the built-in one for None."""
        if path is None:
            return cls()
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"price table {path}: {exc}") from exc
        return cls(parse_prices(data, str(path)))

    def price(self, model: str) -> Price | None:
        """The price of `model`, or None when the table does not know it."""
        lowered = model.lower()
        for key in self._keys:
            if lowered.startswith(key.lower()):
                return self.prices[key]
        return self.prices.get("*")

    def as_json(self) -> list[dict[str, Any]]:
        """The table for /api/stats."""
        return [{"model": k, "input": p.input, "cached_input": p.cached_input, "output": p.output}
                for k, p in sorted(self.prices.items())]


def parse_prices(data: Any, where: str = "price table") -> dict[str, Price]:
    """Validate a `{model: {input, cached_input, output}}` object."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object of model -> prices")
    out: dict[str, Price] = {}
    for model, entry in data.items():
        if not isinstance(entry, dict) or not {"input", "cached_input", "output"} <= set(entry):
            raise ValueError(f"{where}: {model!r} needs input, cached_input and output")
        try:
            out[str(model)] = Price(float(entry["input"]), float(entry["cached_input"]),
                                    float(entry["output"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {model!r}: {exc}") from exc
    return out
