"""One distillation step on the GPU: tokens/s, and where the time goes (attention, target, scorer, ...).

    python bench/bench_distill.py --model smollm2-135m --seq-len 8192 --budget 2048 --window 256

Builds the same `Distiller` as `kvpop train` (full distillation: teacher forward, student forward
with the rule, future-attention target, boundary loss, KL, backward, two clipped AdamW groups),
runs `--warmup` untimed steps (compilation), times `--steps` steps, then profiles `--profile-steps`
more with `torch.profiler`. The shares come from the `record_function` ranges the trainer and the
attention function carry (`kvpop.*`): GPU time of the kernels launched inside each range over the
GPU time of all kernels. Backward kernels are not split by range: `kvpop.backward` holds them all.
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
          "kvpop.target", "kvpop.boundary_loss", "kvpop.backward")


def _device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _self_device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


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
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (CPU times then)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_distill needs CUDA (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from kvpop.config import KVpopConfig
    from kvpop.train.distill import Distiller, TrainConfig

    total = args.warmup + args.steps + args.profile_steps
    with tempfile.TemporaryDirectory() as out:
        tcfg = TrainConfig(model=args.model, data=args.data, seq_len=args.seq_len, steps=total, out=out,
                           save_every=0, device=args.device, freeze_base=args.freeze_base)
        kcfg = KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window, scorer=args.scorer)
        t0 = time.perf_counter()
        d = Distiller(tcfg, kcfg)
        setup_s = time.perf_counter() - t0
        stream = d.batches()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            d.train_step(next(stream))
        warmup_s = time.perf_counter() - t0
        step_s = []
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            d.train_step(next(stream))  # ends in a host read of the losses: the step is finished
            step_s.append(time.perf_counter() - t0)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                d.train_step(next(stream))
        events = prof.key_averages()
        if cuda:
            kernels_us = sum(_self_device_us(e) for e in events)
            shares = {e.key: _device_us(e) / kernels_us for e in events if e.key in RANGES and kernels_us > 0}
        else:  # CPU smoke test: the ranges' CPU time over the profiled steps' wall time
            kernels_us = sum(e.self_cpu_time_total for e in events)
            shares = {e.key: e.cpu_time_total / kernels_us for e in events if e.key in RANGES and kernels_us > 0}
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0

    med = statistics.median(step_s)
    row = {
        "model": args.model, "seq_len": args.seq_len, "budget": kcfg.budget, "sink": kcfg.sink, "window": kcfg.window,
        "topk": d.kcfg.topk, "scorer": args.scorer, "full_distillation": not args.freeze_base,
        "step_s_median": med, "tokens_per_s": args.seq_len / med, "setup_s": setup_s, "warmup_s": warmup_s,
        "gpu_time_shares": shares, "gpu_kernel_ms_per_step": kernels_us / 1e3 / args.profile_steps, "peak_gb": peak_gb,
    }
    print(f"# {args.model} S={args.seq_len} budget={kcfg.budget} scorer={args.scorer}: "
          f"{row['tokens_per_s']:.0f} tokens/s, {med * 1e3:.0f} ms/step (median of {args.steps}), "
          f"GPU kernels {row['gpu_kernel_ms_per_step']:.0f} ms/step, peak {peak_gb:.1f} GB")
    for name in RANGES:
        if name in shares:
            print(f"  {name:<26} {100 * shares[name]:6.1f} % of GPU time")
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
