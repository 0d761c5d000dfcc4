#!/usr/bin/env bash
# The quality study on one offline GPU machine, in phases that each fit a 10-minute command, run back to back on
# the same machine after `.stage_a` (the first half of SmolLM2) is copied to $HOME/stage (bench/README.md,
# "Preparing an offline GPU machine"):
#
#   bash bench/gpu_quality.sh train OUT_DIR   # carry .stage_b: assemble the model, train the ten runs
#   bash bench/gpu_quality.sh eval OUT_DIR    # evaluate them; then one distillation step's timing
#                                             # (bench_distill.py) and bench/gpu_distributed.sh
#   bash bench/gpu_quality.sh dist OUT_DIR    # carry .stage_b: assemble the model, then only
#                                             # bench/gpu_distributed.sh (on a machine with 2 GPUs)
#   bash bench/gpu_quality.sh fidelity OUT_DIR   # after train: long-generation fidelity of the
#                                             # training-free rows and the trained kvpop-mlp / dms runs
#   bash bench/gpu_quality.sh curve OUT_DIR   # after train: held-out recall vs steps of every kvpop run's
#                                             # kept checkpoints (bench/recall_curve.py; runs trained with
#                                             # TRAIN_ARGS="--keep-every N ..."), both phases of a two-phase row
#   bash bench/gpu_quality.sh domains OUT_DIR # after train: in- and out-of-domain rows of every kvpop-mlp
#                                             # run of every study (bench/domain_eval.py)
#
# Environment knobs (seconds and sizes): STEPS (120), TRAIN_S (550), CONC (7: seven runs at S = 8192
# shared the H200 under MPS without running out of memory), EVAL_S (300), EVAL_SEQ (8), DIST_STEPS (3);
# TRAIN_ARGS, extra quality_study.py arguments of the train phase; EVAL_ARGS, of the eval phase; EXTRAS=0
# skips the eval phase's two benchmarks. Fidelity: FID_N (4096 new tokens), FID_P (8 problems), FID_SAMPLES
# (1), FID_BATCH (8 generations decoded together), FID_S (500); a phase stopped at FID_S keeps its finished
# generations in $HOME/fidelity/generations.jsonl, and the same command run again goes on from them.
# STUDY ($HOME/study): the study's directory, so that one machine can hold two (e.g. STUDY=$HOME/study_mix
# TRAIN_ARGS="--data champ,pystdlib,prose"). Domains: DOM_S (500), DOM_SEQ (2 sequences per source), DOM_LEN
# (8192), DOM_BUDGETS (2048,1024), DOM_POLICIES (tova,h2o). The training runs and the evaluation workers share the GPU under
# NVIDIA MPS where the machine has it (quality_study.py --mps falls back to time-slicing otherwise).
# Curve: CURVE_S (300), CURVE_SEQ (8); a phase stopped at CURVE_S keeps its points, the same command goes on.
# Two-phase rows (scorer-only pre-training, then distillation): the same plan arguments in TRAIN_ARGS and EVAL_ARGS, e.g.
# "--rows kvpop-mlp,kvpop-mlstm --pretrain-steps 600 --keep-every 100" (the eval phase re-plans the runs).
set -uo pipefail
phase=${1:?usage: bench/gpu_quality.sh train|eval|dist|fidelity|curve|domains OUT_DIR}
out=${2:?usage: bench/gpu_quality.sh train|eval|dist|fidelity|curve|domains OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stage=$HOME/stage
gguf=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$phase" = train ] || [ "$phase" = dist ]; then
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
fi
export PYTHONPATH=$HOME/site:$PWD/src KVPOP_SMOLLM2_GGUF=$gguf
study_dir=${STUDY:-$HOME/study}
study=(python bench/quality_study.py --out "$study_dir" --steps "${STEPS:-120}" --lr-base 1e-5 --mps)
case $phase in
train)
  # shellcheck disable=SC2086 # TRAIN_ARGS is a list of words
  "${study[@]}" --phase train --deadline-s "${TRAIN_S:-550}" --concurrency "${CONC:-7}" ${TRAIN_ARGS:-}
  cp "$study_dir/train_status.json" "$out/" 2>/dev/null
  ;;
