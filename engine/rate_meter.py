"""A throughput meter weighted by work done: what the engine's prefill-time-saved figure uses."""

from __future__ import annotations


class RateMeter:
    """Throughput over recent work (e.g. prefill tokens/s): amounts and seconds summed with an
    exponential decay per unit of amount (half-life `half_life` units), so each sample weighs
    by its size. A 10-token prefill step, mostly fixed per-step cost, then barely moves a rate
    learned from 512-token chunks; a per-sample average let a run of such steps quadruple
    the reported prefill time saved."""

    def __init__(self, half_life: float = 4096.0) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = half_life
        self.amount = 0.0
        self.seconds = 0.0

    def update(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        keep = 0.5 ** (amount / self.half_life)
        self.amount = self.amount * keep + amount
        self.seconds = self.seconds * keep + seconds

    @property
    def value(self) -> float | None:
        """Amount per second, None before the first sample."""
        return self.amount / self.seconds if self.seconds > 0 else None
