#!/usr/bin/env bash
# The GPU-speed benchmarks in one command of about 3 minutes, each fast path beside its baseline, results to $1.
#
#   bash bench/gpu_speed.sh OUT_DIR
#
# 1. the CUDA-only tests (Triton top-k kernel, FlexAttention, target pass, compiled decode);
# 2. training attention at the Qwen3-4B shape (bench_train_attention.py: cutoffs, block mask,
#    sparse forward/backward, target pass against dense SDPA);
# 3. decoding a Qwen3-8B-shaped model (random bf16 weights, batch 1) with KVpopCache B = 2048 and
#    Hugging Face's dense cache, eager and compiled, at 4k-128k tokens of context.
# Each step has its own time limit, so one failure leaves the others' results; every benchmark prints
# its measurements as they land.
set -uo pipefail
out=${1:?usage: bench/gpu_speed.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, never abort the script
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 40
  echo "=== $name exit ${PIPESTATUS[0]} ($(date -u +%H:%M:%S))"
}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv
echo "MPS control: $(command -v nvidia-cuda-mps-control || echo none)"
step tests "${KVPOP_TESTS_S:-90}" python -m pytest -q -rs -p no:cacheprovider tests/test_topk_kernel.py \
  tests/test_decode.py tests/test_retrofit.py::test_flex_path_on_cuda_equals_cpu_path -m "gpu or not slow" \
  -k "(kernel or cuda) and not test_cuda_graph_step_equals_eager"
step train_attention "${KVPOP_TRAIN_ATTN_S:-140}" python bench/bench_train_attention.py --lengths 16384
# KVpopCache and the dense cache, eager and as a captured CUDA graph (`--compile-backend cudagraph`: the eager step
# captured once, no whole-step inductor compile; bench/gpu_speed_defaults.sh times the default, inductor)
step decode_kvpop "${KVPOP_DECODE_S:-150}" python -m kvpop.eval.bench --model qwen3-8b-shape --device cuda \
  --caches kvpop --contexts 4096,16384,65536,131072 --budget 2048 --window 256 --compile --compile-backend cudagraph \
  --fill random --new-tokens 32 --warmup 4
step decode_dense "${KVPOP_DENSE_S:-120}" python -m kvpop.eval.bench --model qwen3-8b-shape --device cuda \
  --caches dense --contexts 4096,16384,65536,131072 --budget 2048 --window 256 --compile --compile-backend cudagraph \
  --fill random --new-tokens 32 --warmup 4
