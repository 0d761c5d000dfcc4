"""What the long-context suite (`kvpop.eval.suite`) prints and writes: accuracy cells, the table, collapse lines,
the heatmaps and the closing JSON line.

A record is one (policy, budget, prompt) as `run_suite` returns it; everything here is computed from
records alone, so a saved `suite.json` can be summarised again.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvpop.eval.suite import COLLAPSE_SHARE, DENSE
from kvpop.eval.tasks import TASKS


def _row_key(r: dict) -> tuple[str, int | None]:
    return r["policy"], r["budget"]


def _row_order(keys) -> list[tuple[str, int | None]]:
    """The dense row first, then budgets from large to small, policies by name."""
    return sorted(set(keys), key=lambda k: (k[0] != DENSE, -(k[1] or 0), k[0]))


def _length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def cells(records: Sequence[dict]) -> list[dict]:
    """Accuracy per (policy, budget, task, length, depth): `correct` of `n`, the mean share of answers found,
    and the most cache entries held while answering."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["policy"], r["budget"], r["task"], r["length"], r["depth"])].append(r)
    out = []
    for (policy, budget, task, length, depth), rs in groups.items():
        out.append({"policy": policy, "budget": budget, "task": task, "length": length, "depth": depth,
                    "n": len(rs), "correct": sum(r["correct"] for r in rs),
                    "accuracy": sum(r["correct"] for r in rs) / len(rs),
                    "found": sum(r["found"] for r in rs) / len(rs), "slots_max": max(r["slots_max"] for r in rs)})
    return out


def _tally(records: Sequence[dict]) -> dict[tuple, list[int]]:
    """(policy, budget, task[, length]) -> [correct, n]."""
    t: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        for key in ((*_row_key(r), r["task"]), (*_row_key(r), r["task"], r["length"])):
            t[key][0] += int(r["correct"])
            t[key][1] += 1
    return t


def collapses(records: Sequence[dict]) -> list[str]:
    """Plain-language lines: tasks the dense model fails, and policies that collapse where it succeeds."""
    tally = _tally(records)
    tasks = list(dict.fromkeys(r["task"] for r in records))
    lines = []
    for task in tasks:
        dense = tally.get((DENSE, None, task))
        if dense is not None and dense[0] == 0:
            lines.append(f"dense: {dense[0]}/{dense[1]} on {task}: the model itself fails this task at these "
                         f"lengths, so its rows say nothing about eviction")
    for policy, budget in _row_order(_row_key(r) for r in records):
        if policy == DENSE:
            continue
        for task in tasks:
            c, n = tally[(policy, budget, task)]
            dense = tally.get((DENSE, None, task))
            if n == 0 or dense is None or dense[0] == 0:
                continue
            if c / n <= COLLAPSE_SHARE * dense[0] / dense[1]:
                lines.append(f"{policy} at B={budget}: {c}/{n} on {task} (dense {dense[0]}/{dense[1]}) — collapsed")
    return lines


def format_table(records: Sequence[dict]) -> str:
    """One row per (policy, budget): accuracy per task and overall; then per task, accuracy per length;
    then the collapse lines."""
    tally = _tally(records)
    tasks = list(dict.fromkeys(r["task"] for r in records))
    lengths = sorted({r["length"] for r in records})
    rows = _row_order(_row_key(r) for r in records)
    width = max(len(p) for p, _ in rows) + 2

    def cell(c: int, n: int) -> str:
        return f"{c}/{n} {c / n:.2f}" if n else "-"

    head = f"{'policy':<{width}}{'budget':>6}  " + "".join(f"{t:>13}" for t in tasks) + f"{'all':>13}"
    lines = [head, "-" * len(head)]
    for policy, budget in rows:
        per = [tally[(policy, budget, t)] for t in tasks]
        total = [sum(x[0] for x in per), sum(x[1] for x in per)]
        lines.append(f"{policy:<{width}}{budget if budget is not None else '-':>6}  "
                     + "".join(f"{cell(*x):>13}" for x in per) + f"{cell(*total):>13}")
    for task in tasks:
        lines += ["", f"{task} ({TASKS[task].family}) by length"]
        sub = f"{'policy':<{width}}{'budget':>6}  " + "".join(f"{_length(n):>13}" for n in lengths)
        lines += [sub, "-" * len(sub)]
        for policy, budget in rows:
            lines.append(f"{policy:<{width}}{budget if budget is not None else '-':>6}  "
                         + "".join(f"{cell(*tally[(policy, budget, task, n)]):>13}" for n in lengths))
    notes = collapses(records)
    lines += ["", *(notes or ["no collapse: every policy keeps more than "
                              f"{COLLAPSE_SHARE:.0%} of the dense accuracy on every task"])]
    # a budget that holds a whole prompt evicts nothing while it is read: say so, lest it pass for a result
    for policy, budget in rows:
        short = sorted({r["length"] for r in records if _row_key(r) == (policy, budget) and budget is not None
                        and r["prompt_tokens"] <= budget})
        if short:
            lines.append(f"{policy} at B={budget}: prompts of length {', '.join(map(_length, short))} fit the "
                         "budget, so nothing was evicted before answering")
    return "\n".join(lines)


