"""Held-out top-k retention recall against the oracle at every kept checkpoint of training runs: recall vs steps.

    python bench/recall_curve.py $HOME/study/runs/kvpop-mlstm_b2048_pre600_distill \\
        $HOME/study/runs/kvpop-mlp_b2048_pre600_distill --sequences 8 --out $HOME/curve

Each run's complete checkpoints (`kvpop train --keep-every N` keeps them; otherwise only the newest
is there) are put on a copy of the base model (`kvpop.train.weights`) and measured on the held-out
rows `kvpop eval` and the quality study use (`held_out_rows`): the model's own static priorities
against the oracle of the same model, its dense pass (`kvpop.eval.metrics.model_recall`, the
`recall` column of `kvpop eval`), with no logits and no KL. A run started from another
(`--init-from`, recorded in its `config.json`) continues its source's curve: its steps count on from
the source's step, a dotted line marks where it began, and the source's checkpoints up to that step
are measured too (found where the run recorded it, or among the runs given, by name). So a
scorer-only pre-training and the distillation after it draw one line.

The model, data, sequence length and seed default to the first run's (`OUT/config.json`), so the rows
are held out from its training. OUT/recall_curve.json is rewritten after every checkpoint: a
`--deadline-s` (or a kill) keeps the points done, and the same command again measures only the rest.
OUT/recall_curve.png has one panel per budget. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from kvpop.presets import model_help

SETTINGS = ("model", "data", "text_field", "seq_len", "sequences", "packing", "seed")
"""What a point depends on besides its checkpoint: points measured under other settings are measured again."""


def run_config(run: Path) -> dict:
    path = run / "config.json"
    if not path.is_file():
        raise SystemExit(f"{run}: not a kvpop train run directory (no config.json)")
    return json.loads(path.read_text())


def find_source(init: dict, runs: dict[Path, Path]) -> Path | None:
    """The run directory a run started from: where it recorded it, else a given run of that name."""
    recorded = init.get("run")
    if recorded is None:
        return None
    if Path(recorded).is_dir():
        return Path(recorded).resolve()
    # the runs moved (copied off the machine, say): matched by name among those given
    return next((r for r in runs if r.name == Path(recorded).name), None)


def chains(given: list[Path]) -> tuple[dict[Path, dict], list[list[Path]]]:
    """Every run (the given ones and the sources they started from) with its config, and per last run the chain
    of runs it continues, first to last."""
    runs = {r.resolve(): run_config(r) for r in given}
    parent: dict[Path, Path | None] = {}
    todo = list(runs)
    while todo:
        run = todo.pop()
        init = runs[run].get("init")
        source = find_source(init, runs) if init else None
        parent[run] = source
        if source is not None and source not in runs:
            runs[source] = run_config(source)
            todo.append(source)
    sources = {p for p in parent.values() if p is not None}
    out = []
    for last in (r for r in runs if r not in sources):
        chain = [last]
        while parent[chain[0]] is not None:
            chain.insert(0, parent[chain[0]])
        out.append(chain)
    return runs, out


def nominal_budget(cfg: dict) -> int:
    """The budget a run was asked for: an mLSTM with --match-mlp-memory holds its state's share less in the cache."""
    matched = (cfg.get("extra") or {}).get("match_mlp_memory") or {}
    return cfg["sink"] + cfg["window"] + cfg["topk"] + matched.get("state_entries", 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="kvpop train run directories (sources found on their own)")
    p.add_argument("--out", type=Path, required=True, help="directory for recall_curve.json and recall_curve.png")
    p.add_argument("--model", default=None, help=f"the base model: {model_help()} (default: the first run's)")
    p.add_argument("--data", default=None, help="whose held-out split to measure on (default: the first run's)")
    p.add_argument("--text-field", default=None)
    p.add_argument("--seq-len", type=int, default=None, help="default: the first run's")
    p.add_argument("--seed", type=int, default=None, help="the held-out split's seed (default: the first run's)")
    p.add_argument("--sequences", type=int, default=8, help="held-out sequences (default 8)")
    p.add_argument("--packing", default="document", choices=["document", "concat"],
                   help="rows from a document start (default, as kvpop eval and the quality study) or cut from one "
                        "stream")
    p.add_argument("--deadline-s", type=float, default=0, help="stop before a checkpoint that would pass it (0: none)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    start = time.time()

    import torch

    from kvpop.eval.evaluate import held_out_rows
    from kvpop.eval.metrics import model_recall
    from kvpop.eval.plots import plot_recall_curve
    from kvpop.models import load_model
    from kvpop.train.checkpoint import checkpoints
    from kvpop.train.weights import model_with, read_weights

    # a run directory made but not started yet (the quality study makes them) has nothing to measure
    given = [r for r in args.runs if (r / "config.json").is_file()]
    for r in sorted(set(args.runs) - set(given)):
        print(f"recall curve: skipping {r} (no config.json: not a started kvpop train run)", flush=True)
    if not given:
        raise SystemExit("recall curve: no kvpop train run among the directories given")
    args.runs = given
    runs, lines = chains(args.runs)
    # recall is of static priorities: a DMS or StreamingLLM+ run has none to rank by
    lines = [chain for chain in lines if runs[chain[-1]]["kvpop"]["policy"] == "kvpop"]
    first = run_config(args.runs[0].resolve())["train"]
    for name in SETTINGS:
        if name in first and getattr(args, name, None) is None:
            setattr(args, name, first[name])
    settings = {name: getattr(args, name) for name in SETTINGS}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "recall_curve.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    done = {pt["path"]: pt for pt in previous.get("points", [])} if previous.get("settings") == settings else {}

    base, tokenizer = load_model(args.model, device=device)
    tokens = held_out_rows(args.data, tokenizer, args.seq_len, args.sequences, packing=args.packing,
                           text_field=args.text_field, seed=args.seed)
    print(f"recall curve: {len(runs)} runs, {len(tokens)} held-out sequences of {args.seq_len} tokens, {device}",
          flush=True)

    # the checkpoints to measure: of a source only those up to the step the next run started from
    upto: dict[Path, int] = {}
    for chain in lines:
        for source, run in zip(chain, chain[1:]):
            upto[source] = max(upto.get(source, -1), runs[run]["init"]["step"] or 0)
    todo = [(run, c) for run in runs for c in checkpoints(run)
            if c.manifest is not None and c.step <= upto.get(run, c.step) and runs[run]["kvpop"]["policy"] == "kvpop"]
    points = dict(done)
    last = 0.0

    def write() -> dict:
        curves = []
        for chain in lines:
            offset, starts, pts = 0, [], []
            for i, run in enumerate(chain):
                init = runs[run].get("init")
                if i == 0 and init:
                    offset = init["step"] or 0  # its source was not found: the line starts at the source's step
                elif i:
                    offset += init["step"] or 0
                    starts.append(offset)
                limit = upto.get(run) if run is not chain[-1] else None
                pts += [(offset + pt["step"], pt["recall"]) for pt in points.values()
                        if pt["run"] == str(run) and (limit is None or pt["step"] <= limit)]
            cfg = runs[chain[-1]]["kvpop"]
            curves.append({"name": chain[-1].name, "runs": [str(r) for r in chain], "budget": nominal_budget(cfg),
                           "scorer": cfg["scorer"], "starts": starts,
                           "freeze_base": [runs[r]["train"]["freeze_base"] for r in chain], "points": sorted(pts)})
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([sys.executable, *sys.argv]) if argv is None else
                  " ".join(["recall_curve.py", *map(str, argv)]),
                  "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
                  "settings": settings, "sequences_measured": len(tokens), "points": list(points.values()),
                  "curves": curves}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
        return result

    for run, c in todo:
        if str(c.path) in points:
            continue
        if args.deadline_s and time.time() - start + last > args.deadline_s:
            print(f"recall curve: deadline; {sum(str(c.path) not in points for _, c in todo)} checkpoints left "
                  "(the same command goes on)", flush=True)
            break
        t0 = time.time()
        model = model_with(base, read_weights(c.path), f"--model {args.model}")
        result = model_recall(model, (row[None].to(device) for row in tokens))
        del model
        last = time.time() - t0
        points[str(c.path)] = {"run": str(run), "path": str(c.path), "step": c.step, "recall": result.mean,
                               "recall_per_layer": result.per_layer.tolist(), "queries": result.queries,
                               "seconds": round(last, 2)}
        write()
        print(f"  {run.name} step {c.step}: recall {result.mean:.4f} ({last:.1f} s)", flush=True)
    result = write()
    png = plot_recall_curve(result["curves"], args.out / "recall_curve.png") if result["curves"] else None

    print(f"\n{'run (the last of its chain)':<44} {'B':>5} {'step':>6} {'recall':>7}")
    for curve in result["curves"]:
        for step, recall in curve["points"]:
            began = " (next run began)" if step in curve["starts"] else ""
            print(f"{curve['name']:<44} {curve['budget']:>5} {step:>6} {recall:>7.4f}{began}")
    print(f"recall curve: {path}" + (f", {png}" if png else ""), flush=True)
    print(json.dumps({"curves": [{k: c[k] for k in ("name", "budget", "scorer", "starts", "points")}
                                 for c in result["curves"]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
