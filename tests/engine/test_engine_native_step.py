"""The native decode step (engine/native/decode_step.c) against the per-op torch path.

Reference: `LlamaModel.forward` with the same block weights, which runs each layer op by op
(`paged_kernels` StepOps, `engine.native_linear` products) and is itself checked against the dense
model and `transformers`. Sequences get shuffled pages and contexts past one attention run
(128 keys), so the step reads pages out of order and merges runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.native import BlockGemm, load_library, native_gemm
from engine.native_linear import BlockLinear
from engine.native_step import MAX_DECODE_ROWS, NativeDecoder, native_decoder
from engine.sampling_params import SamplingParams

from .engine_runtime_support import pin_products

pytestmark = pytest.mark.skipif(native_gemm() is None, reason="no C compiler for the kernels")

PAGE_SIZE = 16
HIDDEN_ATOL = 2e-3  # final normed hidden states of magnitude ~1; observed ~1e-5


def _config(head_dim: int, layout: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=head_dim, rope_theta=10000.0, rms_eps=1e-5,
        max_position=512, tie_embeddings=True, rope_layout=layout, name="tiny",
    )  # fmt: skip


def _model(head_dim: int, layout: str, quantization: str) -> LlamaModel:
    gen = torch.Generator().manual_seed(head_dim)
    model = LlamaModel(_config(head_dim, layout))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    model.quantize(quantization)  # type: ignore[arg-type]
    return model


class Pages:
    """Caches with shuffled page tables for a few sequences, filled by the torch path."""

    def __init__(self, model: LlamaModel, lengths: list[int], seed: int,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        c = model.config
        need = [n // PAGE_SIZE + 1 for n in lengths]
        pages = sum(need) + 2
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).int()
        self.tables = list(order[: sum(need)].split(need))
        shape = (pages, PAGE_SIZE, c.num_kv_heads, c.head_dim)
        self.k = [torch.zeros(shape, dtype=kv_dtype) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=kv_dtype) for _ in range(c.num_layers)]
        self.model, self.lengths = model, lengths
        ids = torch.Generator().manual_seed(seed + 1)
        for seq, n in enumerate(lengths):
            if n:
                tokens = torch.randint(0, c.vocab_size, (n,), generator=ids)
                self.forward(self.meta([seq], [0], [n]), tokens, torch.arange(n))

    def copy(self) -> Pages:
        """The same model and tables over copies of the caches."""
        twin = copy.copy(self)
        twin.k, twin.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        return twin

    def meta(self, seqs: list[int], starts: list[int], counts: list[int]) -> AttentionMetadata:
        slots, cu, lens = [], [0], []
        for seq, start, n in zip(seqs, starts, counts, strict=True):
            pos = torch.arange(start, start + n)
            slots.append(self.tables[seq].long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
            cu.append(cu[-1] + n)
            lens.append(start + n)
        width = max(len(self.tables[s]) for s in seqs) + 1
        table = torch.full((len(seqs), width), 7, dtype=torch.int32)  # padding is arbitrary
        for row, seq in enumerate(seqs):
            table[row, : len(self.tables[seq])] = self.tables[seq]
        return AttentionMetadata(
            slot_mapping=torch.cat(slots), block_table=table,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), is_decode=max(counts) == 1,
        )  # fmt: skip

    def forward(
        self, meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(ids, pos, meta, self.k, self.v, "torch")

    def decode_inputs(self, seed: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        seqs = list(range(len(self.lengths)))
        meta = self.meta(seqs, self.lengths, [1] * len(seqs))
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.model.config.vocab_size, (len(seqs),), generator=gen)
        return meta, ids, torch.tensor(self.lengths)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv32", "kv16"])
@pytest.mark.parametrize("path", ["avx512bf16", "avx512", "avx2", "scalar"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize(("head_dim", "layout"), [(32, "interleaved"), (16, "half")])
def test_native_step_equals_the_torch_path(
    path: str, quantization: str, head_dim: int, layout: str, kv_dtype: torch.dtype
) -> None:
    """Over a float32 cache, or a float16 one (K and V rounded when stored, by both paths)."""
    lib = load_library()
    assert lib is not None
    gemm = BlockGemm.named(lib, path)
    if gemm is None:
        pytest.skip(f"CPU without {path}")
    # the torch path's products run the same code as the step's
    model = pin_products(_model(head_dim, layout, quantization), gemm)
    # contexts: none, within one page, past one run of 128 keys, past two runs
    pages = Pages(model, [0, 5, 130, 300], seed=head_dim, kv_dtype=kv_dtype)
    reference = pages.copy()
    native = NativeDecoder(model, gemm, pages.k, pages.v)
    for step in range(3):  # consecutive steps read what the previous ones stored
        meta, ids, pos = pages.decode_inputs(seed=step)
        assert native.accepts(meta, ids.shape[0])
        with torch.inference_mode():
            got = native(ids, pos, meta)
        want = reference.forward(meta, ids, pos)
        torch.testing.assert_close(got, want, atol=HIDDEN_ATOL, rtol=0)
        for mine, theirs in zip(pages.k + pages.v, reference.k + reference.v, strict=True):
            assert mine.dtype == kv_dtype
            torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-3, rtol=1e-3)
        pages.lengths = reference.lengths = [n + 1 for n in pages.lengths]


@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_halves_are_stored_rounded_as_torch_rounds(path: str) -> None:
    """The C rounding of K and V to float16 (portable, or F16C on the AVX2 path) is torch's
    `.to(torch.float16)`, bit for bit: over every magnitude a cache meets, ties, subnormals,
    overflow and the special values."""
    lib = load_library()
    assert lib is not None
    gemm = BlockGemm.named(lib, path)
    if gemm is None:
        pytest.skip(f"CPU without {path}")
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-9, 1e-7, 3e-5, 1e-3, 0.1, 1.0, 30.0, 1e3, 3e4, 7e4])
    x = (torch.randn(len(scales), 20000, generator=gen) * scales[:, None]).flatten()
    ties = torch.arange(1, 2049, dtype=torch.float32) * 2**-11 + 2**-12  # halfway to 2 ulps
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -1e6, 2**-25, 2**-24 * 1.5,
                            2**-24 * 2.5, 2**-14, 6.1e-5, 1e-45, float("inf"), -float("inf")])
    values = torch.cat([special, ties, -ties, x])  # the special values in whole vectors of 8
    got, want = gemm.halves(values), values.to(torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert gemm.halves(torch.full((9,), float("nan"))).isnan().all()


def test_only_batched_decode_steps_round_to_bf16() -> None:
    """On the BF16 path a decode step of several sequences and its LM head round to bfloat16;
    the model's own products (prefill chunks, verify steps) stay float32."""
    lib = load_library()
    assert lib is not None
    gemm = BlockGemm.named(lib, "avx512bf16")
    if gemm is None:
        pytest.skip("CPU without AVX-512 BF16")
    model = _model(32, "interleaved", "int4")
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert linears and not any(m.gemm.bf16 for m in linears)  # quantize() takes gemm.exact()
    pages = Pages(model, [3, 20, 40, 0, 7, 33], seed=4)  # six rows: in the BF16 tiles' range
    assert gemm.rounds_to_bf16(6)
    native = NativeDecoder(model, gemm, pages.k, pages.v)
    meta, ids, pos = pages.decode_inputs(seed=0)
    with torch.inference_mode():
        hidden = native(ids, pos, meta)
        got = native.logits(hidden)
        model_head = model.compute_logits(hidden)
    head = model.lm_head
    assert isinstance(head, BlockLinear)
    w = head.dequantized().double()
    rounded = hidden.bfloat16().double() @ w.bfloat16().double().t()
    exact = hidden.double() @ w.t()
    tol = 8 * w.shape[1] * 2**-24 * (hidden.double().abs() @ w.abs().t()) + 1e-6
    assert bool(((got.double() - rounded).abs() <= tol).all())
    assert bool(((model_head.double() - exact).abs() <= tol).all())
    assert not torch.allclose(got, model_head, atol=1e-4, rtol=0)  # the two heads do differ


