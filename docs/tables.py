"""The tables and command references of the docs, made from `docs/data/*.json` and from `kvpop --help`.

    python docs/tables.py            # rewrite every marked block in README.md and docs/*.md
    python docs/tables.py --check    # exit 1, naming each block that differs from what the data gives

A marked block is

    <!-- table: NAME -->
    ... (generated: never edit by hand)
    <!-- /table -->

where NAME is a key of `TABLES` (a function of the data files that returns the block's markdown,
ending with the line that gives the command, card, commit and date behind it), or

    <!-- cli: SUBCOMMAND -->  ...  <!-- /cli -->

the `kvpop SUBCOMMAND --help` text, so that docs/cli.md and the help cannot disagree, or

    <!-- index: data -->  ...  <!-- /index -->      (or index: tables)

the list of `docs/data`'s files with what each measures, or of every table with its command.
tests/test_docs.py runs the check, so a doc cannot drift from its data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
BLOCK = re.compile(r"(<!-- (table|cli|index): ([\w.-]+) -->\n)(.*?)(<!-- /\2 -->)", re.S)


@cache
def data(name: str) -> dict:
    """`docs/data/NAME.json`, parsed once."""
    return json.loads((DATA / f"{name}.json").read_text())


def card(device: str) -> str:
    """The card's name from a device string ("NVIDIA H100 80GB HBM3" -> "H100"), or the CPU's description."""
    for name in ("H100", "H200", "A100", "L40S"):
        if name in device:
            return name
    return device


def source(command: str, device: str, commit: str, date: str) -> str:
    """The provenance line every table ends with."""
    return f"*`{command}` · {card(device)} · commit {commit} · {date[:10]}*"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A markdown table; `align` is one letter per column, `l` or `r` (default: the first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


TABLES: dict[str, Callable[[], str]] = {}


def register(name: str):
    def wrap(fn: Callable[[], str]) -> Callable[[], str]:
        TABLES[name] = fn
        return fn

    return wrap


# --- tables ---
# each reads its data files: the numbers and their provenance come from the data, never from here


# --- quality tables (docs/quality.md, docs/policies.md, README.md) ---
# rows measured in different runs name their run in a last column; one provenance line per run closes the table


def _q_rows(name: str, *path: str) -> list[dict]:
    """The rows under `path` of `docs/data/NAME.json` (a list of rows, or a dict holding `rows`)."""
    node = data(name)
    for key in path:
        node = node[key]
    return node["rows"] if isinstance(node, dict) else node


def _q_row(rows: list[dict], policy: str, budget: int | None = None) -> dict:
    hits = [r for r in rows if r["policy"] == policy and (budget is None or r["budget"] == budget)]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} rows of policy {policy!r} at budget {budget}")
    return hits[0]


def _q_paired(a: list[float], b: list[float]) -> tuple[float, float, int, int]:
    """Mean and standard error of a - b over paired items, and how many items a is lower / higher on."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5
    return mean, se, sum(x < 0 for x in d), sum(x > 0 for x in d)


def _q_diff(a: list[float], b: list[float], digits: int = 4, counts: str | None = "lower") -> str:
    mean, se, lower, higher = _q_paired(a, b)
    if counts is None:
        return f"{mean:+.{digits}f} ± {se:.{digits}f}".replace("-", "−")
    tail = f"lower on {lower} of {len(a)}" if counts == "lower" else f"{lower} / {higher}"
    return f"{mean:+.{digits}f} ± {se:.{digits}f} ({tail})".replace("-", "−")


def _q_ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}"


def _q_span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def _q_cmd(command: str) -> str:
    return command.replace("/opt/torch/.venv/bin/python ", "python ").replace("/root/", "")


def _q_source(run: str, name: str, command: str, device: str, commit: str, date: str, rows: str) -> str:
    """One run's provenance line: the command, card, commit and date, what the table took from it, its file."""
    return source(_q_cmd(command), device, commit, date) + f" — {run}: {rows}; `docs/data/{name}.json`"


_Q_TODAY = "quality_champ_8k_2026-12-07"
_Q_BASELINES = "quality_champ_8k_2026-12-01"
_Q_STATIC = "quality_cascade_2026-12-02"
_Q_OOD = "quality_out_of_domain_2026-12-01"
_Q_OOD_TODAY = "quality_out_of_domain_8k_2026-12-07"
_Q_SUITE = "quality_suite_selfgen_2026-12-01"
_Q_SUITE_TODAY = "quality_suite_recommended_2026-12-07"
_Q_GENERATION = "long_generation_b1024_2026-12-07"


def _q_today_source(run: str = "", rows: str = "") -> str:
    d = data(_Q_TODAY)
    line = source(d["commands"][0] + " (and at --budgets 1024 with the B = 1024 runs)", d["device"], d["commit"],
                  d["date"])
    return line + (f" — {run}: {rows}" if run else "") + f"; `docs/data/{_Q_TODAY}.json`"


def _q_baselines_source(run: str, rows: str) -> str:
    d = data(_Q_BASELINES)
    return _q_source(run, _Q_BASELINES, d["command"], d["device"], d["commit"], d["date"], rows)


def _q_static_source(run: str, rows: str) -> str:
    d = data(_Q_STATIC)
    return _q_source(run, _Q_STATIC, d["table_commands"][0] + " (and at --budgets 1024, --tova-pool-layer 767)",
                     d["machine"], d["commit"], d["date"], rows)


_Q_NAMES = {"mlp_s0": "recommended policy, seed 0", "mlp_s1": "recommended policy, seed 1", "tova": "TOVA (paper)"}


@register("quality-headline")
def quality_headline() -> str:
    """Today's teacher-forced headline: the recommended policy (2 seeds) against TOVA at CR 75 % and 88 %."""
    rows = _q_rows(_Q_TODAY)
    out = []
    for policy in ("mlp_s0", "mlp_s1", "tova"):
        a, b = _q_row(rows, policy, 2048), _q_row(rows, policy, 1024)
        out.append([_Q_NAMES[policy], f(a["kl"], 4), f(a["top1_agreement"], 4), f(b["kl"], 4),
                    f(b["top1_agreement"], 4)])
    head = ["SmolLM2-135M, 8 × 8192 tokens", "KL, CR 75 % (B = 2048)", "top-1", "KL, CR 88 % (B = 1024)", "top-1"]
    return table(head, out) + "\n\n" + _q_today_source()


@register("quality-champ-8k")
def quality_champ_8k() -> str:
    """Today's table in full: relative accuracy, top-1, KL ± SE, perplexity ratio, KL paired against TOVA."""
    rows = _q_rows(_Q_TODAY)
    out = []
    for budget in (2048, 1024):
        tova = _q_row(rows, "tova", budget)
        for policy in ("mlp_s0", "mlp_s1", "tova"):
            r = _q_row(rows, policy, budget)
            paired = "" if policy == "tova" else _q_diff(r["kl_per_sequence"], tova["kl_per_sequence"])
            out.append([f"{r['cr']:.0%}".replace("%", " %"), _Q_NAMES[policy], f(r["rel_accuracy"], 4),
                        f(r["top1_agreement"], 4), f"{r['kl']:.4f} ± {r['kl_se']:.4f}", f(r["ppl_ratio"], 3),
                        paired])
    head = ["CR", "policy", "rel. acc", "top-1", "KL ± SE", "ppl ratio", "KL − TOVA's, paired over the 8 rows"]
    return table(head, out, "llrrrrr") + "\n\n" + _q_today_source()


@register("baselines-champ-8k")
def baselines_champ_8k() -> str:
    """Every policy on the same 8 sequences of 8192 tokens, each row naming the run it comes from."""
    today, base = _q_rows(_Q_TODAY), _q_rows(_Q_BASELINES)
    static = _q_rows(_Q_STATIC, "table", "lpool_b2048") + _q_rows(_Q_STATIC, "table", "lpool_b1024")

    def cells(rows: list[dict], policy: str) -> list[str]:
        a, b = _q_row(rows, policy, 2048), _q_row(rows, policy, 1024)
        return [f(a["kl"], 4), f(a["top1_agreement"], 3), f(b["kl"], 4), f(b["top1_agreement"], 3)]

    out = [
        ["recommended policy, seed 0 (the default)", "scorer", *cells(today, "mlp_s0"), "a"],
        ["recommended policy, seed 1", "scorer", *cells(today, "mlp_s1"), "a"],
        ["TOVA (paper)", "none", *cells(today, "tova"), "a"],
        ["TOVA (paper), the same walk in another process", "none", *cells(base, "tova"), "b"],
        ["H2O (paper)", "none", *cells(base, "h2o"), "b"],
        ["StreamingLLM", "none", *cells(base, "streaming_llm"), "b"],
        ["static rule (`--rule static`), seed 0", "scorer", *cells(static, "mlp"), "c"],
        ["static rule (`--rule static`), seed 1", "scorer", *cells(static, "mlp_s1"), "c"],
        ["oracle static rule (reads the future)", "–", *cells(base, "oracle"), "b"],
    ]
    head = ["policy", "training", "KL, CR 75 %", "top-1", "KL, CR 88 %", "top-1", "run"]
    lines = [
        _q_today_source("a", "recommended policy, TOVA"),
        _q_baselines_source("b", "TOVA, H2O, StreamingLLM, oracle"),
        _q_static_source("c", "static rule (scorer-only, 120 steps, the recipe of run a; 4 sinks, window 256)"),
    ]
    return table(head, out, "llrrrrl") + "\n\n" + "  \n".join(lines)


