"""Tests of `kvpop.train.data`: sources, the train/eval split, packing and resumable batches.

    python -m pytest tests/test_data.py -q

Tokenizers are tiny byte-level BPEs trained here, so nothing is downloaded.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvpop.train import data
from kvpop.train.data import DataError, batches, champ_problems, load_texts, pack_sequences

EOS = "<|endoftext|>"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def _tiny_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the sum of the roots of x^2 - 5x + 6 = 0 is 5, so the answer is 5."] * 8, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, chat_template=chat_template)


@pytest.fixture(scope="session")
def tokenizer():
    return _tiny_tokenizer(CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def plain_tokenizer():
    return _tiny_tokenizer(None)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


DOCS = [f"document {i}: the sum of {i} and {i + 1} is {2 * i + 1}." for i in range(40)]


# --- sources ---------------------------------------------------------------------------------------


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first paragraph\n\nsecond paragraph\n")
    assert load_texts(str(path), split="all") == ["first paragraph\n\nsecond paragraph\n"]


def test_large_txt_file_is_cut_at_paragraphs(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "TXT_BLOCK_CHARS", 100)
    text = "\n\n".join(f"paragraph {i} " + "word " * (i % 7) for i in range(60))
    path = tmp_path / "book.txt"
    path.write_text(text)
    docs = load_texts(str(path), split="all")
    assert len(docs) > 5
    assert "".join(docs) == text
    assert all(len(d) <= 100 for d in docs)
    assert all(d.endswith("\n\n") for d in docs[:-1])


def test_jsonl_text_field(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS[:3])])
    assert load_texts(path, split="all") == DOCS[:3]
    other = _write_jsonl(tmp_path / "o.jsonl", [{"body": d} for d in DOCS[:3]])
    assert load_texts(other, split="all", text_field="body") == DOCS[:3]
    with pytest.raises(DataError, match="body"):
        load_texts(other, split="all")
    with pytest.raises(DataError, match="no field 'content'.*body"):
        load_texts(other, split="all", text_field="content")


def test_json_list_and_bad_jsonl_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": d} for d in DOCS[:4]]))
    assert load_texts(str(path), split="all") == DOCS[:4]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_texts(str(bad), split="all")


def test_chat_records_use_the_chat_template(tmp_path, tokenizer, plain_tokenizer):
    conversation = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    sharegpt = [{"from": "human", "value": "What is 2+3?"}, {"from": "gpt", "value": "5"}]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}, {"conversations": sharegpt}])
    expected = "<|user|>What is 2+3?\n<|assistant|>5\n"
    assert load_texts(path, split="all", tokenizer=tokenizer) == [expected, expected]
    with pytest.raises(DataError, match="need a tokenizer"):
        load_texts(path, split="all")
    with pytest.raises(DataError, match="chat template"):
        load_texts(path, split="all", tokenizer=plain_tokenizer)


def test_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS[:5], "n": list(range(5))}), path)
    assert load_texts(str(path), split="all") == DOCS[:5]
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}), chat)
    assert load_texts(str(chat), split="all", tokenizer=tokenizer) == ["<|user|>hi\n"]


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        load_texts(str(path), split="all")


def test_directory_reads_every_data_file_in_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("from b")
    (tmp_path / "sub" / "c.md").write_text("from c")
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "from a 1"}, {"text": "from a 2"}])
    (tmp_path / "notes.csv").write_text("ignored")
    assert load_texts(str(tmp_path), split="all") == ["from a 1", "from a 2", "from b", "from c"]


def test_document_split_is_disjoint_deterministic_and_complete(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    train, held = load_texts(path, split="train"), load_texts(path, split="eval")
    assert len(held) == 4 and len(train) == 36
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(DOCS)
    assert held == load_texts(path, split="eval")
    assert held != load_texts(path, split="eval", seed=1)
    assert load_texts(path, split="train", limit=3) == train[:3]


def test_duplicates_stay_on_one_side(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS + DOCS[:20]])
    assert not set(load_texts(path, split="train")) & set(load_texts(path, split="eval"))


def test_single_document_trains_and_has_no_eval(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("only one document")
    assert load_texts(str(path), split="train") == ["only one document"]
    with pytest.raises(DataError, match="'eval' split .* is empty"):
        load_texts(str(path), split="eval")


# --- bad input -------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_texts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        load_texts("./missing/dir")


@pytest.mark.parametrize(
    "name, content", [("e.txt", ""), ("w.txt", " \n\n \n"), ("e.jsonl", ""), ("b.jsonl", '{"text": ""}\n')]
)
def test_empty_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match="empty"):
        load_texts(str(path), split="all")


def test_empty_directory(tmp_path):
    with pytest.raises(DataError, match="holds no data files"):
        load_texts(str(tmp_path))


def test_bad_arguments(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("text")
    for kwargs, match in [
        ({"split": "test"}, "split='test'"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"limit": 0}, "limit"),
        ({"chat": True}, "champ only"),
    ]:
        with pytest.raises(DataError, match=match):
            load_texts(str(path), **kwargs)


def test_hub_name_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"not installed \(pip install datasets\).*local"):
        load_texts("no-such-org/no-such-dataset")


def test_hub_name_not_available_offline(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed (pip install datasets)")
    import huggingface_hub.constants

    # offline mode makes the hub fail at once instead of retrying a missing network for ~25 s
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="could not load the Hugging Face dataset 'no-such-org/no-such-dataset'.*local"):
        load_texts("no-such-org/no-such-dataset")


# --- champ -----------------------------------------------------------------------------------------


def test_champ_split_is_by_problem():
    train, held = champ_problems("train"), champ_problems("eval")
    train_ids, eval_ids = {p["id"] for p in train}, {p["id"] for p in held}
    assert len(train_ids) == len(train) and len(eval_ids) == len(held)
    assert train_ids and eval_ids and not train_ids & eval_ids
    assert len(train_ids | eval_ids) == len(champ_problems("all")) == 270
    assert {p["category"] for p in held} == {p["category"] for p in train}
    assert [p["id"] for p in champ_problems("eval")] == [p["id"] for p in held]
    assert {p["id"] for p in champ_problems("eval", seed=1)} != eval_ids
    assert all(p["problem"] and p["answer"] and p["solution"] for p in held)
    with pytest.raises(DataError, match="split='test'"):
        champ_problems("test")


def test_champ_documents_never_cross_the_split():
    train_problems = [p["problem"] for p in champ_problems("train")]
    eval_problems = {p["problem"] for p in champ_problems("eval")}
    held = load_texts("champ", split="eval")
    assert held == load_texts("champ", split="eval")
    assert all(d.startswith("Problem: ") for d in held)
    assert {d.split("\n\nSolution: ")[0].removeprefix("Problem: ") for d in held} == eval_problems
    assert not any(q in d for d in held for q in train_problems)
    train = load_texts("champ", split="train", limit=500)
    assert len(train) == 500
    assert not any(q in d for d in train for q in eval_problems)


def test_champ_chat_format(tokenizer, plain_tokenizer):
    docs = load_texts("champ", split="eval", tokenizer=tokenizer, chat=True, limit=3)
    assert all(d.startswith("<|user|>") and "\n<|assistant|>" in d for d in docs)
    with pytest.raises(DataError, match="chat template"):
        load_texts("champ", split="eval", tokenizer=plain_tokenizer, chat=True)


def test_champ_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "champ_dataset", None)
    # the uncached loader, so the cached corpus of the other tests is left alone
    monkeypatch.setattr(data, "_champ_data", data._champ_data.__wrapped__)
    with pytest.raises(DataError, match="pip install champ-dataset"):
        load_texts("champ")


def test_python_literal_fields_are_decoded():
    assert data._literal("{'steps': [{'_text': 'a'}]}") == {"steps": [{"_text": "a"}]}
    assert data._literal("(n+1)^(n-1)") == "(n+1)^(n-1)"


# --- packing and batches ---------------------------------------------------------------------------


def test_pack_sequences_shapes_and_contents(tokenizer):
    texts = DOCS[:10]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    stream = [tok for doc in ids for tok in [*doc, tokenizer.eos_token_id]]
    seq_len = 17
    packed = pack_sequences(texts, tokenizer, seq_len)
    n = len(stream) // seq_len
    assert packed.dtype == torch.int64 and packed.shape == (n, seq_len)
    assert packed.flatten().tolist() == stream[: n * seq_len]
    whole = pack_sequences(texts, tokenizer, seq_len, drop_last=False)
    assert whole.shape == (n + 1, seq_len)
    assert whole[-1].tolist() == (stream[n * seq_len :] + stream)[:seq_len]
    no_eos = pack_sequences(texts, tokenizer, seq_len, add_eos=False)
    assert no_eos.flatten().tolist() == [tok for doc in ids for tok in doc][: no_eos.numel()]


def test_pack_sequences_errors(tokenizer):
    with pytest.raises(DataError, match="empty"):
        pack_sequences([], tokenizer, 8)
    with pytest.raises(DataError, match="empty"):
        pack_sequences(["", "  "], tokenizer, 8)
    n_tokens = len(tokenizer("short text", add_special_tokens=False)["input_ids"]) + 1
    with pytest.raises(DataError, match=rf"{n_tokens} tokens found in 1 documents.*seq_len=4096"):
        pack_sequences(["short text"], tokenizer, 4096)


def test_batches_resume_exactly():
    tokens = torch.arange(7 * 3).reshape(7, 3)
    run = batches(tokens, batch_size=4, seed=5)
    straight = [next(run) for _ in range(12)]
    assert all(b.shape == (4, 3) for b in straight)
    for start in range(12):
        resumed = batches(tokens, batch_size=4, seed=5, start_step=start)
        for expected in straight[start:]:
            assert torch.equal(next(resumed), expected)


def test_batches_visit_every_row_once_per_epoch():
    tokens = torch.arange(6 * 2).reshape(6, 2)
    run = batches(tokens, batch_size=3, seed=0)
    seen = [next(run) for _ in range(8)]
    epochs = (torch.cat(seen)[:, 0] // 2).reshape(4, 6)
    assert all(sorted(e.tolist()) == list(range(6)) for e in epochs)
    assert len({tuple(e.tolist()) for e in epochs}) > 1
    other = batches(tokens, batch_size=3, seed=1)
    assert not all(torch.equal(next(other), b) for b in seen)


def test_batches_larger_than_the_data():
    tokens = torch.arange(2 * 5).reshape(2, 5)
    batch = next(batches(tokens, batch_size=5, seed=0))
    assert batch.shape == (5, 5)
    with pytest.raises(DataError, match="batch_size"):
        next(batches(tokens, batch_size=0, seed=0))


# --- rows from document starts (evaluation) ---------------------------------------------------------


def _bos_tokenizer():
    from tokenizers import processors

    tok = _tiny_tokenizer(None)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


def test_document_rows_begin_at_document_starts(plain_tokenizer):
    tok = plain_tokenizer
    docs = [f"the sum {'of the roots ' * (i % 5)}is {i}." for i in range(30)]
    ids = [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs]
    seq_len = 23
    rows = data.document_rows(docs, tok, seq_len)
    assert rows.dtype == torch.int64 and rows.shape[1] == seq_len
    # greedy: a row takes documents until full; the next row starts at the following document
    want, d = [], 0
    while d < len(docs):
        row, first = [], d
        while len(row) < seq_len and d < len(docs):
            row += ids[d]
            d += 1
        if len(row) >= seq_len:
            want.append(row[:seq_len])
        assert row[: len(ids[first])] == ids[first][: seq_len]
    assert rows.tolist() == want and len(want) > 2
    assert data.document_rows(docs, tok, seq_len, rows=2).tolist() == want[:2]


def test_document_rows_add_bos_and_eos_as_in_real_use():
    tok = _bos_tokenizer()
    bos, eos = tok.bos_token_id, tok.eos_token_id

    def body(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    # a BOS before each document, never twice; an EOS after it unless the text already ends with one
    docs = ["the sum is 5.", "<s>the roots are 2 and 3.<|endoftext|>\n", "so the answer is 5."]
    want = [bos, *body(docs[0]), eos, *body(docs[1]), bos, *body(docs[2]), eos]
    assert body(docs[1])[0] == bos and body(docs[1])[-2] == eos  # the second text brings its own BOS and EOS
    assert data.document_rows(docs, tok, len(want)).tolist() == [want]


def test_document_rows_errors(plain_tokenizer):
    with pytest.raises(DataError, match="empty"):
        data.document_rows(["", " "], plain_tokenizer, 8)
    with pytest.raises(DataError, match="fewer than seq_len=4096"):
        data.document_rows(["short text"], plain_tokenizer, 4096)
    with pytest.raises(DataError, match="rows=0"):
        data.document_rows(["short text"], plain_tokenizer, 2, rows=0)


def test_pystdlib_is_python_code_without_tests_split_by_file():
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = load_texts("pystdlib", split="train"), load_texts("pystdlib", split="eval")
    everything = load_texts("pystdlib", split="all")
    assert len(everything) == len(train) + len(held) > 100
    assert not set(train) & set(held)
    assert load_texts("pystdlib", split="eval") == held  # deterministic
    assert (root / "json" / "decoder.py").read_text() in everything
    assert all(len(d) <= data.PYSTDLIB_MAX_CHARS for d in everything)
    skipped = [root / "test" / "test_json" / "test_decode.py", root / "pydoc_data" / "topics.py",
               root / "encodings" / "cp1252.py", root / "unittest" / "test" / "test_case.py"]
    skipped = [p for p in skipped if p.is_file()]
    assert skipped, "no skipped file found to check"
    assert not {p.read_text() for p in skipped} & set(everything)


def test_prose_documents_are_generated_the_same_everywhere_and_split_by_seed():
    from kvpop.train import prose

    everything = load_texts("prose", split="all")
    assert everything == list(prose.prose_documents()) and len(everything) == prose.PROSE_DOCUMENTS
    # document i is its own generator's, whatever else was generated before
    assert prose.prose_document(7) == everything[7] and prose.prose_document(7) != everything[8]
    train, held = load_texts("prose", split="train"), load_texts("prose", split="eval")
    seeds = {d: i for i, d in enumerate(everything)}
    assert len(seeds) == len(everything)
    assert not {seeds[d] for d in train} & {seeds[d] for d in held}
    assert len(train) + len(held) == len(everything) and len(held) == round(0.1 * len(everything))
    assert load_texts("prose", split="eval", seed=1) != held
    assert not any(ch.isdigit() for ch in held[0])
    low, high = prose.PROSE_PARAGRAPHS
    assert all(low <= d.count("\n\n") + 1 <= high for d in everything[:20])


def test_pydoc_is_pythons_help_topics_split_by_topic():
    from pydoc_data.topics import topics

    everything = load_texts("pydoc", split="all")
    assert len(everything) == len([t for t in topics.values() if t.strip()]) > 50
    assert topics["assignment"].strip() + "\n" in everything
    train, held = load_texts("pydoc", split="train"), load_texts("pydoc", split="eval")
    assert held and not set(train) & set(held) and len(train) + len(held) == len(everything)


def test_a_mixture_is_refused_where_one_source_is_read():
    with pytest.raises(DataError, match="is a mixture of sources"):
        load_texts("champ,prose")
