"""Conversion of token sequences to the packed int32 bytes the tree compares and hashes."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

TOKEN_BYTES = 4
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1



class PackedTokens:
    """Token ids packed once as int32 bytes, to look up in several caches without repacking
    (a gateway matches one prompt against every replica's shadow cache)."""

    __slots__ = ("data",)

    def __init__(self, tokens: Sequence[int] | np.ndarray[Any, Any]) -> None:
        self.data = pack_tokens(tokens, len(tokens))

    def __len__(self) -> int:
        return len(self.data) // TOKEN_BYTES


TokenInput = Sequence[int] | np.ndarray[Any, Any] | PackedTokens


def pack_tokens(tokens: TokenInput, count: int) -> bytes:
    """Pack ``tokens[:count]`` as native int32 bytes; raise ValueError on bad token ids."""
    if isinstance(tokens, PackedTokens):
        data = tokens.data
        return data if count * TOKEN_BYTES == len(data) else data[: count * TOKEN_BYTES]
    if isinstance(tokens, np.ndarray):
        return _pack_array(tokens, count)
    head = tokens if count == len(tokens) else tokens[:count]
    try:
        return struct.pack(f"{count}i", *head)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32 integers: {exc}") from None


def _pack_array(tokens: np.ndarray[Any, Any], count: int) -> bytes:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    head = tokens[:count]
    if head.dtype != np.int32 and count:
        low, high = int(head.min()), int(head.max())
        if low < _INT32_MIN or high > _INT32_MAX:
            raise ValueError(f"token ids must fit in int32, got range [{low}, {high}]")
    return head.astype(np.int32, copy=False).tobytes()


class PackMemo:
    """Packs token lists, reusing the bytes of the previous list when the new one extends it.

    The engine matches a prompt and then inserts that prompt plus its reply; the second call
    then packs only the reply. Reuse is decided by comparing the token values with a private
    copy of the previous list, so a caller that mutates its lists in place is still correct.
    """

    __slots__ = ("_tokens", "_packed")

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._packed = b""

    def pack(self, tokens: TokenInput, count: int) -> bytes:
        """Same bytes as ``pack_tokens(tokens, count)``."""
        if not isinstance(tokens, list):
            return pack_tokens(tokens, count)
        head = tokens if count == len(tokens) else tokens[:count]
        known = self._tokens
        if self._extends(head, known):
            size = len(known)
            packed = self._packed + pack_tokens(head[size:], count - size)
        else:
            packed = pack_tokens(head, count)
        self._tokens = head if head is not tokens else list(head)
        self._packed = packed
        return packed

    @staticmethod
    def _extends(head: list[int], known: list[int]) -> bool:
        size = len(known)
        if not size or len(head) < size or head[size - 1] != known[-1] or head[0] != known[0]:
            return False
        return head[:size] == known
