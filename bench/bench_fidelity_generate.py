"""Long-generation speed of `kvpop eval --generate`: the fast path (`kvpop.eval.generation`) against its reference loop.

    python bench/bench_fidelity_generate.py --model smollm2-135m --policies dense,tova --budget 256 --batch 4 \
        --new-tokens 256 --threads 1
    python bench/bench_fidelity_generate.py --model smollm2-135m --device cuda --policies dense,tova,kvpop \
        --budget 1024 --batch 8 --new-tokens 4096 --backends fast,reference --repeats 1

Per policy (the plain model as "dense", else a training-free policy retrofitted at `--budget`; kvpop with
its untrained scorer) and backend: one `generate_batch` of `--batch` left-padded random prompts of
`--prompt-len` down to about half of it tokens, every row forced to `--new-tokens` (no EOS), greedy or at
`--temperature`. An untimed short call per (policy, backend) first (on CUDA it captures and compiles
the same shapes, so the timed call shows the steady state plus one capture); the timed calls of the
backends interleave. Reported: medians of seconds per
call, ms per generated token (per step of the batch; wall clock, and the process's CPU time, which on
the CPU with `--threads 1` other processes' load does not inflate), the wall-clock speed-up over the
reference of the same policy,
and whether both backends wrote the same tokens (on CUDA they may part at a near-tie: the captured step
rounds a little differently).

Output: a header, a human table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

import kvpop
from kvpop.eval.bench import load_bench_model, sync
from kvpop.eval.generation import BACKENDS, generate_batch
from kvpop.presets import model_help


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts (ids from 3 on: no special token) of `length` tokens down to about half of it."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max(1, length - (length // 2) * r // max(batch - 1, 1)) for r in range(batch)]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _cache(model, policy: str):
    return None if policy == "dense" else kvpop.KVpopCache(model)


@torch.no_grad()
def bench(model, policies: list[str], backends: list[str], prompts: list[list[int]], new_tokens: int, budget: int,
          temperature: float, repeats: int, seed: int, device: torch.device) -> list[dict]:
    rows = []
    seeds = list(range(seed, seed + len(prompts)))
    for policy in policies:
        if policy != "dense":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(budget, policy=policy))
        try:
            out, times, cpu = {}, {b: [] for b in backends}, {b: [] for b in backends}
            kw = dict(temperature=temperature, seeds=seeds)
            for backend in backends:
                generate_batch(model, prompts, min(new_tokens, 32), _cache(model, policy), **kw, backend=backend)
            # interleaved: a drift of the machine's load hits both backends alike
            for _, backend in itertools.product(range(repeats), backends):
                cache = _cache(model, policy)
                sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                out[backend] = generate_batch(model, prompts, new_tokens, cache, **kw, backend=backend)
                sync(device)
                times[backend].append(time.perf_counter() - start)
                cpu[backend].append(time.process_time() - start_cpu)
                print(f"# {policy} {backend}: {times[backend][-1]:.2f} s (cpu {cpu[backend][-1]:.2f} s)",
                      file=sys.stderr, flush=True)
        finally:
            if policy != "dense":
                kvpop.detach(model)
        ref = statistics.median(times["reference"]) if "reference" in times else None
        for backend in backends:
            s = statistics.median(times[backend])
            rows.append({"policy": policy, "budget": None if policy == "dense" else budget, "backend": backend,
                         "seconds": s, "ms_per_step": s * 1e3 / new_tokens,
                         "cpu_ms_per_step": statistics.median(cpu[backend]) * 1e3 / new_tokens,
                         "vs_reference": None if ref is None else ref / s,
                         "same_tokens": None if ref is None else out[backend] == out["reference"],
                         "times": times[backend]})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("policy", "budget", "backend", "s/call", "ms/step", "cpu ms/step", "speed-up", "same tokens")
    lines = [head]
    for r in rows:
        lines.append((r["policy"], "-" if r["budget"] is None else str(r["budget"]), r["backend"], f"{r['seconds']:.2f}",
                      f"{r['ms_per_step']:.1f}", f"{r['cpu_ms_per_step']:.1f}", "-" if r["vs_reference"] is None else f"{r['vs_reference']:.2f}x",
                      "-" if r["same_tokens"] is None else str(r["same_tokens"])))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths))) for x in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"{model_help(shapes=True)} (default smollm2-135m)")
    parser.add_argument("--policies", default="dense,tova",
                        help="dense and training-free policies, split by KVpopConfig.for_budget (default dense,tova)")
    parser.add_argument("--backends", default="fast,reference", help="comma-separated, of fast and reference")
    parser.add_argument("--budget", type=int, default=256, help="the policies' budget (default 256)")
    parser.add_argument("--batch", type=int, default=4, help="prompts per call (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64, help="the longest prompt (default 64)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per row; medians reported (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, the scorers and the sampling")
    parser.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON result to PATH")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in BACKENDS for b in backends):
        parser.error(f"--backends {args.backends!r}: choose from {', '.join(BACKENDS)}")
    if args.new_tokens < 1 or args.batch < 1 or args.prompt_len < 1 or args.repeats < 1:
        parser.error("--new-tokens, --batch, --prompt-len and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_bench_model(args.model, str(device), args.dtype).eval()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    prompts = _prompts(args.batch, args.prompt_len, model.config.vocab_size, args.seed)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# bench_fidelity_generate: {args.model} ({model.config.num_hidden_layers} layers, "
          f"{next(model.parameters()).dtype}) on {machine}; batch {args.batch}, prompts of "
          f"{[len(p) for p in prompts]} tokens, {args.new_tokens} new tokens, budget {args.budget}, temperature "
          f"{args.temperature}; median of {args.repeats}; load average before: {load}")
    rows = bench(model, policies, backends, prompts, args.new_tokens, args.budget, args.temperature, args.repeats,
                 args.seed, device)
    print(format_table(rows))
    import transformers

    result = {"rows": rows, "device": machine, "model": args.model, "load_before": load,
              "command": shlex.join(["python", "bench/bench_fidelity_generate.py", *argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "transformers": transformers.__version__}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
