#!/usr/bin/env bash
# GPU evaluation of SmolLM2-135M on one offline GPU (H100 or H200), in phases that each fit a 10-minute command and
# run back to back on one machine: the recall-vs-steps curve of the mLSTM scorer, the recommended policy against the
# static rule and the training-free policies, and the speed benches. bench/README.md says how to stage the model and
# wheels ("Preparing an offline GPU machine"); docs/quality.md, docs/policies.md and docs/speed.md report the results.
#
# The recall-vs-steps runs (seed 0): the mLSTM (delay =
# window, the paper's) trained in two phases, 1000 steps of the scorers alone, then a short full distillation
# (DISTILL steps, 60) from those weights; with TWIN=1, its delay-0 twin 1000 steps of the scorers alone beside it.
# B = 1024 (CR 88 %), every 100th checkpoint kept. Alone on an H100 the two phases take 0.6 and 0.95 s/step.
#
#   bash bench/gpu_evaluation.sh 1 OUT   # carry .stage_a: stage the model's first half; then TOVA's prefill walk,
#                                        # profiled (WALK_S, 90), and with ATTN_S > 0 the training attention
#                                        # beside the gathered one
#   bash bench/gpu_evaluation.sh 2 OUT   # carry .stage_b: assemble SmolLM2; under MPS, the runs start (TRAIN_S)
#   bash bench/gpu_evaluation.sh 3 OUT   # the runs go on (TRAIN3_S)
#   bash bench/gpu_evaluation.sh 4 OUT   # the runs go on to CURVE_AT seconds; held-out recall at every kept
#                                        # checkpoint (bench/recall_curve.py) beside the teacher-forced rows of the
#                                        # final runs (8 x 8192 held-out tokens, B = 1024, StreamingLLM as the check
#                                        # that the sequences are docs/quality.md's); scorer-only weights in parts;
#                                        # the newest checkpoint of an unfinished scorer-only run (OUT/resume.tar.part_*)
#
#   bash bench/gpu_evaluation.sh speed OUT    # no staging: the cutoffs' sort and tile sweep, the
#                                             # 36-layer 8B-shape decode step under inductor, cold
#   bash bench/gpu_evaluation.sh speed2 OUT   # the same step from the inductor cache; dense StaticCache + inductor
#   bash bench/gpu_evaluation.sh generate OUT # no staging: a bf16 prefill's profile, then `generate`
#                                             # at SmolLM2's shape, batch 1 and 4 (GEN_BATCHES), against StaticCache
#   bash bench/gpu_evaluation.sh verify OUT   # no staging: the CUDA kernels' tests, the fused
#                                             # cutoffs' share of the sparse forward (twice), the prefill's profile
#
# The default policy against the paper's static rule and the training-free rows, S = 8192, both budgets, KVpop-mlp
# seeds 0 and 1 (pre-RoPE keys, the domain mixture, scorer-only, STEPS steps); a `--trained DIR` row runs the
# recommended policy (`KVpopConfig.for_rule`), its pool and ranking read from `kvpop.config`, never chosen here:
#   bash bench/gpu_evaluation.sh confirm1 OUT  # carry .stage_a: stage; the cascades' Triton walks at size and their
#                                              # captured decode step on CUDA
#   bash bench/gpu_evaluation.sh confirm2 OUT  # carry .stage_b: assemble; under MPS train the four runs (TRAIN_S),
#                                              # beside them the dense stores of long generation on the 27 held-out
#                                              # problems (2048 tokens at B = 1024, 4096 at B = 2048) with the
#                                              # StreamingLLM rows; the trained scorers come back (weights.tgz.part_*)
#   bash bench/gpu_evaluation.sh confirm3 OUT  # the teacher-forced tables, 8 x 8192 held-out tokens of champ, pystdlib
#                                              # and pydoc at each budget, six processes: both seeds as the default
#                                              # policy and as the static rule, TOVA, H2O, StreamingLLM, one process
#                                              # per table (the same sequences)
#   bash bench/gpu_evaluation.sh confirm4 OUT  # the task suite (every family, 4k and 8000 tokens) at each budget: the
#                                              # default policy of both seeds; TOVA, H2O and StreamingLLM
#   bash bench/gpu_evaluation.sh confirm5 OUT  # long generation at B = 1024, 2048 tokens, 27 problems: the default
#                                              # policy of both seeds, TOVA, H2O, each from a copy of the dense store
#   bash bench/gpu_evaluation.sh confirm6 OUT  # the same at B = 2048, 4096 tokens
# Knobs: STEPS (120), TRAIN_S (420), DENSE_S (540), SIDE_S (a table, suite or fidelity process's seconds, 540),
# FID_P (27), LENGTHS (4k,8000), SIDE_SEEDS (the seeds of the suite and fidelity rows, "0 1").
#
# A run carried back (`cat resume.tar.part_* | tar x`: config.json, train_log.jsonl, checkpoints/step-N; 32 MB each,
# so one per command beside the working tree) goes into .stage_d/ or .stage_e/ and resumes exactly on any CUDA machine:
#   bash bench/gpu_evaluation.sh 1 OUT; bash bench/gpu_evaluation.sh 2s OUT   # stage and assemble only (2s trains
#                                                                             # nothing)
#   bash bench/gpu_evaluation.sh resume OUT                                  # carry .stage_d, then .stage_e
#   bash bench/gpu_evaluation.sh 4 OUT                                       # they resume from their checkpoints
#
# Limits of the machine: DMS scorer-only needs ~330 s alone for 120 steps; the fidelity and suite take final weights
# only; each bounded row starts from a copy of the dense store (seven processes that each generate their own dense row
# finish none in 440 s); math-verify's wheels travel in .stage_b; a phase that stops the MPS daemon unsets its
# environment before the next CUDA process; at most 8 files of 16 MiB, 64 MiB in all, come back from the machine, and
# runs whose checkpoints do not come back are lost with it.
# Knobs: TRAIN_S (phase 2's training seconds, 540), TRAIN3_S (phase 3's, 520), CURVE_AT (phase 4's training seconds
# before the curve, 330), CURVE_S (the curve's seconds, 120), SIDE_S (a suite or fidelity process's, 420), LONG (1000),
# DISTILL (the full distillation's steps after the scorer-only phase, 60), TWIN (1: the delay-0 twin too).
set -uo pipefail
usage="usage: bench/gpu_evaluation.sh 1|2|2s|3|4|resume|speed|speed2|generate|verify|confirm1..confirm6 OUT_DIR"
phase=${1:?$usage}
dest=${2:?$usage}
# at most 8 files come back from the machine: everything goes to a work folder, packed into OUT/gpu_eval_PHASE.tgz
# at the end; a machine can keep $HOME from an earlier use, so the phase's folder starts empty
out=$HOME/gpu_eval_$phase
rm -rf "$out" && mkdir -p "$out" "$dest"
trap 'tar czf "$dest/gpu_eval_$phase.tgz" -C "$out" . && ls -la "$dest"' EXIT
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
keep() {  # keep NAME: a result folder under $HOME into the phase's output (json, txt, png, generation stores)
  mkdir -p "$out/$1" && cp "$HOME/$1"/*.json "$HOME/$1"/*.txt "$HOME/$1"/*.png "$HOME/$1"/*.jsonl "$out/$1/" 2>/dev/null
}
keep_weights() {  # the final runs' trained parameters into OUT/weights.tgz.part_*, apart from the results
  # a scorer-only run changes only kvpop_scorers.safetensors: with the local SmolLM2 files copied beside these three,
  # `kvpop.load` rebuilds the run on any machine (a run whose weights stay on the machine is lost with it)
  local w=$HOME/weights; rm -rf "$w" && mkdir -p "$w"
  for d in "$study_dir"/runs/*/final; do
    [ -f "$d/kvpop_scorers.safetensors" ] || continue
    local r; r=$(basename "$(dirname "$d")")
    case $r in *_distill) continue ;; esac  # a distillation changed the base too: its scorers alone are not the run
    mkdir -p "$w/$r"
    cp "$d"/kvpop_config.json "$d"/kvpop_base.json "$d"/kvpop_scorers.safetensors "$w/$r/"
  done
  # at most 16 MiB per file comes back (four runs are 41 MB packed): parts, joined here with `cat weights.tgz.part_*`
  tar czf "$HOME/weights.tgz" -C "$w" . && split -b 15m "$HOME/weights.tgz" "$dest/weights.tgz.part_" \
    && ls -la "$dest"/weights.tgz.part_*
}

