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

the `kvpop SUBCOMMAND --help` text, so that docs/cli.md and the help cannot disagree.
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
BLOCK = re.compile(r"(<!-- (table|cli): ([\w.-]+) -->\n)(.*?)(<!-- /\2 -->)", re.S)


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
