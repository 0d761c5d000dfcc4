"""`bench/quality_study.py` end to end on CPU: ten tiny training runs in parallel, every row evaluated, the outputs written."""

import importlib.util
import json
import math
import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _study():
    spec = importlib.util.spec_from_file_location("quality_study", ROOT / "bench" / "quality_study.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    # records, not one text file: a .txt is cut into few large blocks and its held-out split can be empty
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    path = tmp_path_factory.mktemp("data") / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                            for _ in range(40)))
    return path


@pytest.mark.slow
def test_the_study_trains_and_evaluates_every_row(data_file, tmp_path, capsys):
    study = _study()
    out = tmp_path / "study"
    args = ["--phase", "all", "--out", str(out), "--model", "tiny-random-qwen3", "--data", str(data_file),
            "--seq-len", "128", "--budgets", "48,32", "--window", "16", "--steps", "2", "--concurrency", "2",
            "--eval-sequences", "3", "--dynamic-batch", "2", "--deadline-s", "600", "--min-start-s", "0",
            "--report-s", "5"]
    assert study.main(args) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["missing"] == []
    rows = {(r["policy"], r["budget"]): r for r in result["rows"]}
    opt_in = set(study.TRAINED) - set(study.DEFAULT_TRAINED)
    assert set(rows) == {(p, b) for p in study.ROW_ORDER if p not in opt_in for b in (48, 32)}
    for (policy, _), r in rows.items():
        # TOVA and H2O take the sequences two at a time (a pass of 2, then of 1): all 3 counted
        assert r["sequences"] == 3
        for column in ("top1_agreement", "kl", "ppl_ratio"):
            assert math.isfinite(r[column]), (policy, column, r[column])
        # a random model's teacher may get no next token right: then the ratio is undefined (null)
        assert r["rel_accuracy"] is None or math.isfinite(r["rel_accuracy"])
        if policy in study.LEARNED or policy == "oracle":
            assert 0 <= r["recall"] <= 1 and len(r["recall_per_layer"]) == 2
        if policy not in study.TRAINING_FREE and policy != "dense":
            assert r["weights"] == "final" and r["steps_done"] == 2
    assert set(result["train"]) == {f"{row}_b{b}" for row in ("streaming_llm_plus", "dms", "kvpop-mlp", "kvpop-mlstm",
                                                              "kvpop-mlstm-delay0") for b in (48, 32)}
    assert all(t["final"] and t["status"] == "final" for t in result["train"].values())
    for name in ("table.md", "eviction_pattern.png", "recall_per_layer.png"):
        assert (out / name).stat().st_size > 0
    assert "## B = 32 (CR 75%)" in (out / "table.md").read_text()
    last = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('{"rows"')]
    assert json.loads(last[-1])["missing"] == []

    # a second command skips the finished runs
    assert study.main([*args, "--phase", "train"]) == 0
    assert "skip kvpop-mlp_b48" in capsys.readouterr().out


def test_frozen_base_plan_trains_scorers_only_and_drops_streaming_llm_plus(tmp_path):
    study = _study()
    parser_args = ["--out", str(tmp_path), "--budgets", "2048,1024", "--freeze-base",
                   "--rows", "streaming_llm_plus,kvpop-mlp,dms"]
    runs = study.plan_runs(study.parse(parser_args))
    assert [r.name for r in runs] == ["kvpop-mlp_b2048", "dms_b2048", "kvpop-mlp_b1024", "dms_b1024"]
    assert all("--freeze-base" in r.args for r in runs), [r.args for r in runs]
    with pytest.raises(SystemExit, match="unknown"):
        study.plan_runs(study.parse(["--out", str(tmp_path), "--rows", "bogus"]))


def test_runs_are_spread_over_the_visible_gpus(monkeypatch):
    study = _study()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 1")
    assert study.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert study.visible_gpus() == []


def test_mps_falls_back_when_its_probe_fails(tmp_path, monkeypatch):
    # a stand-in nvidia-cuda-mps-control that logs its calls: the daemon "starts", but the CUDA probe
    # through it cannot succeed here (no GPU), so the study must stop the daemon and time-slice instead
    study = _study()
    calls = tmp_path / "calls.txt"
    exe = tmp_path / "bin" / "nvidia-cuda-mps-control"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\necho \"args=$* stdin=$(cat)\" >> {calls}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(study.sys, "executable", sys.executable)
    assert study.start_mps(tmp_path / "out") is None
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("args=-d") and lines[-1] == "args= stdin=quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_mps_missing_is_not_an_error(tmp_path, monkeypatch):
    study = _study()
    monkeypatch.setenv("PATH", str(tmp_path))
    assert study.start_mps(tmp_path / "out") is None


