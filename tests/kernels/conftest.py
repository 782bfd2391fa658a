"""Kernel tests run Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated; the kernels package imports its Triton
modules lazily, so setting it here (at collection, before any kernel test runs) is enough.

On a GPU (``PREFIXGATE_KERNEL_DEVICE=cuda`` with ``TRITON_INTERPRET=0``, as
benchmarks/gpu_check.sh runs them) the same tests drive the compiled kernels: every Triton entry
point gets the test's CPU tensors copied to the GPU, runs there, and hands its results back on
the CPU (in-place outputs copied back), so each test keeps its inputs and assertions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DEVICE = os.environ.get("PREFIXGATE_KERNEL_DEVICE", "cpu")
TRITON_ENTRY_POINTS = {
    "triton_ops": ("store_kv", "rms_norm", "rotary", "silu_and_mul"),
    "triton_attention": ("paged_decode_attention", "paged_prefill_attention"),
}


def on_device(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn`` run on ``device`` with CPU tensors in and CPU tensors out."""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_device(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                on = x.to(device)
                moved.append((x, on))
                return on
            return x

        out = fn(*map(to_device, args), **{k: to_device(v) for k, v in kwargs.items()})
        for cpu, on in moved:  # in-place results (the KV store) come back too
            cpu.copy_(on)
        if isinstance(out, tuple):
            return tuple(t.cpu() for t in out)
        return out.cpu() if isinstance(out, torch.Tensor) else out

    return run


@pytest.fixture(autouse=True)
def kernels_on_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """With PREFIXGATE_KERNEL_DEVICE=cuda, route every Triton entry point through the GPU."""
    if KERNEL_DEVICE == "cpu":
        yield
        return
    import importlib

    from paged_kernels import backend

    monkeypatch.setattr(backend, "triton_interpret_enabled", lambda: True)  # allow CPU inputs
    for module_name, names in TRITON_ENTRY_POINTS.items():
        module = importlib.import_module(f"paged_kernels.{module_name}")
        for name in names:
            monkeypatch.setattr(module, name, on_device(getattr(module, name), KERNEL_DEVICE))
    yield
