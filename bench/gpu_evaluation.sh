#!/usr/bin/env bash
# The ninth session's device calls (issues 16, 17, 18), back to back in one warm lease of one H200 (`nvidia-h200`);
# the eighth session's calls are this file at commit 63a8c82. bench/README.md has the runbook.
#
#   bash bench/gpu_evaluation.sh 1 OUT   # carry .stage_a: stage the model's first half; the CUDA tests of the fast
#                                        # paths; the prefill walk per kernel variant (bench_walk.py) and TOVA / H2O
#                                        # prefill at the Qwen3-8B shape; `generate` against StaticCache + compile
#   bash bench/gpu_evaluation.sh 2 OUT   # carry .stage_b: assemble SmolLM2; `kvpop selfgen` (the dense model's own
#                                        # generations of champ training problems); train the issue-17 data ablation
#                                        # (pre-RoPE MLP scorers, scorer-only, on the domain mixture without (+mix) and
#                                        # with (+mix2) self-generated text, two seeds, both budgets) under MPS
#   bash bench/gpu_evaluation.sh 3 OUT   # the ablation finished and evaluated (--phase all) on the seventh session's 8
#                                        # sequences; then long-generation fidelity of its seed-0 rows and the
#                                        # training-free rows (issue 16)
#   bash bench/gpu_evaluation.sh 4 OUT   # the task suite of the same rows (issue 16)
#
# Lessons of the eighth session: nine scorer-only runs under MPS ran 3-18 s/step on one GPU (plan fewer runs per
# call); side processes (suite, fidelity) need their own call; the table's TOVA and H2O rows are the seventh
# session's on the same 8 sequences, and StreamingLLM / the oracle must repeat that session's digits.
# Knobs: STEPS (120), SEEDS (0,1), TRAIN_S (call 2's training seconds, 330), EVAL_S (330), SG_N (selfgen
# sequences, 32), SG_TOKENS (4096), SG_S (300; selfgen ran ~33 ms/step at batch 16 on the H200, and a stopped run
# keeps its finished sequences in selfgen.jsonl.partial: repeat the call to continue), FID_N (2048 new tokens), FID_P (8 problems), SIDE_S (420), LENGTHS (4k,8000).
set -uo pipefail
phase=${1:?usage: bench/gpu_evaluation.sh 1|2|3|4 OUT_DIR}
dest=${2:?usage: bench/gpu_evaluation.sh 1|2|3|4 OUT_DIR}
# the device returns at most 8 files: everything goes to a work folder, packed into OUT/callN.tgz at the end
out=$HOME/call$phase
mkdir -p "$out" "$dest"
trap 'tar czf "$dest/call$phase.tgz" -C "$out" . && ls -la "$dest"' EXIT
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
stage=$HOME/stage
gguf=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$HOME/site:$PWD/src KVPOP_SMOLLM2_GGUF=$gguf
kvpop=(python -m kvpop.cli)
# issue 17's ablation, scorers only (the base frozen: every row on the original weights, so the table isolates
# what the scorer keeps): the paper's MLP and the evidence scorer at both budgets, then at B = 1024 a small window,
# pre-RoPE keys, the domain mixture and the mLSTM given more steps
default_rows=(kvpop-mlp+frozen kvpop-evidence+frozen kvpop-mlp+w64+frozen+b1024 kvpop-evidence+w64+frozen+b1024
              kvpop-mlp+prerope+frozen+b1024 kvpop-mlp+mix+frozen+b1024 kvpop-mlstm+frozen+b1024+steps400)
ROWS=${ROWS:-$(IFS=,; echo "${default_rows[*]}")}
study=(python bench/quality_study.py --out "$HOME/study" --steps "${STEPS:-120}" --mps --rows "$ROWS"
       --mix champ,pystdlib,prose --keep-every 100 --free-rows "${FREE_ROWS:-streaming_llm,oracle}")
free=(--policies streaming_llm,tova,h2o)

step() {  # step NAME SECONDS COMMAND...: a time limit, the log in OUT/NAME.log, never aborts the script
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))"; tail -n 30 "$out/$name.log"
}

