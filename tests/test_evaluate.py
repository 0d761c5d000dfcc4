"""`kvpop eval` and `kvpop viz` end to end on a tiny model (`kvpop demo`: tests/test_demo.py)."""

import json
import random

import pytest
import torch

import kvpop
from kvpop.cli import main
from kvpop.eval.evaluate import (
    Evaluator,
    format_table,
    headline,
    held_out_rows,
    mark_stronger_variants,
    training_free,
)
from kvpop.eval.metrics import teacher_forced_metrics
from kvpop.models import load_model


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(1)
    words = "so we add two to both sides and then divide by three which gives x equals five".split()
    path = tmp_path_factory.mktemp("evaldata") / "t.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(200)) for _ in range(30)))
    return path


def test_eval_compares_policies_side_by_side(text_file, tmp_path, capsys):
    trained = tmp_path / "trained"
    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16)), trained, tokenizer=tok)
    args = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "128",
            "--sequences", "2", "--budgets", "32,16", "--trained", str(trained), "--out", str(tmp_path / "o")]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(lines[-1])["rows"]
    assert {(r["policy"], r["budget"]) for r in rows} == {
        ("kvpop", 32), *((p, b) for p in ("streaming_llm", "tova", "h2o", "oracle") for b in (32, 16))}
    for r in rows:
        assert r["cr"] == pytest.approx(1 - r["budget"] / 128)
        assert 0 <= r["top1_agreement"] <= 1 and r["kl"] >= 0 and r["ppl_ratio"] > 0
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    oracle = next(r for r in saved["rows"] if r["policy"] == "oracle" and r["budget"] == 32)
    assert oracle["recall"] == pytest.approx(1.0)
    assert "kvpop eval" in saved["command"]
    # TOVA and H2O ran in both variants; per budget the lower KL is marked, and the headline keeps it
    for budget in (32, 16):
        for paper, windowed in (("tova", "tova_windowed"), ("h2o", "h2o_windowed")):
            pair = {r["policy"]: r for r in saved["rows"] if r["budget"] == budget and r["policy"] in (paper, windowed)}
            assert pair[paper]["variant"] == "paper" and pair[windowed]["variant"] == "windowed"
            assert pair[paper]["sink"] == 0 and pair[windowed]["sink"] == 4
            best = min(pair.values(), key=lambda r: r["kl"])
            assert [r["stronger"] for r in pair.values()].count(True) == 1 and best["stronger"]
            head = next(r for r in rows if r["policy"] == paper and r["budget"] == budget)
            assert head["variant"] == best["variant"] and head["kl"] == best["kl"]


@torch.no_grad()
def test_every_policy_within_its_budget_is_the_dense_model():
    # nothing is evicted before the budget is full, so every policy must agree with the dense model there
    model, _ = load_model("tiny-random-llama")
    ids = torch.randint(0, 250, (1, 64))
    ev = Evaluator(model, [training_free(p, 48) for p in ("streaming_llm", "tova", "h2o", "kvpop")])
    dense = kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=1, topk=0, policy="streaming_llm"))(
        ids, kvpop_dense=True).logits
    kvpop.detach(model)
    for entry in ev.entries:
        m = ev._model(entry)
        logits = m(ids).logits
        ev._release(entry, m)
        assert torch.allclose(logits[:, :48], dense[:, :48], atol=1e-5), entry.name
        assert not torch.allclose(logits[:, 48:], dense[:, 48:], atol=1e-3), entry.name


