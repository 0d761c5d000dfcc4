"""`bench/domain_eval.py` on CPU: one `kvpop eval` per source, the held-out source read whole, one table."""

import importlib.util
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("domain_eval", ROOT / "bench" / "domain_eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_one_eval_per_source_in_one_table(tmp_path, capsys):
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house".split()
    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(80))}) + "\n"
                             for _ in range(20)))
    script = _script()
    out = tmp_path / "domains"
    rc = script.run(script.parse(["--model", "tiny-random-qwen3", "--sources", f"{notes},pydoc", "--policies",
                                  "tova,streaming_llm", "--budgets", "32", "--seq-len", "64", "--sequences", "1",
                                  "--out", str(out)]))
    assert rc == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == f"| B | policy | {notes} KL | {notes} top-1 | pydoc KL | pydoc top-1 |"
    assert [line.split(" | ")[1] for line in printed[2:4]] == ["tova", "streaming_llm"]
    summary = json.loads(printed[-1])
    assert summary["sources"] == [str(notes), "pydoc"] and summary["failed"] == []
    # no training run reads pydoc, so all of it is out of domain; the other sources give their held-out split
    assert json.loads((out / "pydoc" / "results.json").read_text())["args"]["split"] == "all"
    assert json.loads((out / str(notes).replace("/", "_").strip("_") / "results.json").read_text())["args"][
        "split"] == "eval"
