"""Prefill of one prompt into a bounded cache against the dense forward, per policy and prefill path.

    python bench/bench_prefill.py --model smollm2-135m --context 2048 --budget 512 --policies tova,h2o,kvpop,cascade
    python bench/bench_prefill.py --model qwen3-8b-shape --device cuda --context 8192 --budget 2048 --policies tova,h2o

Each repeat runs, interleaved so that a changing machine load hits every row alike: the dense model's
forward over the prompt (a `DynamicCache`, `logits_to_keep=1`), then for each policy the same forward
into a `KVpopCache`, once per prefill path: "walk" (TOVA / H2O: `ops.dynamic`, the default) and
"replay" (their decode step token by token, the path before the walk; `--no-replay` skips it).
Static policies (kvpop, streaming_llm) have one path ("rule"). `cascade` is the recommended policy, the layer-wide
KVpop-cascade a trained KVpop-mlp directory runs by default (random scorers here: the time does not depend on them);
`tova+chunkC` and `cascade+chunkC` the same rules deciding once every C steps (`KVpopConfig.decision_chunk`: path
"chunks": its rounds as Triton kernels where Triton runs; with `--pytorch-rounds` also path "chunks-pytorch", the
same rounds in PyTorch, `ops.dynamic.chunked.FUSED = False`). Reported per row: the median over
repeats of the wall time and, on the CPU, of the process's CPU time (unaffected by other processes
on a shared machine when `--threads 1`), and their ratio to the dense row of the same repeat.

Output: a header, a human table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
import time

import torch

import kvpop
from kvpop.cache import cache_kwargs
from kvpop.eval.bench import RECOMMENDED, load_bench_model, policy_config, sync
from kvpop.presets import model_help

DYNAMIC = ("tova", "h2o", RECOMMENDED)


@torch.no_grad()
def _time(model, ids: torch.Tensor, cache) -> tuple[float, float]:
    """(wall s, process CPU s) of one forward of `ids` into `cache`."""
    device = ids.device
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_prefill(model, ids: torch.Tensor, budget: int, policies: list[str], repeats: int, replay: bool,
                  seed: int, pytorch_rounds: bool = False) -> list[dict]:
    from transformers import DynamicCache

    from kvpop.ops.dynamic import chunked

    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    rows_order = [("dense", "-")]
    for p in policies:
        paths = ((["walk", "replay"] if replay else ["walk"]) if p in DYNAMIC else
                 (["chunks", "chunks-pytorch"] if pytorch_rounds else ["chunks"]) if "+chunk" in p else ["rule"])
        rows_order += [(p, path) for path in paths]
    for r in range(repeats):
        for policy, path in rows_order:
            if policy == "dense":
                t = _time(model, ids, DynamicCache(config=model.config))
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    kvpop.retrofit(model, policy_config(policy, budget))
                fused = chunked.FUSED
                chunked.FUSED = fused and path != "chunks-pytorch"
                try:
                    cache = kvpop.KVpopCache(model, dynamic_prefill="replay" if path == "replay" else "walk")
                    t = _time(model, ids, cache)
                finally:
                    chunked.FUSED = fused
                    kvpop.detach(model)
            runs.setdefault((policy, path), []).append(t)
            print(f"# repeat {r}: {policy}/{path} wall {t[0]:.2f} s cpu {t[1]:.2f} s", file=sys.stderr, flush=True)
    dense = runs[("dense", "-")]
    rows = []
    for policy, path in rows_order:
        ts = runs[(policy, path)]
        rows.append({
            "policy": policy, "path": path, "context": ids.shape[1], "batch": ids.shape[0],
            "budget": None if policy == "dense" else budget,
            "wall_s": statistics.median(t[0] for t in ts), "cpu_s": statistics.median(t[1] for t in ts),
            # ratios within each repeat, then the median: the fair comparison under a changing load
            "wall_vs_dense": statistics.median(t[0] / d[0] for t, d in zip(ts, dense)),
            "cpu_vs_dense": statistics.median(t[1] / d[1] for t, d in zip(ts, dense)),
            "wall_all": [t[0] for t in ts], "cpu_all": [t[1] for t in ts],
        })
    return rows


def format_table(rows: list[dict], cpu: bool) -> str:
    head = ("policy", "path", "context", "budget", "wall s", "vs dense") + (("cpu s", "vs dense (cpu)") if cpu else ())
    lines = [head]
    for r in rows:
        line = (r["policy"], r["path"], str(r["context"]), "-" if r["budget"] is None else str(r["budget"]),
                f"{r['wall_s']:.2f}", f"{r['wall_vs_dense']:.2f}")
        if cpu:
            line += (f"{r['cpu_s']:.2f}", f"{r['cpu_vs_dense']:.2f}")
        lines.append(line)
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths))) for x in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"{model_help(shapes=True)} (default smollm2-135m)")
    parser.add_argument("--context", type=int, default=2048, help="prompt length (default 2048)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per forward (default 1)")
    parser.add_argument("--budget", type=int, default=512, help="cache budget, split by KVpopConfig.for_budget (default 512)")
    parser.add_argument("--policies", default="tova,h2o,kvpop",
                        help="comma-separated policies, split by KVpopConfig.for_budget (TOVA and H2O as their papers define them) (default tova,h2o,kvpop)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is reported (default 3)")
    parser.add_argument("--no-replay", action="store_true", help="skip the token-by-token replay rows of TOVA / H2O")
    parser.add_argument("--pytorch-rounds", action="store_true",
                        help="also time each chunked policy with its rounds in PyTorch (path chunks-pytorch)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-layers", type=int, default=None,
                        help="decoder layers of a *-shape preset (default: the real count; fewer compile faster)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt and the scorers (default 0)")
    parser.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON result to PATH")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_bench_model(args.model, str(device), args.dtype, args.num_layers).eval()
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context), generator=gen).to(device)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    c = model.config
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    load = " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())
    print(f"# bench_prefill: {args.model} ({c.num_hidden_layers} layers, {c.num_attention_heads} query / "
          f"{c.num_key_value_heads} KV heads) on {machine}; batch {args.batch} x {args.context} tokens, budget "
          f"{args.budget}; median of {args.repeats} interleaved repeats; load average before: {load}")
    rows = bench_prefill(model, ids, args.budget, policies, args.repeats, not args.no_replay, args.seed,
                         args.pytorch_rounds)
    print(format_table(rows, device.type == "cpu"))
    result = {"rows": rows, "device": machine, "model": args.model, "load_before": load,
              "command": shlex.join(["python", "bench/bench_prefill.py", *argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
