"""The dynamic policies' prefill walk alone, one layer, per kernel variant: where its time goes.

    python bench/bench_walk.py --device cuda                       # Qwen3-8B shape: Hkv 8, G 4, D 128
    python bench/bench_walk.py --device cuda --context 8192 --budget 2048 --variants triton,triton-w8
    python bench/bench_walk.py --device cuda --variants triton,parallel,parallel-b128
    python bench/bench_walk.py --device cpu --kv-heads 2 --head-dim 64 --budget 512 --context 2048 \
        --variants torch,parallel,parallel-b64,parallel-b128

One layer's `dynamic_walk_triton` over a prompt of `--context` tokens into empty slots, per score
(TOVA's paper split with the head average "mean", TOVA per KV head "max", H2O "sum"; sinks, window and
top-k from `KVpopConfig.for_budget`), per variant: `triton` the Triton walk (`ops/dynamic/kernel.py`;
`-wN` its warps; the kernel variants it was chosen among are in docs/speed.md), `torch` the torch walk, `parallel` the speculated walk (`ops/dynamic/parallel.py`; `-bN` its block of N
tokens, `-fused` its priorities compiled by inductor, `-jacobi` its selection of every step at once), whose rows also give its verification rounds, mismatches and
skips (from one more, untimed run).
`--profile FILE` runs each variant once more under `torch.profiler` and writes its operator table (self time, calls,
kernel launches) to FILE: where the walk's time goes, op by op.
On the CPU the times are wall-clock medians (`time.perf_counter`) and the inputs float32.
Next to it, in the same run: the walk's GEMM part alone (the per-block logits, candidates and key
gather, no kernel) and the dense causal SDPA forward of the layer's queries (bf16), the attention
that a dense prefill runs for this layer. Times are medians over `--repeats` after one warm-up.

Output: a human table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch

from kvpop.config import KVpopConfig
from kvpop.ops.dynamic import dynamic_walk
from kvpop.ops.dynamic.kernel import BLOCK_C, dynamic_walk_triton
from kvpop.ops.dynamic.parallel import dynamic_walk_parallel

POLICIES = {"tova-mean": ("tova", "mean", True), "tova-max": ("tova", "max", False), "h2o": ("h2o", "sum", None)}


def _variant(name: str) -> dict:
    """`triton-w8` -> dynamic_walk_triton keywords; `parallel-b128` -> dynamic_walk_parallel keywords."""
    head, *mods = name.split("-")
    if head not in ("triton", "torch", "parallel"):
        raise ValueError(f"variant {name!r}: expected triton[-wN], parallel[-bN][-fused][-jacobi] or torch")
    plain = [m for m in mods if m not in ("fused", "jacobi")]
    if head == "torch" and mods or head == "parallel" and any(not m.startswith("b") for m in plain) \
            or head == "triton" and any(not m.startswith("w") for m in mods):
        raise ValueError(f"variant {name!r}: 'torch' takes no modifiers, 'parallel' only bN, fused and jacobi, "
                         "'triton' only wN")
    if head == "parallel":
        kw = {"fused": True} if "fused" in mods else {}
        if "jacobi" in mods:
            kw["select"] = "jacobi"
        return {**kw, "block": int(plain[0][1:])} if plain else kw
    return {"num_warps": int(mods[0][1:])} if mods else {}


def _runner(name: str, walk: tuple, block: int):
    """The walk of variant `name` on the arguments `walk` of `dynamic_walk`, as a callable."""
    kw = _variant(name)
    if name in ("torch", "parallel"):
        return functools.partial(dynamic_walk, *walk, backend=name)
    if name.startswith("parallel"):
        return functools.partial(dynamic_walk_parallel, *walk, **kw)
    return functools.partial(dynamic_walk_triton, *walk, block=block, **kw)


def _timed(fn, repeats: int, cuda: bool = True) -> float:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        if not cuda:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _gemm_only(q, key, N, block):
    """The walk's per-block torch work without the kernel: candidates, logits, next block's keys."""
    B, H, C, D = key.shape
    G = q.shape[1] // H
    qf = q.reshape(B, H, G, C, D).float()
    keys = torch.zeros(B, H, N, D, device=key.device)
    col = torch.arange(N, device=key.device).expand(B, H, N)
    for c0 in range(0, C, block):
        cb = min(block, C - c0)
        cand = torch.cat([keys, key[:, :, c0 : c0 + cb].float()], dim=2)
        torch.matmul(qf[:, :, :, c0 : c0 + cb], cand[:, :, None].transpose(-1, -2)).contiguous()
        keys = cand.gather(2, col[..., None].expand(-1, -1, -1, D))


def _profile(run, name: str, cuda: bool, out) -> None:
    """One more run of `run` under torch.profiler: the top operators by self time, and the launches, to `out`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
                                                      "aten::_local_scalar_dense"))
    out.write(f"## {name}: {launches} kernel launches, {syncs} host syncs (item / synchronize calls)\n")
    out.write(events.table(sort_by=sort, row_limit=25) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--policies", default="tova-mean,tova-max,h2o")
    ap.add_argument("--variants", default=None, help="default: triton,parallel on CUDA, torch,parallel on the CPU")
    ap.add_argument("--block", type=int, default=BLOCK_C)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="write each variant's torch.profiler operator table to FILE (one more run each)")
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench_walk.py --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    args.variants = args.variants or ("triton,parallel" if dev == "cuda" else "torch,parallel")
    B, H, G, D, C = args.batch, args.kv_heads, args.group, args.head_dim, args.context
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H * G, C, D, device=dev, generator=g, dtype=dtype)
    key = torch.randn(B, H, C, D, device=dev, generator=g, dtype=dtype)
    position = torch.arange(C, device=dev).expand(B, C)
    valid = torch.ones(B, C, dtype=torch.bool, device=dev)
    priority = torch.zeros(B, H, C, device=dev)
    rows = []
    prof_out = None
    if args.profile:
        if os.path.exists(args.profile):
            print(f"bench_walk.py --profile {args.profile}: exists; choose another file", file=sys.stderr)
            return 2
        prof_out = open(args.profile, "w")  # noqa: SIM115 (closed at the end of main)
    v = torch.randn_like(q)
    sdpa = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, v, v, is_causal=True), args.repeats,
                  dev == "cuda")
    rows.append({"row": f"dense SDPA fwd ({str(dtype)[6:]})", "s": sdpa})
    for pol in args.policies.split(","):
        policy, score, avg = POLICIES[pol]
        kw = {"tova_head_average": avg} if avg is not None else {}
        cfg = KVpopConfig.for_budget(args.budget, policy=policy, **kw)
        N = cfg.sink + cfg.window + cfg.topk
        slots = (torch.zeros(B, H, N, D, device=dev), torch.full((B, H, N), -1, device=dev),
                 torch.full((B, H, N), float("-inf"), device=dev))
        if pol == args.policies.split(",")[0]:
            gemm = functools.partial(_gemm_only, q, key, N, args.block)
            rows.append({"row": f"GEMM part only (block {args.block})", "s": _timed(gemm, args.repeats, dev == "cuda")})
        ref = None
        for name in args.variants.split(","):
            walk = (q, key, *slots, position, valid, priority, cfg.sink, cfg.window, cfg.topk, D**-0.5, score)
            run = _runner(name, walk, args.block)
            s = _timed(run, args.repeats, dev == "cuda")
            ev = run()[0]
            same = None if ref is None else bool(torch.equal(ev, ref))
            ref = ev if ref is None else ref
            row = {"row": f"{pol} ({cfg.sink}/{cfg.window}/{cfg.topk}) {name}", "s": s,
                   "us_per_token": s / C * 1e6, "same_evictions_as_first": same}
            if name.startswith("parallel"):
                stats = {}
                dynamic_walk_parallel(*walk, stats=stats, **_variant(name))
                row["stats"] = {k: v for k, v in stats.items() if k != "first_mismatch"}
            rows.append(row)
            if prof_out is not None:
                _profile(run, row["row"], dev == "cuda", prof_out)
    if prof_out is not None:
        prof_out.close()
    device = (torch.cuda.get_device_name() if dev == "cuda"
              else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads")
    print(f"# bench_walk {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{device}, torch {torch.__version__}, {platform.node()}")
    print(f"# B={B} Hkv={H} G={G} D={D} context={C} budget={args.budget}")
    for r in rows:
        extra = f"  {r['us_per_token']:.2f} us/token  same={r['same_evictions_as_first']}" if "us_per_token" in r else ""
        if "stats" in r:
            st = r["stats"]
            extra += (f"  rounds/block {st['rounds'] / max(1, st['blocks']):.2f}"
                      f"  mismatched rows {st.get('mismatch_rows', 0)}"
                      f"  skips/decision {st.get('skips', 0) / max(1, st['decisions']):.1f}")
        print(f"{r['row']:<48} {r['s'] * 1e3:10.2f} ms{extra}")
    print(json.dumps({"bench": "walk", "args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