def test_negative_slot_is_not_stored_and_bad_indices_are_refused() -> None:
    model = _model(32, "interleaved", "int4")
    pages = Pages(model, [3, 20], seed=1)
    native = NativeDecoder(model, native_gemm(), pages.k, pages.v)  # type: ignore[arg-type]
    meta, ids, pos = pages.decode_inputs(seed=0)
    before = [t.clone() for t in pages.k]
    skipped = AttentionMetadata(
        torch.tensor([-1, -1]), meta.block_table, meta.cu_seqlens_q, meta.seq_lens, True
    )
    with torch.inference_mode():
        native(ids, pos, skipped)
    assert all(torch.equal(a, b) for a, b in zip(before, pages.k, strict=True))
    too_far = torch.tensor([3, model.cos_sin.shape[0]])
    with pytest.raises(RuntimeError, match="bad shape or index"):
        native(ids, too_far, meta)
    bad_page = meta.block_table.clone()
    bad_page[1, 0] = pages.k[0].shape[0]  # past the last page
    bad = AttentionMetadata(meta.slot_mapping, bad_page, meta.cu_seqlens_q, meta.seq_lens, True)
    with pytest.raises(RuntimeError, match="bad shape or index"):
        native(ids, pos, bad)
    with pytest.raises(ValueError, match="positions must be"):
        native(ids, pos.int(), meta)


