#!/usr/bin/env bash
# The evaluation wave's device calls (issues 16, 17, 18), back to back in one warm lease of a 2-GPU
# kind (nvidia-h200-x2: twice the GPUs for the same device time). bench/README.md has the runbook.
#
#   bash bench/gpu_evaluation.sh a OUT   # carry .stage_a: stage the model's first half; the CUDA tests of the new
#                                        # paths, a CUDA smoke of the evidence scorer, TOVA/H2O prefill (8B shape)
#   bash bench/gpu_evaluation.sh b OUT   # carry .stage_b: assemble SmolLM2; train KVpop-mlp and KVpop-evidence at
#                                        # B = 2048 and 1024, two seeds each (quality_study.py, under MPS), while
#                                        # the task suite and the long-generation fidelity of the training-free
#                                        # rows run beside them
#   bash bench/gpu_evaluation.sh c OUT   # the teacher-forced table of every row (document starts, 8 sequences of
#                                        # 8192), the suite and the fidelity of the trained rows
#   bash bench/gpu_evaluation.sh d OUT   # SmolLM2 prefill and `generate` benchmarks; unfinished fidelity goes on
#
# Knobs: STEPS (120), TRAIN_S (540), EVAL_S (400), FID_N (4096 new tokens), FID_P (8 problems),
# FID_SAMPLES (1 sampled generation besides the greedy one), FID_BATCH (16), SIDE_S (seconds for the
# suite and fidelity processes beside training, 480), LENGTHS (suite: 2k,4k,8000; 8k leaves no room for the answer in 8192 positions).
set -uo pipefail
phase=${1:?usage: bench/gpu_evaluation.sh a|b|c|d OUT_DIR}
out=${2:?usage: bench/gpu_evaluation.sh a|b|c|d OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
stage=$HOME/stage
gguf=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$HOME/site:$PWD/src KVPOP_SMOLLM2_GGUF=$gguf
kvpop=(python -m kvpop.cli)
rows=(--rows kvpop-mlp,kvpop-evidence --seeds 0,1)
study=(python bench/quality_study.py --out "$HOME/study" --steps "${STEPS:-120}" --lr-base 1e-5 --mps "${rows[@]}")
free=(--policies streaming_llm,tova,tova_windowed,h2o,h2o_windowed)

step() {  # step NAME SECONDS COMMAND...: a time limit, the log in OUT/NAME.log, never aborts the script
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))"; tail -n 30 "$out/$name.log"
}

on_gpu() {  # on_gpu ID COMMAND...: one GPU, outside MPS (in the 2026-12-01 lease, side processes pointed at the
  # study's MPS pipe could not connect in the eval call and fell back to the CPU; time-slicing beside it is safe)
  local gpu=$1; shift
  CUDA_VISIBLE_DEVICES=$gpu "$@"
}

fidelity() {  # fidelity NAME GPU ARGS...: long-generation fidelity into $HOME/NAME (finished generations kept)
  local name=$1 gpu=$2; shift 2
  on_gpu "$gpu" step "$name" "${SIDE_S:-480}" "${kvpop[@]}" eval --model smollm2-135m --generate "${FID_N:-4096}" \
    --problems "${FID_P:-8}" --samples "${FID_SAMPLES:-1}" --gen-batch "${FID_BATCH:-16}" --ignore-eos \
    --no-progress --out "$HOME/$name" "$@"
  for f in "$HOME/$name"/fidelity.* "$HOME/$name"/generations.jsonl; do
    [ -f "$f" ] && cp "$f" "$out/$name.${f##*/}"
  done
}

