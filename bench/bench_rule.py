"""Cost of the retention rule on plain tensors: `kvpop.eviction_times` against S (CPU or GPU).

    python bench/bench_rule.py --heads 8 --lengths 4096,16384,65536,262144

Prints a table (time, time / (S log2 S) normalised to the first row, which stays flat if the
cost grows like S log S) and one JSON line last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import time

import torch

import kvpop


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lengths", default="4096,16384,65536,262144")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--topk", type=int, default=1788)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    rows = []
    gen = torch.Generator(device=args.device).manual_seed(0)
    for S in (int(x) for x in args.lengths.split(",")):
        pri = torch.randn(1, args.heads, S, generator=gen, device=args.device)
        kvpop.eviction_times(pri, args.sink, args.window, args.topk)  # warm-up
        times = []
        for _ in range(args.repeats):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            kvpop.eviction_times(pri, args.sink, args.window, args.topk)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append({"S": S, "heads": args.heads, "seconds": statistics.median(times)})
    base = rows[0]["seconds"] / (rows[0]["S"] * math.log2(rows[0]["S"]))
    print(f"# kvpop.eviction_times, {args.heads} heads, sink {args.sink}, window {args.window}, topk {args.topk}, "
          f"{args.device} ({platform.machine()}, {torch.get_num_threads()} threads), median of {args.repeats}")
    print(f"{'S':>8} {'seconds':>9} {'per S log S (rel.)':>19}")
    for r in rows:
        r["per_slogs_rel"] = r["seconds"] / (r["S"] * math.log2(r["S"])) / base
        print(f"{r['S']:>8} {r['seconds']:>9.3f} {r['per_slogs_rel']:>19.2f}")
    print(json.dumps({"rows": rows, "device": args.device, "torch": torch.__version__,
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