def test_decoder_takes_decode_steps_of_block_models_only(monkeypatch: pytest.MonkeyPatch) -> None:
    quantized = _model(32, "interleaved", "int4")
    pages = Pages(quantized, [4], seed=2)
    assert native_decoder(quantized, pages.k, pages.v) is not None
    fp16 = _model(32, "interleaved", "fp16")
    assert native_decoder(fp16, pages.k, pages.v) is None
    monkeypatch.setenv("PREFIXGATE_NATIVE_STEP", "off")
    assert native_decoder(quantized, pages.k, pages.v) is None
    monkeypatch.setenv("PREFIXGATE_NATIVE_STEP", "sometimes")
    with pytest.raises(ValueError, match="PREFIXGATE_NATIVE_STEP"):
        native_decoder(quantized, pages.k, pages.v)
    meta, ids, _ = pages.decode_inputs(seed=0)
    assert NativeDecoder.accepts(meta, 1) and not NativeDecoder.accepts(meta, MAX_DECODE_ROWS + 1)
    prefill = pages.meta([0], [0], [4])
    assert not NativeDecoder.accepts(prefill, 4)


@pytest.mark.slow
def test_engine_generates_the_same_tokens_with_and_without_the_native_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real model (int4, the GGUF's own blocks), two prompts batched: greedy tokens equal.
    Float products on both sides: with bfloat16 ones, the paths' last-bit differences in
    attention round some activations the other way, and near-ties then part (the BF16
    products' quality is measured in test_engine_model_quant)."""
    prompts = ["Name three primary colours.", "Write a Python function that reverses a string."]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("PREFIXGATE_NATIVE_GEMM", "avx512")
    native_gemm.cache_clear()
    outputs = []
    try:
        for setting in ("on", "off"):
            monkeypatch.setenv("PREFIXGATE_NATIVE_STEP", setting)
            engine = Engine(EngineConfig(quantization="int4"))
            assert (engine.runner.native_decoder is not None) == (setting == "on")
            outputs.append([out.token_ids for out in engine.generate(prompts, params)])
    finally:
        monkeypatch.undo()
        native_gemm.cache_clear()
    assert outputs[0] == outputs[1] and all(len(ids) == 24 for ids in outputs[0])
