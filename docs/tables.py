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
