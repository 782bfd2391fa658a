"""`evolve` against `dataclasses.replace` (the reference) on every record it serves."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from gateway.evolve import evolve
from gateway.types import ChatRequest, Final, SamplingOptions, TextDelta, Usage

REQUEST = ChatRequest("r1", "openai", "m", ({"role": "user", "content": "hi"},), (),
                      SamplingOptions(max_tokens=5), False, "t", "t", {"model": "m"})
USAGE = Usage(10, 2, 4)
RECORDS = [REQUEST, USAGE, Final("done", (), "stop", USAGE), TextDelta("x")]


def values(record: Any, rng: random.Random) -> dict[str, Any]:
    """A random subset of `record`'s fields with new values (objects compared by identity)."""
    names = [f.name for f in dataclasses.fields(record)]
    return {n: object() for n in rng.sample(names, rng.randint(0, len(names)))}


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_evolve_is_replace(record: Any) -> None:
    rng = random.Random(7)
    for _ in range(50):
        changes = values(record, rng)
        ours, reference = evolve(record, **changes), dataclasses.replace(record, **changes)
        assert type(ours) is type(reference)
        for f in dataclasses.fields(record):
            assert getattr(ours, f.name) is getattr(reference, f.name), f.name
    assert evolve(record) == record and evolve(record) is not record


def test_evolve_keeps_the_record_frozen_and_refuses_unknown_fields() -> None:
    salted = evolve(REQUEST, upstream_salt="s")
    assert (salted.upstream_salt, REQUEST.upstream_salt) == ("s", None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        salted.upstream_salt = "t"  # type: ignore[misc]
    with pytest.raises(TypeError, match="not fields of ChatRequest: \\['salt'\\]"):
        evolve(REQUEST, salt="s")


def test_evolve_refuses_what_a_copy_would_get_wrong() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            assert self.n >= 0

    @dataclasses.dataclass(frozen=True)
    class Plain:
        n: int

    with pytest.raises(TypeError, match="__post_init__"):
        evolve(Checked(1), n=2)
    with pytest.raises(TypeError, match="slotted"):
        evolve(Plain(1), n=2)
