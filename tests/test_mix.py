"""Tests of `kvpop.train.mix`: the `--data` mixture syntax, the training pool it packs, its evaluation rows.

    python -m pytest tests/test_mix.py -q

The tokenizer is kvpop's byte-level one (a token per byte), so nothing is downloaded and token counts
are byte counts.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch

from kvpop.cli import main
from kvpop.eval.evaluate import held_out_rows
from kvpop.models import byte_tokenizer
from kvpop.train.data import DataError, batches, load_texts, pack_sequences
from kvpop.train.mix import check_training_data, parse_mixture, split_count, training_rows

SEQ_LEN = 64
SHARE_TOLERANCE = 0.03
"""Largest gap between a source's share of the drawn sequences and its weight's share."""


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Three text sources, each written in its own letter (`a`, `b`, `c`), 60 paragraphs ~100-200 bytes each,
    every paragraph tagged with its number so that the train / eval split can be traced."""
    root = tmp_path_factory.mktemp("mix")
    paths = {}
    for letter in "abc":
        docs = [f"{letter}{i:03d} " + " ".join(letter * (1 + (i * j) % 5) for j in range(25 + i % 20)) for i in range(60)]
        # one .jsonl record per document: every paragraph is a document of its own
        path = root / f"{letter}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths[letter] = str(path)
    return paths


def _letters(tokenizer, row: torch.Tensor) -> set[str]:
    text = tokenizer.decode(row.tolist(), skip_special_tokens=True)
    return {ch for ch in text if ch.isalpha()}


# --- the syntax ------------------------------------------------------------------------------------


def test_parse_weights_default_to_one_and_are_normalised(sources):
    a, b, c = sources["a"], sources["b"], sources["c"]
    parts = parse_mixture(f"{a}:0.5,{b}:0.3,{c}:0.2")
    assert [(p.source, p.weight) for p in parts] == [(a, 0.5), (b, 0.3), (c, 0.2)]
    assert [p.share for p in parts] == pytest.approx([0.5, 0.3, 0.2])
    assert [p.share for p in parse_mixture(f"{a},{b}:3")] == pytest.approx([0.25, 0.75])
    assert [p.source for p in parse_mixture("champ, pystdlib :2,prose")] == ["champ", "pystdlib", "prose"]


@pytest.mark.parametrize("spec", ["champ", "org/dataset:config", "pystdlib", "notes:1"])
def test_one_source_is_read_as_written(spec):
    # no comma: the spec is the source, `name:config` and all
    parts = parse_mixture(spec)
    assert len(parts) == 1 and parts[0].source == spec and parts[0].share == 1


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "is empty"),
        ("champ:0.5", "a weight applies within a mixture of two or more sources"),
        ("champ,,prose", "has an empty source"),
        ("champ,prose,", "has an empty source"),
        (":2,prose", "has an empty source"),
        ("champ:0,prose", "the weight of 'champ' is 0; a weight must be a finite number above 0"),
        ("champ:-0.5,prose", "the weight of 'champ' is -0.5"),
        ("champ,prose:inf", "the weight of 'prose' is inf"),
        ("champ,prose:nan", "the weight of 'prose' is nan"),
        ("champ,champ:2", "names 'champ' more than once"),
        ("champ,pydoc", "'pydoc' is held out for out-of-domain evaluation"),
        ("champ,pystlib", "unknown data source 'pystlib' (did you mean 'pystdlib'?)"),
        ("champ,./no/such/file.txt", "data file './no/such/file.txt' does not exist"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(DataError) as err:
        parse_mixture(spec)
    assert message in str(err.value)


def test_training_refuses_the_held_out_source():
    with pytest.raises(DataError, match="held out for out-of-domain evaluation"):
        check_training_data("pydoc")
    assert check_training_data("champ")[0].source == "champ"


def test_one_source_at_a_time_elsewhere():
    with pytest.raises(DataError, match="is a mixture of sources"):
        load_texts("champ,pystdlib")


@pytest.mark.parametrize("n", [3, 7, 10, 101])
def test_split_count_follows_the_shares(n):
    parts = parse_mixture("champ:0.5,pystdlib:0.3,prose:0.2")
    counts = split_count(parts, n)
    assert sum(counts) == n and min(counts) >= 1
    assert all(abs(c - p.share * n) < 1 for c, p in zip(counts, parts))
    assert split_count(parse_mixture("champ:1000,prose"), 3) == [2, 1]  # every source gets a row
    with pytest.raises(DataError, match="cannot hold the 3 sources"):
        split_count(parts, 2)


# --- the training pool -----------------------------------------------------------------------------


def _old_training_tokens(source, tokenizer, seq_len, budget):
    """`Distiller._training_tokens` before mixtures existed, verbatim but for its arguments."""
    texts = load_texts(source, split="train", tokenizer=tokenizer)
    chosen, total = [], 0
    for text in texts:
        chosen.append(text)
        total += len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) + 1
        if total >= budget:
            break
    return pack_sequences(chosen, tokenizer, seq_len)


