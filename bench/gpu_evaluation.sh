#!/usr/bin/env bash
# The sixteenth session's device calls (issues 16, 17), back to back in one warm lease of one H200 (`nvidia-h200`);
# the fifteenth session's calls are this file at commit 63cd01b, the fourteenth's at a76f1b3, the thirteenth's at
# 6dd81e3. bench/README.md has the runbook.
#
#   bash bench/gpu_evaluation.sh 1 OUT   # carry .stage_a and .stage_c: stage the model's first half, and the dense
#                                        # long-generation stores of the fifteenth session (.stage_c/fid_dense_*:
#                                        # the same 27 + 8 problems, model and decoding; the bounded rows start from
#                                        # a copy, so no call spends 224 s re-generating the dense text)
#   bash bench/gpu_evaluation.sh 2 OUT   # carry .stage_b: assemble SmolLM2; under MPS, train (seed 0, scorer-only)
#                                        # the mLSTM-delay-0 row at both budgets (120 steps, the quality study's), and
#                                        # the recall-vs-steps runs at B = 1024 (issue 17 item 2): the mLSTM, its
#                                        # delay-0 twin and the MLP, 1000 steps each, every 100th step kept
#   bash bench/gpu_evaluation.sh 3 OUT   # the long runs go on; once the delay-0 rows are final: their task suite
#                                        # (4k, 8000) and long generation (B = 2048: 4096 tokens, 8 problems; B = 1024:
#                                        # 2048 tokens, 27 problems) (issue 16 item 7); their weights in parts
#   bash bench/gpu_evaluation.sh 4 OUT   # the long runs go on to CURVE_AT seconds; held-out recall at every kept
#                                        # checkpoint (bench/recall_curve.py); the newest checkpoint of each unfinished
#                                        # mLSTM run comes back in parts (OUT/resume.tar.part_*), so a later session
#                                        # resumes it exactly (`kvpop train --resume` on any CUDA machine)
#
# A later session goes on with the two mLSTM runs (issue 17 item 2; the MLP has plateaued): put their directories
# (`cat resume.tar.part_* | tar x`: config.json, train_log.jsonl, checkpoints/step-N), one run each, into .stage_d/
# and .stage_e/ (32.1 MB each: a call carries 64 MiB with the working tree's 5 MB, so the two need two calls), then,
# back to back:
#   bash bench/gpu_evaluation.sh 1 OUT; bash bench/gpu_evaluation.sh 2s OUT   # carry .stage_a, then .stage_b:
#                                        # stage and assemble only (2s trains nothing)
#   bash bench/gpu_evaluation.sh resume OUT                                  # carry .stage_d: the first run
#   bash bench/gpu_evaluation.sh resume OUT                                  # carry .stage_e: the second
#   ROWS=long bash bench/gpu_evaluation.sh 4 OUT                             # they resume from their checkpoints
#
# Lessons: DMS scorer-only needs ~330 s alone for 120 steps (twelfth); the fidelity and suite take final weights only;
# each bounded row starts from a copy of the dense store (seven processes that each generated their own dense row
# finished none in 440 s, fourteenth); math-verify's wheels travel in .stage_b; a call that stops the MPS daemon
# unsets its environment before the next CUDA process (eleventh); at most 8 files of 16 MiB come back (fifteenth),
# 64 MiB in all (sixteenth).
# Knobs: TRAIN_S (call 2's training seconds, 540), TRAIN3_S (call 3's, 520), CURVE_AT (call 4's training seconds
# before the curve, 330), CURVE_S (the curve's seconds, 120), SIDE_S (a suite or fidelity process's, 420), LONG (1000).
set -uo pipefail
phase=${1:?usage: bench/gpu_evaluation.sh 1|2|2s|3|4|resume OUT_DIR}
dest=${2:?usage: bench/gpu_evaluation.sh 1|2|2s|3|4|resume OUT_DIR}
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
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))"; tail -n 25 "$out/$name.log"
}
keep() {  # keep NAME: a result folder under $HOME into the call's output (json, txt, png, generation stores)
  mkdir -p "$out/$1" && cp "$HOME/$1"/*.json "$HOME/$1"/*.txt "$HOME/$1"/*.png "$HOME/$1"/*.jsonl "$out/$1/" 2>/dev/null
}
keep_weights() {  # the final runs' trained parameters into OUT/weights.tgz.part_*, apart from the results
  # a scorer-only run changes only kvpop_scorers.safetensors: with the local SmolLM2 files copied beside these three,
  # `kvpop.load` rebuilds the run on any machine (the fourteenth session lost its DMS and mLSTM runs with the lease)
  local w=$HOME/weights; rm -rf "$w" && mkdir -p "$w"
  for d in "$study_dir"/runs/*/final; do
    [ -f "$d/kvpop_scorers.safetensors" ] || continue
    local r; r=$(basename "$(dirname "$d")"); mkdir -p "$w/$r"
    cp "$d"/kvpop_config.json "$d"/kvpop_base.json "$d"/kvpop_scorers.safetensors "$w/$r/"
  done
  # at most 16 MiB per file comes back (four runs are 41 MB packed): parts, joined here with `cat weights.tgz.part_*`
  tar czf "$HOME/weights.tgz" -C "$w" . && split -b 15m "$HOME/weights.tgz" "$dest/weights.tgz.part_" \
    && ls -la "$dest"/weights.tgz.part_*
}

