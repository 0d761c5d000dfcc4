#!/usr/bin/env bash
# The fifteenth session's device calls (issues 16, 17), back to back in one warm lease of one H200 (`nvidia-h200`);
# the fourteenth session's calls are this file at commit a76f1b3, the thirteenth's at 6dd81e3, the twelfth's at
# 31e61c0. bench/README.md has the runbook.
#
#   bash bench/gpu_evaluation.sh 1 OUT   # carry .stage_a: stage the model's first half
#   bash bench/gpu_evaluation.sh 2 OUT   # carry .stage_b: assemble SmolLM2; under MPS, train (seed 0, scorer-only,
#                                        # 120 steps) DMS and KVpop-mLSTM at B = 2048, KVpop-mLSTM and KVpop-mlp
#                                        # (pre-RoPE keys, the domain mixture) at B = 1024; beside them the dense
#                                        # rows of long generation: 2048 tokens for all 27 held-out champ problems,
#                                        # 4096 tokens for 8
#   bash bench/gpu_evaluation.sh 3 OUT   # training finished; the cascades saved from the KVpop-mlp weights; long
#                                        # generation at B = 1024 on the 27 problems, four rows at a time, each from
#                                        # a copy of the dense store: TOVA, H2O, the twelfth session's per-head
#                                        # cascade, the thirteenth's layer-wide cascade
#   bash bench/gpu_evaluation.sh 4 OUT   # the rest, four at a time: DMS and the mLSTM at B = 2048 (4096 tokens,
#                                        # issue 16 item 7), the mLSTM and the windowed layer-wide cascade at
#                                        # B = 1024 on the 27 problems, then the static rule of the cascades' weights
#
# Why 27 problems: the fourteenth session's long-generation rows at B = 1024 were decided by 3-4 departures of 8
# texts (RESULTS, "what the long-generation rows measure"); 27 is every held-out champ problem
# (`champ_problems("eval")`), decoded together in one batch, which costs about what 8 do on the H200.
# The cascades' pools are the ones earlier sessions fixed before their tables, none chosen on these rows: per-head
# 191 (twelfth), layer-wide at TOVA's split 767 (thirteenth), layer-wide at KVpop's split 573 (fourteenth).
# Lessons: DMS scorer-only needs ~330 s alone for 120 steps (twelfth), so call 3 resumes what call 2 left; the
# fidelity takes final weights only; each bounded row starts from a copy of the dense store (seven processes that
# each generated their own dense row finished none in 440 s, fourteenth); math-verify's wheels travel in .stage_b;
# a call that stops the MPS daemon unsets its environment before the next CUDA process (eleventh).
# Knobs: STEPS (120), TRAIN_S (call 2's training seconds, 500), TRAIN3_S (call 3's, 420), SIDE_S (a fidelity
# process's seconds, 420), FID_P (27).
set -uo pipefail
phase=${1:?usage: bench/gpu_evaluation.sh 1|2|3|4 OUT_DIR}
dest=${2:?usage: bench/gpu_evaluation.sh 1|2|3|4 OUT_DIR}
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
  for d in "$HOME"/study_b*/runs/*/final; do
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
mlp=kvpop-mlp+prerope+mix+frozen
problems=${FID_P:-27}
study() {  # study BUDGET ROWS ARGS...: the quality study's training phase for one budget, seed 0
  local b=$1 rows=$2; shift 2
  python bench/quality_study.py --out "$HOME/study_b$b" --budgets "$b" --steps "${STEPS:-120}" --seeds 0 \
    --rows "$rows" --mix champ,pystdlib,prose --phase train --concurrency 2 "$@" > "$out/study_train_b$b.log" 2>&1
  tail -n 12 "$out/study_train_b$b.log"; cp "$HOME/study_b$b/train_status.json" "$out/train_status_b$b.json" 2>/dev/null
}
rows2048=dms+frozen,kvpop-mlstm+frozen
rows1024=kvpop-mlstm+frozen,$mlp
run_dir() { echo "$HOME/study_b$2/runs/$1_b$2/final"; }  # run_dir ROW BUDGET: the seed-0 run's final weights
cascade_dir() { echo "$HOME/cascade_$1"; }
dense() {  # the dense rows (StreamingLLM beside them repeats earlier sessions' rows); a later call continues them
  FID_N=2048 FID_P=$problems FID_BATCH=$problems fidelity fid_dense_2048 --policies streaming_llm --budgets 1024 &
  FID_N=4096 FID_P=8 FID_BATCH=8 fidelity fid_dense_4096 --policies streaming_llm --budgets 2048 &
  wait
}
rows() {  # rows "BUDGET NAME ARGS"...: one fidelity process per row, four at a time, each from a copy of the store
  local i=0 spec b name args n p
  for spec in "$@"; do
    read -r b name args <<< "$spec"
    if [ "$b" = 2048 ]; then n=4096 p=8; else n=2048 p=$problems; fi  # B = 2048 needs 4096 tokens to fill for long
    mkdir -p "$HOME/$name" && cp "$HOME/fid_dense_$n/generations.jsonl" "$HOME/$name/" 2>/dev/null
    # shellcheck disable=SC2086  # args are words
    FID_N=$n FID_P=$p FID_BATCH=$p fidelity "$name" --budgets "$b" $args &
    i=$((i + 1)); [ $((i % 4)) = 0 ] && wait
  done
  wait
}
case $phase in
1)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  ;;
2)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  python -c "import math_verify; print('math_verify', math_verify.__file__)"
  python -c "from kvpop.train.data import champ_problems; print(len(champ_problems('eval')), 'held-out problems')"
  mps_on
  study 2048 "$rows2048" --deadline-s "${TRAIN_S:-500}" &
  study 1024 "$rows1024" --deadline-s "${TRAIN_S:-500}" &
  SIDE_S=${DENSE_S:-520} dense &
  wait
  ;;
3)
  mps_on
  # DMS (44 of 120 steps in call 2, this session) trains on beside the rows; the finished runs return at once
  study 2048 "$rows2048" --deadline-s "${TRAIN3_S:-420}" --min-start-s 20 --stop-grace-s 15 &
  # the cascades: the KVpop-mlp weights (B = 1024) under the pools earlier sessions fixed before their tables
  python - "$(run_dir "$mlp" 1024)" "$HOME" <<'PY'
import dataclasses, sys
import kvpop
from kvpop.retrofit import read_config
src, home = sys.argv[1], sys.argv[2]
cfg = read_config(src)
for name, c in (("perhead191", cfg.with_tova_pool(191)), ("layer767", cfg.with_tova_pool(767, layer=True)),
                ("lwin573", dataclasses.replace(cfg, tova_pool=573, tova_head_average=True))):
    kvpop.save(kvpop.load(src, config=c), f"{home}/cascade_{name}")
    print("saved", name, c.sink, c.window, c.topk, c.tova_pool, c.tova_head_average)
PY
  rows "1024 fid_b1024_tova --policies tova" "1024 fid_b1024_h2o --policies h2o" \
       "1024 fid_b1024_perhead191 --policies none --trained perhead191=$(cascade_dir perhead191)" \
       "1024 fid_b1024_layer767 --policies none --trained layer767=$(cascade_dir layer767)"
  keep_weights
  ;;
4)
  mps_on
  rows "2048 fid_b2048_dms --policies none --trained dms=$(run_dir dms+frozen 2048)" \
       "2048 fid_b2048_mlstm --policies none --trained mlstm=$(run_dir kvpop-mlstm+frozen 2048)" \
       "1024 fid_b1024_mlstm --policies none --trained mlstm=$(run_dir kvpop-mlstm+frozen 1024)" \
       "1024 fid_b1024_lwin573 --policies none --trained lwin573=$(cascade_dir lwin573)" \
       "1024 fid_b1024_mlp --policies none --trained mlp=$(run_dir "$mlp" 1024)"
  ;;
*)
  echo "unknown phase $phase (1 to 4)"; exit 2
  ;;
esac