@pytest.mark.parametrize("budget", [SEQ_LEN * 8, SEQ_LEN * 20 + 5, SEQ_LEN * 10_000])
def test_one_source_packs_what_it_always_packed(sources, tokenizer, budget):
    pool = training_rows(sources["a"], tokenizer, SEQ_LEN, budget)
    assert torch.equal(pool.tokens, _old_training_tokens(sources["a"], tokenizer, SEQ_LEN, budget))
    assert pool.sources.eq(0).all() and pool.passes == (1.0,)


def test_mixture_rows_follow_the_weights_and_hold_one_source_each(sources, tokenizer):
    spec = f"{sources['a']}:0.5,{sources['b']}:0.3,{sources['c']}:0.2"
    pool = training_rows(spec, tokenizer, SEQ_LEN, SEQ_LEN * 40)
    assert pool.tokens.shape == (40, SEQ_LEN)
    assert torch.bincount(pool.sources).tolist() == [20, 12, 8]
    for row, source in zip(pool.tokens, pool.sources.tolist()):
        assert _letters(tokenizer, row) == {"abc"[source]}
    # each source's rows are cut from its own stream as one source's are: the first at a document start
    for i, letter in enumerate("abc"):
        alone = _old_training_tokens(sources[letter], tokenizer, SEQ_LEN, SEQ_LEN * len(pool.tokens[pool.sources == i]))
        assert torch.equal(pool.tokens[pool.sources == i], alone[: int((pool.sources == i).sum())])
    assert tokenizer.decode(pool.tokens[0, :4].tolist()) == "a000"
    assert [p["rows"] for p in pool.summary()] == [20, 12, 8]


def test_batches_draw_each_source_in_proportion(sources, tokenizer):
    spec = f"{sources['a']}:0.5,{sources['b']}:0.3,{sources['c']}:0.2"
    pool = training_rows(spec, tokenizer, SEQ_LEN, SEQ_LEN * 37)
    drawn = collections.Counter()
    stream = batches(pool.sources[:, None], batch_size=4, seed=3)
    for _ in range(500):
        drawn.update(next(stream)[:, 0].tolist())
    total = sum(drawn.values())
    for i, share in enumerate((0.5, 0.3, 0.2)):
        assert abs(drawn[i] / total - share) < SHARE_TOLERANCE, (i, drawn[i] / total, share)


def test_mixture_is_deterministic_and_seeded(sources, tokenizer):
    spec = f"{sources['a']},{sources['b']}:2"
    one = training_rows(spec, tokenizer, SEQ_LEN, SEQ_LEN * 30, seed=0)
    assert torch.equal(one.tokens, training_rows(spec, tokenizer, SEQ_LEN, SEQ_LEN * 30, seed=0).tokens)
    # the seed picks the held-out documents, so another seed trains on other text
    assert not torch.equal(one.tokens, training_rows(spec, tokenizer, SEQ_LEN, SEQ_LEN * 30, seed=1).tokens)