@register("out-of-domain")
def out_of_domain() -> str:
    """Held-out Python code (pystdlib) and Python's help topics (pydoc): the recommended policy against the rest, every
    row of a source and budget from one run on the same sequences; the static rule from an earlier run beside them."""
    d, old = data(_Q_OOD_TODAY), data(_Q_OOD)
    static = "kvpop-mlp+prerope+mix+frozen"
    plan = [("mlp_s0", "recommended policy, seed 0", "a"), ("mlp_s1", "recommended policy, seed 1", "a"),
            (static, "static rule, seed 0", "b"), ("tova", "TOVA (paper)", "a"), ("h2o", "H2O (paper)", "a"),
            ("streaming_llm", "StreamingLLM", "a")]
    out = []
    for src in ("pystdlib", "pydoc"):
        got = {b: {r["policy"]: r for r in d["tables"][src][str(b)]["rows"]} for b in (2048, 1024)}
        for b in (2048, 1024):
            got[b][static] = _q_row(_q_rows(_Q_OOD, "code", f"{src}_{b}"), static, b)
        for policy, label, run in plan:
            cells = []
            for b in (2048, 1024):
                r = got[b][policy]
                cells += [f(r["kl"], 4), f(r["top1_agreement"], 3)]
                for ref in ("tova", "h2o"):
                    cells.append("" if ref == policy else
                                 _q_diff(r["kl_per_sequence"], got[b][ref]["kl_per_sequence"]))
            out.append([f"`{src}`", label, *cells, run])
    head = ["data", "policy"] + [x for cr in ("75", "88") for x in
                                 (f"KL, CR {cr} %", "top-1", "− TOVA's KL, paired", "− H2O's KL, paired")] + ["run"]
    lines = [
        _q_source("a", _Q_OOD_TODAY, d["commands"][0] + " (and --budgets 1024; --data pydoc --split all)", d["device"],
                  d["commit"], d["date"], "recommended policy (seeds 0, 1), TOVA, H2O, StreamingLLM"),
        _q_source("b", _Q_OOD, old["code"]["pystdlib_2048"]["command"] + " (and --budgets 1024; --data pydoc --split all)",
                  old["machine"], old["commit"], old["date"],
                  "static rule (the same recipe's seed-0 weights of that run; its TOVA, H2O and StreamingLLM rows equal run a's bit for bit)"),
    ]
    return table(head, out, "llrrrrrrrrl") + "\n\n" + "  \n".join(lines)


def _q_suite(cells: list[dict]) -> dict[tuple[str, int | None], dict[str, list[int]]]:
    """Per (policy, budget) and task: [correct, prompts]."""
    agg: dict = {}
    for c in cells:
        task = agg.setdefault((c["policy"].split("[")[0], c["budget"]), {}).setdefault(c["task"], [0, 0])
        task[0] += c["correct"]
        task[1] += c["n"]
    return agg


@register("task-suite")
def task_suite() -> str:
    """The 32 prompts of the task suite (6 families, 4k and 8000 tokens, needle depths 0, 0.5, 1) per policy."""
    # the dense cells repeat in every run's file: take them once
    today = data(_Q_SUITE_TODAY)["runs"]
    runs = {"a": _q_suite(data(_Q_SUITE)["suite_b2048"]["cells"]
                          + [c for c in data(_Q_SUITE)["suite_b1024"]["cells"] if c["policy"] != "dense"]),
            "b": _q_suite([c for k in ("suite_b2048_kvpop-mlp+prerope+mix+frozen", "suite_b1024_kvpop-mlp+prerope+mix+frozen")
                           for c in data(_Q_OOD)["suite"][k]["cells"]]),
            "c": _q_suite(today["suite_b2048"]["cells"]),
            "d": _q_suite(today["suite_b1024"]["cells"])}
    plan = [("dense", "dense", None, "a")]
    for b, run in ((2048, "c"), (1024, "d")):
        plan += [(f"recommended policy, seed {s}", f"mlp_s{s}", b, run) for s in (0, 1)]
        plan += [("static rule", "kvpop-mlp+prerope+mix+frozen", b, "b"),
                 ("TOVA (paper)", "tova", b, "a"), ("H2O (paper)", "h2o", b, "a"),
                 ("StreamingLLM", "streaming_llm", b, "a")]
    tasks = ("passkey", "multikey", "qa")
    out = []
    for label, policy, b, run in plan:
        got = runs[run][policy, b]
        silent = [t for t in got if t not in tasks and got[t][0]]
        if silent:
            raise ValueError(f"{label} answers {silent}, which the table leaves out")
        total = [sum(v[0] for v in got.values()), sum(v[1] for v in got.values())]
        out.append([label, "–" if b is None else str(b)] + [f"{got[t][0]}/{got[t][1]}" for t in tasks]
                   + [f"**{total[0]}**/{total[1]}", run])
    head = ["policy", "B", "passkey", "multikey", "QA", "all 32 prompts", "run"]
    da, db = data(_Q_SUITE), data(_Q_OOD)
    lines = [
        _q_source("a", _Q_SUITE, da["suite_b2048"]["command"] + " (and --budgets 1024)", da["study"]["device"],
                  da["commit"], da["study"]["date"], "dense, TOVA, H2O, StreamingLLM"),
        _q_source("b", _Q_OOD, db["suite"]["suite_b2048_kvpop-mlp+prerope+mix+frozen"]["command"] + " (and 1024)",
                  db["machine"], db["commit"], db["date"], "static rule"),
    ] + [_q_source(run, _Q_SUITE_TODAY, today[key]["command"], today[key]["device"], today[key]["commit"],
                   today[key]["date"], "recommended policy, seeds 0 and 1 (its dense row answers as run a's, prompt "
                   "for prompt)")
         for run, key in (("c", "suite_b2048"), ("d", "suite_b1024"))]
    note = ("Multi-value, variable tracking and common-word extraction (14 prompts) are 0 for every row, dense included, "
            "so they say nothing about eviction and are left out.")
    return table(head, out, "lrrrrrl") + "\n\n" + note + "\n\n" + "  \n".join(lines)


_Q_GEN_NAMES = {"dense": "dense", "h2o": "H2O (paper)", "tova": "TOVA (paper)", "streaming_llm": "StreamingLLM (scored on the CPU)",
                "mlp_s0": "recommended policy, seed 0 (the shipped scorer)", "mlp_s1": "recommended policy, seed 1"}


@register("long-generation")
def long_generation() -> str:
    """Today's long generation: 27 problems × 2048 greedy tokens at B = 1024, paired against TOVA and H2O."""
    d = data(_Q_GENERATION)
    per = d["per_problem"]["nll_past_budget"]
    out = []
    for policy in ("dense", "h2o", "tova", "streaming_llm", "mlp_s0", "mlp_s1"):
        r = _q_row(d["rows"], policy)
        # a row scored on another machine differs from the others in the last bits of every NLL: its texts are
        # compared by their tokens, and its paired differences carry no lower / higher counts
        other = "scored" in r
        left = r["texts_leaving_dense"] if other else sum(x != y for x, y in zip(per[policy], per["dense"], strict=True))
        counts = None if other else "split"
        out.append([_Q_GEN_NAMES[policy], f(r["nll"], 4), f(r["nll_past_budget"], 4),
                    "" if policy == "tova" else _q_diff(per[policy], per["tova"], counts=counts),
                    "" if policy == "h2o" else _q_diff(per[policy], per["h2o"], counts=counts),
                    f"{left} of {len(per[policy])}", f(r["agreement"], 4), f(r["repetition"], 3)])
    head = ["policy, B = 1024", "NLL", "NLL past the budget", "− TOVA's, paired (lower / higher)",
            "− H2O's, paired (lower / higher)", "texts that leave the dense text", "agreement", "rep4"]
    cmd = d["commands"][2] + " (TOVA, H2O, StreamingLLM: --policies tova, h2o, streaming_llm)"
    return table(head, out) + "\n\n" + source(cmd, d["device"], d["commit"], d["date"]) + f"; `docs/data/{_Q_GENERATION}.json`"


