"""`kvpop demo`: the learned row is the recommended policy, beside the static rule of the same weights and the
shipped weights where the package has them; under the table, per budget, whether it beats the training-free rows."""

import json
import sys
import types

import pytest
import torch

import kvpop
from kvpop.eval import demo
from kvpop.models import load_model


def _row(policy, budget, kl, top1):
    return {"policy": policy, "budget": budget, "kl": kl, "top1_agreement": top1}


def test_verdict_says_where_the_learned_row_wins_and_where_not():
    rows = [_row("kvpop", 512, 0.030, 0.960), _row("streaming_llm", 512, 0.060, 0.950), _row("tova", 512, 0.050, 0.955),
            _row("h2o", 512, 0.040, 0.965), _row("oracle", 512, 0.001, 0.999), _row("kvpop-static", 512, 0.02, 0.99),
            _row("kvpop", 256, 0.200, 0.872), _row("streaming_llm", 256, 0.25, 0.892), _row("tova", 256, 0.21, 0.896),
            _row("h2o", 256, 0.152, 0.916)]
    win, loss = demo.verdict(rows, (512, 256), reason="a reason")
    # B = 512: the lowest KL of the training-free rows (the oracle and the other learned rows are not rivals), top-1
    # 0.005 below H2O's: within 0.01
    assert win.startswith("B = 512: kvpop KL 0.0300, top-1 0.960: below every training-free row's KL (best h2o 0.0400)")
    assert "top-1 within 0.01 of the best (h2o 0.965)" in win
    assert loss == ("B = 256: kvpop KL 0.2000, top-1 0.872: KL not below h2o's 0.1520; top-1 more than 0.01 below "
                    "h2o's 0.916. a reason")
    # a top-1 exactly 0.01 below the best is within; a KL level with the best is not below it
    edge = [_row("kvpop", 8, 0.1, 0.90), _row("tova", 8, 0.1, 0.91)]
    assert demo.verdict(edge, (8,)) == ["B = 8: kvpop KL 0.1000, top-1 0.900: KL not below tova's 0.1000"]
    assert demo.verdict(rows, (128,)) == []  # no row at that budget


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    """A fake `kvpop.pretrained` whose `shipped` returns a KVpop-mlp directory trained for the static rule at B = 48."""
    path = tmp_path / "shipped"
    model, tok = load_model("tiny-random-qwen3")
    torch.manual_seed(3)
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(48, scorer_hidden=16)), path, tokenizer=tok)
    asked = []
    module = types.ModuleType("kvpop.pretrained")

    def shipped(preset):
        asked.append(preset)
        return path if preset == "tiny-random-qwen3" else None

    module.shipped = shipped
    monkeypatch.setitem(sys.modules, "kvpop.pretrained", module)
    return path, asked