suite() {  # suite NAME GPU ARGS...
  local name=$1 gpu=$2; shift 2
  on_gpu "$gpu" step "$name" "${SIDE_S:-480}" "${kvpop[@]}" eval --model smollm2-135m --suite "${SUITE_TASKS:-all}" \
    --lengths "${LENGTHS:-2k,4k,8000}" --depths 0,0.5,1 --samples 2 --suite-batch 8 --no-progress \
    --out "$HOME/$name" "$@"
  mkdir -p "$out/$name" && cp "$HOME/$name"/* "$out/$name/" 2>/dev/null
}

wait_for_model() {  # the study converts SmolLM2 once; the side processes start after it
  for _ in $(seq 120); do
    grep -q "train:" "$out/study_train.log" 2>/dev/null && return 0
    sleep 2
  done
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
case $phase in
a)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  (
    CUDA_VISIBLE_DEVICES=0 step tests 200 python -m pytest -q -rs -p no:cacheprovider tests/test_dynamic.py \
      tests/test_decode.py tests/test_topk_kernel.py tests/test_attention_flex.py -m "gpu or not slow" \
      -k "cuda or triton or kernel or flex"
    CUDA_VISIBLE_DEVICES=0 step evidence_smoke 120 bash -c '
      set -e; printf "%s\n" "the cat sat on the mat and the dog ran far away from home" > /tmp/notes.txt
      for i in $(seq 200); do cat /tmp/notes.txt; done > /tmp/notes_long.txt
      python -m kvpop.cli train --model tiny-random-qwen3 --data /tmp/notes_long.txt --seq-len 512 --budget 128 \
        --scorer evidence --steps 4 --device cuda --out /tmp/ev --no-progress
      python -m kvpop.cli eval --model tiny-random-qwen3 --data /tmp/notes_long.txt --split all --seq-len 512 \
        --sequences 2 --policies tova --budgets 128 --trained /tmp/ev/final --device cuda --out /tmp/ev_eval \
        --no-progress'
  ) &
  CUDA_VISIBLE_DEVICES=1 step prefill_8b 240 python bench/bench_prefill.py --model qwen3-8b-shape --device cuda \
    --context 8192 --budget 2048 --policies tova,h2o,kvpop --repeats 3 --json-out "$out/prefill_8b.json"
  wait
  ;;
b)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  "${study[@]}" --phase train --deadline-s "${TRAIN_S:-540}" --concurrency 8 > "$out/study_train.log" 2>&1 &
  study_pid=$!
  wait_for_model
  suite suite_free 1 "${free[@]}" --budgets 2048,1024 &
  fidelity fid_free_b2048 0 "${free[@]}" --budgets 2048 &
  fidelity fid_free_b1024 1 "${free[@]}" --budgets 1024 &
  wait $study_pid
  tail -n 40 "$out/study_train.log"
  cp "$HOME/study/train_status.json" "$out/" 2>/dev/null
  wait
  ;;
c)
  trained_b() { for d in "$HOME"/study/runs/kvpop-*_b"$1"/final; do [ -d "$d" ] && echo --trained "$d"; done; }
  # shellcheck disable=SC2046 # one word per flag and directory
  "${study[@]}" --phase eval --deadline-s "${EVAL_S:-400}" --eval-sequences 8 > "$out/study_eval.log" 2>&1 &
  study_pid=$!
  sleep 20
  # the trained rows of seed 0 (row_b*), and the training-free rows again where call b ran out of time
  seed0() { for d in "$HOME"/study/runs/kvpop-{mlp,evidence}_b"$1"/final; do [ -d "$d" ] && echo --trained "$d"; done; }
  # shellcheck disable=SC2046
  suite suite_all 1 "${free[@]}" --budgets 2048,1024 $(seed0 2048) $(seed0 1024) &
  # shellcheck disable=SC2046
  fidelity fid_b1024 0 --policies streaming_llm,tova,h2o --budgets 1024 $(seed0 1024) &
  wait $study_pid
  tail -n 60 "$out/study_eval.log"
  for f in results.json table.md eviction_pattern.png recall_per_layer.png; do cp "$HOME/study/$f" "$out/" 2>/dev/null; done
  wait
  ;;
d)
  CUDA_VISIBLE_DEVICES=0 step prefill_smollm2 150 python bench/bench_prefill.py --model smollm2-135m --device cuda \
    --context 8192 --budget 2048 --policies tova,h2o,kvpop --repeats 3 --json-out "$out/prefill_smollm2.json" &
  CUDA_VISIBLE_DEVICES=1 step generate_smollm2_b1 400 python bench/bench_generate.py --model smollm2-135m \
    --device cuda --contexts 4096 --caches dense,static,kvpop,tova --new-tokens 128 --budget 2048 --batch 1 \
    --json-out "$out/generate_smollm2_b1.json"
  CUDA_VISIBLE_DEVICES=1 step generate_smollm2_b4 150 python bench/bench_generate.py --model smollm2-135m \
    --device cuda --contexts 4096 --caches dense,static,kvpop --new-tokens 128 --budget 2048 --batch 4 \
    --json-out "$out/generate_smollm2_b4.json"
  wait
  ;;
*)
  echo "unknown phase $phase (a, b, c or d)"; exit 2
  ;;
esac
