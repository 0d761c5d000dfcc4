"""Profile of one prefill as `generate` runs it (eager, no compile of the forward): dense against `KVpopCache`.

    python bench/profile_prefill.py --model smollm2-135m-shape --dtype bfloat16 --context 4096 --budget 1024 --out DIR

Why: on an H100 `generate`'s prefill of SmolLM2's shape (bfloat16, 4096 tokens) took 0.32 s with KVpop against
0.04 s dense (docs/speed.md), while in float32 the two were 0.19 and 0.13 s: KVpop's extra
cost is host time (launches), hidden behind slower GPU work. This prints, per cache, the wall time of the forward,
the operators it dispatches (views excluded) and, on CUDA, the GPU busy time and kernels; then per layer KVpop minus
dense. The operator table (self CPU time) goes to `profile_prefill_<cache>.txt`. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
import time

import torch
from profile_decode_step import _kernels  # noqa: E402  (bench/ is the script's directory)

from kvpop.presets import model_help

# operators that launch nothing (metadata only); what is left approximates kernel launches on a GPU
VIEWS = {"aten::view", "aten::slice", "aten::unsqueeze", "aten::expand", "aten::reshape", "aten::transpose",
         "aten::permute", "aten::alias", "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::to",
         "aten::detach", "aten::detach_", "aten::select", "aten::as_strided", "aten::_unsafe_view", "aten::squeeze",
         "aten::t", "aten::empty_strided", "aten::_reshape_alias"}


def _top_level_ops(prof, runs: int) -> dict[str, float]:
    """Operators called from Python (not from inside another operator), views excluded: count per run."""
    out: collections.Counter = collections.Counter()
    for e in prof.events():
        top = e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::") and top \
                and e.name not in VIEWS:
            out[e.name] += 1 / runs
    return dict(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-shape", help=f"{model_help(shapes=True)} (default smollm2-135m-shape)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--caches", default="dense,kvpop", help="dense and KVpop policies (kvpop, tova, h2o, cascade, NAME+chunkC, ...)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import os

    from torch.profiler import ProfilerActivity, profile

    import kvpop
    from kvpop.cache import cache_kwargs
    from kvpop.eval.bench import load_bench_model, policy_config, sync

    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    model = load_bench_model(args.model, args.device, args.dtype, args.num_layers)
    L = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), generator=gen).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    per_cache = {}
    for kind in args.caches.split(","):
        if kind != "dense":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                kvpop.retrofit(model, policy_config(kind, args.budget))
        try:
            def forward(kind=kind):
                kw = {} if kind == "dense" else cache_kwargs(model, kvpop.KVpopCache(model))
                with torch.no_grad():
                    model(ids, use_cache=True, logits_to_keep=1, **kw)

            for _ in range(args.warmup):  # FlexAttention compiles on its first lengths
                forward()
            sync(device)
            walls = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                forward()
                sync(device)
                walls.append(time.perf_counter() - t0)
            with profile(activities=activities) as prof:
                for _ in range(args.runs):
                    forward()
                sync(device)
        finally:
            if kind != "dense":
                kvpop.detach(model)
        with open(f"{args.out}/profile_prefill_{kind}.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        ops = _top_level_ops(prof, args.runs)
        kern = _kernels(prof, args.runs) if device.type == "cuda" else {}
        per_cache[kind] = {"wall_ms": statistics.median(walls) * 1e3, "ops": sum(ops.values()),
                           "gpu_ms": sum(t for _, t in kern.values()) / 1e3,
                           "kernels": sum(n for n, _ in kern.values()), "by_op": ops}
        c = per_cache[kind]
        print(f"# {kind}: {c['wall_ms']:.1f} ms wall, {c['ops']:.0f} operators, GPU busy {c['gpu_ms']:.1f} ms, "
              f"{c['kernels']:.0f} kernels", flush=True)
    if "dense" in per_cache:
        base = per_cache["dense"]
        for kind, c in per_cache.items():
            if kind == "dense":
                continue
            print(f"# per layer, {kind} minus dense ({L} layers): {(c['wall_ms'] - base['wall_ms']) / L:+.2f} ms wall, "
                  f"{(c['ops'] - base['ops']) / L:+.0f} operators, {(c['kernels'] - base['kernels']) / L:+.0f} kernels")
            diff = {k: (c["by_op"].get(k, 0) - base["by_op"].get(k, 0)) / L for k in set(c["by_op"]) | set(base["by_op"])}
            for name, n in sorted(diff.items(), key=lambda kv: -kv[1])[:25]:
                print(f"{n:+8.1f}  {name}")
    result = {"args": vars(args), "layers": L, "caches": per_cache,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(f"{args.out}/profile_prefill.json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "caches"}
                     | {"caches": {k: {kk: vv for kk, vv in v.items() if kk != "by_op"} for k, v in per_cache.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