mps_probe() { python -c "import torch; print(float(torch.ones(8, device='cuda').sum()))" 2>/dev/null | grep -q '^8.0$'; }
mps_on() {  # NVIDIA's MPS daemon, so launch-bound side processes run their kernels at once; off if a probe fails
  export CUDA_MPS_PIPE_DIRECTORY=$HOME/mps/pipe CUDA_MPS_LOG_DIRECTORY=$HOME/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # a daemon outlives its phase (`-d`): an earlier phase's is reused (starting a second one fails, and every
  # process would then run time-sliced)
  if mps_probe || { nvidia-cuda-mps-control -d && mps_probe; }; then
    echo "MPS on"
  else  # without a daemon to connect to, CUDA would fail in every process: run time-sliced instead
    echo quit | timeout 5 nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS off (the daemon or its probe failed)"
  fi
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
long=${LONG:-1000}
study_dir=$HOME/study
distill=${DISTILL:-60}
# the mLSTM in two phases (LONG scorer-only steps, then DISTILL of full distillation); with TWIN=1 its delay-0 twin
# beside it, scorer-only (the two at once run at 1.2 s/step each on an H200)
rows=kvpop-mlstm
[ "${TWIN:-0}" = 1 ] && rows=$rows,kvpop-mlstm-delay0+frozen+steps$long
study() {  # study SECONDS ARGS...: the training phase (a later phase resumes what an earlier one checkpointed)
  local limit=$1; shift
  python bench/quality_study.py --out "$study_dir" --budgets 1024 --steps "$distill" --seeds 0 --rows "$rows" \
    --pretrain-steps "$long" --pretrain-rows kvpop-mlstm --phase train --concurrency 3 --keep-every 100 \
    --lr-base 1e-5 --deadline-s "$limit" "$@" > "$out/study_train.log" 2>&1
  tail -n 14 "$out/study_train.log"; cp "$study_dir/train_status.json" "$out/" 2>/dev/null
}
pre=$study_dir/runs/kvpop-mlstm_b1024_pre$long                  # the mLSTM's scorer-only phase
dist=${pre}_distill                                             # its full distillation from those weights
d0=$study_dir/runs/kvpop-mlstm-delay0+frozen+steps${long}_b1024  # the delay-0 twin, scorer-only
curve_runs() {  # one line per row: the distillation continues its scorer-only phase's curve (recall_curve.py)
  if [ -d "$dist/checkpoints" ] || [ -d "$dist/final" ]; then echo "$dist"; elif [ -d "$pre" ]; then echo "$pre"; fi
  [ -d "$d0" ] && echo "$d0"
}
# the default policy's confirmation (confirm1-6)
mlp=kvpop-mlp+prerope+mix+frozen
mlp_dir() {  # mlp_dir BUDGET SEED: the KVpop-mlp run's final weights
  if [ "$2" = 0 ]; then echo "$study_dir/runs/${mlp}_b$1/final"; else echo "$study_dir/runs/${mlp}_s$2_b$1/final"; fi
}
default_pool() { python -c "from kvpop.config import recommended_pool; print(recommended_pool($1))"; }
default_decay() { python -c "from kvpop.config import RECOMMENDED_POOL_DECAY as d; print('none' if d is None else d)"; }
train_runs() {  # train_runs SECONDS ARGS...: the four runs (quality_study's training phase; a later phase resumes)
  local limit=$1; shift
  python bench/quality_study.py --out "$study_dir" --steps "${STEPS:-120}" --seeds 0,1 --rows "$mlp" \
    --mix champ,pystdlib,prose --free-rows oracle --phase train --deadline-s "$limit" --concurrency 4 "$@" \
    > "$out/study_train.log" 2>&1
  tail -n 20 "$out/study_train.log"; cp "$study_dir/train_status.json" "$out/" 2>/dev/null
}
problems=${FID_P:-27}
side_seeds=${SIDE_SEEDS:-0 1}
trained_args() {  # trained_args BUDGET: --trained of each side seed's run (the default policy)
  local s; for s in $side_seeds; do echo "--trained mlp_s$s=$(mlp_dir "$1" "$s")"; done
}
fidelity() {  # fidelity NAME TOKENS BUDGET ARGS...: long generation on the held-out problems into $HOME/NAME
  local name=$1 n=$2 b=$3; shift 3
  step "$name" "${SIDE_S:-540}" "${kvpop[@]}" eval --model smollm2-135m --generate "$n" --problems "$problems" \
    --samples 0 --gen-batch "$problems" --ignore-eos --budgets "$b" --no-progress --out "$HOME/$name" "$@"
  keep "$name"
}
bounded() {  # bounded TOKENS BUDGET: the bounded rows of long generation, four processes, each from the dense store
  local n=$1 b=$2 name s
  for row in tova h2o $(for s in $side_seeds; do echo "mlp_s$s"; done); do
    name=fid_b${b}_$row
    mkdir -p "$HOME/$name" && cp "$HOME/fid_dense_$n/generations.jsonl" "$HOME/$name/" 2>/dev/null
    case $row in
      mlp_s*) fidelity "$name" "$n" "$b" --policies none --trained "$row=$(mlp_dir "$b" "${row#mlp_s}")" & ;;
      *) fidelity "$name" "$n" "$b" --policies "$row" & ;;
    esac
  done
  wait
}

