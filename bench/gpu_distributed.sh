#!/usr/bin/env bash
# Distillation on 1 and 2 GPUs of one host: same command, same global batch, losses and throughput.
#
#   bash bench/gpu_distributed.sh OUT_DIR [STEPS]
#
# Runs `kvpop train` on SmolLM2-135M at S = 8192 (B = 2048, w = 256), global batch 2 unless a run says
# otherwise. RUNS lists the runs as NAME:NPROC[:EXTRA,ARGS] (NPROC 0: plain python, no torchrun); the
# default is plain, torchrun on 1 GPU with DDP and FSDP2, then, where the host has two GPUs, torchrun on
# 2 GPUs with DDP and FSDP2 (strong scaling: the same global batch split in two) and DDP with a global
# batch of 4 (weak scaling: each GPU keeps 2 sequences). Runs on 2 GPUs are skipped on a 1-GPU host.
# Prints per-step (loss_kl, loss_score) side by side, each run's largest relative difference from the
# first 1-GPU torchrun run (gpu1*) of the same global batch, and the median tokens/s after step 1.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), as the device notes require.
set -uo pipefail
out=${1:?usage: bench/gpu_distributed.sh OUT_DIR [STEPS]}
steps=${2:-8}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
common=(--model smollm2-135m --data champ --seq-len 8192 --budget 2048 --window 256 --steps "$steps"
        --batch-size 2 --save-every 0 --no-progress)
limit=${KVPOP_DIST_S:-240}
runs=${RUNS:-plain:0 gpu1_ddp:1 gpu1_fsdp:1:--fsdp gpu2_ddp:2 gpu2_fsdp:2:--fsdp gpu2_ddp_b4:2:--batch-size,4}
gpus=$(nvidia-smi -L | wc -l)
run() {  # run NAME NPROC EXTRA...
  local name=$1 n=$2; shift 2
  local launch=(torchrun --nproc-per-node "$n" -m)
  [ "$n" = 0 ] && launch=(python -m)
  echo "=== $name ($(date -u +%H:%M:%S)): ${launch[*]} kvpop.cli train ... $*"
  rm -rf "$HOME/dist/$name" "$out/$name".*
  # a later --batch-size overrides the common one (argparse keeps the last)
  timeout --signal=INT -k 15 "$limit" "${launch[@]}" kvpop.cli train "${common[@]}" --out "$HOME/dist/$name" "$@" \
    > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))"
  [ "$rc" = 0 ] || grep -v '%|' "$out/$name.log" | tail -n 8  # why it failed (progress bars left out)
  grep -h '"parallel"\|"backend"\|"world' "$HOME/dist/$name/config.json" 2>/dev/null | tr -d ' \n'; echo
  cp "$HOME/dist/$name/train_log.jsonl" "$out/$name.jsonl" 2>/dev/null
  cp "$HOME/dist/$name/config.json" "$out/$name.config.json" 2>/dev/null
}
for spec in $runs; do
  IFS=: read -r name n extra <<< "$spec"
  if [ "$n" -gt "$gpus" ]; then echo "=== $name skipped: $n GPUs asked, $gpus here"; continue; fi
  # shellcheck disable=SC2086 # EXTRA's commas separate arguments
  run "$name" "$n" ${extra//,/ }
done
python3 - "$out" "$runs" <<'EOF_PY'
import json, statistics, sys
from pathlib import Path
out, order = Path(sys.argv[1]), [s.split(":")[0] for s in sys.argv[2].split()]
runs = {n: [json.loads(l) for l in (out / f"{n}.jsonl").read_text().splitlines()]
        for n in order if (out / f"{n}.jsonl").exists()}
batch = {n: json.loads((out / f"{n}.config.json").read_text())["train"]["batch_size"] for n in runs}
print("step  " + "  ".join(f"{n:>20}" for n in runs))
for i in range(max(map(len, runs.values()), default=0)):
    cells = [f"{r[i]['loss_kl']:.5f}/{r[i]['loss_score']:.5f}" if i < len(r) else "-" for r in runs.values()]
    print(f"{i + 1:>4}  " + "  ".join(f"{c:>20}" for c in cells))
print("global batch: " + ", ".join(f"{n} {b}" for n, b in batch.items()))
# the reference of each global batch: its first 1-GPU torchrun run (gpu1*), else its first run
ref = {}
for n in sorted(runs, key=lambda n: not n.startswith("gpu1")):
    ref.setdefault(batch[n], n)
diff = {}
for n, r in runs.items():
    base = runs[ref[batch[n]]]
    if n == ref[batch[n]] or len(base) < len(r):
        continue
    # largest relative difference over the steps, and at step 1 (no update yet: only reduction order differs)
    rel = lambda key, i: abs(r[i][key] - base[i][key]) / abs(base[i][key])
    diff[n] = {"vs": ref[batch[n]], "step1": max(rel(k, 0) for k in ("loss_kl", "loss_score")),
               "max": max(rel(k, i) for k in ("loss_kl", "loss_score") for i in range(len(r)))}
    print(f"{n} vs {ref[batch[n]]}: largest relative difference {diff[n]['max']:.2e} (step 1: {diff[n]['step1']:.2e})")
speed = {n: statistics.median(x["tokens_per_s"] for x in r[1:]) for n, r in runs.items() if len(r) > 1}
print("tokens/s (median from step 2): " + ", ".join(f"{n} {v:.0f}" for n, v in speed.items()))
try:  # the loss curves side by side, where kvpop is importable (it is under gpu_quality.sh's PYTHONPATH)
    from kvpop.eval.plots import plot_training_curves
    print(f"curves: {plot_training_curves(runs, out / 'curves.png')}")
except ImportError as e:
    print(f"curves: not drawn ({e})")
print(json.dumps({"steps": {n: [(x["loss_kl"], x["loss_score"]) for x in r] for n, r in runs.items()},
                  "batch": batch, "relative_difference": diff, "tokens_per_s": speed}))
EOF_PY
