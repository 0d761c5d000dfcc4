#!/usr/bin/env bash
# The eleventh session's device calls (issues 16, 17, 18), back to back in one warm lease of one H200 (`nvidia-h200`);
# they ran at commit 909b344 (calls 1-4); the tenth session's calls are this file at commit 5e89fc2.
# bench/README.md has the runbook.
#
#   bash bench/gpu_evaluation.sh 1 OUT   # carry .stage_a: stage the model's first half; the CUDA tests of the
#                                        # parallel walk with priors (the lease's minutes go to calls 2-4)
#   bash bench/gpu_evaluation.sh 2 OUT   # carry .stage_b: assemble SmolLM2; train the study's learned rows under
#                                        # MPS, seed 0, both budgets, scorer-only (DMS: gates only): the best KVpop-mlp
#                                        # (pre-RoPE keys, the domain mixture) and DMS
#   bash bench/gpu_evaluation.sh 3 OUT   # under one MPS daemon: the runs finished, then side by side the teacher-forced
#                                        # table on the seventh session's 8 sequences (TOVA, StreamingLLM and the
#                                        # oracle again beside the trained rows), the task suite (every family) and the
#                                        # long-generation fidelity (4096 tokens at B = 2048, 2048 at B = 1024) of the
#                                        # trained rows (issue 16 item 7; the training-free rows' are the tenth's)
#   bash bench/gpu_evaluation.sh 4 OUT   # out of domain: the same rows on Python code (pystdlib, never trained on as
#                                        # held-out text), 8 x 8192 tokens; `generate` of SmolLM2 against StaticCache +
#                                        # compile, batch 1 and 4 (issue 18 item 2)
#   bash bench/gpu_evaluation.sh 5 OUT   # no model needed, any fresh machine: the top-k / block-mask kernel tests and the
#                                        # training path's cutoffs and block mask against the sparse forward (issue 18)
#
# Lessons: nine scorer-only runs under MPS ran 3-18 s/step on one GPU (eighth session), four MLP runs 0.85 s/step
# (ninth); runs stopped by the deadline's stop-grace (60 s) before their last step leave only checkpoints, and the suite
# and fidelity take final weights only (`trained`), so call 2's training budget must cover all the steps (tenth);
# the table's StreamingLLM / oracle must repeat the seventh session's digits on its 8 sequences; fidelity decodes
# ~20-40 ms per batch step (launch-bound), so its processes share the GPU under MPS.
# Knobs: ROWS, FREE_ROWS, STEPS (120), SEEDS (0), TRAIN_S (call 2's training seconds, 420), TRAIN3_S / EVAL_S (call 3: 60 / 420),
# FID_P (8 problems), SUITE_S (400), SIDE_S (fidelity, 430), LENGTHS (4k,8000), OOD_S (call 4's code rows, 330).
set -uo pipefail
phase=${1:?usage: bench/gpu_evaluation.sh 1|2|3|4|5 OUT_DIR}
dest=${2:?usage: bench/gpu_evaluation.sh 1|2|3|4|5 OUT_DIR}
# the device returns at most 8 files: everything goes to a work folder, packed into OUT/callN.tgz at the end
# a machine can keep $HOME from an earlier session (the tenth found the ninth's files): the call's folder starts empty
out=$HOME/call$phase
rm -rf "$out" && mkdir -p "$out" "$dest"
trap 'tar czf "$dest/call$phase.tgz" -C "$out" . && ls -la "$dest"' EXIT
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
stage=$HOME/stage
gguf=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$HOME/site:$PWD/src KVPOP_SMOLLM2_GGUF=$gguf
kvpop=(python -m kvpop.cli)
step() {  # step NAME SECONDS COMMAND...: a time limit, the log in OUT/NAME.log, never aborts the script
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))"; tail -n 30 "$out/$name.log"
}

fidelity() {  # fidelity NAME ARGS...: long-generation fidelity into $HOME/NAME (finished generations kept)
  local name=$1; shift
  step "$name" "${SIDE_S:-430}" "${kvpop[@]}" eval --model smollm2-135m --generate "${FID_N:-2048}" \
    --problems "${FID_P:-8}" --samples "${FID_SAMPLES:-1}" --gen-batch "${FID_BATCH:-16}" --ignore-eos \
    --no-progress --out "$HOME/$name" "$@"
  mkdir -p "$out/$name" && cp "$HOME/$name"/fidelity.* "$out/$name/" 2>/dev/null
}