case $phase in
confirm1)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  step kernel_tests "${TEST_S:-300}" python -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_cascade.py
  step decode_tests "${TEST_S:-300}" python -m pytest -q -rs -p no:cacheprovider tests/test_decode.py \
    -m "gpu or not slow" -k "captured and cascade"
  ;;
confirm2)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  python -c "import math_verify; print('math_verify', math_verify.__file__)"
  mps_on
  train_runs "${TRAIN_S:-420}" &
  SIDE_S=${DENSE_S:-540} fidelity fid_dense_2048 2048 1024 --policies streaming_llm &
  SIDE_S=${DENSE_S:-540} fidelity fid_dense_4096 4096 2048 --policies streaming_llm &
  wait
  keep_weights
  ;;
confirm3)
  mps_on
  # a run confirm2's deadline stopped goes on first (the finished ones are skipped)
  for b in 2048 1024; do for s in 0 1; do [ -f "$(mlp_dir "$b" "$s")/kvpop_config.json" ] || unfinished=1; done; done
  if [ -n "${unfinished:-}" ]; then train_runs "${TRAIN3_S:-240}" --min-start-s 20 --stop-grace-s 15; keep_weights; fi
  for data in champ pystdlib pydoc; do
    split=(); [ "$data" = pydoc ] && split=(--split all)  # Python's help topics: held out from training whole
    for b in 2048 1024; do
      # shellcheck disable=SC2046  # one word per flag and value
      ( step "table_${data}_b$b" "${SIDE_S:-540}" "${kvpop[@]}" eval --model smollm2-135m --data "$data" \
          "${split[@]}" --seq-len 8192 --sequences 8 --budgets "$b" --policies tova,h2o,streaming_llm \
          --trained "mlp_s0=$(mlp_dir "$b" 0)" --trained "mlp_s1=$(mlp_dir "$b" 1)" --rule static \
          --tova-pool-layer "$(default_pool "$b")" --pool-decay "$(default_decay)" --no-progress --force \
          --out "$HOME/table_${data}_b$b"
        keep "table_${data}_b$b" ) &
    done
  done
  wait
  ;;
