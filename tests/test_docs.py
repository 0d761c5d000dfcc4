"""The docs against their sources: generated blocks equal what the data gives, and the tree speaks of the product only."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT = {".py", ".md", ".sh", ".toml", ".json", ".txt", ".cfg", ".yml", ".yaml", ".ini", ""}
SKIP_DIRS = {".git", "runs", "build", "dist", "__pycache__", "node_modules", ".pytest_cache", ".ruff_cache"}

# how the project was made is not the product: numbered work periods, ticket numbers, machine bookings
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+")
NARRATION = re.compile(
    r"\bsess" r"ions?\b|\biss" r"ues? #?[0-9]+|\btick" r"ets? #?[0-9]+|\bcall [0-9]+\b|\blea" r"ses?\b|"
    r"device ti" r"me|\b(" + ORDINALS + r") (work )?per" r"iod",
    re.I,
)
# words that contain a match but are the product's own vocabulary
ALLOWED = re.compile(r"scope=.sess" r"ion|start_new_sess" r"ion|sess" r"ion-scoped|sess" r"ion fixture", re.I)
NAMED_PERIOD = re.compile(r"_s[0-9]{1,2}(?=[._])")


def _tables():
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "docs" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files():
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.startswith((".stage", ".whl", ".venv", "venv")) or part.endswith(".egg-info")
               for part in rel.parts):
            continue
        if path.is_file():
            yield path, rel


def test_generated_blocks_match_the_data():
    tables = _tables()
    stale = []
    for path in tables.documents():
        if path.exists():
            _, changed = tables.update(path)
            stale += [f"{path.relative_to(ROOT)}: {c}" for c in changed]
    assert not stale, "blocks differ from what the data gives (run python docs/tables.py):\n" + "\n".join(stale)


def test_every_table_names_its_source():
    tables = _tables()
    for name, make in tables.TABLES.items():
        last = make().rstrip().splitlines()[-1]
        assert last.startswith("*`") and "commit" in last and re.search(r"\d{4}-\d{2}-\d{2}", last), (
            f"table {name!r} must end with its command, card, commit and date; ends with {last!r}")


def test_the_tree_speaks_of_the_product_only():
    found = []
    for path, rel in _files():
        if NAMED_PERIOD.search(rel.name):
            found.append(f"{rel}: a file named by a work period")
        if path.suffix not in TEXT or path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            m = NARRATION.search(ALLOWED.sub("", line))
            if m:
                found.append(f"{rel}:{i}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not found, "name results by what they measure, their card and date:\n" + "\n".join(found[:60]) + (
        f"\n... and {len(found) - 60} more" if len(found) > 60 else "")


@pytest.mark.parametrize("page", ["method", "policies", "quality", "speed", "training", "cli", "design",
                                  "reproducing", "security"])
def test_the_readme_links_every_topic_page(page):
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / f"{page}.md").exists(), f"docs/{page}.md is missing"
    assert f"docs/{page}.md" in readme, f"README.md does not link docs/{page}.md"


def test_readme_is_a_screen_or_two():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; keep it near 150 and move detail to docs/"