def test_mixture_never_trains_on_held_out_documents(sources, tokenizer):
    spec = f"{sources['a']}:0.5,{sources['b']}:0.3,{sources['c']}:0.2"
    pool = training_rows(spec, tokenizer, SEQ_LEN, SEQ_LEN * 10_000)
    # a source's rows, in order, are its stream of documents (the last, partial row dropped)
    trained = tokenizer.decode(pool.tokens.flatten().tolist(), skip_special_tokens=True)
    for letter in "abc":
        held = load_texts(sources[letter], split="eval")
        assert held and not any(d.split()[0] in trained for d in held)
        train = load_texts(sources[letter], split="train")
        assert all(d.split()[0] in trained for d in train[:-1])


def test_a_source_that_runs_out_is_repeated(sources, tokenizer):
    small = sources["c"]
    pool = training_rows(f"{sources['a']}:0.1,{small}:0.9", tokenizer, SEQ_LEN, SEQ_LEN * 600)
    rows = pool.tokens[pool.sources == 1]
    once = _old_training_tokens(small, tokenizer, SEQ_LEN, 10**9)
    assert len(rows) == 540 > 2 * len(once)
    assert torch.equal(rows[: len(once)], once) and torch.equal(rows[len(once) : 2 * len(once)], once)
    assert pool.passes == (1.0, pytest.approx(540 / len(once)))


def test_max_tokens_gives_runs_of_any_length_the_same_pool(sources, tmp_path):
    from kvpop.config import KVpopConfig
    from kvpop.train.distill import Distiller, TrainConfig

    def pool(steps: int) -> torch.Tensor:
        tcfg = TrainConfig(model="tiny-random-qwen3", data=f"{sources['a']}:0.5,{sources['b']}", seq_len=128,
                           steps=steps, batch_size=2, max_tokens=128 * 12, freeze_base=True, out=str(tmp_path / str(steps)))
        return Distiller(tcfg, KVpopConfig(sink=2, window=8, topk=16, scorer_hidden=32)).tokens

    short = pool(2)
    assert short.shape == (12, 128) and torch.equal(short, pool(50))


def test_chat_needs_a_champ_part(sources, tokenizer):
    with pytest.raises(DataError, match="no champ part"):
        training_rows(f"{sources['a']},{sources['b']}", tokenizer, SEQ_LEN, SEQ_LEN * 8, chat=True)


# --- evaluation rows -------------------------------------------------------------------------------


def test_eval_rows_of_a_mixture_are_each_sources_held_out_rows(sources, tokenizer):
    spec = f"{sources['a']}:3,{sources['b']}"
    rows = held_out_rows(spec, tokenizer, SEQ_LEN, 4)
    assert torch.equal(rows[:3], held_out_rows(sources["a"], tokenizer, SEQ_LEN, 3))
    assert torch.equal(rows[3:], held_out_rows(sources["b"], tokenizer, SEQ_LEN, 1))


# --- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "eval"])
def test_cli_names_a_bad_spec_without_a_traceback(capsys, tmp_path, command):
    rc = main([command, "--model", "tiny-random-qwen3", "--data", "champ,pystlib:0.5", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "unknown data source 'pystlib'" in err and "Traceback" not in err


def test_train_refuses_the_held_out_source(capsys, tmp_path):
    assert main(["train", "--model", "tiny-random-qwen3", "--data", "pydoc", "--out", str(tmp_path)]) == 1
    assert "held out for out-of-domain evaluation" in capsys.readouterr().err


def test_train_on_a_mixture_end_to_end(capsys, sources, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-random-qwen3", "--data", f"prose:0.5,pystdlib:0.3,{sources['a']}:0.2",
            "--seq-len", "128", "--window", "8", "--topk", "16", "--steps", "2", "--batch-size", "2",
            "--max-tokens", str(128 * 10), "--freeze-base", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "10 sequences of 128 tokens from prose 5 (50%), pystdlib 3 (30%)" in err
    resolved = json.loads((out / "config.json").read_text())
    assert [(p["source"], p["rows"]) for p in resolved["data_mix"]] == [("prose", 5), ("pystdlib", 3),
                                                                        (sources["a"], 2)]
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "final").is_dir()