confirm4)
  mps_on
  for b in 2048 1024; do
    # shellcheck disable=SC2046
    ( step "suite_b${b}_default" "${SIDE_S:-540}" "${kvpop[@]}" eval --model smollm2-135m --suite all \
        --lengths "${LENGTHS:-4k,8000}" --depths 0,0.5,1 --samples 1 --suite-batch 8 --policies none --budgets "$b" \
        $(trained_args "$b") --no-progress --force --out "$HOME/suite_b${b}_default"
      keep "suite_b${b}_default" ) &
    ( step "suite_b${b}_free" "${SIDE_S:-540}" "${kvpop[@]}" eval --model smollm2-135m --suite all \
        --lengths "${LENGTHS:-4k,8000}" --depths 0,0.5,1 --samples 1 --suite-batch 8 \
        --policies tova,h2o,streaming_llm --budgets "$b" --no-progress --force --out "$HOME/suite_b${b}_free"
      keep "suite_b${b}_free" ) &
  done
  wait
  ;;
confirm5)
  mps_on
  bounded 2048 1024
  ;;
confirm6)
  mps_on
  bounded 4096 2048
  ;;
resume)  # carry .stage_d or .stage_e: unfinished runs from another machine into this study, where `study` resumes them
  mkdir -p "$study_dir/runs"
  for d in .stage_d .stage_e; do [ -d "$d" ] && cp -r "$d"/* "$study_dir/runs/"; done
  ls -la "$study_dir/runs"/*/checkpoints
  ;;
