"""Helpers for the engine runtime tests: a tiny random Llama and a byte-level tokenizer.

The byte tokenizer maps token i < 256 to the single byte i, so multi-byte UTF-8 characters
span several tokens (what streaming must handle); STOP is its end-of-text token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from engine.dense_reference import greedy_generate
from engine.llm_engine import Engine
from engine.loader import LoadedModel, parameter_bytes
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.native import BlockGemm
from engine.native_linear import BlockLinear
from engine.scheduler import SchedulerOutput

STOP = 256
VOCAB = 260


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is the stop token; 257..259 are unused specials."""

    vocab_size = VOCAB
    stop_token_ids = frozenset({STOP})
    special_token_ids = frozenset(range(STOP, VOCAB))
    bos_token_id = None

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, id: int) -> bytes:  # noqa: A002 - engine contract name
        return bytes([id]) if id < 256 else f"<|special{id}|>".encode()

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


def tiny_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_eps=1e-5, max_position=1024,
        tie_embeddings=False, rope_layout="half", name="tiny-random",
    )  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **overrides: object) -> LoadedModel:
    """A randomly initialised 2-layer Llama with well separated logits."""
    config = tiny_config(**overrides)
    model = LlamaModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                scale = 1.0 if name in ("embed", "lm_head.weight") else param.shape[-1] ** -0.5
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    model.eval()
    return LoadedModel(model, config, ByteTokenizer(), parameter_bytes(model))  # type: ignore[arg-type]


def dense_greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """The dense (non-paged) reference greedy continuation, stopping at the stop tokens."""
    return greedy_generate(loaded.model, prompt, max_tokens, loaded.tokenizer.stop_token_ids)


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models are all per-op overhead: one intra-op thread is faster and steadier on a
    shared CPU. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chain_model(text: str, seed: int = 0) -> LoadedModel:
    """A tiny Llama whose greedy continuation of the text's first byte is the rest of `text`
    (as bytes, one token each), then STOP. Every byte of `text` must be distinct.

    Attention and MLP outputs are zeroed, so the last hidden state is the normalised embedding
    of the current token; the LM-head row of each byte's successor is that byte's embedding.
    """
    chain = list(text.encode("utf-8")) + [STOP]
    if len(set(chain)) != len(chain):
        raise ValueError("chain_model needs distinct bytes")
    loaded = tiny_model(seed)
    model = loaded.model
    with torch.no_grad():
        model.norm.fill_(1.0)
        for layer in model.layers:
            layer.o.weight.zero_()
            layer.down.weight.zero_()
        head_weight = model.lm_head.weight
        head = 0.1 * torch.randn(head_weight.shape, generator=torch.Generator().manual_seed(1))
        for current, successor in itertools.pairwise(chain):
            head[successor] = 4 * model.embed[current]
        head_weight.copy_(head)
    return loaded


def watch_steps(eng: Engine, measure: Callable[[SchedulerOutput], object]) -> list[object]:
    """Every later step's `measure(scheduled step)`, in order: the engine's own schedule, seen."""
    seen: list[object] = []
    schedule = eng.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        seen.append(measure(out))
        return out

    eng.scheduler.schedule = spy  # type: ignore[method-assign]
    return seen


def pin_products(model: LlamaModel, gemm: BlockGemm) -> LlamaModel:
    """`model` with every native block projection (and its LM head) on `gemm`'s code path."""
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.gemm = gemm
    return model
