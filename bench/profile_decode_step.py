"""Kernel profile of one decode step under `torch.compile`: dense on HF `StaticCache` against `KVpopCache`.

    python bench/profile_decode_step.py --model qwen3-8b-shape --num-layers 8 --context 4096 --budget 2048 --out DIR

Both caches are filled at random to `--context` tokens (`kvpop.decode.fill_random`) and decode through
`kvpop.decode.Decoder` with `--backend` (inductor) and `--mode`: "default" keeps each kernel visible to the
profiler as its own launch; "reduce-overhead" is what `kvpop bench --compile` times (CUDA graphs). Per cache it
writes the operator table (`profile_<cache>.txt`) and prints GPU busy time, kernels and launches per step; then
the kernels KVpop adds per layer: each kernel name's count and time per step, KVpop minus dense, over layers.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import time

import torch

from kvpop.presets import model_help


def _kernels(prof, steps: int) -> dict[str, tuple[float, float]]:
    """GPU kernels by name: (launches per step, us per step)."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name][0] += 1 / steps
            out[e.name][1] += e.device_time / steps
    return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b-shape", help=f"{model_help(shapes=True)} (default qwen3-8b-shape)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", default="default", help="torch.compile mode: default (kernels visible) or reduce-overhead")
    p.add_argument("--caches", default="dense,kvpop")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from kvpop.config import KVpopConfig
    from kvpop.decode import Decoder, fill_random
    from kvpop.eval.bench import _new_cache, _prepared, load_bench_model, sync

    device = torch.device(args.device)
    model = load_bench_model(args.model, args.device, num_layers=args.num_layers)
    cfg = KVpopConfig.for_budget(args.budget, window=args.window)
    B, S = args.batch, args.context
    per_cache = {}
    for kind in args.caches.split(","):
        with _prepared(model, kind, cfg, seed=0), torch.no_grad():
            cache = _new_cache(model, kind, static_length=S + args.warmup + 2 * args.steps + 2)
            decoder = Decoder(model, cache, compile=True, backend=args.backend, mode=args.mode)
            fill_random(model, cache, B, S, seed=0)
            tok = torch.zeros(B, 1, dtype=torch.long, device=device)
            position = torch.full((B, 1), S, dtype=torch.long, device=device)
            with decoder.decoding():
                for _ in range(args.warmup):
                    decoder.step(tok, position)
                    position.add_(1)
                sync(device)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        decoder.step(tok, position)
                        position.add_(1)
                    sync(device)
                # wall time of the same steps, outside the profiler
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    decoder.step(tok, position)
                    position.add_(1)
                sync(device)
                ms = (time.perf_counter() - t0) * 1e3 / args.steps
        ka = prof.key_averages()
        with open(f"{args.out}/profile_decode_{kind}.txt", "w") as f:
            f.write(ka.table(sort_by="cuda_time_total", row_limit=60))
        kern = _kernels(prof, args.steps)
        launches = sum(e.count for e in ka if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch")))
        per_cache[kind] = {"ms_per_step": ms, "gpu_us_per_step": sum(t for _, t in kern.values()),
                           "kernels_per_step": sum(n for n, _ in kern.values()), "launches_per_step": launches / args.steps,
                           "kernels": kern}
        print(f"# {kind}: {ms:.3f} ms/step (wall), GPU busy {per_cache[kind]['gpu_us_per_step'] / 1e3:.3f} ms, "
              f"{per_cache[kind]['kernels_per_step']:.0f} kernels/step, {launches / args.steps:.0f} launches/step",
              flush=True)
    if {"dense", "kvpop"} <= per_cache.keys():
        L = args.num_layers
        dk, kk = per_cache["dense"]["kernels"], per_cache["kvpop"]["kernels"]
        rows = []
        for name in set(dk) | set(kk):
            dn, dt = dk.get(name, (0.0, 0.0))
            kn, kt = kk.get(name, (0.0, 0.0))
            rows.append((kt - dt, (kn - dn) / L, (kt - dt) / L, name))
        rows.sort(reverse=True)
        print(f"# per layer, KVpop minus dense ({L} layers): kernels, us, name")
        for _, n, t, name in rows[:40]:
            print(f"{n:+6.2f} {t:+8.2f}  {name[:150]}")
    result = {"args": vars(args), "caches": {k: {kk: vv for kk, vv in v.items() if kk != "kernels"}
                                             for k, v in per_cache.items()},
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(f"{args.out}/profile_decode.json", "w") as f:
        json.dump({**result, "kernels": {k: v["kernels"] for k, v in per_cache.items()}}, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
