"""A small, fast GGUF container parser: metadata values and tensor locations.

`gguf.GGUFReader` builds a numpy view per metadata item, which takes seconds for a 49k-token
vocabulary; this reads the header with `struct` in one pass and memory-maps the tensor data.
Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count, metadata
(key, type, value), tensor infos (name, dims innermost-first, ggml type, offset), padding to
`general.alignment`, tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    qtype: GGMLQuantizationType
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the memory-mapped file

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch shape (outermost first)."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFFile:
    """Metadata dict and tensor infos of a GGUF file (tensor data memory-mapped, read-only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))  # type: ignore[arg-type]  # a memmap is a buffer
        if bytes(cur.buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        raw = [self._tensor_header(cur) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(name, dims, qt, start + off) for name, dims, qt, off in raw]

    @staticmethod
    def _tensor_header(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        return name, dims, cur.scalar("<I"), cur.scalar("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], qt: int, offset: int) -> TensorInfo:
        qtype = GGMLQuantizationType(qt)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(f"tensor {name}: row of {dims[0]} is not a multiple of {block}")
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        end = offset + rows * row_bytes
        if end > self._map.shape[0]:
            raise ValueError(f"tensor {name} runs past the end of {self.path}")
        data = self._map[offset:end].reshape(rows, row_bytes)
        return TensorInfo(name, dims, qtype, data)
