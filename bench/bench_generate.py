"""`model.generate` as a user calls it: a `KVpopCache` against the dense model, prefill included.

    python bench/bench_generate.py --model smollm2-135m --contexts 2048,4096 --new-tokens 64 --budget 512
    python bench/bench_generate.py --model qwen3-8b-shape --device cuda --contexts 4096,16384 --budget 2048 \
        --caches dense,static,kvpop --batch 1

Cache kinds: "dense" (the plain model, transformers' default `DynamicCache`), "static" (the plain model
with `cache_implementation="static"`: on CUDA transformers then compiles the decode step, the
"StaticCache + torch.compile" baseline, with transformers' defaults), any KVpop policy ("kvpop", "tova",
"h2o", ...; the retrofitted model with `cache=KVpopCache(model)`: on CUDA transformers compiles its step
with the compile config `kvpop.retrofit` gives the model, `kvpop.decode.generation_compile_config`),
and "cascade": the recommended policy a trained KVpop-mlp runs by default, the layer-wide KVpop-cascade at the
same budget (`--tova-pool-layer` sets its pool, default 3/4 of `budget - 1`). Per (context, kind) and repeat,
interleaved: `generate` of 1 token (the prefill) and of `--new-tokens` tokens, greedy, every row forced to the
full length. Reported, as medians over the repeats: ms per generated token with the prefill included (the
user's view), the decode ms per token ((total - prefill) / (n - 1)), and each as a ratio to the "dense" row
of the same repeat. Untimed warm-up: on CUDA one full call per (context, kind), which compiles
("first_call_s"; "compile_s" is its excess over the timed call of the same length: inductor's on-disk cache
makes it smaller in a second process); elsewhere a short first call per kind. On the CPU the process's CPU
time is reported beside the wall time (`--threads 1` makes it immune to other processes' load).

Output: a header, a human table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

import kvpop
from kvpop.cache import cache_kwargs
from kvpop.eval.bench import load_bench_model, policy_config, sync
from kvpop.presets import model_help

PLAIN = ("dense", "static")


@torch.no_grad()
def _generate(model, kind: str, ids: torch.Tensor, n: int) -> tuple[float, float]:
    """(wall s, process CPU s) of one greedy `generate` of exactly `n` tokens."""
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    if kind == "static":
        kw["cache_implementation"] = "static"
    elif kind != "dense":
        kw.update(cache_kwargs(model, kvpop.KVpopCache(model)))
    sync(ids.device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = model.generate(ids, **kw)
    sync(ids.device)
    assert out.shape[1] == ids.shape[1] + n
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_generate(model, contexts: list[int], kinds: list[str], new_tokens: int, batch: int, budget: int,
                   repeats: int, seed: int, device: torch.device, pool: int | None = None) -> list[dict]:
    runs: dict[tuple[int, str], list[dict]] = {}
    warm: set = set()
    first: dict[tuple[int, str], float] = {}
    for context in contexts:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + context)
        # ids from 3 on: no pad / bos / eos token in the prompt
        ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
        for r in range(repeats):
            for kind in kinds:
                if kind not in PLAIN:
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(seed)
                        kvpop.retrofit(model, policy_config(kind, budget, pool))
                try:
                    if device.type == "cuda" and (context, kind) not in warm:
                        # the shapes of the timed run: transformers compiles the step of a compileable cache on
                        # CUDA (a `StaticCache` of another length would compile again inside the timing)
                        first[(context, kind)] = _generate(model, kind, ids, new_tokens)[0]
                        warm.add((context, kind))
                        print(f"# {context} {kind}: first call (compiling) {first[(context, kind)]:.1f} s",
                              file=sys.stderr, flush=True)
                    elif kind not in warm:
                        # first-call costs (lazy imports, allocator) outside the timing
                        _generate(model, kind, ids[:, : min(context, 64)], 2)
                        warm.add(kind)
                    pre = _generate(model, kind, ids, 1)
                    tot = _generate(model, kind, ids, new_tokens)
                finally:
                    if kind not in PLAIN:
                        kvpop.detach(model)
                runs.setdefault((context, kind), []).append({"pre": pre, "tot": tot})
                print(f"# {context} {kind} repeat {r}: prefill {pre[0]:.2f} s, {new_tokens} tokens {tot[0]:.2f} s "
                      f"(cpu {pre[1]:.2f} / {tot[1]:.2f} s)", file=sys.stderr, flush=True)
    rows = []
    for context in contexts:
        base = runs.get((context, "dense"))
        for kind in kinds:
            rs = runs[(context, kind)]
            row = {"cache": kind, "context": context, "batch": batch, "new_tokens": new_tokens,
                   "budget": None if kind in PLAIN else budget,
                   "no_eviction": kind not in PLAIN and budget >= context}
            if kind not in PLAIN:
                cfg = policy_config(kind, budget, pool)
                row["split"] = {"sink": cfg.sink, "window": cfg.window, "topk": cfg.topk, "tova_pool": cfg.tova_pool}
            if (context, kind) in first:
                row["first_call_s"] = first[(context, kind)]
                row["compile_s"] = first[(context, kind)] - statistics.median(x["tot"][0] for x in rs)
            for i, clock in enumerate(("wall", "cpu")):
                total = [x["tot"][i] * 1e3 / new_tokens for x in rs]
                decode = [(x["tot"][i] - x["pre"][i]) * 1e3 / max(new_tokens - 1, 1) for x in rs]
                row[f"{clock}_ms_per_token"] = statistics.median(total)
                row[f"{clock}_decode_ms"] = statistics.median(decode)
                row[f"{clock}_prefill_s"] = statistics.median(x["pre"][i] for x in rs)
                if base is not None:
                    btot = [x["tot"][i] * 1e3 / new_tokens for x in base]
                    bdec = [(x["tot"][i] - x["pre"][i]) * 1e3 / max(new_tokens - 1, 1) for x in base]
                    row[f"{clock}_vs_dense"] = statistics.median(a / b for a, b in zip(total, btot))
                    row[f"{clock}_decode_vs_dense"] = statistics.median(a / b for a, b in zip(decode, bdec))
            row["runs"] = rs
            rows.append(row)
    return rows


def format_table(rows: list[dict], cpu: bool) -> str:
    clock = "cpu" if cpu else "wall"
    head = ("cache", "context", "budget", "ms/token (prefill incl.)", "vs dense", "prefill s", "decode ms/token",
            "vs dense ", "first call s")
    lines = [head]
    def f(r, key, spec=".2f"):
        v = r.get(f"{clock}_{key}")
        return "-" if v is None else format(v, spec)

    for r in rows:
        budget = "-" if r["budget"] is None else str(r["budget"]) + ("*" if r["no_eviction"] else "")
        lines.append((r["cache"], str(r["context"]), budget, f(r, "ms_per_token", ".1f"), f(r, "vs_dense"),
                      f(r, "prefill_s"), f(r, "decode_ms", ".1f"), f(r, "decode_vs_dense"),
                      "-" if "first_call_s" not in r else f"{r['first_call_s']:.1f}"))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths))) for x in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.insert(0, f"({clock} time)")
    if any(r["no_eviction"] for r in rows):
        out.append("* budget not below the context: nothing was evicted")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"{model_help(shapes=True)} (default smollm2-135m)")
    parser.add_argument("--contexts", default="2048,4096", help="comma-separated prompt lengths (default 2048,4096)")
    parser.add_argument("--caches", default="dense,kvpop",
                        help="dense, static, KVpop policies split by KVpopConfig.for_budget, or cascade (the "
                             "layer-wide KVpop-cascade) (default dense,kvpop)")
    parser.add_argument("--tova-pool-layer", type=int, default=None, metavar="N",
                        help="cache kind cascade: its TOVA pool, N of the budget - 1 long-range slots (default 3/4)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per call (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per call (default 1)")
    parser.add_argument("--budget", type=int, default=512, help="KVpop budget, split by KVpopConfig.for_budget (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians reported (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-layers", type=int, default=None,
                        help="decoder layers of a *-shape preset (default: the real count; fewer compile faster)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the scorers (default 0)")
    parser.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON result to PATH")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens={args.new_tokens} must be >= 2 (the decode rate needs tokens after the first)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_bench_model(args.model, str(device), args.dtype, args.num_layers).eval()
    contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    kinds = [k.strip() for k in args.caches.split(",") if k.strip()]
    covered = [c for c in contexts if args.budget >= c]
    if covered and any(k not in PLAIN for k in kinds):
        print(f"bench_generate: warning: budget {args.budget} is not below context {covered}: nothing is evicted there",
              file=sys.stderr)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    c = model.config
    print(f"# bench_generate: {args.model} ({c.num_hidden_layers} layers) on {machine}; batch {args.batch}, "
          f"{args.new_tokens} new tokens, KVpop budget {args.budget}; median of {args.repeats} interleaved repeats; "
          f"load average before: {load}")
    rows = bench_generate(model, contexts, kinds, args.new_tokens, args.batch, args.budget, args.repeats, args.seed,
                          device, args.tova_pool_layer)
    if device.type == "cpu":
        print(format_table(rows, cpu=True))
    print(format_table(rows, cpu=False))
    import transformers

    result = {"rows": rows, "device": machine, "model": args.model, "num_layers": args.num_layers, "load_before": load,
              "command": shlex.join(["python", "bench/bench_generate.py", *argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "transformers": transformers.__version__}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