def test_a_batch_of_sequences_gives_the_rows_of_one_at_a_time():
    # the quality study's TOVA / H2O workers evaluate several held-out sequences per pass: the rows
    # must be the ones sequence-by-sequence evaluation gives (the metrics sum over positions)
    model, _ = load_model("tiny-random-qwen3")
    ids = torch.randint(3, 250, (3, 80), generator=torch.Generator().manual_seed(0))
    policies = ("tova", "h2o", "streaming_llm", "oracle")
    one = Evaluator(model, [training_free(p, 40) for p in policies])
    for i in range(3):
        one.add(ids[i : i + 1])
    many = Evaluator(model, [training_free(p, 40) for p in policies])
    many.add(ids[:2])
    many.add(ids[2:])
    for a, b in zip(one.rows(80), many.rows(80)):
        assert a["positions"] == b["positions"] == 3 * 39, a["policy"]  # positions 40..78 predict a next token
        for key in ("rel_accuracy", "top1_agreement", "kl", "ppl_ratio"):
            # rel_accuracy is NaN here (random model and tokens: the dense accuracy is 0)
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6, nan_ok=True), (a["policy"], key)
        assert a["kl"] > 0, a["policy"]
        # each sequence on its own too: the same positions per sequence, so the pooled KL is their mean
        assert a["kl_per_sequence"] == pytest.approx(b["kl_per_sequence"], rel=1e-5) and len(a["kl_per_sequence"]) == 3
        assert a["kl"] == pytest.approx(sum(a["kl_per_sequence"]) / 3, rel=1e-6) and a["kl_se"] > 0


def test_eval_bad_input(text_file, tmp_path, capsys):
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "64", "--out", str(tmp_path)]
    assert main(base + ["--budgets", "64"]) == 1
    assert "not below --seq-len 64" in capsys.readouterr().err
    assert main(base + ["--policies", "none", "--budgets", ""]) == 1
    assert "nothing to evaluate" in capsys.readouterr().err


def test_viz_writes_the_eviction_pattern(tmp_path):
    out = tmp_path / "pattern.png"
    text = " ".join(["the proof follows by induction on n"] * 40)
    assert main(["viz", "--model", "tiny-random-qwen3", "--text", text, "--budget", "64", "--last", "40",
                 "--out", str(out)]) == 0
    assert out.stat().st_size > 5000
    # a second run does not replace it unless asked
    assert main(["viz", "--model", "tiny-random-qwen3", "--text", text, "--budget", "64", "--out", str(out)]) == 1
    assert main(["viz", "--model", "tiny-random-qwen3", "--text", text, "--budget", "64", "--last", "40",
                 "--out", str(out), "--force"]) == 0


def test_eval_pass_at_1_with_rollouts(text_file, tmp_path, capsys):
    trained = tmp_path / "trained"
    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16)), trained, tokenizer=tok)
    args = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "96",
            "--sequences", "1", "--budgets", "32", "--policies", "streaming_llm,oracle", "--rollouts", "2",
            "--problems", "1", "--max-new-tokens", "8", "--trained", str(trained), "--out", str(tmp_path / "o")]
    assert main(args) == 0
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["rows"]
    by = {r["policy"]: r for r in rows}
    # math-verify over 2 sampled answers to 1 champ problem, generated with the bounded cache of the
    # trained directory and of a training-free policy; a random model answers nothing right
    assert by["streaming_llm"]["pass_at_1"] == 0.0 and by["kvpop"]["pass_at_1"] == 0.0
    assert "pass_at_1" not in by["oracle"]  # teacher-forced only: it cannot generate


def test_rollouts_score_right_answers(monkeypatch):
    # the number is pass@1 indeed: completions that box the right answer count, per problem and sample
    from kvpop.eval import evaluate

    pytest.importorskip("math_verify")
    model, tok = load_model("tiny-random-qwen3")
    model = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16))
    answers = iter(["so \\boxed{4}", "\\boxed{5}", "\\boxed{7}", "\\boxed{7}"])
    monkeypatch.setattr(tok, "decode", lambda *a, **k: next(answers))
    problems = [{"problem": "2+2?", "answer": "4"}, {"problem": "3+4?", "answer": "7"}]
    score, completions = evaluate.rollouts_pass_at_1(model, tok, problems, 2, 2)
    assert completions == [["so \\boxed{4}", "\\boxed{5}"], ["\\boxed{7}", "\\boxed{7}"]]
    assert score == pytest.approx(0.75)


