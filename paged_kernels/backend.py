"""Choosing the implementation of an op: Triton kernels on CUDA, torch on CPU."""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
BACKENDS: tuple[str, ...] = ("triton", "torch")


def triton_interpret_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str | None, tensor: torch.Tensor) -> Backend:
    """Return the backend for an op whose main input is ``tensor``.

    ``None`` picks by device: CUDA tensors -> ``"triton"``, anything else -> ``"torch"``.
    Asking for ``"triton"`` on CPU tensors is allowed only under ``TRITON_INTERPRET=1``.
    """
    if backend is None:
        return "triton" if tensor.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not tensor.is_cuda and not triton_interpret_enabled():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got device {tensor.device}); "
            "set TRITON_INTERPRET=1 before the first Triton kernel is used to run it on CPU"
        )
    return backend  # type: ignore[return-value]
