"""`kvpop eval --suite`: prompts answered through each policy's real decode path, on a tiny random model.

The tiny model cannot retrieve anything; these tests check the machinery (cache bound, decode path,
batching, scoring, the table's collapse lines, the files and the errors), not accuracy.
"""

import json
import re

import pytest
import torch

import kvpop
from helpers import quiet
from kvpop.cache import cache_kwargs
from kvpop.cli import main
from kvpop.eval import suite_report
from kvpop.eval.evaluate import training_free
from kvpop.eval.suite import SuiteConfig, build_samples, check_lengths, parse_depths, parse_lengths, run_suite
from kvpop.models import load_model

LENGTH = 600
BUDGET = 64


CONFIG = dict(tasks=("passkey", "vt", "cwe"), lengths=(LENGTH,), depths=(0.0, 0.5, 1.0), samples=1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # a tiny model's steps are many small kernels: on a busy 2-core machine, one thread ran them 10x faster
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random-qwen3")


@pytest.fixture(scope="module")
def samples(tiny):
    _, tok = tiny
    return build_samples(SuiteConfig(**CONFIG), tok, max_positions=4096)


@pytest.fixture(scope="module")
def records(tiny, samples):
    model, tok = tiny
    entries = [training_free("streaming_llm", BUDGET), training_free("kvpop", BUDGET), training_free("tova", BUDGET)]
    with quiet():
        return run_suite(model, tok, entries, samples, progress=False)


def test_every_policy_answers_within_its_budget(records, samples):
    assert len(records) == 4 * len(samples)
    assert {(r["policy"], r["budget"]) for r in records} == {
        ("dense", None), ("streaming_llm", BUDGET), ("kvpop", BUDGET), ("tova", BUDGET)}
    for r in records:
        assert r["prompt_tokens"] > BUDGET
        if r["budget"] is None:
            # the dense cache holds every token: the prompt and all but the last answer token
            assert r["slots_max"] == r["prompt_tokens"] + max(0, r["new_tokens"] - 1) or r["new_tokens"] == 0
        else:
            # full, and never more than the budget, at every step of prefill and decoding
            assert r["slots_max"] == BUDGET
            assert r["cr"] == pytest.approx(1 - BUDGET / r["prompt_tokens"], abs=1e-4)


def test_answers_come_from_prefill_and_greedy_decoding_through_the_cache(tiny, samples, records):
    # the same tokens as Hugging Face's generate with a KVpopCache (one prompt per policy checked)
    model, tok = tiny
    for policy in ("streaming_llm", "kvpop"):
        s = samples[1]
        rec = next(r for r in records if r["policy"] == policy and r["task"] == s.task and r["index"] == s.index
                   and r["depth"] == s.depth)
        torch.manual_seed(0)  # run_suite seeds the untrained scorer the same way
        m = kvpop.retrofit(model, training_free(policy, BUDGET).cfg)
        try:
            ids = torch.tensor([s.input_ids])
            with quiet():
                out = m.generate(ids, max_new_tokens=s.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, **cache_kwargs(m, kvpop.KVpopCache(m)))
        finally:
            kvpop.detach(m)
        assert rec["output"] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_batched_prompts_give_the_same_answers(tiny, samples, records):
    model, tok = tiny
    entries = [training_free("kvpop", BUDGET)]
    with quiet():
        batched = run_suite(model, tok, entries, samples, batch_size=3, prefill_chunk=128, progress=False)
    single = [r for r in records if r["policy"] in ("dense", "kvpop")]
    assert [r["output"] for r in batched] == [r["output"] for r in single]
    assert [r["slots_max"] for r in batched if r["budget"]] == [r["slots_max"] for r in single if r["budget"]]


def test_fixed_seed_gives_identical_prompts(tiny, samples):
    _, tok = tiny
    cfg = SuiteConfig(**CONFIG)
    assert build_samples(cfg, tok, max_positions=4096) == samples
    cfg.seed = 1
    assert [s.text for s in build_samples(cfg, tok)] != [s.text for s in samples]


def _rec(policy, budget, task, correct, length=1024, depth=0.5):
    return {"policy": policy, "budget": budget, "task": task, "length": length, "depth": depth, "correct": correct,
            "found": float(correct), "slots_max": budget or 1000, "prompt_tokens": length - 3}


def test_table_names_collapses_plainly():
    recs = [_rec("dense", None, "passkey", True) for _ in range(4)]
    recs += [_rec("tova", 256, "passkey", False) for _ in range(4)]
    recs += [_rec("streaming_llm", 512, "passkey", c) for c in (True, True, True, False)]
    recs += [_rec("dense", None, "vt", False) for _ in range(2)] + [_rec("tova", 256, "vt", False) for _ in range(2)]
    recs += [_rec("streaming_llm", 512, "vt", False) for _ in range(2)]
    lines = suite_report.collapses(recs)
    assert "tova at B=256: 0/4 on passkey (dense 4/4) — collapsed" in lines
    assert not any("streaming_llm" in line for line in lines)
    assert any(line.startswith("dense: 0/2 on vt: the model itself fails") for line in lines)
    table = suite_report.format_table(recs)
    assert table.splitlines()[2].startswith("dense")  # the reference row first
    assert "3/4 0.75" in table and "collapsed" in table
    assert "nothing was evicted" not in table
    recs.append(_rec("streaming_llm", 2048, "passkey", True))
    assert "streaming_llm at B=2048: prompts of length 1k fit the budget" in suite_report.format_table(recs)
    head = suite_report.headline(recs)
    assert head["suite"][0] == {"policy": "dense", "budget": None, "accuracy": {"passkey": 1.0, "vt": 0.0}}


def test_heatmaps_one_per_policy_and_budget(tmp_path):
    recs = [_rec(p, b, t, (i + d) % 2 == 0, length=n, depth=d) for p, b in (("dense", None), ("tova", 256))
            for t in ("passkey", "cwe") for n in (1024, 2048) for d in (0.0, 0.5, 1.0) for i in range(2)]
    for r in recs:
        if r["task"] == "cwe":
            r["depth"] = None
    paths = suite_report.write_heatmaps(recs, tmp_path)
    assert sorted(p.name for p in paths) == ["heatmap_dense.png", "heatmap_tova_256.png"]
    acc, n, depths, lengths = suite_report.heatmap_grid(recs, "tova", 256, "passkey")
    assert acc.shape == (3, 2) and n.tolist() == [[2, 2]] * 3 and depths == [0.0, 0.5, 1.0] and lengths == [1024, 2048]


def test_policy_grid_pools_lengths_per_task_and_depth(tmp_path):
    # kvpop demo's panel: a row per (policy, budget), dense first; a column per (task, depth); lengths pooled
    recs = [_rec("tova", 256, "passkey", c, length=n, depth=0.5) for c, n in ((True, 1024), (False, 2048))]
    recs += [_rec("dense", None, "passkey", True, length=1024, depth=0.5), _rec("dense", None, "cwe", False)]
    recs[-1]["depth"] = None
    rows, cols, acc, n = suite_report.policy_grid(recs)
    assert rows == ["dense", "tova, B = 256"] and cols == ["passkey @ 50%", "cwe"]
    assert n.tolist() == [[1, 1], [2, 0]]
    assert acc[0].tolist() == [1.0, 0.0] and acc[1, 0] == 0.5 and acc[1, 1] != acc[1, 1]  # NaN: nothing ran
    from kvpop.eval.plots import plot_policy_grid

    assert plot_policy_grid(rows, cols, acc, n, tmp_path / "grid.png").stat().st_size > 5000
    with pytest.raises(ValueError, match=r"must be \[2 rows, 1 columns\]"):
        plot_policy_grid(rows, cols[:1], acc, n, tmp_path / "bad.png")


def test_suite_from_the_command_line(tiny, tmp_path, capsys):
    model, tok = tiny
    trained = tmp_path / "run" / "final"
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(40, scorer_hidden=16)), trained, tokenizer=tok)
    kvpop.detach(model)
    out = tmp_path / "suite"
    args = ["eval", "--model", "tiny-random-qwen3", "--suite", "passkey,cwe", "--lengths", "512", "--depths", "0,1",
            "--samples", "1", "--policies", "streaming_llm,oracle", "--budgets", "48", "--trained", str(trained),
            "--out", str(out)]
    with quiet():
        assert main(args) == 0
    captured = capsys.readouterr()
    assert "skipping the oracle" in captured.err
    lines = captured.out.strip().splitlines()
    head = json.loads(lines[-1])
    assert [(r["policy"], r["budget"]) for r in head["suite"]] == [
        ("dense", None), ("streaming_llm", 48), ("kvpop[run/final]", 40)]
    # a random model retrieves nothing, and the output says why the rows are uninformative
    assert any("the model itself fails" in line for line in head["collapsed"])
    assert "passkey" in lines[0] and "cwe" in lines[0]
    saved = json.loads((out / "suite.json").read_text())
    assert len(saved["records"]) == 3 * 3 and saved["config"]["tasks"] == ["passkey", "cwe"]
    assert all(r["slots_max"] == r["budget"] for r in saved["records"] if r["budget"])
    assert (out / "suite_table.txt").read_text().strip() == "\n".join(lines[:-1]).strip()
    assert {p.name for p in out.glob("*.png")} == {"heatmap_dense.png", "heatmap_streaming_llm_48.png",
                                                  "heatmap_kvpop_run_final_40.png"}