fidelity() {  # fidelity NAME ARGS...: long-generation fidelity into $HOME/NAME (finished generations kept)
  local name=$1; shift
  step "$name" "${SIDE_S:-420}" "${kvpop[@]}" eval --model smollm2-135m --generate "${FID_N:-2048}" \
    --problems "${FID_P:-8}" --samples 0 --gen-batch "${FID_BATCH:-16}" --ignore-eos --no-progress \
    --out "$HOME/$name" "$@"
  keep "$name"
}

mps_probe() { python -c "import torch; print(float(torch.ones(8, device='cuda').sum()))" 2>/dev/null | grep -q '^8.0$'; }
mps_on() {  # NVIDIA's MPS daemon, so launch-bound side processes run their kernels at once; off if a probe fails
  export CUDA_MPS_PIPE_DIRECTORY=$HOME/mps/pipe CUDA_MPS_LOG_DIRECTORY=$HOME/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # a daemon outlives its call (`-d`): an earlier call's is reused (starting a second one fails, and the
  # thirteenth session's call 3 then ran every process time-sliced)
  if mps_probe || { nvidia-cuda-mps-control -d && mps_probe; }; then
    echo "MPS on"
  else  # without a daemon to connect to, CUDA would fail in every process: run time-sliced instead
    echo quit | timeout 5 nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS off (the daemon or its probe failed)"
  fi
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
problems=${FID_P:-27}
long=${LONG:-1000}
study_dir=$HOME/study
# one study: the delay-0 row at both budgets (the quality study's 120 steps), and the three long runs at B = 1024
rows=kvpop-mlstm-delay0+frozen,kvpop-mlstm+frozen+steps$long+b1024,kvpop-mlstm-delay0+frozen+steps$long+b1024
rows=$rows,kvpop-mlp+frozen+steps$long+b1024
# ROWS=long: only the two mLSTM runs of 1000 steps (a later session's continuation; nothing else starts)
[ "${ROWS:-}" = long ] && rows=kvpop-mlstm+frozen+steps$long+b1024,kvpop-mlstm-delay0+frozen+steps$long+b1024
study() {  # study SECONDS ARGS...: the training phase (a later call resumes what an earlier one checkpointed)
  local limit=$1; shift
  python bench/quality_study.py --out "$study_dir" --budgets 2048,1024 --steps 120 --seeds 0 --rows "$rows" \
    --phase train --concurrency 5 --keep-every 100 --deadline-s "$limit" "$@" > "$out/study_train.log" 2>&1
  tail -n 14 "$out/study_train.log"; cp "$study_dir/train_status.json" "$out/" 2>/dev/null
}
run_dir() { echo "$study_dir/runs/$1_b$2"; }  # run_dir ROW BUDGET: the seed-0 run's directory
long_runs() { for r in kvpop-mlstm+frozen+steps$long kvpop-mlstm-delay0+frozen+steps$long kvpop-mlp+frozen+steps$long; do
  [ -d "$(run_dir "$r" 1024)" ] && run_dir "$r" 1024; done; }
suite() {  # suite NAME ARGS...: the task suite at 4k and 8000 tokens, every family, depths 0, 0.5, 1
  local name=$1; shift
  step "$name" "${SIDE_S:-420}" "${kvpop[@]}" eval --model smollm2-135m --suite all --lengths 4k,8000 \
    --depths 0,0.5,1 --samples 1 --suite-batch 8 --no-progress --out "$HOME/$name" "$@"
  keep "$name"
}
rows() {  # rows "BUDGET NAME ARGS"...: one fidelity process per row, each from a copy of the dense store
  local spec b name args n p
  for spec in "$@"; do
    read -r b name args <<< "$spec"
    if [ "$b" = 2048 ]; then n=4096 p=8; else n=2048 p=$problems; fi  # B = 2048 needs 4096 tokens to fill for long
    mkdir -p "$HOME/$name" && cp "$HOME/fid_dense_$n/generations.jsonl" "$HOME/$name/"
    # shellcheck disable=SC2086  # args are words
    FID_N=$n FID_P=$p FID_BATCH=$p fidelity "$name" --budgets "$b" $args &
  done
  wait
}
case $phase in
resume)  # carry .stage_d or .stage_e: a former lease's unfinished runs into this study, where `study` resumes them
  mkdir -p "$study_dir/runs"
  for d in .stage_d .stage_e; do [ -d "$d" ] && cp -r "$d"/* "$study_dir/runs/"; done
  ls -la "$study_dir/runs"/*/checkpoints
  ;;
