"""The whole model through the Triton kernels, end to end, against the torch path.

The test writes a tiny Llama as a Hugging Face folder (random weights in safetensors, a
byte-level BPE tokenizer.json it builds itself), then runs the same greedy workload through two
engines that differ only in `kernel_backend`: a batch of 3 with chunked prefill, then prompts
that extend earlier ones (prefix-cache hits). Tokens must be identical; the logits of every step
agree within LOGITS_ATOL. On CPU the Triton engine runs in Triton's interpreter
(TRITON_INTERPRET=1, set by this folder's conftest); where CUDA is present and the interpreter is
off (benchmarks/gpu_check.sh) both engines run on the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import save_file

import paged_kernels
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.model_runner import StepInputs
from engine.sampling_params import SamplingParams
from engine.tokenizer import byte_alphabet
from paged_kernels import torch_attention, torch_ops
from paged_kernels.backend import triton_interpret_enabled

LOGITS_ATOL = 2e-4  # float32 on both paths; logits are O(10); measured max ~1e-5 on CPU
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
PAGE_SIZE = 8
CHUNK = 16  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
MAX_TOKENS = 4  # generated per request (each Triton launch costs ~10 ms in the interpreter)

MERGES = [  # (left, right) in merge order; each result gets the next id after the 256 bytes
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
    ("Ġ", "s"), ("r", "e"), ("a", "t"), ("in", "g"), ("Ġ", "c"), ("o", "r"), ("e", "n"),
    ("Ġ", "p"), ("a", "n"), ("Ġ", "w"), ("a", "r"), ("c", "he"), ("Ġc", "a"),
    ("Ġca", "che"),
]  # fmt: skip
EOS = "<|endoftext|>"

PROMPTS = [
    "the paged cache stores every token of the prompt in pages",
    "an agent resends its whole history",
    "streaming tokens",
]
FOLLOW_UPS = [  # share a page-aligned prefix with PROMPTS[0] and PROMPTS[1]
    PROMPTS[0] + " and the radix tree finds them again",
    PROMPTS[1] + " every turn, so caching wins",
    "a fresh prompt with nothing cached at all, long enough to chunk",
]

pytestmark = pytest.mark.skipif(
    not (triton_interpret_enabled() or torch.cuda.is_available()),
    reason="Triton needs CUDA or TRITON_INTERPRET=1 (tests/engine/conftest.py sets it)",
)


def device() -> str:
    """CPU under the interpreter; the GPU when one is present and the interpreter is off."""
    return "cpu" if triton_interpret_enabled() else "cuda"


# --- the tiny Llama folder ----------------------------------------------------------------------


def tokenizer_json() -> dict[str, Any]:
    """A byte-level BPE: the 256 byte symbols, MERGES, and one end-of-text token."""
    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in MERGES:
        assert left in vocab and right in vocab, (left, right)
        vocab[left + right] = len(vocab)
    eos_id = len(vocab)
    return {
        "version": "1.0",
        "added_tokens": [{"id": eos_id, "content": EOS, "special": True, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in MERGES]},
    }  # fmt: skip


def llama_weights(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights; projections scaled by fan-in so logits stay well separated."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        s = shape[-1] ** -0.5 if scale is None else scale
        return (s * torch.randn(shape, generator=gen)).contiguous()

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)

    weights = {
        "model.embed_tokens.weight": rand(vocab_size, HIDDEN, scale=1.0),
        "model.norm.weight": norm(),
        "lm_head.weight": rand(vocab_size, HIDDEN, scale=1.0),
    }
    shapes = {
        "self_attn.q_proj": (HEADS * head_dim, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HEADS * head_dim),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "post_attention_layernorm.weight"] = norm()
        for name, shape in shapes.items():
            weights[f"{p}{name}.weight"] = rand(*shape)
    return weights


def write_tiny_llama(folder: Path) -> Path:
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json in `folder`."""
    tok = tokenizer_json()
    vocab_size = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": None}), encoding="utf-8"
    )
    save_file(llama_weights(vocab_size), str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_triton"))


# --- running the workload -----------------------------------------------------------------------


class Run(NamedTuple):
    """What one engine produced: tokens and cached-token counts per request, logits per step."""

    tokens: list[list[int]]
    cached: list[int]
    step_logits: list[torch.Tensor]  # per model step: [N, vocab] float32 on CPU


def make_engine(folder: Path, backend: str) -> Engine:
    config = EngineConfig(
        model=folder, page_size=PAGE_SIZE, num_pages=48, max_num_seqs=4,
        max_num_batched_tokens=CHUNK, device=device(), kernel_backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    return Engine(config)


def run_workload(engine: Engine) -> Run:
    """A batch of 3 (chunked prefill), then 3 prompts of which two hit the prefix cache."""
    step_logits: list[torch.Tensor] = []
    run_step = engine.runner.run

    def recording(inputs: StepInputs) -> torch.Tensor:
        logits = run_step(inputs)
        step_logits.append(logits.detach().float().cpu())
        return logits

    engine.runner.run = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params) + engine.generate(FOLLOW_UPS, params)
    engine.check()
    return Run(
        tokens=[o.token_ids for o in outputs],
        cached=[o.cached_tokens for o in outputs],
        step_logits=step_logits,
    )


TORCH_PATH = {
    torch_ops: ("store_kv", "rms_norm", "rotary", "silu_and_mul"),
    torch_attention: ("paged_decode_attention", "paged_prefill_attention"),
}
TRITON_OPS = ("store_kv", "rms_norm", "rotary", "silu_and_mul")
TRITON_ATTENTION = ("paged_decode_attention", "paged_prefill_attention")


def forbid(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"torch path {name} ran under kernel_backend='triton'")

    return refuse


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Every torch implementation of a hot op raises; every Triton entry point is counted."""
    from paged_kernels import triton_attention, triton_ops

    for module, names in TORCH_PATH.items():
        for name in names:
            monkeypatch.setattr(module, name, forbid(name))
    counts = dict.fromkeys((*TRITON_OPS, *TRITON_ATTENTION), 0)
    for module, names in ((triton_ops, TRITON_OPS), (triton_attention, TRITON_ATTENTION)):
        for name in names:
            monkeypatch.setattr(module, name, counted(getattr(module, name), name, counts))
    yield counts


def counted(fn: Callable[..., Any], name: str, counts: dict[str, int]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


@pytest.fixture(scope="module")
def torch_run(tiny_llama: Path) -> Run:
    return run_workload(make_engine(tiny_llama, "torch"))


def test_tiny_llama_folder_tokenizer_matches_hf_tokenizers(tiny_llama: Path) -> None:
    """The test's own tokenizer.json is a valid byte-level BPE: the `tokenizers` library and
    the engine encode the prompts identically, with several merges used."""
    tokenizers = pytest.importorskip("tokenizers")
    reference = tokenizers.Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    engine_tok = make_engine(tiny_llama, "torch").tokenizer
    for text in PROMPTS + FOLLOW_UPS:
        ids = engine_tok.encode(text)
        assert ids == reference.encode(text).ids
        assert any(i >= 256 for i in ids)  # merges really apply


def test_triton_backend_generates_what_the_torch_backend_does(
    tiny_llama: Path, torch_run: Run, triton_launches: dict[str, int]
) -> None:
    triton_run = run_workload(make_engine(tiny_llama, "triton"))
    steps = len(triton_run.step_logits)

    # the workload is what it claims: chunked prefill, a batch of 3, prefix-cache hits
    assert steps == len(torch_run.step_logits) and steps > 2 * MAX_TOKENS
    assert max(len(p) for p in PROMPTS + FOLLOW_UPS) > CHUNK
    assert torch_run.cached[:3] == [0, 0, 0]
    assert torch_run.cached[3] >= 2 * PAGE_SIZE and torch_run.cached[4] >= PAGE_SIZE
    assert any(logits.shape[0] == 3 for logits in torch_run.step_logits)

    assert triton_run.tokens == torch_run.tokens
    assert triton_run.cached == torch_run.cached
    for t, ref in zip(triton_run.step_logits, torch_run.step_logits, strict=True):
        assert t.shape == ref.shape
        if t.numel():
            torch.testing.assert_close(t, ref, atol=LOGITS_ATOL, rtol=0.0)

    # every hot op of every layer went through Triton (the torch path raises if called)
    model_steps = triton_launches["store_kv"] // LAYERS
    assert model_steps >= steps and triton_launches["store_kv"] == LAYERS * model_steps
    assert triton_launches["rotary"] == LAYERS * model_steps
    assert triton_launches["silu_and_mul"] == LAYERS * model_steps
    assert triton_launches["rms_norm"] == (2 * LAYERS + 1) * model_steps
    decode, prefill = triton_launches["paged_decode_attention"], triton_launches[
        "paged_prefill_attention"
    ]
    assert decode > 0 and prefill > 0 and decode + prefill == LAYERS * model_steps


def test_triton_on_cpu_without_the_interpreter_is_refused(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        Engine(EngineConfig(model=tiny_llama, num_pages=8, kernel_backend="triton"))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kernel_backend": "cuda"}, "kernel_backend must be one of"),
        ({"device": "cuda", "quantization": "fp16"}, "CPU weight format"),
        ({"device": "tpu"}, "device must be"),
    ],
)
def test_engine_config_checks_kernel_backend_and_device(
    fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)


def test_kernels_export_what_the_engine_uses() -> None:
    """The engine reaches the kernels through the package's public names only."""
    engine_dir = Path(__file__).resolve().parents[2] / "engine"
    for path in engine_dir.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "from paged_kernels." not in text and "import paged_kernels." not in text, path.name
        for word in text.split("paged_kernels.")[1:]:
            name = word.split("(")[0].split(")")[0].split(",")[0].split()[0].strip("`:")
            if name.isidentifier():
                assert name in paged_kernels.__all__, f"{path.name} uses paged_kernels.{name}"


@pytest.mark.skipif(
    triton_interpret_enabled() or not torch.cuda.is_available(),
    reason="needs a GPU with TRITON_INTERPRET=0 (benchmarks/gpu_check.sh)",
)
def test_cuda_decode_steps_never_sync_with_the_host(tiny_llama: Path) -> None:
    """On CUDA a decode step (inputs prepared, model run, logits) issues no host sync: every
    one runs under torch's sync debugger in "error" mode. 16-bit weights, Triton kernels."""
    engine = Engine(EngineConfig(
        model=tiny_llama, page_size=PAGE_SIZE, num_pages=48, max_num_batched_tokens=CHUNK,
        device="cuda", dtype="float16", kernel_backend="triton",
    ))  # fmt: skip
    runner = engine.runner
    prepare, run = runner.prepare, runner.run
    decode_steps = [0]

    def strict(fn: Callable[[Any], Any], arg: Any, decode: bool) -> Any:
        if not decode:
            return fn(arg)
        decode_steps[0] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(arg)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.prepare = lambda batch: strict(  # type: ignore[method-assign]
        prepare, batch, all(n == 1 for _, n in batch)
    )
    runner.run = lambda inputs: strict(run, inputs, inputs.meta.is_decode)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)
    assert decode_steps[0] >= 2 * (MAX_TOKENS - 1)