eval)
  # shellcheck disable=SC2086
  "${study[@]}" --phase eval --deadline-s "${EVAL_S:-300}" --eval-sequences "${EVAL_SEQ:-8}" ${EVAL_ARGS:-}
  for f in results.json table.md eviction_pattern.png recall_per_layer.png; do
    cp "$study_dir/$f" "$out/" 2>/dev/null
  done
  [ "${EXTRAS:-1}" = 0 ] && exit 0
  echo "=== bench_distill ($(date -u +%H:%M:%S))"
  timeout --signal=INT 100 python bench/bench_distill.py --warmup 2 --steps 4 --json-out "$out/distill.json"
  echo "=== gpu_distributed ($(date -u +%H:%M:%S))"
  KVPOP_DIST_S=70 bash bench/gpu_distributed.sh "$HOME/dist_out" "${DIST_STEPS:-3}"
  (cd "$HOME/dist_out" && tar czf "$out/dist_logs.tgz" ./*.log ./*.jsonl 2>/dev/null)
  ;;
dist)
  # plain, torchrun 1 GPU (DDP, FSDP2) and, on a host with two, 2 GPUs (DDP, FSDP2); per-run limit DIST_LIMIT_S
  KVPOP_DIST_S=${DIST_LIMIT_S:-100} bash bench/gpu_distributed.sh "$HOME/dist_out" "${DIST_STEPS:-8}"
  (cd "$HOME/dist_out" && tar czf "$out/dist_logs.tgz" ./*.log ./*.jsonl ./*.config.json 2>/dev/null)
  cp "$HOME/dist_out/curves.png" "$out/" 2>/dev/null
  ;;
fidelity)
  trained=()
  for d in "$study_dir"/runs/kvpop-mlp_b*/final "$study_dir"/runs/dms_b*/final; do
    [ -d "$d" ] && trained+=(--trained "$d")
  done
  timeout --signal=INT "${FID_S:-500}" python -m kvpop.cli eval --model smollm2-135m --generate "${FID_N:-4096}" \
    --problems "${FID_P:-8}" --samples "${FID_SAMPLES:-1}" --gen-batch "${FID_BATCH:-8}" --ignore-eos \
    --budgets 2048,1024 --policies streaming_llm,tova,tova_windowed,h2o,h2o_windowed "${trained[@]}" \
    --out "$HOME/fidelity" --force  # a scratch folder a machine may keep from an earlier run
  for f in fidelity.json fidelity.txt fidelity.png generations.jsonl; do
    cp "$HOME/fidelity/$f" "$out/" 2>/dev/null
  done
  ;;
curve)
  timeout --signal=INT $(( ${CURVE_S:-300} + 60 )) python bench/recall_curve.py "$HOME"/study/runs/kvpop-* \
    --sequences "${CURVE_SEQ:-8}" --deadline-s "${CURVE_S:-300}" --out "$HOME/study/curve"
  cp "$HOME"/study/curve/recall_curve.* "$out/" 2>/dev/null
  ;;
domains)
  # in-domain and out-of-domain rows (bench/domain_eval.py) of every kvpop-mlp run of every study in
  # $HOME/study*, e.g. one trained with TRAIN_ARGS="--data champ" and one with --data champ,pystdlib,prose
  trained=()
  for d in "$HOME"/study*/runs/kvpop-mlp_*/final; do
    [ -d "$d" ] && trained+=(--trained "$d")
  done
  timeout --signal=INT "${DOM_S:-500}" python bench/domain_eval.py --model smollm2-135m "${trained[@]}" \
    --policies "${DOM_POLICIES:-tova,h2o}" --budgets "${DOM_BUDGETS:-2048,1024}" --seq-len "${DOM_LEN:-8192}" \
    --sequences "${DOM_SEQ:-2}" --out "$HOME/domains" --force | tee "$out/domains.txt"
  cp "$HOME/domains/domains.json" "$out/" 2>/dev/null
  ;;
*)
  echo "unknown phase $phase (train, eval, dist, fidelity, curve or domains)"; exit 2
  ;;
esac