def heatmap_grid(records: Sequence[dict], policy: str, budget: int | None,
                 task: str) -> tuple[np.ndarray, np.ndarray, list[float], list[int]]:
    """Accuracy and sample counts [depths, lengths] of one (policy, budget, task); NaN where nothing ran."""
    mine = [c for c in cells(records) if (c["policy"], c["budget"], c["task"]) == (policy, budget, task)]
    depths = sorted({c["depth"] for c in mine})
    lengths = sorted({c["length"] for c in mine})
    acc = np.full((len(depths), len(lengths)), np.nan)
    n = np.zeros((len(depths), len(lengths)), dtype=int)
    for c in mine:
        i, j = depths.index(c["depth"]), lengths.index(c["length"])
        acc[i, j], n[i, j] = c["accuracy"], c["n"]
    return acc, n, depths, lengths


def write_heatmaps(records: Sequence[dict], out: str | Path) -> list[Path]:
    """One PNG per (policy, budget): a depth x length panel for every task with a depth, retrieval first."""
    from kvpop.eval.plots import plot_depth_heatmaps

    order = {f: i for i, f in enumerate(("retrieval", "tracking", "qa"))}
    tasks = sorted({r["task"] for r in records if r["depth"] is not None},
                   key=lambda t: (order.get(TASKS[t].family, 9), list(TASKS).index(t)))
    paths = []
    if not tasks:
        return paths
    for policy, budget in _row_order(_row_key(r) for r in records):
        panels = {t: heatmap_grid(records, policy, budget, t) for t in tasks}
        name = re.sub(r"[^A-Za-z0-9-]+", "_", policy).strip("_")
        label = "dense" if budget is None else f"{policy}, budget {budget}"
        paths.append(plot_depth_heatmaps(panels, Path(out) / f"heatmap_{name}{'' if budget is None else f'_{budget}'}.png",
                                         title=f"accuracy by needle depth and prompt length: {label}"))
    return paths


def policy_grid(records: Sequence[dict]) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """Every (policy, budget) row against every (task, depth) column, pooled over lengths: row labels,
    column labels, accuracy [rows, columns] (NaN where nothing ran) and sample counts. `kvpop demo`'s panel."""
    rows = _row_order(_row_key(r) for r in records)
    cols = sorted({(r["task"], r["depth"]) for r in records},
                  key=lambda c: (list(TASKS).index(c[0]), -1.0 if c[1] is None else c[1]))
    correct = np.zeros((len(rows), len(cols)))
    n = np.zeros((len(rows), len(cols)), dtype=int)
    for r in records:
        i, j = rows.index(_row_key(r)), cols.index((r["task"], r["depth"]))
        correct[i, j] += int(r["correct"])
        n[i, j] += 1
    acc = np.where(n > 0, correct / np.maximum(n, 1), np.nan)
    row_labels = ["dense" if b is None else f"{p}, B = {b}" for p, b in rows]
    col_labels = [t if d is None else f"{t} @ {d:.0%}" for t, d in cols]
    return row_labels, col_labels, acc, n


def headline(records: Sequence[dict]) -> dict:
    """The JSON object printed last: accuracy per (policy, budget, task) and the collapse lines."""
    tally = _tally(records)
    rows = []
    for policy, budget in _row_order(_row_key(r) for r in records):
        acc = {t: round(c / n, 4) for (p, b, t, *rest), (c, n) in tally.items()
               if (p, b) == (policy, budget) and not rest}
        rows.append({"policy": policy, "budget": budget, "accuracy": acc})
    return {"suite": rows, "collapsed": collapses(records)}


__all__ = ["cells", "collapses", "format_table", "headline", "heatmap_grid", "write_heatmaps"]