1)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  for n in 2048 4096; do mkdir -p "$HOME/fid_dense_$n" && cp ".stage_c/fid_dense_$n.jsonl" "$HOME/fid_dense_$n/generations.jsonl"; done
  wc -l "$HOME"/fid_dense_*/generations.jsonl
  ;;
2|2s)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  python -c "import math_verify; print('math_verify', math_verify.__file__)"
  [ "$phase" = 2s ] && exit 0
  mps_on
  study "${TRAIN_S:-540}"
  ;;
3)
  mps_on
  study "${TRAIN3_S:-520}" --min-start-s 20 --stop-grace-s 15 &
  d0=kvpop-mlstm-delay0+frozen
  for _ in $(seq 60); do  # the delay-0 rows' final weights (call 2 normally leaves them done)
    [ -d "$(run_dir $d0 2048)/final" ] && [ -d "$(run_dir $d0 1024)/final" ] && break; sleep 5
  done
  for b in 2048 1024; do
    suite "suite_b${b}_mlstmdelay0" --policies none --budgets "$b" --trained "mlstm-delay0=$(run_dir $d0 $b)/final" &
  done
  rows "2048 fid_b2048_mlstmdelay0 --policies none --trained mlstm-delay0=$(run_dir $d0 2048)/final" \
       "1024 fid_b1024_mlstmdelay0 --policies none --trained mlstm-delay0=$(run_dir $d0 1024)/final" &
  wait
  for b in 2048 1024; do cp "$HOME/suite_b${b}_mlstmdelay0"/*.png "$out/suite_b${b}_mlstmdelay0/" 2>/dev/null; done
  keep_weights
  ;;
4)
  mps_on
  study "${CURVE_AT:-330}" --min-start-s 20 --stop-grace-s 15
  # shellcheck disable=SC2046  # one directory per word
  step curve "${CURVE_S:-120}" python bench/recall_curve.py $(long_runs) --sequences 8 --out "$HOME/curve" \
    --deadline-s "$(( ${CURVE_S:-120} - 15 ))"
  keep curve
  # the newest checkpoint of each unfinished mLSTM run, with its config and log: enough for `kvpop train --resume`.
  # At most 64 MB come back per call in all (the sixteenth session's three runs were 101 MB: three parts stayed
  # behind); the MLP's run (36 MB) is left out, it has plateaued
  local_keep=$HOME/resume; rm -rf "$local_keep" && mkdir -p "$local_keep"
  for d in $(long_runs); do
    [ -d "$d/final" ] && continue
    case $d in *kvpop-mlp+*) continue ;; esac
    newest=$(ls -d "$d"/checkpoints/step-* 2>/dev/null | sort | tail -n 1)
    [ -n "$newest" ] || continue
    r=$(basename "$d"); mkdir -p "$local_keep/$r/checkpoints"
    cp "$d"/config.json "$d"/train_log.jsonl "$local_keep/$r/" && cp -r "$newest" "$local_keep/$r/checkpoints/"
  done
  tar cf "$HOME/resume.tar" -C "$local_keep" . && split -b 15m "$HOME/resume.tar" "$dest/resume.tar.part_" \
    && ls -la "$dest"/resume.tar.part_*
  ;;
*)
  echo "unknown phase $phase (1, 2, 2s, 3, 4, resume)"; exit 2
  ;;
esac
