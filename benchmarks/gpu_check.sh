#!/usr/bin/env bash
# The GPU check of the Triton path, in one script: under 10 minutes, no downloads.
#
#   benchmarks/gpu_check.sh [--quick]
#
# With a CUDA GPU (TRITON_INTERPRET=0 for every part):
#   1. the Triton kernel tests, run on the GPU (PREFIXGATE_KERNEL_DEVICE=cuda)
#   2. the tiny-Llama end-to-end test on the GPU (triton vs torch engine; no host sync in decode)
#   3. benchmarks/bench_kernels.py: decode attention bandwidth as a fraction of a measured
#      device copy, speedup over SDPA on gathered pages
#   4. benchmarks/bench_gpu_engine.py: SmolLM2 greedy equal to CPU float32 on a prompt set,
#      host syncs in decode steps, TPOT and tokens/s at batch 1, 8, 64
# Without one it says so and runs what a CPU can: the sm_90 compile of every kernel, the
# end-to-end test in Triton's interpreter, and the CPU float32 reference of part 4.
# Every part logs to $GPU_CHECK_OUT (default /tmp/gpu_check); one table is printed at the end.
# On a GPU the parts' time limits add up to 570 s, so the script ends within 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${GPU_CHECK_OUT:-/tmp/gpu_check}"
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# step NAME TIMEOUT_S CMD...: run CMD under a time limit, log it, record "name rc seconds"
step() {
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/steps.tsv"
  tail -n 3 "$OUT/$name.log"
}

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "GPU: $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
  export TRITON_INTERPRET=0
  step kernel_tests_gpu 180 env PREFIXGATE_KERNEL_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_kernels_triton_ops.py tests/kernels/test_kernels_triton_attention.py
  step engine_e2e_gpu 90 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_engine_triton_e2e.py
  step bench_kernels 120 "$PY" benchmarks/bench_kernels.py $QUICK --out "$OUT/bench_kernels.json"
  step bench_gpu_engine 180 "$PY" benchmarks/bench_gpu_engine.py $QUICK --out "$OUT/bench_gpu_engine.json"
else
  echo "no CUDA GPU on this machine: the GPU parts do not run; running the CPU-runnable parts"
  step sm90_compile 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_triton_compile.py
  step engine_e2e_interpreter 300 env TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider \
    tests/engine/test_engine_triton_e2e.py
  step bench_kernels 60 "$PY" benchmarks/bench_kernels.py --no-cpu-table
  step bench_gpu_engine 400 "$PY" benchmarks/bench_gpu_engine.py --quick --out "$OUT/bench_gpu_engine.json"
fi
"$PY" benchmarks/gpu_check_report.py "$OUT"