@pytest.mark.parametrize("flags,message", [
    (["--suite", "passkey", "--lengths", "8k"], "allowed lengths are 1..4080"),
    (["--suite", "passkey,haystack"], "choose from passkey, multikey, multivalue, vt, cwe, qa"),
    (["--suite", "passkey", "--depths", "0,50"], r"outside \[0, 1\]"),
    (["--suite", "passkey", "--lengths", "2x"], "not a token count"),
    (["--suite", "passkey", "--filler", "nowhere"], "prose, champ, stdlib"),
])
def test_suite_errors_name_the_allowed_values(tmp_path, capsys, flags, message):
    args = ["eval", "--model", "tiny-random-qwen3", "--policies", "streaming_llm", "--budgets", "48",
            "--out", str(tmp_path), *flags]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error" in err and re.search(message, err), err


def test_parsers_and_length_limit():
    assert parse_lengths("1k, 2k,4096") == [1024, 2048, 4096]
    assert parse_depths("0,0.25,1") == [0.0, 0.25, 1.0]
    cfg = SuiteConfig(tasks=("passkey", "multivalue"), lengths=(8192,))
    with pytest.raises(ValueError, match="max_position_embeddings=8192.*allowed lengths are 1..8144"):
        check_lengths(cfg, 8192)
    check_lengths(SuiteConfig(tasks=("passkey",), lengths=(8176,)), 8192)
    with pytest.raises(ValueError, match="samples=0"):
        SuiteConfig(samples=0)