_GEMMA_NAMES = {"oracle": "oracle (future attention)", "tova": "TOVA (paper)", "h2o": "H2O (paper)",
                 "streaming_llm": "StreamingLLM"}


@register("gemma3-champ")
def gemma3_champ() -> str:
    """Gemma 3 270M teacher-forced at 8k and 16k tokens: the baselines and the oracle at 1/8 to 1/32 of the length."""
    d = data("gemma3_champ_2026-12-07")
    rows = []
    for run in d["runs"].values():
        for p in _GEMMA_NAMES:
            r = _q_row(run["rows"], p, run["budget"])
            rows.append([str(run["seq_len"]), str(run["budget"]), f"{100 * r['cr']:.1f} %", _GEMMA_NAMES[p],
                         f"{r['kl']:.4f} ± {r['kl_se']:.4f}", f(r["top1_agreement"]), f(r["rel_accuracy"]),
                         f(r["ppl_ratio"])])
    head = ["tokens", "B", "CR (full layers)", "policy", "KL ± SE", "top-1", "rel. acc", "ppl ratio"]
    first = next(iter(d["runs"].values()))
    cmd = first["command"] + " (one run per budget and length)"
    return table(head, rows, "rrrlrrrr") + "\n\n" + source(cmd, d["device"], d["commit"], d["date"]) + \
        " — `docs/data/gemma3_champ_2026-12-07.json`"


@register("gemma3-suite-8k")
def gemma3_suite_8k() -> str:
    """The task suite on Gemma 3 270M at 8192 tokens: the dense row first, then each baseline at three budgets."""
    d = data("gemma3_suite_8k_2026-12-07")
    tasks = list(d["runs"])
    cells = _q_suite([c for run in d["runs"].values() for c in run["cells"]])
    order = [("dense", None)] + [(p, b) for b in (1024, 512, 256) for p in ("tova", "h2o", "streaming_llm")]
    names = {"dense": "dense", **_GEMMA_NAMES}
    rows = []
    for p, b in order:
        got = cells[p, b]
        total = [sum(got[t][0] for t in tasks), sum(got[t][1] for t in tasks)]
        rows.append([names[p], "–" if b is None else str(b)] + [f"{got[t][0]}/{got[t][1]}" for t in tasks]
                    + [f"**{total[0]}**/{total[1]}"])
    labels = {"passkey": "passkey", "multikey": "multi-key", "multivalue": "multi-value", "vt": "var. tracking",
              "cwe": "common words", "qa": "QA"}
    head = ["policy", "B"] + [labels[t] for t in tasks] + ["all"]
    cmd = d["runs"][tasks[0]]["command"] + " (one run per task)"
    return table(head, rows, "lr" + "r" * (len(tasks) + 1)) + "\n\n" + source(cmd, d["device"], d["commit"], d["date"]) + \
        " — `docs/data/gemma3_suite_8k_2026-12-07.json`"


_GEMMA_TRAINED = "gemma3_trained_8k_2026-12-07"
_GEMMA_TRAINED_ROWS = [
    ("oracle", "oracle (future attention)"),
    ("mlp_b1024_s0+lpool767", "**recommended policy** (KVpop-mlp, layer-wide cascade), seed 0"),
    ("mlp_b1024_s1+lpool767", "**recommended policy**, seed 1"),
    ("tova", "TOVA (paper)"),
    ("mlp_b1024_s0", "KVpop-mlp, static rule, seed 0"),
    ("mlp_b1024_s1", "KVpop-mlp, static rule, seed 1"),
    ("mlstm_b1024_s0", "KVpop-mLSTM, seed 0"),
    ("h2o", "H2O (paper)"),
    ("dms_b1024_s1", "DMS, seed 1"),
    ("mlstm_b1024_s1", "KVpop-mLSTM, seed 1"),
    ("streaming_llm", "StreamingLLM"),
    ("dms_b1024_s0", "DMS, seed 0"),
]


@register("gemma3-trained-8k")
def gemma3_trained_8k() -> str:
    """Gemma 3 270M at 8192 tokens and B = 1024: the trained scorers (two seeds each) beside the baselines and the
    oracle on the same 4 rows, with each row's KL paired against TOVA's."""
    d = data(_GEMMA_TRAINED)
    t = d["table"]
    rows = []
    tova = _q_row(t["rows"], "tova")["kl_per_sequence"]
    for policy, name in _GEMMA_TRAINED_ROWS:
        r = _q_row(t["rows"], policy)
        diff = "" if policy == "tova" else _q_diff(r["kl_per_sequence"], tova, counts="split")
        used = r.get("avg_cache_fraction")
        rows.append([name, f"{r['kl']:.4f} ± {r['kl_se']:.4f}", diff, f(r["top1_agreement"]), f(r["rel_accuracy"]),
                     f(r["ppl_ratio"]), f(r.get("recall")), "100 %" if used is None else f"{100 * used:.0f} %"])
    head = ["S = 8192, B = 1024 (CR 87.5 %)", "KL ± SE", "− TOVA's KL, paired (lower / higher)", "top-1", "rel. acc",
            "ppl ratio", "recall vs oracle", "cache used"]
    cmd = t["command"] + f" (trained: {d['command']})"
    return table(head, rows) + "\n\n" + source(cmd, d["device"], d["commit"], d["date"]) + \
        f" — `docs/data/{_GEMMA_TRAINED}.json`"


@register("gemma3-trained-runs")
def gemma3_trained_runs() -> str:
    """The six training runs behind the Gemma 3 trained rows: steps, step time and the last losses."""
    d = data(_GEMMA_TRAINED)
    names = {"mlp": "KVpop-mlp", "mlstm": "KVpop-mLSTM", "dms": "DMS"}
    rows = []
    for r in d["train"].values():
        rows.append([names[r["kind"]], str(r["seed"]), str(r["steps"]), f(1000 * r["step_time_median_s"], 0),
                     f(r["loss_first"]), f(r["loss_last10"]),
                     f(r["accuracy_last10"]) if r["accuracy_last10"] is not None else f"retention {r['retention_last']:.3f}"])
    head = ["scorer-only training, S = 8192, B = 1024", "seed", "steps", "ms per step", "loss, step 1",
            "loss, last 10", "boundary accuracy, last 10"]
    first = next(iter(d["train"].values()))
    return table(head, rows, "lrrrrrr") + "\n\n" + source(first["command"] + " (--scorer mlstm; --policy dms; --seed 1)",
                                                        d["device"], d["commit"], d["date"])


@register("gemma3-trained-suite-8k")
def gemma3_trained_suite_8k() -> str:
    """The task suite at 8192 tokens with the trained rows at B = 1024, the dense row first."""
    d = data(_GEMMA_TRAINED)
    suite = d["suite"]
    cells = _q_suite([c for task in suite.values() for c in task.get("cells", [])])
    tasks = list(suite)
    rows = []
    for policy, name in [("dense", "dense")] + _GEMMA_TRAINED_ROWS:
        if policy == "oracle":
            continue  # the oracle reads the future: teacher-forced only
        got = []
        for t in tasks:
            if "totals" in suite[t]:
                got.append(suite[t]["totals"][policy])
            else:
                got.append(cells[policy, None if policy == "dense" else 1024][t])
        rows.append([name] + [f"{c}/{n}" for c, n in got] + [f"**{sum(c for c, _ in got)}**/{sum(n for _, n in got)}"])
    labels = {"passkey": "passkey", "multikey": "multi-key", "multivalue": "multi-value", "qa": "QA"}
    head = ["8192 tokens, B = 1024"] + [labels[t] for t in tasks] + ["all"]
    cmd = suite["passkey"]["command"].split(" --trained")[0] + " --trained ... --rule static --tova-pool-layer 767 " \
        "(one run per task)"
    return table(head, rows) + "\n\n" + source(cmd, d["device"], d["commit"], d["date"]) + \
        f" — `docs/data/{_GEMMA_TRAINED}.json`"


_GEMMA_GENERATION = "gemma3_generation_cpu_2026-12-07"


