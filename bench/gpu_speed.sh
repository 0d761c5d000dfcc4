#!/usr/bin/env bash
# The GPU-speed benchmarks of one device call, each fast path beside its baseline, results to $1.
#
#   bash bench/gpu_speed.sh OUT_DIR
#
# 1. the CUDA-only tests (Triton top-k kernel, FlexAttention, target pass, compiled decode);
# 2. training attention at the Qwen3-4B shape (bench_train_attention.py: cutoffs, block mask,
#    sparse forward/backward, target pass against dense SDPA);
# 3. decoding a Qwen3-8B-shaped model (random bf16 weights, batch 1) with KVpopCache B = 2048 and
#    Hugging Face's dense cache, eager and compiled, at 4k-128k tokens of context.
# Each step has its own time limit, so one failure leaves the others' results.
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
step tests "${KVPOP_TESTS_S:-170}" bash -c "python -m pytest -q -rs -m gpu tests/; python -m pytest -q tests/test_topk_kernel.py"
step train_attention "${KVPOP_TRAIN_ATTN_S:-110}" python bench/bench_train_attention.py --lengths 4096,16384 \
  --naive-mask --json-out "$out/train_attention.json"
step decode "${KVPOP_DECODE_S:-270}" python -m kvpop.eval.bench --model qwen3-8b-shape --device cuda \
  --contexts 4096,16384,65536,131072 --budget 2048 --window 256 --compile --fill random \
  --new-tokens 32 --warmup 4 --json-out "$out/decode.json"
