#!/usr/bin/env bash
# The twelfth session's device calls (issues 16, 17, 18), back to back in one warm lease of one H200 (`nvidia-h200`);
# the eleventh session's calls are this file at commit 31d4f17. bench/README.md has the runbook.
#
#   bash bench/gpu_evaluation.sh 1 OUT   # carry .stage_a: stage the model's first half; the CUDA tests of KVpop-cascade
#                                        # (the Triton walk with two pools, the captured decode step) and of the walks
#   bash bench/gpu_evaluation.sh 2 OUT   # carry .stage_b: assemble SmolLM2; train the study's learned rows under
#                                        # MPS, seed 0, both budgets: the best KVpop-mlp (pre-RoPE keys, the domain
#                                        # mixture, scorer-only), DMS (gates only) and StreamingLLM+ (base distilled)
#   bash bench/gpu_evaluation.sh 3 OUT   # under one MPS daemon, side by side: the teacher-forced table of every trained
#                                        # row and of KVpop-cascade (the KVpop-mlp weights with POOLS TOVA slots) beside
#                                        # TOVA on the seventh session's 8 sequences; the task suite and the long-
#                                        # generation fidelity of the cascade, DMS and StreamingLLM+ rows (issue 16 item 7)
#   bash bench/gpu_evaluation.sh 4 OUT   # held-out Python code (pystdlib) and Python's help topics (pydoc, out of
#                                        # domain), 8 x 8192 tokens, every training-free row, KVpop-mlp and the cascade;
#                                        # `generate` of SmolLM2 at batch 4 against StaticCache + compile (issue 18)
#   bash bench/gpu_evaluation.sh 5 OUT   # no model needed, any fresh machine: the top-k / block-mask kernel tests and the
#                                        # training path's cutoffs and block mask against the sparse forward (issue 18)
#
# Lessons: nine scorer-only runs under MPS ran 3-18 s/step on one GPU (eighth session), four MLP runs 0.85 s/step
# (ninth); runs stopped by the deadline's stop-grace (60 s) before their last step leave only checkpoints, and the suite
# and fidelity take final weights only (`trained`), so call 2's training budget must cover all the steps (tenth);
# the table's StreamingLLM / oracle / TOVA must repeat the seventh session's digits on its 8 sequences; fidelity decodes
# ~20-40 ms per batch step (launch-bound), so its processes share the GPU under MPS; a call that stops the MPS daemon
# unsets its environment before the next CUDA process (eleventh).
# Knobs: ROWS, FREE_ROWS, STEPS (120), SEEDS (0), POOLS / TABLE_POOLS (the cascade's TOVA slots per budget),
# TRAIN_S (call 2's training seconds, 420), TRAIN3_S / EVAL_S (call 3: 60 / 420), FID_P (8 problems), SUITE_S (400),
# SIDE_S (fidelity, 430), LENGTHS (4k,8000), OOD_S (call 4's code rows, 330).
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
rows=${ROWS:-kvpop-mlp+prerope+mix+frozen,dms+frozen,streaming_llm_plus}
# the cascade's TOVA slots per budget: a quarter of the top-k (window 256: 1788 and 764 slots), fixed on the CPU before
# this lease (docs/RESULTS.md, twelfth session); the table adds half the top-k beside it
pool() {  # pool BUDGET: the pre-registered pool at that budget, from POOLS
  echo "${POOLS:-2048:447,1024:191}" | tr ',' '\n' | sed -n "s/^$1://p"
}
table_pools() {  # table_pools BUDGET: the table's pools at that budget, from TABLE_POOLS (slashes between them)
  echo "${TABLE_POOLS:-2048:447/894,1024:191/382}" | tr ',' '\n' | sed -n "s/^$1://p" | tr '/' ','
}
mlp_dir() {  # the KVpop-mlp run at budget $1 (seed 0)
  echo "$HOME/study/runs/kvpop-mlp+prerope+mix+frozen_b$1/final"
}
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
  # KVpop-cascade on CUDA: the Triton walk with two pools at size, the decode step compiled and captured; the
  # kernel's other scores again after its change
  step tests 200 python -m pytest -q -rs -p no:cacheprovider tests/test_cascade.py tests/test_decode.py \
    tests/test_dynamic.py -m "gpu or not slow" -k "cuda or cascade"
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
  cp "$HOME/study/train_status.json" "$out/" 2>/dev/null
  for b in 2048 1024; do
    # the table: TOVA beside every trained row and the cascade (the KVpop-mlp weights with a TOVA pool), one process
    # per budget on the seventh session's 8 sequences (TOVA must repeat its digits)
    ( step "table_b$b" "${EVAL_S:-420}" "${kvpop[@]}" eval --model smollm2-135m --data champ --seq-len 8192 \
        --sequences 8 --budgets "$b" --policies tova $(trained "$b") --tova-pool "$(table_pools "$b")" --no-progress \
        --out "$HOME/table_b$b"
      mkdir -p "$out/table_b$b" && cp "$HOME/table_b$b"/*.json "$HOME/table_b$b"/*.txt "$out/table_b$b/" 2>/dev/null ) &
    # the suite: one process per trained row (the cascade beside its KVpop-mlp weights), so they overlap
    while read -r flag t; do
      name=${t%%=*}; extra=(); [ "$name" = "kvpop-mlp+prerope+mix+frozen" ] && extra=(--tova-pool "$(pool "$b")")
      ( SIDE_S=${SUITE_S:-400} suite "suite_b${b}_$name" --policies none --budgets "$b" "$flag" "$t" "${extra[@]}"
        cp "$HOME/suite_b${b}_$name"/*.png "$out/suite_b${b}_$name/" 2>/dev/null ) &
    done < <(trained "$b")
  done
  # B = 2048 needs 4096 tokens to fill its cache for long; one trained row per process, so the launch-bound
  # decodes overlap; B = 1024 at 2048 tokens as in the ninth session's table
  while read -r flag t; do
    extra=(); [ "${t%%=*}" = "kvpop-mlp+prerope+mix+frozen" ] && extra=(--tova-pool "$(pool 2048)")
    FID_N=4096 fidelity "fid_b2048_${t%%=*}" --policies none --budgets 2048 --samples 0 "$flag" "$t" "${extra[@]}" &
  done < <(trained 2048)
  FID_N=2048 fidelity fid_b1024 --policies none --budgets 1024 --samples 0 $(trained 1024) --tova-pool "$(pool 1024)" &
  wait
  ;;
4)
  # held-out code (a training domain, unseen files) and Python's help topics (a domain never trained on), both
  # budgets, every training-free row beside KVpop-mlp and the cascade
  mps_on
  for data in pystdlib pydoc; do
    split=(); [ "$data" = pydoc ] && split=(--split all)
    for b in 2048 1024; do
      step "${data}_b$b" "${OOD_S:-330}" "${kvpop[@]}" eval --model smollm2-135m --data "$data" "${split[@]}" \
        --seq-len 8192 --sequences 8 --budgets "$b" --policies streaming_llm,tova,h2o \
        --trained "kvpop-mlp+prerope+mix+frozen=$(mlp_dir "$b")" --tova-pool "$(pool "$b")" --no-progress \
        --out "$HOME/${data}_b$b" &
    done
  done
  wait
  for d in pystdlib pydoc; do
    for b in 2048 1024; do mkdir -p "$out/${d}_b$b" && cp "$HOME/${d}_b$b"/*.json "$HOME/${d}_b$b"/*.txt "$out/${d}_b$b/" 2>/dev/null; done
  done
  # the daemon stopped and its environment gone: the eleventh session's generate bench failed in inductor right
  # after a stop with the variables still set (and ran cleanly in a fresh call)
  echo quit | timeout 5 nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  # issue 18 item 2 on SmolLM2 at batch 4 (batch 1: the eleventh session), on a quiet GPU after the evaluation
  step generate_smollm2_b4 150 python bench/bench_generate.py --model smollm2-135m --device cuda \
    --contexts 4096 --caches static,kvpop --new-tokens 64 --budget 1024 --batch 4 --repeats 2 \
    --json-out "$out/generate_smollm2_b4.json"
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
