"""prefixgate kernels: paged attention and layer ops, Triton on CUDA, torch on CPU.

Every op takes ``backend=None | "triton" | "torch"``; ``None`` picks Triton for CUDA tensors
and the torch path otherwise (``resolve_backend``). Triton is imported only when a Triton
kernel is first used, so ``TRITON_INTERPRET=1`` set before that point runs the kernels on CPU
tensors.

KV cache layout: ``[num_pages, page_size, num_kv_heads, head_dim]``, contiguous, page size a
power of two >= 8; slot of (page, offset) = ``page * page_size + offset``.

    paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale) -> [B, Hq, D]
        q [B, Hq, D]; block_table [B, max_pages] int32; seq_lens [B] int32 (current token
        already stored)
    paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale)
        q [T, Hq, D] ragged by cu_seqlens_q [B+1] int32; seq_lens [B] int32 total tokens,
        new ones included and stored -> [T, Hq, D], causal over prefix + chunk
    store_kv(k, v, k_cache, v_cache, slot_mapping)   # in place; slot < 0 skips the token
    rms_norm(x, weight, eps, residual=None) -> normed, or (norm(x + residual), x + residual)
    rotary(q, k, positions, cos_sin_cache, layout="interleaved" | "half") -> (q_rot, k_rot)
    rotary_cache(max_positions, head_dim, theta, dtype=float32) -> [max_positions, head_dim]
    silu_and_mul(x) -> silu(x[..., :F]) * x[..., F:]

One engine step runs every op once per layer over the same metadata; build its plans once and
pass them as ``plan=`` (the op checks the plan was built for the tensors it gets):

    plan_attention(block_table, seq_lens, cu_seqlens_q, slot_mapping, k_cache, *, is_decode,
                   backend, max_new_tokens) -> AttentionPlan   # store_kv + both attentions
    plan_rotary(positions, cos_sin_cache, layout, *, backend) -> RotaryPlan

The layers of one step share its plans; ``plan_step`` checks the step once (plans, every
layer's caches, the layer geometry) and returns a ``StepOps`` whose per-layer ops
(``add_rms_norm``, ``split_rotate`` of a fused QKV row, ``store_kv``, ``attend``,
``silu_and_mul``) run without per-call checks:

    plan_step(attention_plan, rotary_plan, k_caches, v_caches, geometry, dtype) -> StepOps

``paged_kernels.naive`` holds the slow, obviously-correct references the tests compare against.
"""

from .attention import paged_decode_attention, paged_prefill_attention, store_kv
from .backend import BACKENDS, Backend, resolve_backend
from .layer_ops import rms_norm, rotary, rotary_cache, silu_and_mul
from .plan import AttentionPlan, RotaryPlan, plan_attention, plan_rotary
from .step_ops import QKV, LayerGeometry, NormedResidual, StepOps, plan_step

__all__ = [
    "BACKENDS",
    "QKV",
    "AttentionPlan",
    "Backend",
    "LayerGeometry",
    "NormedResidual",
    "RotaryPlan",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_attention",
    "plan_rotary",
    "plan_step",
    "resolve_backend",
    "rms_norm",
    "rotary",
    "rotary_cache",
    "silu_and_mul",
    "store_kv",
    "StepOps",
]