def test_table_shows_the_dms_cache_share_and_the_stronger_variant():
    study = _study()
    rows = [{"policy": p, "budget": 64, "rel_accuracy": 1.0, "top1_agreement": 0.9, "kl": kl, "ppl_ratio": 1.1,
             "sequences": 2} for p, kl in (("tova", 0.2), ("tova_windowed", 0.1), ("h2o", 0.3), ("h2o_windowed", 0.4))]
    rows.append({"policy": "dms", "budget": 64, "rel_accuracy": 0.9, "top1_agreement": 0.8, "kl": 0.5,
                 "ppl_ratio": 1.2, "avg_cache_fraction": 0.5625, "trained": "x", "sequences": 2})
    from kvpop.eval.evaluate import mark_stronger_variants

    mark_stronger_variants(rows)
    result = {"model": "m", "seq_len": 256, "sink": 4, "window": 16, "date": "d", "device": "cpu", "torch": "t",
              "transformers": "t", "eval": {"sequences": 2}, "data": "champ", "steps": 1, "budgets": [64],
              "rows": study.sort_rows(rows), "missing": []}
    table = study.table_md(result)
    assert "| dms | 0.900 | 0.800 | 0.5000 | 1.200 | - | 0.562 |" in table
    assert "| tova_windowed * |" in table and "| h2o * |" in table and "| tova |" in table
    assert [r["policy"] for r in result["rows"]] == ["tova", "tova_windowed", "h2o", "h2o_windowed", "dms"]


def test_seeds_and_extension_rows_plan_one_run_each(tmp_path):
    # --seeds trains every row once per seed; the first keeps the earlier name (its runs resume), the others
    # are labelled row/sN in the table; the evidence rows are opt-in (--rows) with their own flags
    study = _study()
    args = study.parse(["--rows", "kvpop-evidence,kvpop-evidence-prerope", "--seeds", "3,5", "--budgets", "2048",
                        "--out", str(tmp_path)])
    runs = study.plan_runs(args)
    assert [(r.name, r.label) for r in runs] == [
        ("kvpop-evidence_b2048", "kvpop-evidence"), ("kvpop-evidence_s5_b2048", "kvpop-evidence/s5"),
        ("kvpop-evidence-prerope_b2048", "kvpop-evidence-prerope"),
        ("kvpop-evidence-prerope_s5_b2048", "kvpop-evidence-prerope/s5")]
    seeds = [r.args[r.args.index("--seed") + 1] for r in runs]
    assert seeds == ["3", "5", "3", "5"]
    assert "--scorer-keys" in runs[2].args and "--scorer-keys" not in runs[0].args
    assert all(r.args[r.args.index("--scorer") + 1] == "evidence" for r in runs)
    assert [r.row for r in study.plan_runs(study.parse(["--out", str(tmp_path)]))][:5] == list(study.DEFAULT_TRAINED)
    rows = [{"budget": 2048, "trained": "d", "policy": name, "rel_accuracy": acc, "top1_agreement": 0.9, "kl": kl,
             "ppl_ratio": 1.0, "recall": None} for name, acc, kl in
            (("kvpop-evidence", 0.90, 0.10), ("kvpop-evidence/s5", 0.94, 0.20), ("tova", 0.99, 0.01))]
    (line,) = study.seed_lines(rows, 2048)
    assert line.startswith("| kvpop-evidence: mean ± sd of 2 seeds | 0.920 ± 0.028 | 0.900 ± 0.000 | 0.1500 ± 0.0707")