1)  # staging, then (no model needed) TOVA's prefill walk at one layer of the 8B shape per variant
  # (WALK_VARIANTS: the sequential selection against the "jacobi" one), with an operator profile of each
  # (WALK_S seconds); the training attention's pieces at S = 16k with the cutoff kernel's tiles (ATTN_S seconds).
  # 0 skips either.
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  if [ "${WALK_S:-90}" -gt 0 ]; then
    step walk "${WALK_S:-90}" python bench/bench_walk.py --policies tova-mean \
      --variants "${WALK_VARIANTS:-parallel,parallel-jacobi}" --repeats 2 --profile "$out/walk_profile.txt"
  fi
  if [ "${ATTN_S:-0}" -gt 0 ]; then  # `if`, not `&&`: a skipped step must not become the phase's exit status
    step train_attention "${ATTN_S:-0}" python bench/bench_train_attention.py --lengths 16384 --budget 2048 \
      --gather --json-out "$out/train_attention.json"
  fi
  ;;
2|2s)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  [ "$phase" = 2s ] && exit 0
  mps_on
  study "${TRAIN_S:-540}"
  ;;
3)
  mps_on
  study "${TRAIN3_S:-520}" --min-start-s 20 --stop-grace-s 15
  ;;
4)
  mps_on
  study "${CURVE_AT:-330}" --min-start-s 20 --stop-grace-s 15
  # shellcheck disable=SC2046  # one directory per word
  step curve "${CURVE_S:-120}" python bench/recall_curve.py $(curve_runs) --sequences 8 --out "$HOME/curve" \
    --deadline-s "$(( ${CURVE_S:-120} - 15 ))" &
  trained=()  # the final runs' teacher-forced rows, beside the curve
  [ -f "$pre/final/kvpop_config.json" ] && trained+=(--trained "mlstm-${long}=$pre/final")
  [ -f "$dist/final/kvpop_config.json" ] && trained+=(--trained "mlstm-${long}+${distill}=$dist/final")
  [ -f "$d0/final/kvpop_config.json" ] && trained+=(--trained "mlstm-delay0-${long}=$d0/final")
  if [ ${#trained[@]} -gt 0 ]; then
    step table "${CURVE_S:-120}" "${kvpop[@]}" eval --model smollm2-135m --data champ --seq-len 8192 --sequences 8 \
      --budgets 1024 --policies streaming_llm --no-progress --out "$HOME/table" --force "${trained[@]}"
    keep table
  fi
  wait
  keep curve
  keep_weights
  # the newest checkpoint of each unfinished scorer-only run, with its config and log: enough for `kvpop train
  # --resume` (32 MB each; a distillation's checkpoint holds the base's weights and optimizer, too large to return)
  local_keep=$HOME/resume; rm -rf "$local_keep" && mkdir -p "$local_keep"
  for d in "$pre" "$d0"; do
    [ -d "$d/final" ] && continue
    newest=$(ls -d "$d"/checkpoints/step-* 2>/dev/null | sort -t- -k2 -n | tail -n 1)
    [ -n "$newest" ] || continue
    r=$(basename "$d"); mkdir -p "$local_keep/$r/checkpoints"
    cp "$d"/config.json "$d"/train_log.jsonl "$local_keep/$r/" && cp -r "$newest" "$local_keep/$r/checkpoints/"
  done
  if [ -n "$(ls "$local_keep")" ]; then
    tar cf "$HOME/resume.tar" -C "$local_keep" . && split -b 15m "$HOME/resume.tar" "$dest/resume.tar.part_" \
      && ls -la "$dest"/resume.tar.part_*
  fi
  ;;
speed|speed2)  # no staging: `speed` times the cutoffs' sort and tile choices and the whole 36-layer
  # decode step of the 8B shape under inductor, cold; `speed2` the same step from the inductor cache on disk
  # (the compile time a second run pays), then the dense StaticCache + inductor baseline at 4k
  export TORCHINDUCTOR_CACHE_DIR=$HOME/inductor_cache
  dec=(python -m kvpop.eval.bench --model qwen3-8b-shape --device cuda --budget 2048 --window 256 --fill random
       --new-tokens 32 --warmup 4 --compile --compile-backend inductor)
  if [ "$phase" = speed ]; then
    step sweep "${SWEEP_S:-170}" python bench/bench_train_attention.py --lengths 16384 --budget 2048 --quick --sweep \
      --json-out "$out/train_attention_sweep.json"
    step decode_kvpop_cold "${DEC_S:-380}" "${dec[@]}" --caches kvpop --contexts 4096,131072 \
      --json-out "$out/decode_kvpop_cold.json"
  else
    step decode_kvpop_cached "${DEC_S:-200}" "${dec[@]}" --caches kvpop --contexts 4096,16384,65536,131072 \
      --json-out "$out/decode_kvpop_cached.json"
    step decode_dense "${DENSE_S:-300}" "${dec[@]}" --caches dense --contexts 4096 --json-out "$out/decode_dense.json"
  fi
  ;;
generate)  # no staging: where a bf16 prefill's time goes (`profile_prefill.py`), then `generate` at
  # SmolLM2's shape, batch 1 and 4, against transformers' compiled StaticCache (the 8B shape: `bench_generate.py`
  # --model qwen3-8b-shape --num-layers 12 --contexts 4096,16384 --budget 2048 in a command of its own); bf16,
  # since that StaticCache is 4.7x slower in float32 on an H100. SmolLM2 has 8192 positions: 7680 + 128
  step prefill_smollm2 "${PRE_S:-90}" python bench/profile_prefill.py --model smollm2-135m-shape --dtype bfloat16 \
    --context 4096 --budget 1024 --out "$out/prefill_smollm2"
  # without the eager dense rows (20-28 ms per token here) one context fits 110 s; each more context compiles the
  # StaticCache again (4096,7680 with dense does not end in 140 s): GEN_CONTEXTS, GEN_S
  gen=(python bench/bench_generate.py --device cuda --dtype bfloat16 --caches static,kvpop --new-tokens 128
       --repeats 2)
  for b in ${GEN_BATCHES:-1 4}; do
    step "gen_smollm2_b$b" "${GEN_S:-150}" "${gen[@]}" --model smollm2-135m-shape --contexts "${GEN_CONTEXTS:-4096}" \
      --budget 1024 --batch "$b" --json-out "$out/gen_smollm2_b$b.json"
  done
  # GEN8B_BATCHES (e.g. "1 4"): the 8B shape's 12 layers at 4k too, one batch size per step (~150 s each)
  for b in ${GEN8B_BATCHES:-}; do
    step "gen_8b_b$b" "${GEN8B_S:-200}" "${gen[@]}" --model qwen3-8b-shape --num-layers 12 --contexts 4096 \
      --budget 2048 --batch "$b" --json-out "$out/gen_8b_b$b.json"
  done
  # DECODE_PROFILE=1: which kernels a KVpop layer's decode step adds over dense, at SmolLM2's shape
  if [ "${DECODE_PROFILE:-0}" = 1 ]; then
    step decode_profile_smollm2 "${DPROF_S:-100}" python bench/profile_decode_step.py --model smollm2-135m-shape \
      --num-layers 8 --context 4096 --budget 1024 --out "$out"
  fi
  ;;