fidelity() {  # fidelity NAME ARGS...: long-generation fidelity into $HOME/NAME (finished generations kept)
  local name=$1; shift
  step "$name" "${SIDE_S:-420}" "${kvpop[@]}" eval --model smollm2-135m --generate "${FID_N:-2048}" \
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

wait_for_model() {  # the study converts SmolLM2 once; the side processes start after it
  for _ in $(seq 120); do
    grep -q "train:" "$out/study_train.log" 2>/dev/null && return 0
    sleep 2
  done
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
selfgen=$HOME/selfgen.jsonl
mixes=(--mix champ,pystdlib,prose --mix "champ,pystdlib,prose,$selfgen")
study=(python bench/quality_study.py --out "$HOME/study" --steps "${STEPS:-120}" --seeds "${SEEDS:-0,1}" --mps
       --rows kvpop-mlp+prerope+mix+frozen,kvpop-mlp+prerope+mix2+frozen "${mixes[@]}" --free-rows oracle)
trained() {  # the seed-0 final weights of the study's rows at budget $1, as --trained arguments
  for d in "$HOME"/study/runs/*_b"$1"; do
    case $d in *_s[0-9]*_b"$1") continue ;; esac  # seed 0 only
    [ -f "$d/final/kvpop_config.json" ] && echo --trained "$(basename "${d%_b$1}")=$d/final"
  done
}
case $phase in
1)
  mkdir -p "$stage" && cp .stage_a/* "$stage/" && ls -la "$stage"
  TORCH_LOGS=perf_hints step tests 120 python -m pytest -q -rs -p no:cacheprovider tests/test_decode.py \
    tests/test_dynamic.py tests/test_generation.py tests/test_cache.py -m "gpu or not slow" \
    -k "cuda or captured or triton or compile"
  grep -i "skipping cudagraphs" "$out/tests.log" | sort | uniq -c | head
  step walk 150 python bench/bench_walk.py --variants "${WALK_VARIANTS:-v1,v2,v2-r2,v2-r4,v2-r8,v2-w32-r8,v2-online}"
  step prefill_8b 110 python bench/bench_prefill.py --model qwen3-8b-shape --device cuda --context 8192 \
    --budget 2048 --policies tova,h2o,kvpop --repeats 3 --no-replay --json-out "$out/prefill_8b.json"
  step generate_8b_b1 150 python bench/bench_generate.py --model qwen3-8b-shape --num-layers 12 --device cuda \
    --contexts 4096 --caches dense,static,kvpop --new-tokens 64 --budget 2048 --batch 1 --repeats 2 \
    --json-out "$out/generate_8b_b1.json"
  ;;
2)
  cp .stage_b/* "$stage/" && cat "$stage"/part_a? > "$gguf" \
    && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" "$stage"/*.whl \
    || { echo "staging failed"; ls -la "$stage"; exit 1; }
  (cd "$stage" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf; cat SHA256 2>/dev/null)
  # the ninth session lost two runs here (64 x 7680 and 32 x 4096 tokens stopped at their limits, before
  # the partial file existed); give selfgen its own call and repeat it until the file is whole
  step selfgen "${SG_S:-300}" "${kvpop[@]}" selfgen --model smollm2-135m --out "$selfgen" --sequences "${SG_N:-32}" \
    --tokens "${SG_TOKENS:-4096}" --temperature 0,0.7 --batch "${SG_N:-32}" --no-progress
  cp "$selfgen" "$out/" 2>/dev/null
  "${study[@]}" --phase train --deadline-s "${TRAIN_S:-330}" --concurrency 8 > "$out/study_train.log" 2>&1
  tail -n 40 "$out/study_train.log"
  cp "$HOME/study/train_status.json" "$out/" 2>/dev/null
  ;;
3)
  "${study[@]}" --phase all --deadline-s "${STUDY_S:-300}" --eval-reserve-s "${EVAL_S:-200}" --eval-sequences 8 \
    --concurrency 8 > "$out/study.log" 2>&1
  for f in results.json table.md recall_per_layer.png train_status.json; do cp "$HOME/study/$f" "$out/" 2>/dev/null; done
  grep -v progress "$out/study.log" | tail -n 50
  # long-generation fidelity (greedy), the trained seed-0 rows beside the training-free ones, per budget
  for b in 2048 1024; do
    fidelity "fid_b$b" --policies streaming_llm,tova,h2o --budgets "$b" --samples 0 $(trained "$b") &
  done
  wait
  ;;
4)
  for b in 2048 1024; do
    suite "suite_b$b" --policies streaming_llm,tova,h2o --budgets "$b" $(trained "$b") &
  done
  wait
  ;;
*)
  echo "unknown phase $phase (1, 2, 3 or 4)"; exit 2
  ;;
esac
