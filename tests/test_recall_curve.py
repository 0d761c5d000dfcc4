"""`bench/recall_curve.py`: held-out recall at every kept checkpoint of a scorer-only run and the distillation
started from it, drawn as one line; the numbers are `kvpop eval`'s recall."""

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import pytest

import kvpop
from kvpop.eval.evaluate import Evaluator, from_directory, held_out_rows
from kvpop.models import load_model
from kvpop.train import distill
from kvpop.train.distill import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
KCFG = dict(sink=2, window=8, topk=16, scorer="mlstm", mlstm_dim=8)


def _curve():
    spec = importlib.util.spec_from_file_location("recall_curve", ROOT / "bench" / "recall_curve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """4 scorer-only steps keeping every 2nd checkpoint, then 2 steps of full distillation from them."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    root = tmp_path_factory.mktemp("curve")
    # records, not one text: a .txt is cut into few large blocks and its held-out split can be empty
    data = root / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                            for _ in range(40)))
    common = dict(model="tiny-random-qwen3", data=str(data), seq_len=128, batch_size=2, save_every=0,
                  lr_scorer=1e-2, max_tokens=128 * 16)
    pre, post = root / "pre", root / "post"
    distill.train(TrainConfig(**common, steps=4, keep_every=2, freeze_base=True, out=str(pre)),
                  kvpop.KVpopConfig(**KCFG), progress=False)
    distill.train(TrainConfig(**common, steps=2, keep_every=1, out=str(post)), None, init_from=pre, progress=False)
    return data, pre, post


@pytest.mark.slow
def test_the_curve_follows_the_pretraining_into_the_distillation(runs, tmp_path, capsys):
    data, pre, post = runs
    curve = _curve()
    out = tmp_path / "curve"
    assert curve.main([str(post), "--sequences", "2", "--out", str(out)]) == 0
    result = json.loads((out / "recall_curve.json").read_text())
    (line,) = result["curves"]
    # the source's checkpoints (found where the run recorded it), then the run's, counted on from step 4
    assert [s for s, _ in line["points"]] == [2, 4, 5, 6] and line["starts"] == [4]
    assert line["name"] == "post" and line["freeze_base"] == [True, False] and line["budget"] == 26
    assert result["settings"]["seq_len"] == 128 and result["settings"]["data"] == str(data)
    assert all(0 <= r <= 1 for _, r in line["points"])
    assert (out / "recall_curve.png").stat().st_size > 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["curves"][0]["points"] == line["points"]

    # the last point is kvpop eval's recall of the final model on the same held-out rows
    base, tokenizer = load_model("tiny-random-qwen3")
    evaluator = Evaluator(base, [from_directory(str(post / "final"), rule="static")])
    for row in held_out_rows(str(data), tokenizer, 128, 2):
        evaluator.add(row[None])
    assert line["points"][-1][1] == pytest.approx(evaluator.rows(128)[0]["recall"], rel=1e-9)

    # the same command again measures nothing: the points are kept
    assert curve.main([str(post), "--sequences", "2", "--out", str(out)]) == 0
    assert " step " not in capsys.readouterr().out.split("\n\n")[0]
    assert json.loads((out / "recall_curve.json").read_text())["points"] == result["points"]

    # moved off the machine: the source is found among the runs given, by name
    moved = tmp_path / "moved"
    for run in (pre, post):
        shutil.copytree(run, moved / run.name)
    shutil.move(pre, tmp_path / "gone")
    try:
        assert curve.main([str(moved / "post"), str(moved / "pre"), "--sequences", "2", "--out",
                           str(tmp_path / "again")]) == 0
    finally:
        shutil.move(tmp_path / "gone", pre)
    again = json.loads((tmp_path / "again" / "recall_curve.json").read_text())["curves"]
    assert [c["points"] for c in again] == [line["points"]]