verify)  # no staging: the Triton kernels on CUDA (the fused cutoffs, the decode step's slot update and the split
  # attention reading the positions): the slot, top-k and
  # decode-attention kernels' tests, the captured steps against the teacher-forced pass, the cutoffs' share of the
  # sparse forward (twice: it follows the host; the unfused cutoffs timed beside them, `cutoffs_unfused_ms`), the
  # prefill's profile, then `generate` at SmolLM2's shape (the `generate` phase, in a command of its own after this one)
  step kernel_tests "${TEST_S:-150}" python -m pytest -q tests/test_slots.py tests/test_topk_kernel.py \
    tests/test_decode_kernel.py
  # the cache's prefill takes the fused cutoffs on CUDA: its captured steps against the teacher-forced pass
  step cache_gpu_tests "${TEST_S:-150}" python -m pytest -q -m gpu tests/test_decode.py tests/test_retrofit.py
  for r in 1 2; do
    step "cutoffs_$r" "${CUT_S:-150}" python bench/bench_train_attention.py --lengths 16384 --budget 2048 --quick \
      --json-out "$out/cutoffs_$r.json"
  done
  step prefill_smollm2 "${PRE_S:-90}" python bench/profile_prefill.py --model smollm2-135m-shape --dtype bfloat16 \
    --context 4096 --budget 1024 --out "$out/prefill_smollm2"
  ;;
*)
  echo "unknown phase $phase (1, 2, 2s, 3, 4, resume, speed, speed2, generate, verify, confirm1 to confirm6)"; exit 2
  ;;
esac
