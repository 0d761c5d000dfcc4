#!/usr/bin/env bash
# The recommended policy against the paper's static rule and the training-free policies on SmolLM2-135M-Instruct,
# S = 8192, B = 2048 and 1024 (CR 75 % / 88 %), KVpop-mlp scorers of seeds 0 and 1 (pre-RoPE keys, the champ +
# pystdlib + prose mixture, scorer-only, STEPS steps), every row on the same sequences, prompts and problems:
#
#   bash bench/gpu_policy_table.sh stage OUT     # with .stage_a: the model's first half; the cascades' kernels on CUDA
#   bash bench/gpu_policy_table.sh train OUT     # with .stage_b: assemble the model; under MPS the four training runs,
#                                                # beside them every training-free row: the teacher-forced tables
#                                                # (champ, pystdlib, pydoc; 8 x 8192 tokens), the task suite (every
#                                                # family, 4k and 8000 tokens) and the dense and StreamingLLM rows of long
#                                                # generation (27 held-out problems, 2048 tokens at B = 1024); the
#                                                # scorers come back (weights.tgz.part_*)
#   bash bench/gpu_policy_table.sh trained OUT   # the trained rows of the same tables, suite and generations: the
#                                                # recommended policy (its pool and ranking read from kvpop.config) and
#                                                # the static rule of both seeds, the pool ranked by accumulated
#                                                # attention beside it; development rows (champ 8-15) of the pool
#                                                # rankings; TOVA's and H2O's generations from the dense store
#
# The GPU machine has no network: .stage_a/.stage_b are staged as bench/README.md says, with the champ-dataset
# and math-verify wheels (math-verify, latex2sympy2_extended, antlr4-python3-runtime) added to .stage_b.
# Each phase fits a 10-minute command; the phases must follow each other on the same machine (results live under
# $HOME there). Knobs: STEPS (120), TRAIN_S (360), SIDE_S (seconds of each evaluation process, 420), PROBLEMS (27),
# JOBS (processes on the GPU at once: 12 under MPS, else 1). The walks of TOVA, H2O and the recommended policy are
# bound by kernel launches; without MPS the GPU time-slices between processes, and on an H100 seven evaluations at
# once did not finish in 500 s where one at a time each 8 x 8192-token table took about 100 s. Without MPS a phase
# then runs fewer rows than it starts: what did not finish is named by its log's exit status.
set -uo pipefail
usage="usage: bench/gpu_policy_table.sh stage|train|trained OUT_DIR"
phase=${1:?$usage}
dest=${2:?$usage}
out=$HOME/policy_$phase
rm -rf "$out" && mkdir -p "$out" "$dest"
# at most 8 files come back: the logs and results are packed into one archive
trap 'tar czf "$dest/$phase.tgz" -C "$out" . && ls -la "$dest"' EXIT
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
stage=$HOME/stage
gguf=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$HOME/site:$PWD/src KVPOP_SMOLLM2_GGUF=$gguf
kvpop=(python -m kvpop.cli)
study=$HOME/study
run=kvpop-mlp+prerope+mix+frozen
budgets=(2048 1024)
seeds=(0 1)

