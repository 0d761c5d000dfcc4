#!/usr/bin/env bash
# Distillation on 1 and 2 GPUs of one host (issue 9): same command, same global batch, losses and throughput.
#
#   bash bench/gpu_distributed.sh OUT_DIR [STEPS]
#
# Runs `kvpop train` on SmolLM2-135M at S = 8192 (B = 2048, w = 256) with a global batch of 2 sequences:
# plain (no torchrun), torchrun on 1 GPU with DDP and with FSDP2 (NCCL), then, where the host has
# two GPUs, torchrun on 2 GPUs with DDP and with FSDP2. Prints per-step (loss_kl, loss_score) of each
# run side by side and the median tokens/s after the first step.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes require.
set -uo pipefail
out=${1:?usage: bench/gpu_distributed.sh OUT_DIR [STEPS]}
steps=${2:-8}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
common=(--model smollm2-135m --data champ --seq-len 8192 --budget 2048 --window 256 --steps "$steps"
        --batch-size 2 --save-every 0 --no-progress)
limit=${KVPOP_DIST_S:-240}
run() {  # run NAME NPROC EXTRA...  (NPROC 0: plain python, no torchrun)
  local name=$1 n=$2; shift 2
  local launch=(torchrun --nproc-per-node "$n" -m)
  [ "$n" = 0 ] && launch=(python -m)
  echo "=== $name ($(date -u +%H:%M:%S)): ${launch[*]} kvpop.cli train ... $*"
  rm -rf "$HOME/dist/$name"
  timeout --signal=INT "$limit" "${launch[@]}" kvpop.cli train "${common[@]}" --out "$HOME/dist/$name" "$@" \
    > "$out/$name.log" 2>&1
  echo "=== $name exit $? ($(date -u +%H:%M:%S))"
  grep -h '"parallel"\|"backend"\|"world' "$HOME/dist/$name/config.json" 2>/dev/null | tr -d ' \n'; echo
  cp "$HOME/dist/$name/train_log.jsonl" "$out/$name.jsonl" 2>/dev/null
}
gpus=$(nvidia-smi -L | wc -l)
run plain 0
run gpu1_ddp 1
run gpu1_fsdp 1 --fsdp
if [ "$gpus" -ge 2 ]; then
  run gpu2_ddp 2
  run gpu2_fsdp 2 --fsdp
else
  echo "=== one GPU here: the 2-GPU runs need a multi-GPU machine"
fi
python3 - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {p.stem: [json.loads(l) for l in p.read_text().splitlines()] for p in sorted(out.glob("*.jsonl"))}
names = list(runs)
print("step  " + "  ".join(f"{n:>24}" for n in names))
for i in range(max(map(len, runs.values()), default=0)):
    cells = [f"{r[i]['loss_kl']:.5f}/{r[i]['loss_score']:.5f}" if i < len(r) else "-" for r in runs.values()]
    print(f"{i + 1:>4}  " + "  ".join(f"{c:>24}" for c in cells))
speed = {n: statistics.median(x["tokens_per_s"] for x in r[1:]) for n, r in runs.items() if len(r) > 1}
print("tokens/s (median from step 2): " + ", ".join(f"{n} {v:.0f}" for n, v in speed.items()))
print(json.dumps({"steps": {n: [(x["loss_kl"], x["loss_score"]) for x in r] for n, r in runs.items()},
                  "tokens_per_s": speed}))
EOF