@register("gemma3-generation")
def gemma3_generation() -> str:
    """Long generation on Gemma 3 270M: 4096 greedy tokens from 4 held-out problems at B = 512, scored by the dense
    model, each row's NLL past the budget paired per problem against TOVA's."""
    d = data(_GEMMA_GENERATION)
    per = d["per_problem"]
    names = {"dense": "dense", "tova": "TOVA (paper)", "h2o": "H2O (paper)", "streaming_llm": "StreamingLLM"}
    rows = []
    for policy in ("dense", "tova", "h2o", "streaming_llm"):
        r = next((r for r in d["rows"] if r["policy"] == policy), None)
        if r is None:
            continue
        mine = per["nll_past_budget"][policy]
        rows.append([names[policy], f(r["nll"], 4), f(r["nll_past_budget"], 4),
                     "" if policy == "tova" else _q_diff(mine, per["nll_past_budget"]["tova"], counts="split"),
                     f"{len(mine) - per['texts_equal_dense'][policy]} of {len(mine)}", f(r["agreement"], 4),
                     f(r["repetition"], 3)])
    head = ["4096 tokens, B = 512", "NLL", "NLL past the budget", "− TOVA's, paired (lower / higher)",
            "texts that leave the dense text", "agreement", "rep4"]
    out = table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])
    if "h2o_run" in d:  # H2O's row came from a later run of its own, beside the dense model's texts again
        h = d["h2o_run"]
        out += "  \n" + source(h["command"], h["device"], h["commit"], h["date"]) + " (H2O)"
    return out + f" — `docs/data/{_GEMMA_GENERATION}.json`"


@register("gemma3-memory")
def gemma3_memory() -> str:
    """Gemma 3 270M's whole KV cache on one GPU, dense against the static rule at B = 2048, 8k to 32k tokens."""
    d = data("gemma3_memory_2026-12-07")
    by = {(r["cache"], r["context"]): r for r in d["rows"]}
    rows = []
    for n in sorted({r["context"] for r in d["rows"]}):
        dense, kv = by["dense", n], by["kvpop", n]
        rows.append([str(n), f(dense["cache_mb"], 1), f(kv["cache_mb"], 1), f"{100 * kv['cache_mb'] / dense['cache_mb']:.0f} %",
                     f(dense["peak_mb"], 0), f(kv["peak_mb"], 0)])
    head = ["prompt tokens", "dense KV MB", "retrofitted KV MB", "of dense", "dense peak MB", "retrofitted peak MB"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"]) + \
        " — `docs/data/gemma3_memory_2026-12-07.json`"


@register("chunked-rule-cpu")
def chunked_rule_cpu() -> str:
    """The chunked rule against the per-token rule of the same kind, teacher-forced at S = 2048, in the same memory."""
    d = data("chunked_rule_cpu_2026-12-07")
    out = []
    for run in d["runs"]:
        rows = run["rows"]
        budget = rows[0]["budget"]
        for base, label in (("ship", "recommended policy (the shipped scorer)"), ("tova", "TOVA (paper)")):
            ref = _q_row(rows, base)
            chunks = sorted(int(r["policy"].split("+chunk")[1]) for r in rows if r["policy"].startswith(base + "+chunk"))
            for c in [1, *chunks]:
                r = ref if c == 1 else _q_row(rows, f"{base}+chunk{c}")
                out.append([f"{budget} ({r['cr']:.0%})", label, "every token" if c == 1 else f"every {c} steps",
                            f(r["kl"], 4), f(r["top1_agreement"], 3),
                            "" if c == 1 else _q_diff(r["kl_per_sequence"], ref["kl_per_sequence"])])
    head = ["budget (CR), S = 2048", "rule", "decides", "KL", "top-1", "KL − the per-token rule's, paired"]
    lines = [source(run["command"], d["device"], d["commit"], d["date"]) for run in d["runs"]]
    return table(head, out, "lllrrr") + "\n\n" + "  \n".join(lines)


def _chunked_seeds(name: str, chunks: tuple[int, ...], text: str) -> str:
    """The chunked rule's KL beside the per-token rule's, per seed and for TOVA, and the seeds' own spread."""
    d = data(name)
    rows = d["rows"]
    out = []
    for base, label in (("s0", "recommended policy, seed 0"), ("s1", "recommended policy, seed 1"),
                        ("tova", "TOVA (paper)")):
        ref = _q_row(rows, base)
        cells = [label, f(ref["kl"], 4)]
        for c in chunks:
            r = _q_row(rows, f"{base}+chunk{c}")
            cells += [f(r["kl"], 4), _q_diff(r["kl_per_sequence"], ref["kl_per_sequence"])]
        out.append(cells)
    s0, s1 = _q_row(rows, "s0"), _q_row(rows, "s1")
    head = [f"{text}, B = {rows[0]['budget']} (CR {rows[0]['cr']:.0%}), S = 2048", "KL, every token"]
    for c in chunks:
        head += [f"every {c} steps", "− every token's, paired"]
    spread = ("Seed 1 − seed 0, deciding every token: "
              + _q_diff(s1["kl_per_sequence"], s0["kl_per_sequence"]) + ".")
    return table(head, out) + "\n\n" + spread + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("chunked-rule-seeds")
def chunked_rule_seeds() -> str:
    """The chunked rule's cost beside the spread between two seeds' scorers, teacher-forced at S = 2048."""
    return _chunked_seeds("chunked_rule_seeds_cpu_2026-12-07", (16, 64), "champ")


@register("chunked-rule-pystdlib")
def chunked_rule_pystdlib() -> str:
    """The chunked rule out of domain (held-out Python files) beside the seeds' spread, teacher-forced at S = 2048."""
    return _chunked_seeds("chunked_rule_pystdlib_cpu_2026-12-07", (64,), "pystdlib")


@register("chunked-rule-pydoc")
def chunked_rule_pydoc() -> str:
    """The chunked rule out of domain (Python's help topics) beside the seeds' spread, teacher-forced at S = 2048."""
    return _chunked_seeds("chunked_rule_pydoc_cpu_2026-12-07", (64,), "pydoc")


_CHUNKED_H2O = "chunked_h2o_cpu_2026-12-07"


@register("chunked-h2o")
def chunked_h2o() -> str:
    """H2O's chunked rule against H2O's per-token rule, teacher-forced at S = 2048 on champ (two budgets) and out of
    domain, each chunked row paired per sequence with the per-token row of its run."""
    d = data(_CHUNKED_H2O)
    names = {"champ": "champ (development rows)", "pystdlib": "pystdlib (held-out files)", "pydoc": "pydoc (help topics)"}
    out, cmds = [], []
    for run in d["teacher_forced"]:
        rows = {r["policy"]: r for r in run["rows"]}
        base = rows["h2o"]
        for p in sorted(rows, key=lambda p: (p != "h2o", int(p.partition("+chunk")[2] or 0))):
            r = rows[p]
            c = p.partition("+chunk")[2]
            paired = _q_diff(r["kl_per_sequence"], base["kl_per_sequence"]) if c else ""
            out.append([names[run["data"]], f"{r['budget']} ({100 * r['cr']:.0f}%)", f"every {c} steps" if c else
                        "every token", f(r["kl"], 4), f(r["top1_agreement"]), paired])
        cmds.append(source(run["command"], d["device"], d["commit"], d["date"]))
    head = ["H2O (paper split), S = 2048", "budget (CR)", "decides", "KL", "top-1", "KL − every token's, paired"]
    return table(head, out, "llrrrr") + "\n\n" + "  \n".join(cmds)


@register("chunked-h2o-generation")
def chunked_h2o_generation() -> str:
    """H2O's chunked rule in long generation: its own greedy text scored by the dense model, paired per problem."""
    top = data(_CHUNKED_H2O)
    d = top["generation"]
    rows, per = {r["policy"]: r for r in d["rows"]}, d["per_problem"]
    out = []
    for p, decides in (("dense", "–"), ("h2o", "every token"), ("h2o+chunk64", "every 64 steps")):
        r = rows[p]
        paired = _q_diff(per[p], per["h2o"]) if p == "h2o+chunk64" else ""
        out.append(["dense" if p == "dense" else "H2O (paper)", decides, f(r["nll_past_budget"], 4), paired,
                    f(r["agreement"], 4), f(r["repetition"], 3)])
    head = [f"B = {d['rows'][1]['budget']}, {d['tokens']} tokens × {d['problems']} problems", "decides",
            "NLL past the budget", "− every token's, paired", "agreement", "rep4"]
    return table(head, out, "llrrrr") + "\n\n" + source(d["command"], top["device"], top["commit"], top["date"])


@register("chunked-rule-generation")
def chunked_rule_generation() -> str:
    """The chunked rule in long generation: each rule's own greedy text scored by the dense model, paired per
    problem against the per-token rule of the same scorer, beside the spread between two seeds' scorers."""
    d = data("chunked_rule_generation_cpu_2026-12-07")
    rows, per = {r["policy"]: r for r in d["rows"]}, d["per_problem"]
    names = {"dense": "dense", "s0": "recommended policy, seed 0", "s1": "recommended policy, seed 1",
             "tova": "TOVA (paper)"}
    out = []
    for p in [p for p in ("dense", "s0", "s1", "tova") if p in rows]:
        for c in ("", "+chunk64"):
            if p + c not in rows:
                continue
            r = rows[p + c]
            paired = _q_diff(per[p + c], per[p]) if c else ""
            decides = "–" if p == "dense" else "every 64 steps" if c else "every token"
            out.append([names[p], decides, f(r["nll_past_budget"], 4), paired,
                        f(r["agreement"], 4), f(r["repetition"], 3)])
    budget = d["rows"][0]["budget"]
    head = [f"B = {budget}, {d['tokens']} tokens × {d['problems']} problems", "decides", "NLL past the budget",
            "− every token's, paired", "agreement", "rep4"]
    spread = ("Seed 1 − seed 0, deciding every token: " + _q_diff(per["s1"], per["s0"]) + ".") if "s1" in per else ""
    return table(head, out, "llrrrr") + "\n\n" + spread + "\n\n" + source(d["command"], d["device"], d["commit"],
                                                                         d["date"])


@register("policy-choice")
def policy_choice() -> str:
    """README's "which policy": each policy's teacher-forced KL as a ratio to TOVA's KL in the same run."""
    today, base = _q_rows(_Q_TODAY), _q_rows(_Q_BASELINES)
    static = _q_rows(_Q_STATIC, "table", "lpool_b2048") + _q_rows(_Q_STATIC, "table", "lpool_b1024")
    static_tova = _q_rows(_Q_STATIC, "table", "tova_b2048") + _q_rows(_Q_STATIC, "table", "tova_b1024")

    def ratios(rows: list[dict], policies: tuple[str, ...], tova_rows: list[dict]) -> list[str]:
        return [_q_span([_q_row(rows, p, b)["kl"] / _q_row(tova_rows, "tova", b)["kl"] for p in policies])
                for b in (2048, 1024)]

    minutes = data(_Q_TODAY)["training_seconds_per_run"] / 60
    out = [
        ["**recommended** (the default of a trained directory)",
         f"yes: a scorer (SmolLM2-135M ships one; {minutes:.0f} min on one H100)", *ratios(today, ("mlp_s0", "mlp_s1"), today),
         "a scorer exists for the model: the lowest KL at both ratios; in long free-running generation no better "
         "than H2O or TOVA", "a"],
        ["TOVA (`--policies tova`)", "no", "1.00", "1.00", "no scorer for the model: the best training-free rule",
         "a"],
        ["H2O (`--policies h2o`)", "no", *ratios(base, ("h2o",), base),
         "no scorer and mostly long free-running generation, where it has the lowest NLL of the bounded rows "
         "(within noise)", "b"],
        ["StreamingLLM (`--policies streaming_llm`)", "no", *ratios(base, ("streaming_llm",), base),
         "sinks and a recent window only: the largest loss", "b"],
        ["static rule (`--rule static`)", "yes (the same scorer)", *ratios(static, ("mlp", "mlp_s1"), static_tova),
         "the paper's rule; fails on repetition loops, level with the recommended policy on text it never trained "
         "on", "c"],
        ["dense (no `KVpopCache`)", "no", "0", "0", "memory allows: the reference every KL is measured against", "–"],
    ]
    head = ["policy", "needs training?", "KL ÷ TOVA's, CR 75 %", "KL ÷ TOVA's, CR 88 %", "when to pick it", "run"]
    lines = [
        _q_today_source("a", "recommended policy (seeds 0, 1), TOVA"),
        _q_baselines_source("b", "H2O, StreamingLLM, each ÷ that run's TOVA"),
        _q_static_source("c", "static rule (seeds 0, 1) ÷ that run's TOVA"),
    ]
    return (table(head, out, "llrrll") + "\n\nSmolLM2-135M, 8 held-out rows of 8192 tokens; a range spans two seeds."
            + "\n\n" + "  \n".join(lines))


# --- end of quality tables ---


# --- speed tables (docs/speed.md, docs/training.md, README.md) ---


def _compiled(run: dict, cache: str, context: int) -> dict | None:
    """A `kvpop.eval.bench` run's compiled row for `cache` at `context`, None if the run has none."""
    return next((r for r in run["rows"] if r["compiled"] and r["cache"] == cache and r["context"] == context), None)


def _span(values: list[float], digits: int = 2) -> str:
    """"a–b" over the values (one value: itself)."""
    lo, hi = min(values), max(values)
    return f(lo, digits) if f(lo, digits) == f(hi, digits) else f"{f(lo, digits)}–{f(hi, digits)}"


@register("decode-8b")
def decode_8b() -> str:
    """The compiled decode step at the 8B shape: the static rule and the recommended policy as a user gets them (no
    environment variable set), beside compiled dense `StaticCache` and the bandwidth floor."""
    old = data("decode_8b_shape_2026-12-06")
    d = data("decode_default_8b_shape_2026-12-07")
    dense_run = next(r for r in old["runs"] if r["commit"] != "d0f5144")
    dense = {4096: _compiled(next(r for r in old["runs"] if r["commit"] == "d0f5144"), "dense", 4096),
             131072: _compiled(dense_run, "dense", 131072)}
    floor = d["rows"][0]["floor_ms"]
    rows = [[f"dense, HF `StaticCache` + `torch.compile` (commit {c})", f"{ctx // 1024}k",
             f(dense[ctx]["ms_per_token"], 2), "1.00", f(dense[ctx]["ms_per_token"] / floor, 2),
             f(dense[ctx]["peak_mb"] / 1024, 2), f(dense[ctx]["compile_s"], 0)]
            for ctx, c in ((4096, "d0f5144"), (131072, dense_run["commit"]))]
    for kind, label in (("kvpop", "static rule"), ("cascade", "recommended policy")):
        for ctx in (4096, 131072):
            r = _compiled(d, kind, ctx)
            rows.append([f"**{label}, B = 2048**", f"{ctx // 1024}k", f"**{f(r['ms_per_token'], 2)}**",
                         f(r["ms_per_token"] / dense[ctx]["ms_per_token"], 2), f(r["ms_per_token"] / floor, 2),
                         f(r["peak_mb"] / 1024, 2),
                         f(r["compile_s"], 0) + (" (cold)" if ctx == 4096 else " (the same graph)")])
    head = ["Qwen3-8B shape, 36 layers, batch 1", "context", "ms per token", "vs dense", f"vs floor ({f(floor, 2)} ms)",
            "peak GiB", "compile s"]
    return table(head, rows, "llrrrrl") + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])[:-1] + \
        f"; dense: `{old['runs'][0]['command']}` · {card(old['device'])} · commits d0f5144, {dense_run['commit']} · " \
        f"{old['date']}*"


