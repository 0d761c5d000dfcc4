"""Tests of `kvpop selfgen` (`kvpop.eval.selfgen`): the dense model's generations as a training source.

    python -m pytest tests/test_selfgen.py -q

The model is the tiny random preset (byte tokenizer, ChatML template): fast, nothing downloaded.
"""

from __future__ import annotations

import json

import pytest

from kvpop.cli import main
from kvpop.eval.fidelity import BOXED_HINT, champ_prompt
from kvpop.eval.selfgen import SelfgenConfig, fitting, load_prompts, plan, row_seed
from kvpop.models import byte_tokenizer
from kvpop.train.data import champ_problems, load_texts
from kvpop.train.mix import training_rows

MODEL = "tiny-random-qwen3"
FIELDS = {"text", "prompt_tokens", "generated_tokens", "temperature", "seed", "model"}


def selfgen(capsys, out, *argv: str) -> tuple[int, str, str]:
    rc = main(["selfgen", "--model", MODEL, "--out", str(out), "--no-progress", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One run of 4 sequences, greedy and sampled, in batches of 3: (path, stdout)."""
    path = tmp_path_factory.mktemp("selfgen") / "gen.jsonl"
    rc = main(["selfgen", "--model", MODEL, "--out", str(path), "--no-progress", "--sequences", "4",
               "--tokens", "24", "--temperature", "0,0.7", "--batch", "3", "--min-tokens", "8"])
    assert rc == 0
    return path


def test_the_file_is_a_training_source(written, tokenizer):
    rows = records(written)
    assert len(rows) == 4 and all(set(r) == FIELDS for r in rows)
    assert [r["temperature"] for r in rows] == [0.0, 0.0, 0.7, 0.7]
    assert all(r["model"] == MODEL and 1 <= r["generated_tokens"] <= 24 for r in rows)
    for r in rows:
        # the chat prompt of a champ problem, as kvpop eval --generate renders it, then the continuation
        assert r["text"].startswith("<|im_start|>user\n")
        assert f"{BOXED_HINT}<|im_end|>\n<|im_start|>assistant\n" in r["text"]
    assert load_texts(str(written), split="all") == [r["text"] for r in rows]
    pool = training_rows(f"champ:0.5,{written}:0.5", tokenizer, seq_len=64, pool_tokens=64 * 8)
    assert pool.tokens.shape == (8, 64) and pool.sources.tolist() == [0] * 4 + [1] * 4
    assert [p["source"] for p in pool.summary()] == ["champ", str(written)]


def test_the_summary_gives_length_and_repetition(capsys, tmp_path):
    rc, out, err = selfgen(capsys, tmp_path / "g.jsonl", "--sequences", "2", "--tokens", "16", "--temperature", "0")
    assert rc == 0, err
    assert "mean tokens" in out and "rep4" in out
    last = json.loads(out.strip().splitlines()[-1])
    (row,) = last["summary"]
    assert row["sequences"] == 2 and 1 <= row["mean_generated_tokens"] <= 16 and 0 <= row["repetition"] <= 1
    assert "wrote 2 sequences" in err


def test_a_seed_repeats_the_file_at_any_batch(capsys, written, tmp_path):
    argv = ["--sequences", "4", "--tokens", "24", "--temperature", "0,0.7", "--min-tokens", "8"]
    assert selfgen(capsys, tmp_path / "b1.jsonl", *argv, "--batch", "1")[0] == 0
    assert (tmp_path / "b1.jsonl").read_bytes() == written.read_bytes()
    assert selfgen(capsys, tmp_path / "s1.jsonl", *argv, "--batch", "3", "--seed", "1")[0] == 0
    assert (tmp_path / "s1.jsonl").read_bytes() != written.read_bytes()


def test_temperatures_divide_the_sequences_in_blocks(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    rc, _, err = selfgen(capsys, path, "--sequences", "5", "--tokens", "4", "--temperature", "0,0.7,1.2",
                         "--batch", "2", "--seed", "3")
    assert rc == 0, err
    rows = records(path)
    assert [r["temperature"] for r in rows] == [0.0, 0.0, 0.7, 0.7, 1.2]
    assert [r["seed"] for r in rows] == [row_seed(3, i) for i in range(5)]
    prompts = [r["text"].split("<|im_start|>assistant\n")[0] for r in rows]
    assert len(set(prompts)) == 5, "the temperatures continue different prompts"


def test_plan_takes_the_prompts_again_past_their_number():
    rows = plan(SelfgenConfig(sequences=7, temperatures=(0.7,)), prompts=3)
    assert [r.prompt for r in rows[3:]] == [r.prompt for r in rows[:4]]
    assert len({r.seed for r in rows}) == 7
    with pytest.raises(ValueError, match="greedy decoding gives one text per prompt"):
        plan(SelfgenConfig(sequences=4, temperatures=(0.0,)), prompts=3)


def test_prompts_come_from_the_training_split_only(capsys, tokenizer, tmp_path):
    train, held_out = champ_problems("train"), champ_problems("eval")
    prompts = load_prompts("champ", tokenizer)
    assert prompts == [champ_prompt(tokenizer, p["problem"]) for p in train]
    # every training prompt once, with one token each; no held-out problem anywhere
    path = tmp_path / "all.jsonl"
    rc, _, err = selfgen(capsys, path, "--sequences", str(len(train)), "--tokens", "1", "--temperature", "0",
                         "--batch", "64")
    assert rc == 0, err
    texts = [r["text"] for r in records(path)]
    assert sorted(t.split("\n", 1)[1].split(BOXED_HINT)[0] for t in texts) == sorted(p["problem"] for p in train)
    assert not any(p["problem"] in t for p in held_out for t in texts)


def test_other_prompt_sources_and_fields(capsys, tmp_path):
    source = tmp_path / "asks.jsonl"
    source.write_text("".join(json.dumps({"ask": f"question {i}"}) + "\n" for i in range(20)))
    path = tmp_path / "g.jsonl"
    rc, _, err = selfgen(capsys, path, "--prompts", str(source), "--text-field", "ask", "--sequences", "3",
                         "--tokens", "4", "--temperature", "0.7")
    assert rc == 0, err
    held_out = set(load_texts(str(source), split="eval", text_field="ask"))
    for r in records(path):
        ask = r["text"].removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]
        assert ask.startswith("question ") and ask not in held_out


def test_prompts_that_leave_no_room_are_left_out():
    assert fitting([[1] * 10, [1] * 3], tokens=5, positions=13) == [[1] * 3]
    assert fitting([[1] * 10], tokens=5, positions=14) == [[1] * 10]
    assert fitting([[1] * 10], tokens=5, positions=None) == [[1] * 10]


def test_an_existing_file_needs_force(capsys, tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text("keep\n")
    rc, _, err = selfgen(capsys, path, "--sequences", "1", "--tokens", "2", "--temperature", "0")
    assert rc == 1 and f"--out {path} exists: pass --force" in err and "Traceback" not in err
    assert path.read_text() == "keep\n"
    rc, _, err = selfgen(capsys, path, "--sequences", "1", "--tokens", "2", "--temperature", "0", "--force")
    assert rc == 0, err
    assert len(records(path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["g.jsonl"], "a temporary file was left behind"


@pytest.mark.parametrize("argv,expected", [
    (["--sequences", "0"], "--sequences 0: must be >= 1"),
    (["--tokens", "-3"], "--tokens -3: must be >= 1"),
    (["--batch", "0"], "--batch 0: must be >= 1"),
    (["--temperature", "-0.5"], "--temperature -0.5: a temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature nan: a temperature must be a finite number >= 0"),
    (["--temperature", "0,warm"], "--temperature '0,warm': must be a number or comma-separated numbers"),
    (["--temperature", "0.7,0.7"], "--temperature 0.7,0.7: a temperature is given twice"),
    (["--sequences", "2", "--temperature", "0,0.5,1"],
     "--sequences 2 cannot be divided among the 3 temperatures 0.0,0.5,1.0"),
    (["--tokens", "100", "--min-tokens", "200"], "--min-tokens 200: must lie in [0, --tokens 100]"),
    (["--prompts", "champ,prose"], "--prompts 'champ,prose': give one source, not a mixture"),
    (["--prompts", "./missing.jsonl"], "data file './missing.jsonl' does not exist"),
])
def test_bad_values_are_named(capsys, tmp_path, argv, expected):
    rc, _, err = selfgen(capsys, tmp_path / "g.jsonl", *argv)
    assert rc == 1, err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "g.jsonl").exists()


def test_out_must_be_a_jsonl_file(capsys, tmp_path):
    rc, _, err = selfgen(capsys, tmp_path / "g.txt")
    assert rc == 1 and "must end in .jsonl" in err
    # a value of the wrong type is argparse's usage error, exit status 2
    with pytest.raises(SystemExit) as exit_:
        main(["selfgen", "--model", MODEL, "--out", str(tmp_path / "g.jsonl"), "--sequences", "x"])
    assert exit_.value.code == 2 and "invalid int value: 'x'" in capsys.readouterr().err


def test_a_retrofitted_model_is_refused(capsys, tmp_path):
    import kvpop
    from kvpop.models import load_model

    model, tok = load_model(MODEL)
    saved = tmp_path / "saved"
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=3, scorer_hidden=8)), saved,
               tokenizer=tok)
    rc = main(["selfgen", "--model", str(saved), "--out", str(tmp_path / "g.jsonl")])
    err = capsys.readouterr().err
    assert rc == 1 and "is retrofitted: selfgen writes the dense model's generations" in err


def test_a_stopped_run_keeps_its_finished_sequences_and_continues(capsys, written, tmp_path, monkeypatch):
    import kvpop.eval.selfgen as sg

    out = tmp_path / "gen.jsonl"
    argv = ("--sequences", "4", "--tokens", "24", "--temperature", "0,0.7", "--batch", "1", "--min-tokens", "8")
    real, calls = sg.generate_batch, []

    def stop_at_third(*a, **kw):  # a time limit or Ctrl-C while the third sequence is generated
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(sg, "generate_batch", stop_at_third)
    rc, _, err = selfgen(capsys, out, *argv)
    assert rc == 130 and "the same command continues" in err and not out.exists()
    part = sg.partial_path(out)
    assert len(part.read_text().splitlines()) == 1 + 2  # the header and the two finished sequences
    # a torn last line (stopped mid-write) is generated again
    with open(part, "a") as f:
        f.write('{"record": {"te')
    monkeypatch.setattr(sg, "generate_batch", real)
    rc, _, err = selfgen(capsys, out, *argv)
    assert rc == 0 and "2 of 4 sequences were finished" in err
    # the same bytes as the run that never stopped (the fixture's, at batch 3), and no partial file left
    assert out.read_bytes() == written.read_bytes() and not part.exists()


def test_a_partial_file_of_another_run_is_refused(capsys, tmp_path):
    import kvpop.eval.selfgen as sg

    out = tmp_path / "gen.jsonl"
    header = sg.run_header(SelfgenConfig(sequences=4, tokens=24, seed=5), MODEL, 10)
    sg.partial_path(out).write_text(json.dumps({"kvpop_selfgen": header}) + "\n")
    rc, _, err = selfgen(capsys, out, "--sequences", "4", "--tokens", "24")
    assert rc == 1 and "holds the unfinished sequences of another run" in err and "seed: 5 there, 0 now" in err
    # --force starts over
    rc, _, _ = selfgen(capsys, out, "--sequences", "4", "--tokens", "24", "--force")
    assert rc == 0 and len(records(out)) == 4 and not sg.partial_path(out).exists()