# --- bad input, silent mismatches and progress ---


def _eval(text_file, tmp_path, *extra) -> list[str]:
    return ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "64",
            "--sequences", "1", "--out", str(tmp_path / "o"), *extra]


@pytest.mark.parametrize("budgets,message", [
    ("-5", "--budgets: -5 must lie above --sink + 1 = 5"),
    ("5", "--budgets: 5 must lie above --sink + 1 = 5"),
    ("32,a", "--budgets='32,a' must be comma-separated integers"),
    ("64", "below --seq-len 64"),
])
def test_eval_budgets_are_checked_against_the_flags(text_file, tmp_path, capsys, budgets, message):
    assert main(_eval(text_file, tmp_path, "--budgets", budgets)) == 1
    err = capsys.readouterr().err
    assert message in err and "window=" not in err


def test_eval_refuses_a_trained_directory_of_another_base(text_file, tmp_path, capsys):
    trained = tmp_path / "trained"
    model, tok = load_model("tiny-random-qwen3")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16)), trained, tokenizer=tok)
    assert main(_eval(text_file, tmp_path, "--model", "tiny-random-llama", "--policies", "none",
                      "--trained", str(trained))) == 1
    err = capsys.readouterr().err
    assert f"{trained} was trained from another base model" in err and "architecture: model_type qwen3 vs llama" in err
    # a directory from before the record: evaluated, with a note that it cannot be checked
    (trained / "kvpop_base.json").unlink()
    assert main(_eval(text_file, tmp_path, "--policies", "none", "--trained", str(trained))) == 0
    assert "records no base model" in capsys.readouterr().err


def test_eval_shows_each_pass_and_announces_untrained_scorers(text_file, tmp_path, capsys):
    assert main(_eval(text_file, tmp_path, "--budgets", "32", "--policies", "streaming_llm,kvpop")) == 0
    err = capsys.readouterr().err
    assert "--policies kvpop: its scorers are untrained (random)" in err
    # the dense pass, then each of the two entries: three ticks for the one sequence
    assert "3/3" in err and "pass" in err
    # a second eval into the same --out: refused before any work, the first one's results kept; then --force
    results = (tmp_path / "o" / "results.json").read_text()
    assert main(_eval(text_file, tmp_path, "--budgets", "32", "--policies", "streaming_llm", "--no-progress")) == 1
    err = capsys.readouterr().err
    assert "holds the results of an earlier eval (table.txt, results.json): pass --force" in err
    assert "Traceback" not in err and (tmp_path / "o" / "results.json").read_text() == results
    assert main(_eval(text_file, tmp_path, "--budgets", "32", "--policies", "streaming_llm", "--no-progress",
                      "--force")) == 0
    assert "kvpop eval" not in capsys.readouterr().err
    assert (tmp_path / "o" / "results.json").read_text() != results


def test_held_out_rows_begin_at_a_document_start_unless_concat():
    _, tok = load_model("tiny-random-qwen3")
    start = tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False).split("X")[0]
    rows = held_out_rows("champ", tok, 256, 4)
    assert rows.shape == (4, 256)
    # champ as in real use: every row is a conversation from its first token, the problem as the user turn
    assert all(tok.decode(r).startswith(start) for r in rows)
    concat = held_out_rows("champ", tok, 256, 4, packing="concat")
    texts = [tok.decode(r) for r in concat]
    assert texts[0].startswith("Problem: ") and not all(t.startswith("Problem: ") for t in texts)
    with pytest.raises(ValueError, match="packing='stream' is invalid"):
        held_out_rows("champ", tok, 256, 4, packing="stream")