def test_row_modifiers_set_window_frozen_base_and_prerope_per_row(tmp_path):
    # an ablation in one command: the same row with its own window, a frozen base, pre-RoPE keys
    study = _study()
    args = study.parse(["--rows", "kvpop-mlp,kvpop-mlp+w32+frozen,kvpop-evidence+prerope,streaming_llm_plus+frozen",
                        "--budgets", "1024", "--window", "256", "--out", str(tmp_path)])
    runs = study.plan_runs(args)
    assert [(r.name, r.row, r.label) for r in runs] == [
        ("kvpop-mlp_b1024", "kvpop-mlp", "kvpop-mlp"),
        ("kvpop-mlp+w32+frozen_b1024", "kvpop-mlp", "kvpop-mlp+w32+frozen"),
        ("kvpop-evidence+prerope_b1024", "kvpop-evidence", "kvpop-evidence+prerope")]

    def flag(run, name):
        return run.args[run.args.index(name) + 1] if name in run.args else None

    assert [flag(r, "--window") for r in runs] == ["256", "32", "256"]
    assert ["--freeze-base" in r.args for r in runs] == [False, True, False]
    assert [flag(r, "--scorer-keys") for r in runs] == [None, None, "pre_rope"]
    assert study.base_row("kvpop-mlp+w32+frozen/s1") == "kvpop-mlp"
    # +bN: that budget only (the label drops it: the budget is a column already)
    two = study.parse(["--rows", "kvpop-mlp+frozen,kvpop-mlp+w64+b1024", "--budgets", "2048,1024", "--out",
                       str(tmp_path)])
    assert [(r.name, r.label) for r in study.plan_runs(two)] == [
        ("kvpop-mlp+frozen_b2048", "kvpop-mlp+frozen"), ("kvpop-mlp+frozen_b1024", "kvpop-mlp+frozen"),
        ("kvpop-mlp+w64_b1024", "kvpop-mlp+w64")]
    # +stepsN and +mix: a run's own length and training data
    own = study.plan_runs(study.parse(["--rows", "kvpop-mlstm+steps600,kvpop-mlp+mix", "--budgets", "1024",
                                       "--steps", "120", "--mix", "champ,pystdlib", "--out", str(tmp_path)]))
    assert [(r.steps, flag(r, "--steps"), flag(r, "--data")) for r in own] == [
        (600, "600", "champ"), (120, "120", "champ,pystdlib")]
    with pytest.raises(SystemExit, match="--mix"):
        study.plan_runs(study.parse(["--rows", "kvpop-mlp+mix", "--out", str(tmp_path)]))
    # +mixN: the N-th --mix, so one study compares training data (e.g. with and without self-generated text)
    two_mixes = study.plan_runs(study.parse(["--rows", "kvpop-mlp+mix,kvpop-mlp+mix2", "--budgets", "1024",
                                             "--mix", "champ,pystdlib", "--mix", "champ,gen.jsonl",
                                             "--out", str(tmp_path)]))
    assert [(r.name, flag(r, "--data")) for r in two_mixes] == [
        ("kvpop-mlp+mix_b1024", "champ,pystdlib"), ("kvpop-mlp+mix2_b1024", "champ,gen.jsonl")]
    with pytest.raises(SystemExit, match="number 3, but 2 --mix given"):
        study.plan_runs(study.parse(["--rows", "kvpop-mlp+mix3", "--mix", "a", "--mix", "b", "--out", str(tmp_path)]))
    with pytest.raises(SystemExit, match="not among --budgets"):
        study.plan_runs(study.parse(["--rows", "kvpop-mlp+b512", "--budgets", "1024", "--out", str(tmp_path)]))
    for bad, why in (("kvpop-mlp+w0", "modifier 'w0'"), ("kvpop-mlp+fast", "modifier 'fast'"),
                     ("dms+prerope", "prerope only"), ("streaming_llm_plus+w8", "drop \\+w")):
        with pytest.raises(SystemExit, match=why):
            study.plan_runs(study.parse(["--rows", bad, "--out", str(tmp_path)]))


def test_free_rows_choose_the_training_free_rows(tmp_path):
    study = _study()
    assert study.parse(["--out", str(tmp_path)]).free_rows == list(study.TRAINING_FREE)
    assert study.parse(["--out", str(tmp_path), "--free-rows", "tova,oracle"]).free_rows == ["tova", "oracle"]
    with pytest.raises(SystemExit):
        study.parse(["--out", str(tmp_path), "--free-rows", "tova,bogus"])


