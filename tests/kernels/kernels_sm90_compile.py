"""Compile every Triton kernel for sm_90 (H100/H200) without a GPU; run as a script.

Must run in a process where TRITON_INTERPRET is unset from the start: Triton's own library
functions are decorated when triton is imported, so an interpreter-mode process cannot
compile for a GPU. ``test_kernels_triton_compile.py`` runs this in a subprocess.
Prints one ``compiled <kernel> <dtype>`` line per kernel; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ATTENTION_CASES = [  # (kernel, dtype, constexprs) as the launch wrappers choose them
    ("_decode_split_kernel", "fp16", dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_G=16,
                                          BLOCK_D=64, BLOCK_N=64, DOT_PRECISION="tf32")),
    ("_decode_split_kernel", "fp32", dict(GROUP=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=16,
                                          BLOCK_D=128, BLOCK_N=64, DOT_PRECISION="ieee")),
    ("_decode_merge_kernel", "bf16", dict(HEAD_DIM=128, BLOCK_S=8, BLOCK_D=128)),
    ("_prefill_kernel", "fp16", dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_G=4, BLOCK_T=16,
                                     BLOCK_N=64, BLOCK_D=64, DOT_PRECISION="tf32")),
    ("_prefill_kernel", "bf16", dict(GROUP=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=8, BLOCK_T=8,
                                     BLOCK_N=32, BLOCK_D=128, DOT_PRECISION="tf32")),
]
OP_CASES = [  # (kernel, pointer types beyond the fp16 defaults, constexprs)
    ("_store_kv_kernel", {"slot_ptr": "*i64"}, dict(NUM_HEADS=3, HEAD_DIM=64, BLOCK_T=1,
                                                    BLOCK_HD=256)),
    ("_rms_norm_kernel", {"eps": "fp32"}, dict(HAS_RESIDUAL=True, BLOCK_R=1, BLOCK=1024)),
    ("_rotary_kernel", {"pos_ptr": "*i64", "cache_ptr": "*fp32"},
     dict(NUM_Q_HEADS=9, NUM_K_HEADS=3, HALF=32, INTERLEAVED=True, BLOCK_T=1, BLOCK_JQ=512,
          BLOCK_JK=128)),
    ("_rotary_kernel", {"pos_ptr": "*i64", "cache_ptr": "*fp32"},
     dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HALF=64, INTERLEAVED=False, BLOCK_T=1, BLOCK_JQ=2048,
          BLOCK_JK=512)),
    ("_silu_and_mul_kernel", {}, dict(BLOCK_R=1, BLOCK=1024)),
]


def compile_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any]) -> Any:
    """Lower ``fn`` to a cubin. Pointers default to fp16, other arguments to i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    def arg_type(name: str) -> str:
        if name in consts:
            return "constexpr"
        return types.get(name, "*fp16" if name.endswith("_ptr") else "i32")

    signature = {name: arg_type(name) for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    options = {"num_warps": 4, "enable_fp_fusion": True}
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def attention_types(dtype: str) -> dict[str, str]:
    return {
        **{n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "out_ptr")},
        "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "cu_seqlens_ptr": "*i32",
        "mid_o_ptr": "*fp32",
        "mid_lse_ptr": "*fp32",
        "scale_log2": "fp32",
    }


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1: cannot compile for a GPU in this process", file=sys.stderr)
        return 2
    from paged_kernels import triton_attention, triton_ops

    for name, dtype, consts in ATTENTION_CASES:
        kernel = compile_sm90(getattr(triton_attention, name), attention_types(dtype), consts)
        assert ".target sm_90" in kernel.asm["ptx"] and kernel.asm["cubin"], name
        print(f"compiled {name} {dtype}", flush=True)
    for name, types, consts in OP_CASES:
        kernel = compile_sm90(getattr(triton_ops, name), types, consts)
        assert kernel.asm["cubin"], name
        print(f"compiled {name} fp16", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
