"""prefixgate kernels: paged attention and layer ops, Triton on CUDA, torch on CPU.

Every op takes ``backend=None | "triton" | "torch"``; ``None`` picks Triton for CUDA tensors
and the torch path otherwise. Triton is imported only when a Triton kernel is first used, so
``TRITON_INTERPRET=1`` set before that point runs the kernels on CPU tensors.
"""

from .attention import paged_decode_attention, paged_prefill_attention, store_kv
from .layer_ops import rms_norm, rotary, rotary_cache, silu_and_mul

__all__ = [
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary",
    "rotary_cache",
    "silu_and_mul",
    "store_kv",
]