def test_two_phase_rows_pretrain_the_scorers_then_distill_from_their_weights(tmp_path):
    from kvpop.train import checkpoint as ckpt

    study = _study()
    args = study.parse(["--out", str(tmp_path), "--budgets", "2048", "--rows", "kvpop-mlp,kvpop-mlstm,dms",
                        "--pretrain-steps", "600", "--pretrain-rows", "kvpop-mlstm", "--steps", "120",
                        "--keep-every", "100"])
    runs = study.plan_runs(args)
    assert [r.name for r in runs] == ["kvpop-mlp_b2048", "kvpop-mlstm_b2048_pre600", "kvpop-mlstm_b2048_pre600_distill",
                                      "dms_b2048"]
    pre, post = runs[1], runs[2]
    assert pre.pretrain and not post.pretrain and post.after is pre and (pre.label, post.label) == ("kvpop-mlstm",) * 2
    assert "--freeze-base" in pre.args and "--freeze-base" not in post.args
    assert (pre.steps, post.steps) == (600, 120) and pre.args[pre.args.index("--steps") + 1] == "600"
    assert all(r.args[r.args.index("--keep-every") + 1] == "100" for r in runs)
    # the distillation waits for the pre-training, starts from its weights, and resumes without them
    assert not post.ready()
    assert post.command()[-2:] == ["--init-from", str(pre.out)]
    (pre.out / "final").mkdir(parents=True)
    (pre.out / "final" / "kvpop_config.json").write_text("{}")
    assert post.ready()
    post.out.mkdir(parents=True)
    (post.out / ckpt.LOG).write_text('{"step": 1}\n')
    assert post.command()[-3:] == ["--init-from", str(pre.out), "--overwrite"]  # stopped before its first checkpoint
    ckpt.write(post.out, 2, {"model": {"model": {}}}, {})
    assert post.command()[-1] == "--resume" and "--init-from" not in post.command()
    # the default: every KVpop scorer row in two phases; not with a frozen base, not for a row without a scorer
    default = study.plan_runs(study.parse(["--out", str(tmp_path), "--pretrain-steps", "10", "--budgets", "2048"]))
    assert [r.row for r in default if r.pretrain] == ["kvpop-mlp", "kvpop-mlstm", "kvpop-mlstm-delay0"]
    for bad, message in ((["--pretrain-rows", "dms"], "not KVpop scorer rows"), (["--freeze-base"], "already")):
        with pytest.raises(SystemExit, match=message):
            study.plan_runs(study.parse(["--out", str(tmp_path), "--pretrain-steps", "10", *bad]))
    row = {"policy": "kvpop-mlstm", "budget": 2048, "rel_accuracy": 1.0, "top1_agreement": 0.9, "kl": 0.1,
           "ppl_ratio": 1.1, "trained": "x", "weights": "final", "steps_done": 120, "pretrain_steps": 600, "sequences": 2}
    result = {"model": "m", "seq_len": 8192, "sink": 4, "window": 256, "date": "d", "device": "cpu", "torch": "t",
              "transformers": "t", "eval": {"sequences": 2}, "data": "champ", "steps": 120, "budgets": [2048],
              "rows": [row], "missing": []}
    assert "| 600+120 | 2 |" in study.table_md(result)


@pytest.mark.slow
def test_a_two_phase_row_trains_both_phases_in_order(data_file, tmp_path, capsys):
    study = _study()
    out = tmp_path / "study"
    args = ["--phase", "train", "--out", str(out), "--model", "tiny-random-qwen3", "--data", str(data_file),
            "--seq-len", "128", "--budgets", "48", "--window", "16", "--steps", "2", "--concurrency", "2",
            "--rows", "kvpop-mlp", "--pretrain-steps", "2", "--keep-every", "1", "--deadline-s", "600",
            "--min-start-s", "0", "--report-s", "5"]
    assert study.main(args) == 0
    pre, post = out / "runs" / "kvpop-mlp_b48_pre2", out / "runs" / "kvpop-mlp_b48_pre2_distill"
    assert (pre / "final").is_dir() and (post / "final").is_dir()
    assert json.loads((pre / "config.json").read_text())["train"]["freeze_base"] is True
    init = json.loads((post / "config.json").read_text())["init"]
    assert init["run"] == str(pre.resolve()) and init["step"] == 2
    from kvpop.train.checkpoint import checkpoints

    assert [c.step for c in checkpoints(pre)] == [1, 2] and [c.step for c in checkpoints(post)] == [1, 2]
    logged = capsys.readouterr().out
    # the distillation started only once the pre-training was final
    assert logged.index("end kvpop-mlp_b48_pre2: final") < logged.index("start kvpop-mlp_b48_pre2_distill")

    # a row is evaluated from a checkpoint when its run has no final weights: a scorer-only one holds no base
    from safetensors.torch import save_file

    from kvpop.eval.evaluate import held_out_rows
    from kvpop.models import load_model

    _, tokenizer = load_model("tiny-random-qwen3")
    save_file({"tokens": held_out_rows(str(data_file), tokenizer, 128, 1)}, str(tmp_path / "tokens.safetensors"))
    spec = {"group": "static_b48", "entries": [{"name": "kvpop-mlp", "budget": 48,
                                                "trained": str(checkpoints(pre)[-1].path)}],
            "plot": False, "batch": 1, "model": "tiny-random-qwen3", "seq_len": 128, "sink": 4, "window": 16,
            "tokens": str(tmp_path / "tokens.safetensors"), "out": str(tmp_path / "rows.json"),
            "plot_path": str(tmp_path / "plot.png"), "deadline": 1e12, "seed": 0}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert study.worker(str(tmp_path / "spec.json")) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["failed"] == [] and rows["rows"][0]["sequences"] == 1 and 0 <= rows["rows"][0]["recall"] <= 1