step() {  # step NAME SECONDS COMMAND...: a time limit, the log in OUT/NAME.log; never aborts the script
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name exit $? ($(date -u +%H:%M:%S))"; tail -n 12 "$out/$name.log"
}
keep() {  # keep NAME: the results of $HOME/NAME into the archive
  mkdir -p "$out/$1" && cp "$HOME/$1"/*.json "$HOME/$1"/*.txt "$HOME/$1"/*.png "$HOME/$1"/*.jsonl "$out/$1/" 2>/dev/null
}
eval_into() {  # eval_into NAME ARGS...: `kvpop eval ... --out $HOME/NAME`, kept
  local name=$1; shift
  step "$name" "${SIDE_S:-420}" "${kvpop[@]}" eval --model smollm2-135m --no-progress --force --out "$HOME/$name" "$@"
  keep "$name"
}
weights() {  # weights BUDGET SEED: a training run's final directory
  if [ "$2" = 0 ]; then echo "$study/runs/${run}_b$1/final"; else echo "$study/runs/${run}_s$2_b$1/final"; fi
}
pool() { python -c "from kvpop.config import recommended_pool; print(recommended_pool($1))"; }
decays() { python -c "from kvpop.config import RECOMMENDED_POOL_DECAY as d; print('none' if d is None else d)"; }
slot() {  # wait for a free place among the JOBS evaluations allowed on the GPU at once (BESIDE: other background jobs)
  while [ "$(jobs -rp | wc -l)" -ge "$(( ${JOBS:-1} + ${BESIDE:-0} ))" ]; do wait -n; done
}
mps_probe() { python -c "import torch; print(float(torch.ones(8, device='cuda').sum()))" 2>/dev/null | grep -q '^8.0$'; }
mps_on() {  # NVIDIA's MPS daemon: the launch-bound processes share the GPU at once instead of time-sliced
  export CUDA_MPS_PIPE_DIRECTORY=$HOME/mps/pipe CUDA_MPS_LOG_DIRECTORY=$HOME/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if mps_probe || { nvidia-cuda-mps-control -d && mps_probe; }; then
    JOBS=${JOBS:-12}
    echo "MPS on, $JOBS processes at once"
  else
    echo quit | timeout 5 nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    JOBS=${JOBS:-1}
    echo "MPS off (the daemon or its probe failed), $JOBS process(es) at once"
  fi
}
tables() {  # tables ARGS...: the teacher-forced table of each held-out source and budget, one process each
  local data b split
  for data in champ pystdlib pydoc; do
    split=(); [ "$data" = pydoc ] && split=(--split all)  # Python's help topics: no training run reads them
    for b in "${budgets[@]}"; do
      slot
      eval_into "table_${data}_b${b}_$1" --data "$data" "${split[@]}" --seq-len 8192 --sequences 8 --budgets "$b" \
        "${@:2}" $( [ "$1" = trained ] && trained_rows "$b" ) &
    done
  done
}
trained_rows() {  # trained_rows BUDGET: both seeds as the static rule and as the layer-wide cascade of the
  # recommended pool, ranked by TOVA's latest attention and by the accumulated attention (H2O's, and decayed)
  local s
  for s in "${seeds[@]}"; do echo "--trained mlp_s$s=$(weights "$1" "$s")"; done
  echo "--rule static --tova-pool-layer $(pool "$1") --pool-decay none,1,0.99"
}
suite() {  # suite NAME BUDGET ARGS...: every family at 4k and 8000 tokens
  eval_into "$1" --suite all --lengths 4k,8000 --depths 0,0.5,1 --samples 1 --suite-batch 8 --budgets "$2" "${@:3}"
}
generation() {  # generation NAME ARGS...: 2048 greedy tokens on the held-out problems at B = 1024 from the dense store
  local name=$1; shift
  mkdir -p "$HOME/$name" && cp "$HOME/gen_dense/generations.jsonl" "$HOME/$name/" 2>/dev/null
  eval_into "$name" --generate 2048 --problems "${PROBLEMS:-27}" --samples 0 --gen-batch "${PROBLEMS:-27}" \
    --ignore-eos --budgets 1024 "$@"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
git log -1 --format='commit %h %cI' 2>/dev/null || true
case $phase in
stage)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  step kernel_tests 150 python -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_cascade.py tests/test_slots.py
  ;;
train)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum "$(basename "$gguf")" && cat SHA256)
  mps_on
  step train $(( ${TRAIN_S:-360} + 60 )) python bench/quality_study.py --out "$study" --steps "${STEPS:-120}" --seeds 0,1 \
    --rows "$run" --mix champ,pystdlib,prose --free-rows oracle --phase train --deadline-s "${TRAIN_S:-360}" \
    --concurrency 4 &
  BESIDE=1
  tables free --policies tova,h2o,streaming_llm
  for b in "${budgets[@]}"; do slot; suite "suite_b${b}_free" "$b" --policies tova,h2o,streaming_llm & done
  slot
  eval_into gen_dense --generate 2048 --problems "${PROBLEMS:-27}" --samples 0 --gen-batch "${PROBLEMS:-27}" \
    --ignore-eos --budgets 1024 --policies streaming_llm &
  wait
  cp "$study/train_status.json" "$out/" 2>/dev/null
  # the final scorers (adapters: scorers, config, base identity), in parts of at most 15 MB
  tar czf "$HOME/weights.tgz" -C "$study/runs" $(cd "$study/runs" && ls -d */final) \
    && split -b 15m "$HOME/weights.tgz" "$dest/weights.tgz.part_" && ls -la "$dest"
  ;;
trained)
  mps_on
  tables trained --policies none
  for b in "${budgets[@]}"; do
    slot
    eval_into "dev_b$b" --data champ --seq-len 8192 --sequences 8 --skip-sequences 8 --budgets "$b" --policies none \
      --trained "mlp_s0=$(weights "$b" 0)" --rule static --tova-pool-layer "$(pool "$b")" --pool-decay none,1,0.99 &
    slot
    suite "suite_b${b}_trained" "$b" --policies none \
      $(for s in "${seeds[@]}"; do echo "--trained mlp_s$s=$(weights "$b" "$s")"; done) &
  done
  for s in "${seeds[@]}"; do slot; generation "gen_mlp_s$s" --policies none --trained "mlp_s$s=$(weights 1024 "$s")" & done
  slot; generation gen_tova --policies tova &
  slot; generation gen_h2o --policies h2o &
  wait
  ;;
*)
  echo "$usage"; exit 2
  ;;
esac