@register("generate")
def generate() -> str:
    d = data("generate_2026-12-06")
    rows = []
    for run in d["runs"]:
        r = {x["cache"]: x for x in run["rows"] if x["context"] == 4096}
        s, k = r["static"], r["kvpop"]
        rows.append([run["label"].split(" (")[0], f(s["wall_ms_per_token"], 2), f"**{f(k['wall_ms_per_token'], 2)}**",
                     f(k["wall_ms_per_token"] / s["wall_ms_per_token"], 2), f(s["wall_decode_ms"], 2),
                     f(k["wall_decode_ms"], 2), f(s["wall_prefill_s"], 3), f(k["wall_prefill_s"], 3),
                     f(k["wall_prefill_s"] / s["wall_prefill_s"], 2)])
    head = ["4096-token prompt + 128 tokens, bf16", "static ms/token", "KVpop ms/token", "KVpop / static",
            "static decode ms", "KVpop decode ms", "static prefill s", "KVpop prefill s", "prefill ratio"]
    late = next(r for r in d["runs"] if r["commit"] != "d0f5144")
    late_label = late["label"].split(" (")[0].replace("Qwen3-8B shape, 12 layers", "8B")
    command = "python bench/bench_generate.py --device cuda --dtype bfloat16 --caches static,kvpop --new-tokens 128 " \
              "--repeats 2 --contexts 4096 --model {qwen3-8b-shape --num-layers 12 --budget 2048," \
              " smollm2-135m-shape --budget 1024} --batch {1,4}"
    return table(head, rows) + "\n\n" + source(command, d["device"], f"d0f5144 ({late_label}: {late['commit']})",
                                               d["date"])


@register("generate-recommended")
def generate_recommended() -> str:
    """`model.generate` at SmolLM2's shape, batch 1 and 4: compiled `StaticCache`, the static rule, the recommended
    policy; the first call from an empty inductor cache and from a cache an earlier process left."""
    d = data("generate_recommended_2026-12-07")
    names = {"static": "dense, `StaticCache`", "kvpop": "static rule, B = 1024", "cascade": "recommended policy, B = 1024"}
    rows = []
    for run in d["runs"]:
        r = {x["cache"]: x for x in run["rows"]}
        rows += [[run["label"], names[c], f(r[c]["wall_ms_per_token"], 2),
                  f(r[c]["wall_ms_per_token"] / r["static"]["wall_ms_per_token"], 2), f(r[c]["wall_decode_ms"], 2),
                  f(r[c]["wall_prefill_s"], 3), f(r[c]["first_call_s"], 0)] for c in ("static", "kvpop", "cascade")]
    head = ["4096-token prompt + 128 tokens", "SmolLM2 shape, bf16", "ms/token (prefill incl.)", "vs dense",
            "decode ms", "prefill s", "first call s (compile)"]
    lines = [source(run["command"], d["device"], run["commit"], run["date"]) + f" — {run['label']}" for run in d["runs"]]
    return table(head, rows, "llrrrrr") + "\n\n" + "  \n".join(lines)