def test_mark_stronger_variants_and_the_headline():
    def row(policy, budget, kl, **kw):
        return {"policy": policy, "budget": budget, "cr": 0.5, "rel_accuracy": 1.0, "top1_agreement": 0.9, "kl": kl,
                "ppl_ratio": 1.1, **kw}

    rows = [row("tova", 8, 0.3), row("tova_windowed", 8, 0.2), row("h2o", 8, 0.1), row("tova", 4, 0.5),
            row("dms", 8, 0.4, avg_cache_fraction=0.55, trained="d")]
    mark_stronger_variants(rows)
    assert [r.get("stronger") for r in rows] == [False, True, None, None, None]
    assert [r.get("variant") for r in rows] == ["paper", "windowed", "paper", "paper", None]
    head = headline(rows)["rows"]
    assert [(r["policy"], r["budget"], r.get("variant")) for r in head] == [
        ("tova", 8, "windowed"), ("h2o", 8, "paper"), ("tova", 4, "paper"), ("dms", 8, None)]
    assert head[-1]["avg_cache_fraction"] == 0.55
    table = format_table([{**r, "positions": 1, "recall": None} for r in rows])
    assert "tova_windowed *" in table and "0.550" in table and "lower KL" in table


def test_eval_labels_trained_rows_and_refuses_two_alike(text_file, tmp_path, capsys):
    for name in ("a", "b"):
        model, tok = load_model("tiny-random-qwen3")
        kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16)), tmp_path / name,
                   tokenizer=tok)
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "128",
            "--sequences", "1", "--policies", "none", "--out", str(tmp_path / "o")]
    # two directories of one policy at one budget would share a row: refused, with the fix named
    assert main([*base, "--trained", str(tmp_path / "a"), "--trained", str(tmp_path / "b")]) == 1
    assert "are both 'kvpop' at budget 32" in capsys.readouterr().err
    assert main([*base, "--trained", f"champ={tmp_path / 'a'}", "--trained", f"self+gen={tmp_path / 'b'}"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert {(r["policy"], r["budget"]) for r in rows} == {("champ", 32), ("self+gen", 32)}


def test_eval_runs_a_kvpop_mlp_directory_as_kvpop_cascade(text_file, tmp_path, capsys):
    # --tova-pool N: the same weights, with N of the top-k slots ranked by TOVA (KVpop-cascade); the row must be
    # what a directory saved with tova_pool = N gives (a saved cascade runs as saved), and differ from the plain
    # directory's row (the recommended layer-wide cascade)
    model, tok = load_model("tiny-random-qwen3")
    torch.manual_seed(0)
    mlp = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16))
    kvpop.save(mlp, tmp_path / "mlp", tokenizer=tok)
    kvpop.detach(mlp)
    cascade = kvpop.load(tmp_path / "mlp", config=kvpop.KVpopConfig.for_budget(32, scorer_hidden=16, tova_pool=8))
    kvpop.save(cascade, tmp_path / "cascade", tokenizer=tok)
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "128",
            "--force", "--sequences", "2", "--policies", "none", "--out", str(tmp_path / "o")]
    assert main([*base, "--trained", f"mlp={tmp_path / 'mlp'}", "--tova-pool", "8,20",
                 "--trained", f"saved={tmp_path / 'cascade'}"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"mlp", "mlp+pool8", "mlp+pool20", "saved"}
    for key in ("kl", "top1_agreement"):
        assert rows["mlp+pool8"][key] == pytest.approx(rows["saved"][key], rel=1e-6)
    assert rows["mlp+pool8"]["kl"] != pytest.approx(rows["mlp"]["kl"], rel=1e-6)
    # bad pools name the flag and what is allowed
    assert main([*base, "--trained", str(tmp_path / "mlp"), "--tova-pool", "21"]) == 1
    assert "--tova-pool 21 must lie in [1, topk=20]" in capsys.readouterr().err
    assert main([*base, "--trained", str(tmp_path / "mlp"), "--tova-pool", "x"]) == 1
    assert "--tova-pool='x' must be comma-separated integers" in capsys.readouterr().err
    assert main([*base, "--policies", "tova", "--budgets", "32", "--tova-pool", "4"]) == 1
    assert "--tova-pool needs a --trained KVpop-mlp directory" in capsys.readouterr().err


def test_eval_runs_a_kvpop_mlp_directory_as_the_layer_wide_cascade(text_file, tmp_path, capsys):
    # --tova-pool-layer N: the same weights at TOVA's split of the budget, N slots ranked by TOVA's head average; the
    # row must be what a directory saved with that config gives
    model, tok = load_model("tiny-random-qwen3")
    torch.manual_seed(0)
    mlp = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16))
    kvpop.save(mlp, tmp_path / "mlp", tokenizer=tok)
    kvpop.detach(mlp)
    cfg = kvpop.KVpopConfig.for_budget(32, scorer_hidden=16, tova_pool=24, tova_head_average=True)
    kvpop.save(kvpop.load(tmp_path / "mlp", config=cfg), tmp_path / "layer", tokenizer=tok)
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "128",
            "--force", "--sequences", "2", "--policies", "none", "--out", str(tmp_path / "o")]
    assert main([*base, "--trained", f"mlp={tmp_path / 'mlp'}", "--tova-pool-layer", "24,31", "--tova-pool", "8",
                 "--trained", f"saved={tmp_path / 'layer'}"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"mlp", "mlp+pool8", "mlp+lpool24", "mlp+lpool31", "saved"}
    for key in ("kl", "top1_agreement"):
        assert rows["mlp+lpool24"][key] == pytest.approx(rows["saved"][key], rel=1e-6)
    assert rows["mlp+lpool24"]["kl"] != pytest.approx(rows["mlp+pool8"]["kl"], rel=1e-6)
    # every slot in the TOVA pool: TOVA as its paper defines it, on the same sequences
    assert main([*base[:-4], "--policies", "tova", "--budgets", "32", "--out", str(tmp_path / "t")]) == 0
    tova = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][0]
    assert tova["policy"] == "tova" and tova["kl"] == pytest.approx(rows["mlp+lpool31"]["kl"], rel=1e-6)
    assert main([*base, "--trained", str(tmp_path / "mlp"), "--tova-pool-layer", "32"]) == 1
    assert "--tova-pool-layer 32 must lie in [1, budget - 1=31]" in capsys.readouterr().err