def test_a_trained_directory_runs_at_its_entrys_config(tiny, samples, tmp_path, monkeypatch):
    # a directory's weights at another split (a TOVA pool, per-layer budgets): the suite loads it at the entry's
    # config, not the saved one (it loaded the saved one, so a `+layers` row ran at the uniform split)
    import importlib

    from kvpop.eval.evaluate import from_directory, with_layer_budgets, with_tova_pool

    retrofit_module = importlib.import_module("kvpop.retrofit")  # `kvpop.retrofit` is also the function
    model, tok = tiny
    kvpop.save(kvpop.retrofit(load_model("tiny-random-qwen3")[0], kvpop.KVpopConfig.for_budget(BUDGET, scorer_hidden=8)),
               tmp_path / "mlp", tokenizer=tok)
    saved = from_directory(str(tmp_path / "mlp"))
    entries = [with_tova_pool(saved, 3), with_layer_budgets(saved, [BUDGET - 4, BUDGET + 4])]
    seen = []
    real = retrofit_module.load

    def load(*args, **kw):
        m = real(*args, **kw)
        seen.append(m.kvpop.config)
        return m

    monkeypatch.setattr(retrofit_module, "load", load)
    with quiet():
        records = run_suite(model, tok, entries, samples[:1], dense=False, progress=False)
    assert [c.tova_pool for c in seen] == [3, 0] and seen[1].layer_topk == entries[1].cfg.layer_topk
    assert {r["policy"].split("[")[0] for r in records} == {e.name for e in entries}  # labelled NAME[its directory]


@pytest.mark.parametrize("cfg", [
    dict(policy="dms"),
    dict(scorer="mlstm", match_mlp_memory=True),
    dict(scorer="mlstm", match_mlp_memory=True, delay=0),
], ids=["dms", "mlstm", "mlstm-delay0"])
def test_stateful_and_dms_directories_run_the_suite_and_the_fidelity(tiny, tmp_path, capsys, cfg):
    # every trained row of the quality study gets both: a DMS or mLSTM directory must decode
    # through the suite's prompts and a long generation with its slots within the budget, as the MLP's does
    model, tok = tiny
    trained = tmp_path / "run" / "final"
    config = kvpop.KVpopConfig.for_budget(40, scorer_hidden=16, mlstm_hidden=16, **cfg)
    kvpop.save(kvpop.retrofit(model, config), trained, tokenizer=tok)
    kvpop.detach(model)
    with quiet():
        assert main(["eval", "--model", "tiny-random-qwen3", "--suite", "passkey", "--lengths", "256",
                     "--depths", "0.5", "--samples", "1", "--policies", "none", "--trained", f"row={trained}",
                     "--out", str(tmp_path / "suite")]) == 0
    capsys.readouterr()
    records = json.loads((tmp_path / "suite" / "suite.json").read_text())["records"]
    row = [r for r in records if r["budget"]]
    # the mLSTM pays for its state in slots (`match_mlp_memory`): its budget is below 40
    assert len(row) == 1 and row[0]["policy"].startswith("row") and row[0]["slots_max"] == row[0]["budget"] <= 40
    with quiet():
        assert main(["eval", "--model", "tiny-random-qwen3", "--generate", "48", "--problems", "1", "--samples", "0",
                     "--policies", "none", "--trained", f"row={trained}", "--ignore-eos",
                     "--out", str(tmp_path / "fid")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["policy"].split("[")[0] for r in rows] == ["dense", "row"]
    assert rows[1]["nll"] > 0 and 0 <= rows[1]["agreement"] <= 1
    gens = json.loads((tmp_path / "fid" / "fidelity.json").read_text())["generations"]
    assert sorted(len(g["tokens"]) for g in gens) == [48, 48]
