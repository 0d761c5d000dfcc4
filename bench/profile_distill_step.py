"""Operator profile of distillation steps (the same `Distiller` as `kvpop train`), whole-sequence FlexAttention vs
the gathered tiles: where the step's time goes, on the GPU and on the host.

    python bench/profile_distill_step.py --attention flex,gather --out DIR    # TrainConfig.attention values
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from kvpop.presets import model_help


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help=f"{model_help()} (default smollm2-135m)")
    p.add_argument("--data", default="prose")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--attention", default="flex,gather", help="comma-separated TrainConfig.attention values")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    from torch.profiler import ProfilerActivity, profile

    from kvpop.config import KVpopConfig
    from kvpop.train.distill import Distiller, TrainConfig

    for mode in args.attention.split(","):
        with tempfile.TemporaryDirectory() as out:
            tcfg = TrainConfig(model=args.model, data=args.data, seq_len=args.seq_len,
                               steps=args.warmup + args.steps + 1, out=out, save_every=0, device=args.device,
                               attention=mode)
            d = Distiller(tcfg, KVpopConfig.for_budget(args.budget, window=args.window))
            stream = d.batches()
            for _ in range(args.warmup):
                d.train_step(next(stream))
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    d.train_step(next(stream))
                sync()
        ka = prof.key_averages()
        with open(f"{args.out}/profile_{mode}.txt", "w") as f:
            f.write(ka.table(sort_by="cuda_time_total", row_limit=40))
            f.write("\n\n")
            f.write(ka.table(sort_by="cpu_time_total", row_limit=40))
        gpu = sum(e.self_device_time_total for e in ka) / 1e3 / args.steps
        launches = sum(e.count for e in ka if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
        syncs = sum(e.count for e in ka if e.key in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
                                                       "cudaDeviceSynchronize"))
        print(f"# {mode}: GPU busy {gpu:.1f} ms/step, {launches / args.steps:.0f} launches/step, "
              f"{syncs / args.steps:.0f} sync events/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