def test_skip_sequences_gives_a_disjoint_development_set(text_file, tmp_path, capsys):
    # --skip-sequences N: the rows after the first N, exactly the later rows of a longer run
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "128",
            "--policies", "streaming_llm", "--budgets", "32", "--packing", "concat", "--out", str(tmp_path / "o"),
            "--force"]
    def per_sequence():
        return json.loads((tmp_path / "o" / "results.json").read_text())["rows"][0]["kl_per_sequence"]

    assert main([*base, "--sequences", "3"]) == 0
    both = per_sequence()
    assert main([*base, "--sequences", "2", "--skip-sequences", "1"]) == 0
    later = per_sequence()
    assert later == pytest.approx(both[1:], rel=1e-6) and len(later) == 2
    assert main([*base, "--sequences", "2", "--skip-sequences", "1000"]) == 1
    assert "no held-out sequence" in capsys.readouterr().err


def test_eval_decision_chunk_rows_are_the_chunked_configs(text_file, tmp_path, capsys):
    # --decision-chunk C: every TOVA, H2O and layer-wide cascade row again, deciding every C steps in the same memory;
    # the row must be what a directory saved with that config gives, and bad chunks name the flag and what is allowed
    model, tok = load_model("tiny-random-qwen3")
    torch.manual_seed(0)
    mlp = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, scorer_hidden=16))
    kvpop.save(mlp, tmp_path / "mlp", tokenizer=tok)
    kvpop.detach(mlp)
    chunked = kvpop.KVpopConfig.for_budget(32, scorer_hidden=16).recommended().with_decision_chunk(8)
    kvpop.save(kvpop.load(tmp_path / "mlp", config=chunked), tmp_path / "chunked", tokenizer=tok)
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text_file), "--split", "all", "--seq-len", "128",
            "--force", "--sequences", "2", "--out", str(tmp_path / "o")]
    assert main([*base, "--policies", "tova,h2o", "--budgets", "32", "--trained", f"mlp={tmp_path / 'mlp'}",
                 "--decision-chunk", "8,16", "--trained", f"saved={tmp_path / 'chunked'}"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert {"tova+chunk8", "tova+chunk16", "h2o+chunk8", "h2o+chunk16", "mlp+chunk8", "mlp+chunk16"} <= set(rows)
    for key in ("kl", "top1_agreement"):
        assert rows["mlp+chunk8"][key] == pytest.approx(rows["saved"][key], rel=1e-6)
    assert rows["mlp+chunk8"]["kl"] != pytest.approx(rows["mlp"]["kl"], rel=1e-6)
    assert rows["tova+chunk8"]["kl"] != pytest.approx(rows["tova"]["kl"], rel=1e-6)
    assert rows["h2o+chunk8"]["kl"] != pytest.approx(rows["h2o"]["kl"], rel=1e-6)
    for chunks, expected in (("1", "integers >= 2"), ("32", "must be an integer in [1, budget - 1 = 31]"),
                             ("x", "comma-separated integers")):
        assert main([*base, "--policies", "tova", "--budgets", "32", "--decision-chunk", chunks]) == 1
        assert expected in capsys.readouterr().err
    # H2O's ring is the newest part of its window (16 of the budget's 32)
    assert main([*base, "--policies", "h2o", "--budgets", "32", "--decision-chunk", "20"]) == 1
    assert "window = 16" in capsys.readouterr().err
    assert main([*base, "--policies", "streaming_llm", "--budgets", "32", "--decision-chunk", "8"]) == 1
    assert "needs a row it applies to" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny-random-llama", "tiny-random-gemma3", "tiny-random-gemma2"])
@torch.no_grad()
def test_the_metrics_read_logits_projected_from_the_hidden_states(preset):
    # a long evaluation holds each pass's final hidden states, not its [B, S, V] logits: the projection (Gemma 2's
    # soft-capping included) must be the model's own logits, and the metrics the same as from the full tensor
    from kvpop.eval.evaluate import output_logits
    from kvpop.eval.metrics import HiddenLogits, logit_positions, logit_rows

    model, _ = load_model(preset)
    ids = torch.randint(3, 250, (2, 70), generator=torch.Generator().manual_seed(1))
    tova = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(32, policy="tova"))
    full = tova(ids, use_cache=False).logits.float()
    assert isinstance(output_logits(tova, ids), torch.Tensor)  # small enough to hold
    lazy = output_logits(tova, ids, held_bytes=0)
    kvpop.detach(model)
    assert isinstance(lazy, HiddenLogits) and lazy.shape == full.shape
    assert torch.allclose(logit_positions(lazy, 0, 70), full, atol=1e-5)
    assert torch.allclose(logit_positions(logit_rows(lazy, 1, 2), 10, 20), full[1:2, 10:20], atol=1e-5)
    dense = model(ids, use_cache=False).logits.float()
    a = teacher_forced_metrics(dense, full, ids, start=32).as_dict()
    b = teacher_forced_metrics(dense, lazy, ids, start=32).as_dict()
    assert a["kl"] > 0
    for key, value in a.items():
        assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key


@torch.no_grad()
def test_a_head_the_projection_does_not_know_gets_the_full_logits(monkeypatch):
    # a model whose logits are more than its head of the final norm (a scale, say) must not be projected wrongly
    from kvpop.eval.evaluate import output_logits

    model, _ = load_model("tiny-random-llama")
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(2))
    plain = model(ids, use_cache=False).logits.float()
    forward = type(model).forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 1.05  # a mild scale: outside any rounding
        return out

    monkeypatch.setattr(type(model), "forward", scaled)
    logits = output_logits(model, ids, held_bytes=0)
    assert isinstance(logits, torch.Tensor) and torch.allclose(logits, 1.05 * plain, atol=1e-5)
