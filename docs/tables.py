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
    d = data("decode_8b_shape_2026-12-06")
    current = [r for r in d["runs"] if r["commit"] == "d0f5144"]
    dense_run = next(r for r in d["runs"] if r["commit"] != "d0f5144")
    floor = d["floor_ms"]
    dense = {4096: _compiled(current[0], "dense", 4096), 131072: _compiled(dense_run, "dense", 131072)}
    kv4 = [r for r in (_compiled(run, "kvpop", 4096) for run in current) if r]
    kv128 = [r for r in (_compiled(run, "kvpop", 131072) for run in current) if r]
    gb = lambda rows: _span([r["peak_mb"] / 1024 for r in rows])  # noqa: E731
    rows = [
        ["dense, HF `StaticCache` + `torch.compile`", "4k", f(dense[4096]["ms_per_token"], 2), "1.00", "–",
         gb([dense[4096]]), f(dense[4096]["compile_s"], 0)],
        [f"dense, the same (commit {dense_run['commit']})", "128k", f(dense[131072]["ms_per_token"], 2), "1.00", "–",
         gb([dense[131072]]), f(dense[131072]["compile_s"], 0)],
        ["**KVpop, B = 2048**", "4k", f"**{_span([r['ms_per_token'] for r in kv4])}**",
         _span([r["ms_per_token"] / dense[4096]["ms_per_token"] for r in kv4]),
         _span([r["ms_per_token"] / floor for r in kv4]), gb(kv4),
         " / ".join(f(r["compile_s"], 0) for r in kv4) + " (cold / inductor's cache)"],
        ["**KVpop, B = 2048**", "128k", f"**{_span([r['ms_per_token'] for r in kv128])}**",
         _span([r["ms_per_token"] / dense[131072]["ms_per_token"] for r in kv128]),
         _span([r["ms_per_token"] / floor for r in kv128]), gb(kv128), "0 (the same graph)"],
    ]
    head = ["Qwen3-8B shape, 36 layers, batch 1", "context", "ms per token", "vs dense", f"vs floor ({floor} ms)",
            "peak GiB", "compile s"]
    return table(head, rows, "llrrrrl") + "\n\n" + source(
        dense_run["command"], d["device"], f"d0f5144 (dense at 128k: {dense_run['commit']})", d["date"])


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


@register("prefill-8b-dynamic")
def prefill_8b_dynamic() -> str:
    d = data("prefill_8b_shape_2026-12-01")
    names = {"dense": "dense forward", "kvpop": "KVpop (the rule, one pass)", "h2o": "H2O (Triton walk)",
             "tova": "TOVA (parallel walk)"}
    warm = {r["policy"]: r["wall_all"][-1] for r in d["rows"]}
    ratio = {p: warm[p] / warm["dense"] for p in warm}
    rows = [[names[p], f(warm[p], 2), f(ratio[p], 2 if ratio[p] < 2 else 1) + "×"]
            for p in ("dense", "kvpop", "h2o", "tova")]
    return table(["Qwen3-8B shape, 36 layers, 8192-token prompt, B = 2048", "s (warm)", "vs dense"], rows) + \
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


# --- end of speed tables ---


# --- policy tables (docs/policies.md); the indexes of docs/reproducing.md ---


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