@register("prefill-gpu")
def prefill_gpu() -> str:
    """One 8192-token prompt at B = 2048 at two shapes: the dense forward, the static rule's one pass, and the walks."""
    d = data("prefill_gpu_2026-12-07")
    names = {"dense": "dense forward", "kvpop": "static rule (one pass)", "h2o": "H2O (walk)", "tova": "TOVA (walk)",
             "cascade": "recommended policy (walk)"}
    runs = {run["model"]: {r["policy"]: r["wall_all"][-1] for r in run["rows"]} for run in d["runs"]}
    big, small = runs["qwen3-8b-shape"], runs["smollm2-135m-shape"]
    rows = [[names[p], f(big[p], 2), f(big[p] / big["dense"], 1) + "×", f(small[p], 3),
             f(small[p] / small["dense"], 1) + "×"] for p in ("dense", "kvpop", "h2o", "tova", "cascade")]
    head = ["8192-token prompt, B = 2048, batch 1, bf16", "Qwen3-8B shape s", "vs dense", "SmolLM2 shape s", "vs dense"]
    cmd = d["runs"][0]["command"] + " (and --model smollm2-135m-shape --dtype bfloat16 --repeats 3)"
    return table(head, rows) + "\n\n" + source(cmd, d["device"], d["commit"], d["date"])


@register("prefill-gpu-chunked")
def prefill_gpu_chunked() -> str:
    """One 8192-token prompt at B = 2048 at two shapes: the per-token walks beside the chunked rule, one run."""
    d = data("prefill_gpu_chunked_2026-12-07")
    names = {"dense": "dense forward", "kvpop": "static rule (one pass)", "h2o": "H2O (walk)", "tova": "TOVA (walk)",
             "cascade": "recommended policy (walk)", "cascade+chunk64": "recommended policy, chunks of 64",
             "cascade+chunk256": "recommended policy, chunks of 256"}
    runs = {k: {r["policy"]: r["wall_all"][-1] for r in run["rows"]} for k, run in d["runs"].items()}
    big, small = runs["8b"], runs["smollm2"]
    rows = [[names[p], f(big[p], 2), f(big[p] / big["dense"], 1) + "×", f(small[p], 3),
             f(small[p] / small["dense"], 1) + "×"] for p in names]
    head = ["8192-token prompt, B = 2048, batch 1, bf16", "Qwen3-8B shape s", "vs dense", "SmolLM2 shape s", "vs dense"]
    cmd = d["command"] + " (" + "; ".join(run["command"] for run in d["runs"].values()) + ")"
    return table(head, rows) + "\n\n" + source(cmd, d["device"], d["commit"], d["date"])


