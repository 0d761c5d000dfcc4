"""One distillation step on the GPU: tokens/s, and where the time goes (attention, target, scorer, ...).

    python bench/bench_distill.py --model smollm2-135m --seq-len 8192 --budget 2048 --window 256

Builds the same `Distiller` as `kvpop train` (full distillation: teacher forward, student forward
with the rule, future-attention target, boundary loss, KL, backward, two clipped AdamW groups),
runs `--warmup` untimed steps (compilation), then times `--steps` steps. The time shares come from
the `kvpop.timing.timed` ranges of the trainer and the attention function, timed with CUDA events
on the stream (`RangeTimer`), over the steps' wall time. Ranges nest: `kvpop.scorer`, `kvpop.rule`
and `kvpop.sparse_attention` are parts of `kvpop.student_forward` (all 30 layers); the backward pass
is one range (`kvpop.backward`, attention's backward included), as autograd runs it.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time

import torch

RANGES = ("kvpop.teacher_forward", "kvpop.student_forward", "kvpop.scorer", "kvpop.rule", "kvpop.sparse_attention",
          "kvpop.kl", "kvpop.target", "kvpop.boundary_loss", "kvpop.backward", "kvpop.optimizer")
NESTED = ("kvpop.scorer", "kvpop.rule", "kvpop.sparse_attention")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="champ")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--scorer", default="mlp", choices=("mlp", "mlstm"))
    p.add_argument("--freeze-base", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (CPU times then)")
    p.add_argument("--attention", default="auto", choices=("auto", "flex", "gather"),
                   help="the student's training attention, as `kvpop train --attention`: auto (FlexAttention over the "
                        "sequence on CUDA), flex, or gather (each query tile over its own keys)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_distill needs CUDA (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from kvpop.config import KVpopConfig
    from kvpop.timing import RangeTimer
    from kvpop.train.distill import Distiller, TrainConfig

    with tempfile.TemporaryDirectory() as out:
        tcfg = TrainConfig(model=args.model, data=args.data, seq_len=args.seq_len, steps=args.warmup + args.steps,
                           out=out, save_every=0, device=args.device, freeze_base=args.freeze_base,
                           attention=args.attention)
        kcfg = KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window, scorer=args.scorer)
        t0 = time.perf_counter()
        d = Distiller(tcfg, kcfg)
        setup_s = time.perf_counter() - t0
        stream = d.batches()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            d.train_step(next(stream))
        sync()
        warmup_s = time.perf_counter() - t0
        step_s = []
        with RangeTimer(args.device) as timer:
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                d.train_step(next(stream))
                sync()
                step_s.append(time.perf_counter() - t0)
        range_ms = {name: ms / args.steps for name, ms in timer.totals().items()}
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0

    med = statistics.median(step_s)
    mean_ms = 1e3 * sum(step_s) / len(step_s)
    row = {
        "model": args.model, "seq_len": args.seq_len, "budget": kcfg.budget, "sink": kcfg.sink, "window": kcfg.window,
        "topk": d.kcfg.topk, "scorer": args.scorer, "attention": args.attention, "full_distillation": not args.freeze_base,
        "step_s_median": med, "tokens_per_s": args.seq_len / med, "setup_s": setup_s, "warmup_s": warmup_s,
        "range_ms_per_step": range_ms, "shares": {k: v / mean_ms for k, v in range_ms.items()}, "peak_gb": peak_gb,
    }
    print(f"# {args.model} S={args.seq_len} budget={kcfg.budget} scorer={args.scorer}: "
          f"{row['tokens_per_s']:.0f} tokens/s, {med * 1e3:.0f} ms/step (median of {args.steps}), peak {peak_gb:.1f} GB")
    for name in RANGES:
        if name in range_ms:
            indent = "    " if name in NESTED else "  "
            print(f"{indent}{name:<26} {range_ms[name]:8.1f} ms  {100 * row['shares'][name]:5.1f} % of the step")
    result = {"rows": [row], "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "command": "python bench/bench_distill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
