#!/usr/bin/env bash
# The speed of the defaults on one GPU, with nothing set by the user: one phase per command, each within 10 minutes,
# results to OUT_DIR, then `bench/speed_targets.py` over everything in OUT_DIR so far.
#
#   bash bench/gpu_speed_defaults.sh tests OUT          # the CUDA tests of the decode kernels, the compiled steps
#                                                        # and the training attention's rule (about 5 min)
#   bash bench/gpu_speed_defaults.sh decode OUT         # Qwen3-8B shape, 36 layers, B = 2048, 4k: the static rule
#                                                        # and the layer-wide cascade compiled cold (about 6 min)
#   bash bench/gpu_speed_defaults.sh decode-long OUT    # the same at 4k and 128k from inductor's cache, then
#                                                        # compiled dense StaticCache at 4k, cold (about 6 min)
#   bash bench/gpu_speed_defaults.sh decode-chunked OUT  # the recommended policy deciding every 64 steps, its step
#                                                        # compiled (the decisions between steps), 4k and 128k
#                                                        # (about 5 min)
#   bash bench/gpu_speed_defaults.sh generate1 OUT      # model.generate at SmolLM2's shape, 4k prompt, batch 1:
#                                                        # compiled StaticCache, KVpop, the cascade, cold (about 5 min)
#   bash bench/gpu_speed_defaults.sh generate1-cached OUT  # the same from inductor's cache (about 3 min)
#   bash bench/gpu_speed_defaults.sh generate4 OUT      # batch 4 (about 5 min)
#   bash bench/gpu_speed_defaults.sh prefill OUT        # one 8192-token prompt at B = 2048: the dense forward, the
#                                                        # static rule, H2O, TOVA and the recommended policy's walk,
#                                                        # and the recommended policy deciding every 64 and 256 steps
#                                                        # (rounds as kernels and in PyTorch), at the Qwen3-8B shape
#                                                        # and SmolLM2's (about 4 min)
#   bash bench/gpu_speed_defaults.sh prefill-profile OUT  # where the chunked prefill's time goes at SmolLM2's shape
#                                                        # (8192 tokens, chunks of 256): operators and kernels,
#                                                        # dense against the recommended policy (about 2 min)
#   bash bench/gpu_speed_defaults.sh distill OUT        # a distillation step, SmolLM2's shape at 8k (auto, gather)
#                                                        # and the Qwen3-4B shape at 16k, 4 layers (auto, flex)
#                                                        # (about 8 min)
#   KVPOP_TINY=1 bash bench/gpu_speed_defaults.sh all OUT   # every phase at a tiny size, on the CPU if no GPU
#
# "cold" phases empty inductor's cache first (KVPOP_INDUCTOR_CACHE, default ~/kvpop-inductor-cache); the others use
# what an earlier phase left on the same machine, so run them in this order while the machine stays warm. Each phase
# prints whether it found the cache empty. Every command has its own time limit and log (OUT/NAME.log); its JSON
# result is OUT/NAME.json.
set -uo pipefail
phase=${1:?usage: bench/gpu_speed_defaults.sh tests|decode|decode-long|generate1|generate1-cached|generate4|decode-chunked|prefill|prefill-profile|distill|all OUT_DIR}
out=${2:?usage: bench/gpu_speed_defaults.sh PHASE OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
cache=${KVPOP_INDUCTOR_CACHE:-$HOME/kvpop-inductor-cache}
export TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton
tiny=${KVPOP_TINY:-0}
if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  device=cuda
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv,noheader
else
  device=cpu
fi
echo "# $(date -u +%FT%TZ) phase $phase on $device, commit $(git rev-parse --short HEAD 2>/dev/null || echo none)"

step() {  # step NAME SECONDS COMMAND...: a time limit, the log in OUT/NAME.log, never aborts the script
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v '^{' | tail -n 30
  echo "=== $name exit ${PIPESTATUS[0]} ($(date -u +%H:%M:%S))"
}
cold() {  # an empty inductor cache: what a new user's first compile meets
  rm -rf "$cache" && mkdir -p "$cache"
  echo "# inductor cache emptied: $cache"
}
warm() {
  mkdir -p "$cache"
  echo "# inductor cache: $(find "$cache" -type f | wc -l) files in $cache"
}

# sizes: the targets' shapes, or a tiny stand-in that runs anywhere in a minute or two
if [ "$tiny" = 1 ]; then
  m8b=(--model tiny-qwen3-shape --dtype float32); ctx=(64 128); b8=32; win8=8; newtok=2; warmup=1
  compile_backend=(--compile-backend aot_eager)
  msm=(--model smollm2-135m-shape --num-layers 2 --dtype float32); gctx=64; gbudget=32; gnew=4; grep_=1
  dsm=(--model smollm2-135m-shape --num-layers 2 --dtype float32 --seq-len 128 --budget 32 --window 8 --warmup 1
       --steps 1)
  d4b=(--model smollm2-135m-shape --num-layers 1 --dtype float32 --seq-len 256 --budget 64 --window 16 --warmup 1
       --steps 1)
  pre8b=(--model tiny-qwen3-shape --dtype float32 --context 128 --budget 32 --repeats 2)
  chunked=cascade+chunk8,cascade+chunk16; dchunked=cascade+chunk8
  presm=(--model smollm2-135m-shape --num-layers 2 --dtype float32 --context 128 --budget 32 --repeats 2)
  tests=(tests/test_attention.py -k auto_backend)
  gpu_tests=(tests/test_decode.py -m gpu)
else
  m8b=(--model qwen3-8b-shape); ctx=(4096 131072); b8=2048; win8=256; newtok=32; warmup=4
  compile_backend=()
  msm=(--model smollm2-135m-shape --dtype bfloat16); gctx=4096; gbudget=1024; gnew=128; grep_=2
  dsm=(--model smollm2-135m-shape --dtype float32 --seq-len 8192 --budget 1024 --window 256 --warmup 3 --steps 8)
  d4b=(--model qwen3-4b-shape --num-layers 4 --seq-len 16384 --budget 2048 --window 512 --warmup 2 --steps 5)
  pre8b=(--model qwen3-8b-shape --context 8192 --budget 2048 --repeats 2)
  chunked=cascade+chunk64,cascade+chunk256  # the recommended policy deciding every 64 and 256 steps
  dchunked=cascade+chunk64  # ... and its compiled decode step
  presm=(--model smollm2-135m-shape --dtype bfloat16 --context 8192 --budget 2048 --repeats 3)
  tests=(tests/test_slots.py tests/test_decode_kernel.py tests/test_attention.py::test_decode_attention_matches_reference
         tests/test_attention.py::test_auto_backend_on_cuda_picks_by_shape_and_budget
         tests/test_attention.py::test_auto_backend_threshold_and_the_other_devices
         tests/test_chunked.py::test_a_captured_round_is_the_eager_round tests/test_chunked_kernel.py)
  gpu_tests=(tests/test_decode.py tests/test_cascade.py tests/test_generation.py -m gpu)
fi
bench=(python -m kvpop.eval.bench "${m8b[@]}" --device "$device" --budget "$b8" --window "$win8" --fill random
       --new-tokens "$newtok" --warmup "$warmup" --compile "${compile_backend[@]}")
generate=(python bench/bench_generate.py "${msm[@]}" --device "$device" --caches static,kvpop,cascade
          --contexts "$gctx" --budget "$gbudget" --new-tokens "$gnew" --repeats "$grep_")
distill=(python bench/bench_distill.py --data prose --device "$device")

run_phase() {
  case $1 in
    tests)
      # the kernels' tests, in this process on CUDA (byte for byte, the compiled custom ops); then the gpu-marked
      # decode, cascade and generation tests (inductor with kvpop's options, model.generate with nothing set, the
      # captured steps, the walk at size)
      step tests_kernels 240 python -m pytest -q -rs -p no:cacheprovider "${tests[@]}"
      step tests_gpu 330 python -m pytest -q -rs -p no:cacheprovider "${gpu_tests[@]}" ;;
    decode)
      cold
      step decode_cold 570 "${bench[@]}" --caches kvpop,cascade --contexts "${ctx[0]}" --json-out "$out/decode_cold.json" --force ;;
    decode-long)
      warm
      step decode_long 330 "${bench[@]}" --caches kvpop,cascade --contexts "${ctx[0]},${ctx[1]}" \
        --json-out "$out/decode_long.json" --force
      step decode_dense 240 "${bench[@]}" --caches dense --contexts "${ctx[0]}" --json-out "$out/decode_dense.json" --force ;;
    decode-chunked)
      warm
      step decode_chunked 400 "${bench[@]}" --caches "$dchunked" --contexts "${ctx[0]},${ctx[1]}" \
        --json-out "$out/decode_chunked.json" --force ;;
    generate1)
      cold
      step generate_b1 560 "${generate[@]}" --batch 1 --json-out "$out/generate_b1.json" ;;
    generate1-cached)
      warm
      step generate_b1_cached 400 "${generate[@]}" --batch 1 --json-out "$out/generate_b1_cached.json" ;;
    generate4)
      warm
      step generate_b4 560 "${generate[@]}" --batch 4 --json-out "$out/generate_b4.json" ;;
    prefill)
      # the first repeat of each row is cold (compiles, Triton's first launches); the targets compare the last one
      step prefill_8b 300 python bench/bench_prefill.py "${pre8b[@]}" --device "$device" \
        --policies "tova,h2o,kvpop,cascade,$chunked" --no-replay --pytorch-rounds --json-out "$out/prefill_8b.json"
      step prefill_smollm2 200 python bench/bench_prefill.py "${presm[@]}" --device "$device" \
        --policies "tova,h2o,kvpop,cascade,$chunked" --no-replay --pytorch-rounds \
        --json-out "$out/prefill_smollm2.json" ;;
    prefill-profile)
      # the prefill phase's SmolLM2 shape without its last two arguments (--repeats N: the profile takes --runs)
      step prefill_profile 200 python bench/profile_prefill.py "${presm[@]:0:${#presm[@]}-2}" --caches "dense,${chunked##*,}" \
        --warmup 2 --runs 3 --device "$device" --out "$out/prefill_profile" ;;
    distill)
      # SmolLM2's shape: auto keeps FlexAttention (its step is bound by launches), the gathered tiles beside it;
      # the 4B shape at 16k: auto takes the gathered tiles, FlexAttention over the sequence beside it
      step distill_smollm2_auto 150 "${distill[@]}" "${dsm[@]}" --attention auto --json-out "$out/distill_smollm2_auto.json"
      step distill_smollm2_gather 150 "${distill[@]}" "${dsm[@]}" --attention gather \
        --json-out "$out/distill_smollm2_gather.json"
      step distill_4b_auto 130 "${distill[@]}" "${d4b[@]}" --attention auto --json-out "$out/distill_4b_auto.json"
      if [ "$device" = cuda ]; then
        step distill_4b_flex 130 "${distill[@]}" "${d4b[@]}" --attention flex --json-out "$out/distill_4b_flex.json"
      fi ;;
    *)
      echo "unknown phase $1: tests, decode, decode-long, generate1, generate1-cached, generate4, decode-chunked, prefill, prefill-profile, distill or all" >&2
      exit 2 ;;
  esac
}

if [ "$phase" = all ]; then
  for p in tests decode decode-long generate1 generate1-cached generate4 decode-chunked prefill prefill-profile distill; do run_phase "$p"; done
else
  run_phase "$phase"
fi
echo "=== targets so far"
python bench/speed_targets.py "$out"
