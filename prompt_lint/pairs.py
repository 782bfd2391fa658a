"""Word-pair samples: what a request's template text says, beside its line hashes.

Families are found by line hashes (`family_index`), which a value no pattern names breaks
wherever it sits on its line: a one-line system prompt with a user id near one end kept
one of its three hashes (the line's, its head's, its tail's) from request to request and
matched no family. A text's word pairs change only around such a value, so two requests
of one prompt share most of them. A sample keeps the `SAMPLE` smallest CRC-32s of a text's
distinct whitespace-separated word pairs (a bottom-k sample: bounded, and two texts that
share most of their pairs share most of their samples). CRC-32, not `hash()`: Python salts
string hashes per process, and the samples decide families, which must not depend on the
run.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Iterable
from itertools import pairwise

__all__ = ["SAMPLE", "merge_samples", "pair_sample"]

#: Word pairs a sample keeps (all of them for a text of 33 words or fewer).
SAMPLE = 32


def pair_sample(text: str) -> frozenset[int]:
    """The sample of `text`'s word pairs (lone surrogates are encoded as they are)."""
    pairs = map(b" ".join, pairwise(text.encode("utf-8", "surrogatepass").split()))
    return frozenset(heapq.nsmallest(SAMPLE, set(map(zlib.crc32, pairs))))


def merge_samples(samples: Iterable[frozenset[int]]) -> frozenset[int]:
    """The sample of several texts together (a request's system prompt and tool texts)."""
    return frozenset(heapq.nsmallest(SAMPLE, frozenset().union(*samples)))
