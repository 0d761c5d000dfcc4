"""In-domain and out-of-domain rows side by side: `kvpop eval` once per data source, one table.

    # CPU: two scorers (trained on champ, and on the mixture champ,pystdlib,prose) against TOVA and H2O
    python bench/domain_eval.py --trained runs/champ/final --trained runs/mix/final --out runs/domains
    # GPU scale, e.g. after bench/quality_study.py --data champ,pystdlib,prose on the same machine
    python bench/domain_eval.py --trained $HOME/study/runs/kvpop-mlp_b2048/final --seq-len 8192 \
        --budgets 2048 --sequences 8 --out $HOME/domains

Each source is one `kvpop eval` run, its results in `OUT/<source>/` (`results.json` with its command,
`table.txt`). The default sources are the three a mixture trains on, champ, pystdlib and prose (their
held-out splits: in domain for a scorer trained on them), and pydoc (Python's `help()` topics), which
`kvpop train` refuses (`kvpop.train.data.HELD_OUT_SOURCES`): out of domain for every scorer, so all of
it is read (`--split all`). The table gives KL to the dense model (± its standard error over the
sequences) and top-1 agreement, a row per policy and budget (a trained directory named by its path),
a column pair per source; one JSON line follows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

from kvpop.cli import main as kvpop
from kvpop.presets import model_help
from kvpop.train.data import HELD_OUT_SOURCES


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help=f"{model_help()} (default smollm2-135m)")
    p.add_argument("--trained", action="append", default=[], metavar="DIR", help="a trained directory; repeatable")
    p.add_argument("--policies", default="tova,h2o", help="training-free rows, as kvpop eval takes them (default tova,h2o)")
    p.add_argument("--budgets", default="256", help="budgets of the training-free rows (default 256)")
    p.add_argument("--sources", default="champ,pystdlib,prose,pydoc",
                   help="comma-separated --data sources, each evaluated alone (default champ,pystdlib,prose,pydoc)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--sequences", type=int, default=2, help="sequences per source (default 2)")
    p.add_argument("--out", type=Path, default=Path("runs/domains"))
    p.add_argument("--force", action="store_true", help="replace the results of an earlier run in --out (kvpop eval's)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def label(row: dict) -> str:
    return f"{row['policy']} ({row['trained']})" if row.get("trained") else row["policy"]


def table(results: dict[str, list[dict]]) -> str:
    sources = list(results)
    keys = list(dict.fromkeys((label(r), r["budget"]) for rows in results.values() for r in rows))
    cells = {(s, label(r), r["budget"]): r for s, rows in results.items() for r in rows}
    lines = ["| B | policy | " + " | ".join(f"{s} KL | {s} top-1" for s in sources) + " |",
             "|---|---|" + "---:|---:|" * len(sources)]
    for name, budget in sorted(keys, key=lambda k: (-k[1], keys.index(k))):
        row = []
        for s in sources:
            r = cells.get((s, name, budget))
            se = f" ± {r['kl_se']:.3f}" if r and r.get("kl_se") is not None else ""
            row += [f"{r['kl']:.3f}{se}", f"{r['top1_agreement']:.3f}"] if r else ["-", "-"]
        lines.append(f"| {budget} | {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results, failed = {}, []
    for source in [s.strip() for s in args.sources.split(",") if s.strip()]:
        # a path or dataset name as a directory name: `/data/notes.jsonl` -> `data_notes.jsonl`
        out = args.out / (re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("_.") or "source")
        argv = ["eval", "--model", args.model, "--data", source, "--seq-len", str(args.seq_len),
                "--sequences", str(args.sequences), "--budgets", args.budgets, "--policies", args.policies,
                "--out", str(out), "--seed", str(args.seed), "--no-progress",
                *(["--split", "all"] if source in HELD_OUT_SOURCES else []),
                *(a for d in args.trained for a in ("--trained", d)),
                *(["--device", args.device] if args.device else []), *(["--force"] if args.force else [])]
        print(f"domain_eval: kvpop {' '.join(argv)}", file=sys.stderr, flush=True)
        # each run's own table and JSON line go to stderr: stdout is the combined table, then one JSON line
        with contextlib.redirect_stdout(sys.stderr):
            rc = kvpop(argv)
        if rc != 0:
            failed.append(source)
            if rc == 130:
                # interrupted (Ctrl-C, or `timeout --signal=INT` at a deadline): the sources done still print
                break
            continue
        results[source] = json.loads((out / "results.json").read_text())["rows"]
    if results:
        print(table(results))
    summary = {"sources": list(results), "failed": failed, "seq_len": args.seq_len,
               "rows": {s: [{"policy": label(r), "budget": r["budget"], "kl": r["kl"], "kl_se": r.get("kl_se"),
                             "top1_agreement": r["top1_agreement"], "sequences": r["sequences"]} for r in rows]
                        for s, rows in results.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "domains.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(parse()))