@register("prefill-cpu-h2o-chunked")
def prefill_cpu_h2o_chunked() -> str:
    """H2O's prefill on one CPU thread: its per-token walk against its chunked rule, beside the dense forward."""
    d = data("prefill_cpu_h2o_chunked_2026-12-07")
    names = {"dense": "dense forward", "h2o": "H2O (walk)", "h2o+chunk16": "H2O, deciding every 16 steps",
             "h2o+chunk64": "H2O, deciding every 64 steps"}
    rows = [[names[r["policy"]], f(r["cpu_s"], 1), f(r["cpu_vs_dense"], 2) + "×"] for r in d["rows"]]
    head = ["SmolLM2-135M, 2048 tokens, B = 512, one thread", "CPU s", "vs dense"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("prefill-gpu-chunked-graphs")
def prefill_gpu_chunked_graphs() -> str:
    """The chunked rule's prefill with each whole chunk's round replayed as one captured CUDA graph per layer."""
    d = data("prefill_gpu_chunked_graphs_2026-12-07")
    names = {"dense": "dense forward", "cascade+chunk64": "recommended policy, chunks of 64, captured rounds",
             "cascade+chunk256": "recommended policy, chunks of 256, captured rounds"}
    runs = {k: {r["policy"]: r["wall_all"][-1] for r in run["rows"]} for k, run in d["runs"].items()}
    big, small = runs["8b"], runs["smollm2"]
    rows = [[names[p], f(big[p], 2), f(big[p] / big["dense"], 1) + "×", f(small[p], 3),
             f(small[p] / small["dense"], 1) + "×"] for p in names]
    head = ["8192-token prompt, B = 2048, batch 1, bf16", "Qwen3-8B shape s", "vs dense", "SmolLM2 shape s", "vs dense"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("prefill-gpu-fused-rounds")
def prefill_gpu_fused_rounds() -> str:
    """The chunked rule's prefill with each round as three Triton kernels beside the same rounds in PyTorch, both
    captured, in one run."""
    d = data("prefill_gpu_fused_rounds_2026-12-08")
    names = {("dense", "-"): "dense forward",
             ("cascade+chunk64", "chunks"): "recommended policy, chunks of 64, rounds as Triton kernels",
             ("cascade+chunk64", "chunks-pytorch"): "recommended policy, chunks of 64, rounds in PyTorch",
             ("cascade+chunk256", "chunks"): "recommended policy, chunks of 256, rounds as Triton kernels",
             ("cascade+chunk256", "chunks-pytorch"): "recommended policy, chunks of 256, rounds in PyTorch"}
    runs = {k: {(r["policy"], r["path"]): r["wall_all"][-1] for r in run["rows"]} for k, run in d["runs"].items()}
    big, small = runs["8b"], runs["smollm2"]
    rows = [[names[p], f(big[p], 2), f(big[p] / big["dense", "-"], 1) + "×", f(small[p], 3),
             f(small[p] / small["dense", "-"], 1) + "×"] for p in names]
    head = ["8192-token prompt, B = 2048, batch 1, bf16", "Qwen3-8B shape s", "vs dense", "SmolLM2 shape s", "vs dense"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("prefill-profile-smollm2")
def prefill_profile_smollm2() -> str:
    d = data("prefill_profile_smollm2_2026-12-06")
    dense, kv = d["caches"]["dense"], d["caches"]["kvpop"]
    layers = d["layers"]
    rows = [[name, f(dense[key], digits), f(kv[key], digits), f((kv[key] - dense[key]) / layers, digits + 1)]
            for name, key, digits in (("wall ms", "wall_ms", 1), ("GPU busy ms", "gpu_ms", 1),
                                      ("operators dispatched", "ops", 0), ("kernels", "kernels", 0))]
    return table(["SmolLM2 shape, one 4096-token prefill", "dense", "KVpop", "KVpop - dense, per layer"], rows) + \
        "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("rule-cost")
def rule_cost() -> str:
    d = data("rule_cost_2026-12-06")
    rows = []
    for i, run in enumerate(d["runs"], 1):
        r = run["rows"][0]
        rows.append([str(i), f(r["cutoffs_ms"]), f(r["cutoffs_unfused_ms"]), f(r["block_mask_ms"]),
                     f(r["sparse_fwd_ms"], 2), f"**{f(r['mask_share_of_sparse_fwd'])}**"])
    head = ["run", "cutoffs ms", "cutoffs, unfused ms", "block mask ms", "sparse forward ms",
            "(cutoffs + mask) / sparse forward"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("train-attention")
def train_attention() -> str:
    d = data("train_attention_4b_shape_2026-12-06")
    r = d["rows"][0]
    dense = r["dense_fwd_bwd_ms"]
    ratio = lambda fwd_bwd: f((fwd_bwd + r["target_ms"]) / dense, 2) + "×"  # noqa: E731
    rows = [
        ["dense causal SDPA", f(r["dense_fwd_ms"], 2), f(dense, 2), "1.00×", "–"],
        ["FlexAttention over the sequence (`flex`)", f(r["sparse_fwd_ms"], 2), f(r["sparse_fwd_bwd_ms"], 2),
         ratio(r["sparse_fwd_bwd_ms"]), f(r["sparse_fwd_bwd_extra_gb"], 2)],
        ["**gathered tiles of 512 (`gather`; what `auto` picks here)**", f(r["gather_fwd_ms"], 2),
         f(r["gather_fwd_bwd_ms"], 2), f"**{ratio(r['gather_fwd_bwd_ms'])}**", f(r["gather_fwd_bwd_extra_gb"], 2)],
        ["gathered tiles of 1024", f(r["gather_fwd_ms_b1024"], 2), f(r["gather_fwd_bwd_ms_b1024"], 2),
         ratio(r["gather_fwd_bwd_ms_b1024"]), f(r["gather_fwd_bwd_extra_gb_b1024"], 2)],
        ["the target pass (part of both sparse rows)", f(r["target_ms"], 2), "–", "–", "–"],
    ]
    head = ["Qwen3-4B attention shape, S = 16384, B = 2048", "forward ms", "fwd + bwd ms",
            "(fwd + bwd + target) / dense fwd + bwd", "GiB (fwd + bwd)"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("training-throughput")
def training_throughput() -> str:
    d = data("distill_smollm2_2026-12-06")
    run = d["runs"][-1]
    r = run["rows"][0]
    rows = [["SmolLM2-135M", str(r["seq_len"]), str(r["budget"]),
             "full distillation" if r["full_distillation"] else "scorers only",
             "FlexAttention over the sequence (what `auto` picks here)" if r["attention"] == "flex" else r["attention"],
             f(r["step_s_median"] * 1e3, 0), f"{r['tokens_per_s']:,.0f}", f(r["peak_gb"], 1)]]
    head = ["model", "S", "budget", "training", "attention", "ms per step", "tokens/s", "peak GiB"]
    return table(head, rows, "lrrllrrr") + "\n\n" + source(run["command"], d["device"], run["commit"], d["date"])


@register("distill-auto")
def distill_auto() -> str:
    """A distillation step with the training attention `auto` picks, beside the other one, at two shapes."""
    d = data("distill_auto_2026-12-07")
    names = {"smollm2-135m-shape": "SmolLM2-135M shape, 30 layers", "qwen3-4b-shape": "Qwen3-4B shape, 4 layers"}
    att = {"flex": "FlexAttention over the sequence", "gather": "gathered tiles"}
    rows, steps = [], {}
    for run in d["runs"]:
        r = run["rows"][0]
        chosen = r["attention_auto"] if r["attention"] == "auto" else r["attention"]
        steps.setdefault(r["model"], {})[chosen] = r["step_s_median"]
        label = f"**{att[chosen]} (`auto`)**" if r["attention"] == "auto" else att[chosen]
        rows.append([names[r["model"]], str(r["seq_len"]), str(r["budget"]), label, f(r["step_s_median"] * 1e3, 0),
                     f"{r['tokens_per_s']:,.0f}", f(r["peak_gb"], 1)])
    for row, run in zip(rows, d["runs"], strict=True):
        r = run["rows"][0]
        mine, other = steps[r["model"]], r["attention_auto"]
        row.append(f(mine[r["attention_auto"] if r["attention"] == "auto" else r["attention"]] / mine[other], 3))
    head = ["shape", "S", "budget", "training attention", "ms per step", "tokens/s", "peak GiB", "/ `auto`'s step"]
    cmds = " ; ".join(run["command"] for run in d["runs"][::2]) + " (and --attention gather, flex)"
    return table(head, rows, "lrrlrrrr") + "\n\n" + source(cmds, d["device"], d["commit"], d["date"])


@register("distributed")
def distributed() -> str:
    from statistics import median

    d = data("distributed_smollm2_2026-11-29")

    def rate(tag: str, name: str) -> float:
        return median(x["tokens_per_s"] for x in d["runs"][tag]["logs"][name] if x["step"] >= 2)

    b2 = {k: rate("b", k) for k in ("gpu1_ddp", "gpu2_ddp")}
    b4 = {k: rate("c", k) for k in ("gpu1_ddp_b4", "gpu2_ddp_b4", "gpu2_fsdp_b4")}
    n = lambda x: f"{x:,.0f}"  # noqa: E731
    rows = [
        ["2 (1 sequence per GPU)", n(b2["gpu1_ddp"]), n(b2["gpu2_ddp"]), "–",
         f"{b2['gpu2_ddp'] / b2['gpu1_ddp']:.2f}× / –"],
        ["4 (2 sequences per GPU)", n(b4["gpu1_ddp_b4"]), n(b4["gpu2_ddp_b4"]), n(b4["gpu2_fsdp_b4"]),
         f"{b4['gpu2_ddp_b4'] / b4['gpu1_ddp_b4']:.2f}× / {b4['gpu2_fsdp_b4'] / b4['gpu1_ddp_b4']:.2f}×"],
        ["2 sequences per GPU: 1 GPU at batch 2, 2 GPUs at batch 4", n(b2["gpu1_ddp"]), n(b4["gpu2_ddp_b4"]),
         n(b4["gpu2_fsdp_b4"]),
         f"{b4['gpu2_ddp_b4'] / b2['gpu1_ddp']:.2f}× / {b4['gpu2_fsdp_b4'] / b2['gpu1_ddp']:.2f}×"],
    ]
    head = ["global batch (tokens/s, median)", "1 GPU, DDP", "2 GPUs, DDP", "2 GPUs, FSDP2", "speed-up DDP / FSDP2"]
    command = "torchrun --nproc-per-node {1,2} -m kvpop.cli train --model smollm2-135m --data champ --seq-len 8192 " \
              "--budget 2048 --window 256 --batch-size {2,4} [--fsdp]"
    return table(head, rows) + "\n\n" + source(command, d["device"], d["commit"], d["date"])


@register("cpu-generate")
def cpu_generate() -> str:
    d = data("cpu_generate_2026-12-02")
    dense, kv = (next(r for r in d["rows"] if r["cache"] == c) for c in ("dense", "kvpop"))
    vs = lambda key: f(kv[key], 2) if key in kv else "–"  # noqa: E731
    rows = [
        ["prefill of 2048 tokens, s", f(dense["prefill_s"], 2), f(kv["prefill_s"], 2), vs("prefill_vs_dense")],
        ["`generate`, ms per token with its prefill", f(dense["generate_ms_per_token"], 1),
         f"**{f(kv['generate_ms_per_token'], 1)}**", f"**{vs('generate_vs_dense')}**"],
        ["... its prefill, s", f(dense["generate_prefill_s"], 2), f(kv["generate_prefill_s"], 2), "–"],
        ["... its decode, ms per token", f(dense["decode_ms_per_token"], 1), f(kv["decode_ms_per_token"], 1),
         vs("decode_vs_dense")],
    ]
    head = ["SmolLM2-135M, 2-core CPU, 64 new tokens", "dense (`DynamicCache`)", "KVpop, B = 512",
            "KVpop / dense (paired)"]
    return table(head, rows) + "\n\n" + source(" ; ".join(d["commands"]), d["device"], d["commit"], d["date"])


@register("cpu-generate-recommended")
def cpu_generate_recommended() -> str:
    """`generate` on the CPU after a 2048-token prompt: dense, the static rule, the recommended policy."""
    d = data("cpu_generate_recommended_2026-12-07")
    r = {x["cache"]: x for x in d["rows"]}
    names = {"dense": "dense (`DynamicCache`)", "kvpop": "static rule, B = 512", "cascade": "recommended policy, B = 512"}
    rows = [[names[c], f(r[c]["cpu_ms_per_token"], 1), f(r[c]["cpu_vs_dense"], 2),
             f(r[c]["cpu_prefill_s"], 2), f(r[c]["cpu_decode_ms"], 1)] for c in ("dense", "kvpop", "cascade")]
    head = ["SmolLM2-135M, 2048-token prompt + 64 tokens, one thread", "CPU ms/token (prefill incl.)", "vs dense (paired)",
            "prefill s", "decode ms/token"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("cpu-generate-chunked")
def cpu_generate_chunked() -> str:
    """`generate` on the CPU after a 2048-token prompt: the recommended policy per token and in chunks."""
    d = data("cpu_generate_chunked_2026-12-07")
    r = {x["cache"]: x for x in d["rows"]}
    names = {"dense": "dense (`DynamicCache`)", "kvpop": "static rule", "cascade": "recommended policy",
             "cascade+chunk16": "recommended policy, deciding every 16 steps",
             "cascade+chunk64": "recommended policy, deciding every 64 steps"}
    rows = [[names[c], f(r[c]["cpu_ms_per_token"], 1), f(r[c]["cpu_vs_dense"], 3), f(r[c]["cpu_prefill_s"], 2),
             f(r[c]["cpu_decode_ms"], 1)] for c in names]
    head = ["SmolLM2-135M, 2048-token prompt + 64 tokens, B = 512, one thread", "CPU ms/token (prefill incl.)",
            "vs dense (paired)", "prefill s", "decode ms/token"]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


@register("prefill-cpu")
def prefill_cpu() -> str:
    """The prefill of a 2048-token prompt on the CPU: the static rule, the recommended policy's walk, TOVA's walk."""
    d = data("prefill_cpu_2026-12-07")
    names = {"dense": "dense forward", "kvpop": "static rule (one pass)", "cascade": "recommended policy (walk)",
             "tova": "TOVA (walk)"}
    rows = [[names.get(r["policy"], r["policy"]), f(r["cpu_s"], 1), f"{r['cpu_vs_dense']:.1f}×"] for r in d["rows"]]
    return "\n".join([table(["SmolLM2-135M, 2048 tokens, B = 512, one thread", "CPU s", "vs dense"], rows), "",
                      source(d["command"], d["device"], d["commit"], d["date"])])


@register("prefill-cpu-chunked")
def prefill_cpu_chunked() -> str:
    """The prefill of a 2048-token prompt on the CPU: the per-token walks against the chunked rule's rounds."""
    d = data("prefill_cpu_chunked_2026-12-07")

    def name(policy: str) -> str:
        base, _, c = policy.partition("+chunk")
        rule = {"dense": "dense forward", "cascade": "recommended policy", "tova": "TOVA"}[base]
        return rule if base == "dense" else f"{rule}, deciding every {c} steps" if c else f"{rule} (walk)"

    rows = [[name(r["policy"]), f(r["cpu_s"], 1), f"{r['cpu_vs_dense']:.2f}×"] for r in d["rows"]]
    return "\n".join([table(["SmolLM2-135M, 2048 tokens, B = 512, one thread", "CPU s", "vs dense"], rows), "",
                      source(d["command"], d["device"], d["commit"], d["date"])])


# --- end of speed tables ---


# --- policy tables (docs/policies.md); the indexes of docs/reproducing.md ---


@register("demo-quick")
def demo_quick() -> str:
    """`kvpop demo --quick` in a fresh clone on the 2-core CPU: its teacher-forced table, its verdict and its run
    time."""
    d = data("demo_quick_cpu_2026-12-07")
    rows = []
    for r in sorted(d["rows"], key=lambda r: (-r["budget"], r["kl"])):
        rows.append([f"{r['budget']} (CR {r['cr']:.0%})", r["policy"], f(r["top1_agreement"]), f(r["kl"], 4),
                     f(r["ppl_ratio"])])
    out = [table(["budget", "policy", "top-1 agreement", "KL", "ppl ratio"], rows, "llrrr"), ""]
    out += [f"- {line}" for line in d["verdict"]]
    out += ["", f"The demo ran {d['demo_seconds'] / 60:.1f} minutes (it printed {d['demo_seconds']:.0f} s), the installs "
                "not counted.", "", source(d["command"], d["device"], d["commit"], d["date"])]
    return "\n".join(out)


def data_index() -> str:
    """Every data file behind the docs: what it measures, on which machine, when."""
    rows = []
    for path in sorted(DATA.iterdir()):
        if path.name.startswith("."):
            continue
        what, where, when = "–", "–", "–"
        if path.suffix == ".json":
            d = data(path.stem)
            what = d.get("measures", "–")
            where = card(d["device"]) if "device" in d else "–"
            when = str(d.get("date", "–"))[:10]
        rows.append([f"[`{path.name}`](data/{path.name})", what, where, when])
    return table(["file", "what it measures", "card", "date"], rows, "llll")


def tables_index() -> str:
    """Every registered table: the pages that show it and the provenance line it ends with (command, card, commit,
    date)."""
    shown: dict[str, list[str]] = {}
    for path in documents():
        if path.exists():
            for m in BLOCK.finditer(path.read_text()):
                if m.group(2) == "table":
                    shown.setdefault(m.group(3), []).append(str(path.relative_to(ROOT)))
    rows = []
    for name in sorted(TABLES):
        pages = ", ".join(f"[{p}](../{p})" for p in shown.get(name, [])) or "–"
        rows.append([f"`{name}`", pages, TABLES[name]().rstrip().splitlines()[-1].replace("|", "\\|")])
    return table(["table", "shown in", "command · card · commit · date"], rows, "lll")


@register("pool-choice")
def pool_choice() -> str:
    """The recommended policy's pool on development rows: the GPU's fractions of `budget - 1`, then the CPU's
    rankings of the pool (TOVA's latest attention against H2O's accumulated one)."""
    gpu = data("pool_choice_2026-12-02")
    rows = []
    for r in gpu["rows"]:
        best = min(r["kl_pools"])
        cells = [f"**{f(k, 4)}**" if k == best else f(k, 4) for k in r["kl_pools"]]
        rows.append([f"{r['budget']} (CR {r['cr']:.0%})", f(r["kl_static"], 4), *cells,
                     f"{r['chosen']} ({r['chosen'] / (r['budget'] - 1):.2f})"])
    out = [table(["budget, S = 8192", "static rule", "pool 1/2", "pool 3/4", "pool 7/8", "lowest KL at"], rows),
           "", source(gpu["commands"][0], gpu["device"], gpu["commit"], gpu["date"])]
    cpu = data("pool_choice_cpu_2026-12-07")
    by = {(r["budget"], r["policy"]): r for r in cpu["rows"]}
    rows = []
    for budget in sorted({r["budget"] for r in cpu["rows"]}, reverse=True):
        pool = max(int(p.split("lpool")[1].split("+")[0]) for _, p in by if _ == budget and "lpool" in p)
        name = f"kvpop+lpool{pool}"
        rows.append([f"{budget} (CR {by[(budget, 'tova')]['cr']:.0%})", f(by[(budget, "tova")]["kl"], 4),
                     f(by[(budget, "h2o")]["kl"], 4), f(by[(budget, "kvpop")]["kl"], 4),
                     f(by[(budget, name)]["kl"], 4), f(by[(budget, name + "+d0.9")]["kl"], 4),
                     f(by[(budget, name + "+h2o")]["kl"], 4)])
    out += ["", table(["budget, S = 2048", "TOVA", "H2O", "static rule", "pool 3/4, TOVA's score",
                       "decayed sum (0.9)", "H2O's sum"], rows),
            "", source(" ; ".join(cpu["commands"]), cpu["device"], cpu["commit"], cpu["date"])]
    return "\n".join(out)


@register("pool-choice-passkey")
def pool_choice_passkey() -> str:
    """Passkey retrieval on development prompts at B = 1024: the pool ranked by TOVA's latest attention against the
    pool ranked by accumulated attention."""
    d = data("pool_choice_passkey_2026-12-07")
    lengths = d["config"]["lengths"]
    agg: dict = {}
    for c in d["cells"]:
        cell = agg.setdefault(c["policy"], {}).setdefault(c["length"], [0, 0])
        cell[0] += c["correct"]
        cell[1] += c["n"]
    rows = [[d["names"][p], "–" if p == "dense" else "1024"] + [f"{agg[p][n][0]}/{agg[p][n][1]}" for n in lengths]
            for p in ("dense", "mlp_s0+lpool767", "mlp_s0+lpool767+h2o", "mlp_s0", "tova", "h2o")]
    head = ["policy", "B"] + [f"passkey, {n} tokens" for n in lengths]
    return table(head, rows) + "\n\n" + source(d["command"], d["device"], d["commit"], d["date"])


# --- blocks ---


def cli_help(name: str) -> str:
    """`kvpop NAME --help` as the docs show it (80 columns, whatever the terminal)."""
    sys.path.insert(0, str(ROOT / "src"))
    from kvpop.cli import build_parser

    os.environ["COLUMNS"] = "100"
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if name not in sub.choices:
        raise KeyError(f"docs name `kvpop {name}`, which is not a command ({', '.join(sub.choices)})")
    return "```\n" + sub.choices[name].format_help().rstrip() + "\n```"


def render(kind: str, name: str) -> str:
    if kind == "cli":
        return cli_help(name)
    if kind == "index":
        indexes = {"data": data_index, "tables": tables_index}
        if name not in indexes:
            raise KeyError(f"no index named {name!r} in docs/tables.py (known: {', '.join(indexes)})")
        return indexes[name]()
    if name not in TABLES:
        raise KeyError(f"no table named {name!r} in docs/tables.py (known: {', '.join(sorted(TABLES))})")
    return TABLES[name]()


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def update(path: Path) -> tuple[str, list[str]]:
    """The text of `path` with every block rendered, and the names of the blocks that changed."""
    text = path.read_text()
    changed = []

    def sub(m: re.Match) -> str:
        body = render(m.group(2), m.group(3)).rstrip("\n") + "\n"
        if body != m.group(4):
            changed.append(f"{m.group(2)}: {m.group(3)}")
        return m.group(1) + body + m.group(5)

    return BLOCK.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    stale = []
    for path in documents():
        if not path.exists():
            continue
        text, changed = update(path)
        if changed and args.check:
            stale += [f"{path.relative_to(ROOT)}: {c}" for c in changed]
        elif changed:
            path.write_text(text)
            print(f"{path.relative_to(ROOT)}: {', '.join(changed)}")
    if stale:
        print("blocks that differ from the data (run python docs/tables.py):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