def test_shipped_entries(shipped_dir, monkeypatch):
    path, asked = shipped_dir
    entries = demo.shipped_entries("tiny-random-qwen3", (64, 32))
    assert asked == ["tiny-random-qwen3"]
    assert [(e.name, e.budget, e.trained) for e in entries] == [("kvpop-shipped", 64, str(path)),
                                                                ("kvpop-shipped", 32, str(path))]
    # the recommended policy at each budget: the layer-wide cascade, pool 3/4 of budget - 1, the saved scorer
    for e in entries:
        assert (e.cfg.sink, e.cfg.window, e.cfg.topk, e.cfg.tova_pool) == (0, 1, e.budget - 1, 3 * (e.budget - 1) // 4)
        assert e.cfg.scorer_hidden == 16 and e.cfg.tova_head_average
    assert demo.shipped_entries("smollm2-135m", (64,)) == []  # none ship for it
    monkeypatch.setitem(sys.modules, "kvpop.pretrained", types.ModuleType("kvpop.pretrained"))
    assert demo.shipped_entries("tiny-random-qwen3", (64,)) == []  # a package without the function


def test_demo_on_a_hybrid_model(tmp_path, monkeypatch, capsys):
    """The whole job on a sliding-window hybrid (Gemma 3's layout, random weights): every row at both budgets, the
    tasks and the generation rows, each bounded row within its budget in the full-attention layers."""
    small = demo.DemoPlan(seq_len=256, budgets=(64, 32), train_steps=2, eval_sequences=1, sample_tokens=8,
                          bench_contexts=(64, 128), suite_lengths=(700,), suite_depths=(0.0,), suite_samples=1,
                          task_budgets=(32,), fidelity_tokens=48, fidelity_problems=1,
                          baselines=("streaming_llm", "tova", "h2o", "oracle"))
    monkeypatch.setattr(demo.DemoPlan, "for_machine", classmethod(lambda cls, quick, cuda: small))
    result = demo.run_demo(tmp_path / "demo", quick=True, model_name="tiny-random-gemma3")
    assert {(r["policy"], r["budget"]) for r in result["rows"]} == {
        (p, b) for p in ("kvpop", "kvpop-static", "streaming_llm", "tova", "h2o", "oracle") for b in (64, 32)}
    assert all(torch.isfinite(torch.tensor(r["kl"])) for r in result["rows"])
    records = result["tasks"]["records"]
    assert {(r["policy"].split("[")[0], r["budget"]) for r in records} == {
        ("dense", None), ("kvpop", 32), ("streaming_llm", 32), ("tova", 32), ("h2o", 32)}
    assert {(r["policy"], r["budget"]) for r in result["fidelity"]} == {
        ("dense", 32), ("kvpop", 32), ("streaming_llm", 32), ("tova", 32), ("h2o", 32)}


def test_demo_end_to_end_with_a_small_plan(tmp_path, monkeypatch, capsys, shipped_dir):
    small = demo.DemoPlan(seq_len=256, budgets=(64, 32), train_steps=2, eval_sequences=1, sample_tokens=8,
                          bench_contexts=(64, 128), suite_lengths=(700,), suite_depths=(0.0, 1.0), suite_samples=1,
                          task_budgets=(32,), fidelity_tokens=48, fidelity_problems=1)
    monkeypatch.setattr(demo.DemoPlan, "for_machine", classmethod(lambda cls, quick, cuda: small))
    result = demo.run_demo(tmp_path / "demo", quick=True, model_name="tiny-random-qwen3")
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert {(r["policy"], r["budget"]) for r in last["rows"]} == {
        (p, b) for p in ("kvpop", "kvpop-static", "kvpop-shipped", "streaming_llm", "tova", "h2o", "oracle")
        for b in (64, 32)}
    assert set(last["rows"][0]) == {"policy", "budget", "cr", "rel_accuracy", "top1_agreement", "kl", "ppl_ratio"}
    # the learned row is the recommended policy; the static rule of the same weights beside it, with its recall
    rows = {(r["policy"], r["budget"]): r for r in result["rows"]}
    assert rows["kvpop", 64]["rule"].startswith("the layer-wide KVpop-cascade at budget 64: 47 of 63")
    assert rows["kvpop-static", 64]["rule"].startswith("the static rule at budget 64")
    assert rows["kvpop-static", 64]["recall"] is not None and "recall" not in rows["kvpop", 64]
    assert rows["kvpop-shipped", 32]["trained"] == str(shipped_dir[0]) and result["shipped"] == str(shipped_dir[0])
    # one verdict line per budget and learned row (the shipped weights first), under the table and in table.txt
    assert [" ".join(line.split()[:4]) for line in result["verdict"]] == [
        "B = 64: kvpop-shipped", "B = 32: kvpop-shipped", "B = 64: kvpop", "B = 32: kvpop"]
    assert all(line in out for line in result["verdict"])
    assert (tmp_path / "demo" / "table.txt").read_text().strip().endswith(result["verdict"][-1])
    for name in ("eviction_pattern", "recall_per_layer", "memory_latency", "tasks", "fidelity"):
        assert (tmp_path / "demo" / f"{name}.png").stat().st_size > 5000
    assert result["sample"]["tokens_seen"] > 0
    # the task panel: every prompt of passkey and vt, answered by the dense model and each row at B = 32
    records = result["tasks"]["records"]
    # a trained row is labelled with its directory (kvpop[train_b32/final])
    assert {(r["policy"].split("[")[0], r["budget"]) for r in records} == {
        ("dense", None), ("kvpop", 32), ("streaming_llm", 32), ("tova", 32), ("h2o", 32)}
    assert {(r["task"], r["depth"]) for r in records} == {(t, d) for t in ("passkey", "vt") for d in (0.0, 1.0)}
    assert all(r["slots_max"] <= 32 for r in records if r["budget"] == 32)
    # a generation-fidelity row per policy at the smallest budget, greedy
    fid = {(r["policy"], r["budget"]) for r in result["fidelity"]}
    assert fid == {("dense", 32), ("kvpop", 32), ("streaming_llm", 32), ("tova", 32), ("h2o", 32)}
    assert "Long-context tasks" in out and "Long generation at B = 32" in out
    with pytest.raises(ValueError, match=r"task_budgets \[128\] are not trained"):
        demo.DemoPlan(budgets=(64, 32), task_budgets=(128,))


def test_the_demo_runs_the_shipped_scorers_at_its_budgets():
    # the shipped directory holds the static rule it was trained for; the demo moves it to each budget and runs the
    # recommended policy there
    from kvpop import pretrained
    from kvpop.eval.demo import shipped_entries
    from kvpop.retrofit import read_config

    path = pretrained.shipped("smollm2-135m")
    assert path is not None
    entries = shipped_entries("smollm2-135m", (512, 256))
    assert [(e.name, e.budget) for e in entries] == [("kvpop-shipped", 512), ("kvpop-shipped", 256)]
    for e in entries:
        assert e.cfg == read_config(path).at_budget(e.budget).recommended()
        assert e.cfg.tova_head_average and e.cfg.window == 1 and e.cfg.budget == e.budget