suite() {  # suite NAME ARGS...
  local name=$1; shift
  step "$name" "${SIDE_S:-420}" "${kvpop[@]}" eval --model smollm2-135m --suite "${SUITE_TASKS:-all}" \
    --lengths "${LENGTHS:-4k,8000}" --depths 0,0.5,1 --samples 1 --suite-batch 8 --no-progress \
    --out "$HOME/$name" "$@"
  mkdir -p "$out/$name" && cp "$HOME/$name"/*.json "$HOME/$name"/*.txt "$out/$name/" 2>/dev/null
}

mps_on() {  # NVIDIA's MPS daemon, so launch-bound side processes run their kernels at once; off if a probe fails
  export CUDA_MPS_PIPE_DIRECTORY=$HOME/mps/pipe CUDA_MPS_LOG_DIRECTORY=$HOME/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d && python -c "import torch; print(float(torch.ones(8, device='cuda').sum()))" \
      | grep -q '^8.0$'; then
    echo "MPS on"
  else  # without a daemon to connect to, CUDA would fail in every process: run time-sliced instead
    echo quit | timeout 5 nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS off (the daemon or its probe failed)"
  fi
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
rows=${ROWS:-kvpop-mlp+prerope+mix+frozen,dms+frozen}
study=(python bench/quality_study.py --out "$HOME/study" --steps "${STEPS:-120}" --seeds "${SEEDS:-0}"
       --rows "$rows" --mix champ,pystdlib,prose --free-rows "${FREE_ROWS:-oracle,streaming_llm,tova}")
trained() {  # the seed-0 final weights of the study's rows at budget $1, as --trained arguments
  for d in "$HOME"/study/runs/*_b"$1"; do
    case $d in *_s[0-9]*_b"$1") continue ;; esac  # seed 0 only
    [ -f "$d/final/kvpop_config.json" ] && echo --trained "$(basename "${d%_b$1}")=$d/final"
  done
}
case $phase in
1)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  # the parallel walk with KVpop-TOVA's priors on CUDA (the selection kernel, the 8B shape's heads at 2k)
  step tests 120 python -m pytest -q -rs -p no:cacheprovider tests/test_dynamic.py -m "gpu or not slow" \
    -k "at_size_on_cuda or parallel_selection_kernel"
  ;;
2)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  "${study[@]}" --mps --phase train --deadline-s "${TRAIN_S:-420}" --concurrency 8 > "$out/study_train.log" 2>&1
  tail -n 40 "$out/study_train.log"
  cp "$HOME/study/train_status.json" "$out/" 2>/dev/null
  ;;
3)
  # everything of the evaluation at once, under one MPS daemon that every process joins (the study without its own
  # --mps): the runs finished, then the teacher-forced table, the suite and the fidelity side by side
  mps_on
  "${study[@]}" --phase train --deadline-s "${TRAIN3_S:-60}" --min-start-s 20 --stop-grace-s 15 --concurrency 8 \
    > "$out/study_train.log" 2>&1
  tail -n 12 "$out/study_train.log"
  ( "${study[@]}" --phase eval --deadline-s "${EVAL_S:-420}" --eval-sequences 8 --concurrency 8 > "$out/study.log" 2>&1
    for f in results.json table.md recall_per_layer.png train_status.json; do cp "$HOME/study/$f" "$out/" 2>/dev/null; done
    grep -v progress "$out/study.log" | tail -n 40 ) &
  for b in 2048 1024; do
    ( SIDE_S=${SUITE_S:-400} suite "suite_b$b" --policies none --budgets "$b" $(trained "$b")
      cp "$HOME/suite_b$b"/*.png "$out/suite_b$b/" 2>/dev/null ) &
  done
  # B = 2048 needs 4096 tokens to fill its cache for long; one trained row per process, so the launch-bound
  # decodes overlap; B = 1024 at 2048 tokens as in the ninth session's table
  while read -r flag t; do
    FID_N=4096 fidelity "fid_b2048_${t%%=*}" --policies none --budgets 2048 --samples 0 "$flag" "$t" &
  done < <(trained 2048)
  FID_N=2048 fidelity fid_b1024 --policies none --budgets 1024 --samples 0 $(trained 1024) &
  wait
  ;;
4)
  # out of domain (issue 17's target): Python code, never the training text, the same rows at both budgets
  mps_on
  for b in 2048 1024; do
    step "code_b$b" "${OOD_S:-330}" "${kvpop[@]}" eval --model smollm2-135m --data pystdlib --seq-len 8192 \
      --sequences 8 --budgets "$b" --policies streaming_llm,tova,h2o $(trained "$b") --no-progress \
      --out "$HOME/code_b$b" &
  done
  wait
  for b in 2048 1024; do mkdir -p "$out/code_b$b" && cp "$HOME/code_b$b"/*.json "$HOME/code_b$b"/*.md "$out/code_b$b/" 2>/dev/null; done
  # the daemon stopped and its environment gone: the eleventh session's generate bench failed in inductor right
  # after a stop with the variables still set (and ran cleanly in a fresh call)
  echo quit | timeout 5 nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  # issue 18 item 2 on SmolLM2 (batch 1 and 4), on a quiet GPU after the evaluation
  for bs in 1 4; do
    step "generate_smollm2_b$bs" 100 python bench/bench_generate.py --model smollm2-135m --device cuda \
      --contexts 4096 --caches static,kvpop --new-tokens 64 --budget 1024 --batch "$bs" --repeats 2 \
      --json-out "$out/generate_smollm2_b$bs.json"
  done
  ;;
5)
  # the training path's cutoffs and block mask (issue 18 item 4): needs no model, so it fits any fresh machine
  step tests 150 python -m pytest -q -rs -p no:cacheprovider tests/test_topk_kernel.py tests/test_attention_flex.py \
    -m "gpu or not slow" -k "cuda or triton or kernel"
  step train_attention 240 python bench/bench_train_attention.py --lengths 16384 --budget 2048 ${TA_ARGS:---quick} --json-out "$out/train_attention.json"
  ;;
*)
  echo "unknown phase $phase (1 to 5)"; exit 2
  ;;
esac
