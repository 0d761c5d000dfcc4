#!/bin/bash
# Reliability probes (bad input and faults), on the tiny presets, in a fresh directory:
#   bash bench/reliability_probes.sh [WORK_DIR]     # about 5 minutes on 2 CPU cores
# Each probe prints its command, the exit status and the last stderr lines; each should end in one error line, never a traceback.
work=${1:-$(mktemp -d)}
mkdir -p "$work" && cd "$work" || exit 1
echo "# in $work"
export OMP_NUM_THREADS=1
K="python -m kvpop.cli"
python -c "
import random
rng = random.Random(0)
words = 'the cat sat on a mat and then it ran to the big red house where many dogs live'.split()
open('notes.txt','w').write('\n\n'.join(' '.join(rng.choice(words) for _ in range(300)) for _ in range(40)))
"
T="train --model tiny-random-qwen3 --data notes.txt --seq-len 128 --window 8 --topk 16 --save-every 2 --max-tokens 2048 --freeze-base --no-progress"
probe() {  # probe NAME COMMAND...
  local name=$1; shift
  echo "### $name"
  local shown="$*"
  shown=${shown#python -m kvpop.cli }
  echo "\$ kvpop ${shown:0:240}"
  "$@" > out.txt 2> err.txt; local rc=$?
  echo "rc=$rc"
  grep -v "^\[transformers\]\|Warning\|warn(" err.txt | grep -v "^$" | tail -n 4 | cut -c1-300
  echo
}
probe "first run" $K $T --steps 4 --out r
probe "train into a run, no --resume" $K $T --steps 6 --out r
ls r/checkpoints
probe "resume, spelled ./r, ./notes.txt, --device cpu" $K ${T/notes.txt/.\/notes.txt} --steps 6 --out ./r --resume --device cpu
mv r r_moved && cp notes.txt notes_copy.txt
python - <<'PY'
open('r_moved/train_log.jsonl', 'a').write('{"step": 7, "loss')
PY
probe "moved run + torn last log line, resume with more steps" $K ${T/notes.txt/notes_copy.txt} --steps 8 --out r_moved --resume
probe "--overwrite" $K $T --steps 2 --out r_moved --overwrite
ls -a . | grep -c replaced
python - <<'PY'
import kvpop
from kvpop.models import load_model
m, t = load_model("tiny-random-qwen3")
kvpop.save(kvpop.retrofit(m, kvpop.KVpopConfig(sink=2, window=8, topk=16)), "saved", tokenizer=t)
m.save_pretrained("hf_notok")
PY
cp -r saved saved_nocfg && rm saved_nocfg/kvpop_config.json
probe "save dir without kvpop_config.json" $K generate --model saved_nocfg --prompt hi
probe "eval --trained of another base" $K eval --model tiny-random-llama --trained saved --policies none --data notes.txt --split all --seq-len 64 --sequences 1 --out ev
probe "train --model <kvpop dir> --budget 30" $K train --model saved --budget 30 --data notes.txt --seq-len 128 --out r2
probe "generate on a plain model" $K generate --model tiny-random-qwen3 --prompt hello --max-new-tokens 4
probe "eval --policies kvpop (and progress)" $K eval --model tiny-random-qwen3 --policies kvpop,streaming_llm --budgets 32 --data notes.txt --split all --seq-len 64 --sequences 2 --out ev
cp -r saved saved_trunc && python -c "p='saved_trunc/model.safetensors'; b=open(p,'rb').read(); open(p,'wb').write(b[:len(b)//2])"
probe "truncated model.safetensors" $K generate --model saved_trunc --prompt hi
: > r_moved/checkpoints/step-00000002/model.safetensors
probe "zero-byte checkpoint part" $K $T --steps 4 --out r_moved --resume
mkdir -p legacy && head -c 64 /dev/urandom > legacy/checkpoint.pt
probe "garbage legacy checkpoint.pt" $K $T --steps 4 --out legacy --resume
probe "--device cuda without CUDA" $K generate --model tiny-random-qwen3 --prompt hi --device cuda
cp -r saved saved_badjson && echo "{" > saved_badjson/kvpop_config.json
probe "corrupt kvpop_config.json" $K generate --model saved_badjson --prompt hi
probe "model directory without tokenizer" $K generate --model hf_notok --prompt hi
python -c "
from transformers import GPT2Config; GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained('gpt2')"
probe "GPT-2" $K info --model gpt2
tail -n 1 out.txt
probe "eval --budgets -5" $K eval --model tiny-random-qwen3 --budgets=-5,32 --data notes.txt --seq-len 64 --out ev
probe "--top-p 1.5" $K generate --model tiny-random-qwen3 --prompt hi --do-sample --top-p 1.5
python -c "print('a' * 4090, end='')" > long.txt
probe "4090-token prompt + 20 new tokens at 4096 positions" $K generate --model tiny-random-qwen3 --prompt "$(cat long.txt)" --max-new-tokens 20 --window 8 --topk 8
probe "train --no-progress: no transformers bars" $K $T --steps 1 --out r3
grep -c "Writing model shards\|%|" err.txt
probe "default budget" $K generate --model tiny-random-llama --prompt hi --max-new-tokens 2
