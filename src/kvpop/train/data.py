"""Training data: documents from local files, a Hugging Face dataset or the embedded math corpus,
packed into fixed-length token sequences and served in a deterministic, resumable order.

    from kvpop.train.data import batches, load_texts, pack_sequences
    texts = load_texts("champ", split="train")                  # list[str], one per document
    tokens = pack_sequences(texts, tokenizer, seq_len=2048)     # int64 [N, 2048], cut anywhere
    rows = document_rows(texts, tokenizer, seq_len=2048)        # int64 [N, 2048], each at a document start
    for batch in batches(tokens, batch_size=4, seed=0):         # int64 [4, 2048], forever
        ...

Sources (`--data`):
- `champ`: the math-reasoning corpus of the PyPI package `champ-dataset` (270 competition problems,
  ~19k model-written solutions). One document per solution, "Problem: ...\\n\\nSolution: ...",
  plus one per reference solution. Train and eval are split by problem.
- `pystdlib`: Python code, out of champ's domain and on every machine: the `.py` sources of the
  running Python's standard library, one document per file, in sorted path order; test suites,
  installed packages and generated tables (`PYSTDLIB_SKIP`, files over `PYSTDLIB_MAX_CHARS`) are left
  out. The files depend on the Python version, so results name it.
- `prose`: generated English prose, the long-context suite's haystack text (`kvpop.train.prose`):
  `PROSE_DOCUMENTS` documents of ~1.5k-12k tokens, each from its own seeded generator, the same on
  every machine. Fluent but repetitive (a grammar of a few hundred words).
- `pydoc`: technical English with code examples, for out-of-domain evaluation only: the Python
  documentation topics that `help()` shows (`pydoc_data.topics`: the language reference's chapters,
  79 documents, ~110k tokens, in sorted topic order). `kvpop train` refuses it (`HELD_OUT_SOURCES`),
  so every split of it is unseen; `kvpop eval --data pydoc --split all` uses all of it.
- a `.txt`/`.md` file: the whole file is one document; a file over `TXT_BLOCK_CHARS` characters is
  cut at paragraph breaks into blocks of about that size, each a document, so that long books
  still give several documents to split into train and eval.
- a `.jsonl`/`.json` file: one record per line (or a JSON list). The text is the field `text_field`
  (by default `text`, else `messages`, else `conversations`); a field holding a list of
  `{role, content}` messages is rendered with the tokenizer's chat template.
- a `.parquet` file (needs `pyarrow`): the same fields, as columns.
- a directory: every file above inside it, recursively, in sorted order.
- anything else: a Hugging Face dataset name (`name` or `name:config`) loaded through the
  `datasets` package (its `train` split, or its only split). Nothing is downloaded when the
  machine is offline: the dataset must then already be in the local `datasets` cache.

Held-out evaluation data never overlaps the training data: champ holds out `eval_fraction` of the
problems of each category; other sources hold out `eval_fraction` of the documents (identical
documents always land on the same side: pystdlib is split by file, prose by generator seed). Both
choices depend only on `seed` and the content.

Several sources at once (`champ,pystdlib:0.3`) are a mixture: `kvpop.train.mix` reads them, through
`load_texts` one source at a time.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import importlib.util
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvpop.train.prose import prose_documents

Split = Literal["train", "eval", "all"]

TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
TXT_BLOCK_CHARS = 50_000
"""A plain-text file longer than this is cut into documents of about this many characters (~12k tokens)."""
TEXT_FIELDS = ("text", "messages", "conversations")
"""Fields tried in order when no `text_field` is given."""
CHAMP_INSTALL = "pip install champ-dataset"
NAMED_SOURCES = ("champ", "pystdlib", "prose", "pydoc")
"""The sources `--data` knows by name; anything else is a path or a Hugging Face dataset name."""
HELD_OUT_SOURCES = ("pydoc",)
"""Named sources kept for out-of-domain evaluation: no training run, alone or in a mixture, reads them."""
PYSTDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings",
                           "pydoc_data"})
"""Directories of the standard library that `pystdlib` leaves out: installed packages, test suites, and
generated tables (codec maps, pydoc's topics)."""
PYSTDLIB_MAX_CHARS = 200_000
"""`pystdlib` leaves out files longer than this (generated code)."""
_PARTIAL_MARKER = "Below is a partial solution to the problem that may be helpful:"
_TOKENIZE_CHUNK = 1024


class DataError(ValueError):
    """A data source that cannot give training text; the message says what to do instead."""


# --- sources ---------------------------------------------------------------------------------------


def load_texts(
    source: str,
    *,
    split: Split = "train",
    text_field: str | None = None,
    tokenizer: Any = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
    limit: int | None = None,
    chat: bool = False,
) -> list[str]:
    """The documents of one split of a data source (see the module docstring for the sources).

    Args:
        source: `champ`, `pystdlib`, `prose`, `pydoc`, a path to a file or directory, or a Hugging Face
            dataset name (one source: a mixture is read by `kvpop.train.mix`).
        split: `train`, `eval` (the held-out part) or `all`.
        text_field: record field holding the text or the chat messages (jsonl, parquet, datasets).
        tokenizer: needed for chat-formatted records (its chat template renders them).
        eval_fraction: share of problems (champ) or documents (other sources) held out, in [0, 1).
        seed: picks the held-out part, and the document order of champ.
        limit: keep only the first `limit` documents of the split.
        chat: champ only: render each document as a user turn (the problem) and an assistant turn
            (the solution) through the tokenizer's chat template, as an instruct model sees them.

    Returns:
        Non-empty document strings: in source order, except champ, whose documents come in a seeded
        shuffled order (its file groups 72 solutions per problem, which packing would otherwise
        put side by side).
    """
    _check_split(split, eval_fraction)
    if limit is not None and limit < 1:
        raise DataError(f"limit={limit!r} is invalid: it must be >= 1 (or None for no limit)")
    if "," in source and not Path(source).expanduser().exists():
        raise DataError(f"{source!r} is a mixture of sources: kvpop train and kvpop eval read mixtures; here give "
                        "one source")
    if source == "champ":
        docs = _champ_documents(split, eval_fraction, seed, tokenizer if chat else None, chat)
    else:
        if chat:
            raise DataError("chat=True applies to --data champ only; chat records in files are always rendered")
        generated = {"pystdlib": _pystdlib_documents, "prose": prose_documents, "pydoc": _pydoc_documents}
        everything = list(generated[source]()) if source in generated else _load_source(source, text_field, tokenizer)
        held_out = _held_out(everything, eval_fraction, seed)
        docs = [d for i, d in enumerate(everything) if split == "all" or (i in held_out) == (split == "eval")]
    if not docs:
        raise DataError(
            f"the {split!r} split of {source!r} is empty (eval_fraction={eval_fraction}): "
            "give more documents, or use split='all' / eval_fraction=0"
        )
    return docs[:limit]


def _load_source(source: str, text_field: str | None, tokenizer: Any) -> list[str]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise DataError(f"directory {source!r} holds no data files ({', '.join(DATA_SUFFIXES)})")
        docs = [d for f in files for d in _load_file(f, text_field, tokenizer)]
    elif path.is_file() or path.is_symlink():
        docs = _load_file(path, text_field, tokenizer)
    elif _looks_like_path(source):
        raise DataError(f"data file {source!r} does not exist")
    else:
        docs = _load_hub(source, text_field, tokenizer)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"data source {source!r} is empty: it holds no non-blank text")
    return docs


def check_source(source: str) -> None:
    """Raise a `DataError` naming `source` if it can be no source at all; cheap, reads nothing.

    A named source, an existing path and, with the `datasets` package installed, any other name (a
    Hugging Face dataset, found or not when it loads) pass.
    """
    if source in NAMED_SOURCES or Path(source).expanduser().exists():
        return
    if Path(source).expanduser().is_symlink():
        from kvpop.files import check_file

        check_file(Path(source).expanduser(), "the data file")
    if _looks_like_path(source):
        raise DataError(f"data file {source!r} does not exist")
    if importlib.util.find_spec("datasets") is None:
        close = difflib.get_close_matches(source, NAMED_SOURCES, n=1)
        raise DataError(
            f"unknown data source {source!r}{f' (did you mean {close[0]!r}?)' if close else ''}: it is no named source "
            f"({', '.join(NAMED_SOURCES)}) and no local file or directory, and a Hugging Face dataset name needs the "
            "`datasets` package (pip install datasets)"
        )


def _looks_like_path(source: str) -> bool:
    # "org/name" is a hub id, but "./x", "/x", "~/x" or "x.jsonl" can only mean a local file.
    return source.startswith((".", "/", "~")) or Path(source).suffix.lower() in DATA_SUFFIXES


def _load_file(path: Path, text_field: str | None, tokenizer: Any) -> list[str]:
    from kvpop.files import check_file
    from kvpop.limits import check_fits

    check_file(path, "the data file")
    # read whole: a file larger than the memory free is refused before a byte of it is read
    check_fits({"the file's text": path.stat().st_size}, "cpu", f"data file {str(path)!r}", "split it into smaller files "
               "(a directory of them is one source)")
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return _text_blocks(path.read_text(encoding="utf-8", errors="replace"), TXT_BLOCK_CHARS)
    if suffix in PARQUET_SUFFIXES:
        return _load_parquet(path, text_field, tokenizer)
    if suffix in JSON_SUFFIXES:
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text, so no JSON records: a binary file or a damaged one") from None
        if not raw.strip():
            raise DataError(f"data file {str(path)!r} is empty")
        return [_record_text(r, text_field, tokenizer, where) for where, r in _json_records(raw, path)]
    raise DataError(f"{str(path)!r}: unsupported file type {suffix!r}; use one of {', '.join(DATA_SUFFIXES)}")


def _text_blocks(text: str, size: int) -> list[str]:
    """Cut `text` into consecutive blocks of at most ~`size` characters, preferring paragraph breaks."""
    blocks, start = [], 0
    while len(text) - start > size:
        end = start + size
        # a cut in the second half of the block, at a blank line if possible, else at a line end
        paragraph = text.rfind("\n\n", start + size // 2, end)
        line = text.rfind("\n", start + size // 2, end)
        end = paragraph + 2 if paragraph >= 0 else line + 1 if line >= 0 else end
        blocks.append(text[start:end])
        start = end
    blocks.append(text[start:])
    return blocks


def _json_records(raw: str, path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() == ".json":
        # a .json file is a list of records, one record, or (failing to parse whole) JSON lines
        try:
            whole = json.loads(raw)
        except json.JSONDecodeError:
            whole = None
        except (RecursionError, ValueError) as e:
            raise DataError(f"{path} is not data kvpop reads ({_json_fault(e)})") from None
        if isinstance(whole, (list, dict)):
            for i, r in enumerate(whole if isinstance(whole, list) else [whole]):
                yield f"{path}[{i}]", r
            return
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno} is not a JSON record ({e}); expected one JSON object per line") from e
        except (RecursionError, ValueError) as e:
            raise DataError(f"{path}:{lineno} is not a JSON record kvpop reads ({_json_fault(e)})") from None
        yield f"{path}:{lineno}", record


def _json_fault(err: BaseException) -> str:
    if isinstance(err, RecursionError):
        return "it nests too deeply"
    return " ".join(str(err).split())[:120]


def _load_parquet(path: Path, text_field: str | None, tokenizer: Any) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"reading {str(path)!r} needs pyarrow: pip install pyarrow") from e
    names = pq.read_schema(path).names
    column = _pick_field(names, text_field, str(path))
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    return [_value_text(v, tokenizer, f"{path} row {i}") for i, v in enumerate(values)]


def _load_hub(name: str, text_field: str | None, tokenizer: Any) -> list[str]:
    hint = f"pass a local .txt/.jsonl/.parquet file or directory, or a named source ({', '.join(NAMED_SOURCES)})"
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"{name!r} is no local file or directory, so it was taken for a Hugging Face dataset name, "
            f"but the `datasets` package is not installed (pip install datasets); or {hint}"
        ) from e
    path, _, config = name.partition(":")
    try:
        loaded = datasets.load_dataset(path, config or None)
    except Exception as e:
        # datasets raises many types (ConnectionError, FileNotFoundError, DatasetNotFoundError, ...)
        raise DataError(
            f"could not load the Hugging Face dataset {name!r} ({type(e).__name__}: {e}). Without a network "
            f"it must already be in the local datasets cache (set HF_HUB_OFFLINE=1 to fail fast); or {hint}"
        ) from e
    part = loaded["train"] if "train" in loaded else loaded[next(iter(loaded))]
    column = _pick_field(part.column_names, text_field, f"dataset {name!r}")
    return [_value_text(v, tokenizer, f"dataset {name!r} row {i}") for i, v in enumerate(part[column])]


def _pick_field(names: Sequence[str], text_field: str | None, where: str) -> str:
    if text_field is not None:
        if text_field not in names:
            raise DataError(f"{where}: no field {text_field!r} (fields: {', '.join(map(str, names))})")
        return text_field
    for name in TEXT_FIELDS:
        if name in names:
            return name
    raise DataError(
        f"{where}: none of the fields {', '.join(TEXT_FIELDS)} is present (fields: {', '.join(map(str, names))}); "
        "name the text field with --text-field"
    )


def _record_text(record: Any, text_field: str | None, tokenizer: Any, where: str) -> str:
    if isinstance(record, str) and text_field is None:
        return record
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with a text field, got {type(record).__name__}")
    return _value_text(record[_pick_field(list(record), text_field, where)], tokenizer, where)


def _value_text(value: Any, tokenizer: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        return format_chat(value, tokenizer, where)
    raise DataError(f"{where}: the text field holds a {type(value).__name__}, not a string or a list of messages")


_ROLES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant"}


def format_chat(messages: list[Any], tokenizer: Any, where: str = "conversation") -> str:
    """Render `[{role, content}, ...]` (ShareGPT's `{from, value}` too) with the tokenizer's chat template."""
    if tokenizer is None:
        raise DataError(f"{where}: chat messages need a tokenizer with a chat template to be rendered as text")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: chat messages need a chat template, and the tokenizer has none; "
            "use a chat (instruct) model's tokenizer, or plain text records"
        )
    normalised = []
    for m in messages:
        if not isinstance(m, dict):
            raise DataError(f"{where}: a chat message must be an object with role and content, got {m!r:.80}")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value", m.get("text")))
        if role is None or not isinstance(content, str):
            raise DataError(f"{where}: a chat message needs 'role' and a string 'content', got keys {sorted(m)}")
        normalised.append({"role": _ROLES.get(str(role).lower(), str(role).lower()), "content": content})
    return tokenizer.apply_chat_template(normalised, tokenize=False)


# --- champ -----------------------------------------------------------------------------------------


def champ_problems(split: Split = "eval", *, eval_fraction: float = 0.1, seed: int = 0) -> list[dict[str, str]]:
    """The problems of one champ split, in the file's order, for pass@1 evaluation.

    Each dict has `id`, `category`, `problem`, `answer` (the reference final answer, free-form, e.g.
    `"C(10, 5), or equivalently 252"`) and `solution` (the reference steps, numbered). The split is
    the one `load_texts("champ", ...)` uses with the same `eval_fraction` and `seed`.
    """
    _check_split(split, eval_fraction)
    problems = _champ_data()
    held_out = _champ_held_out(eval_fraction, seed)
    return [
        {k: p[k] for k in ("id", "category", "problem", "answer", "solution")}
        for p in problems
        if split == "all" or (p["id"] in held_out) == (split == "eval")
    ]


def _champ_documents(split: Split, eval_fraction: float, seed: int, tokenizer: Any, chat: bool) -> list[str]:
    held_out = _champ_held_out(eval_fraction, seed)
    pairs = [
        (p["problem"], solution)
        for p in _champ_data()
        if split == "all" or (p["id"] in held_out) == (split == "eval")
        for solution in (p["reference"], *p["samples"])
    ]
    pairs.sort(key=lambda pair: _key(seed, pair[0] + "\0" + pair[1]))
    if chat:
        return [
            format_chat([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenizer, "champ")
            for q, a in pairs
        ]
    return [f"Problem: {q}\n\nSolution: {a}" for q, a in pairs]


def _champ_held_out(eval_fraction: float, seed: int) -> frozenset[str]:
    # stratified by category, so that every kind of problem is evaluated
    by_category: dict[str, list[str]] = {}
    for p in _champ_data():
        by_category.setdefault(p["category"], []).append(p["id"])
    return frozenset(i for ids in by_category.values() for i in _held_out_keys(ids, eval_fraction, seed))


@functools.lru_cache(maxsize=1)
def _champ_data() -> tuple[dict[str, Any], ...]:
    """Parse `champ_dataset/dataset_files/v0.json` (72 MB, ~1 s) into one flat dict per problem."""
    # locate the package without importing it: its __init__ needs `natsort`, which kvpop does not use
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"--data champ needs the champ-dataset package: {CHAMP_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset_files" / "v0.json"
    if not path.is_file():
        raise DataError(f"champ-dataset is installed but has no {path}; reinstall it: {CHAMP_INSTALL}")
    raw = json.loads(path.read_text(encoding="utf-8"))
    problems = []
    for pid, p in _literal(raw["problems"]).items():
        p = _literal(p)
        problem = p["_text"].strip()
        steps = [_literal(s)["_text"].strip() for s in _literal(p["solution"])["steps"]]
        answer = str(p["_answer"]).strip()
        reference = "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1)) + f"\n\nAnswer: {answer}"
        conversations = _literal(p.get("conversations") or {})
        samples = [s for c in conversations.values() if (s := _champ_sample(problem, _literal(c))) is not None]
        problems.append(
            {
                "id": pid,
                "category": p["category"],
                "problem": problem,
                "answer": answer,
                "solution": reference,
                "reference": reference,
                "samples": samples,
            }
        )
    return tuple(problems)


def _literal(value: Any) -> Any:
    # champ fields may hold containers as Python-literal strings; v1.0.0 stores plain JSON, which passes through
    return ast.literal_eval(value) if isinstance(value, str) and value[:1] in "[{" else value


def _champ_sample(problem: str, conversation: dict[str, Any]) -> str | None:
    """One model-written solution: the reply to the turn that poses `problem`, and its one-line summary.

    Earlier turns (few-shot examples, concept explanations) are left out: they hold other problems.
    """
    messages = [_literal(m) for m in conversation.get("messages") or []]
    ask = next(
        (i for i, m in enumerate(messages) if m.get("role") == "User" and problem in (m.get("text") or "")), None
    )
    if ask is None or ask + 1 >= len(messages):
        return None
    reply = messages[ask + 1]
    if not str(reply.get("role", "")).startswith("Model.") or not reply.get("text"):
        return None
    text = reply["text"].strip()
    # "1/3 Soln" / "2/3 Soln" runs continue a given partial solution: keep it, or the reply starts mid-way
    _, marker, partial = messages[ask]["text"].partition(_PARTIAL_MARKER)
    if marker and partial.strip():
        text = partial.strip() + "\n" + text
    summary = messages[ask + 3] if ask + 3 < len(messages) else {}
    if str(summary.get("role", "")).startswith("Model.") and summary.get("text"):
        text += "\n\n" + summary["text"].strip()
    return text


# --- pystdlib ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _pystdlib_documents() -> tuple[str, ...]:
    """The standard library's `.py` files (see the module docstring), one document each, in sorted path order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if PYSTDLIB_SKIP.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip() and len(text) <= PYSTDLIB_MAX_CHARS:
            docs.append(text)
    if not docs:
        raise DataError(f"--data pystdlib found no Python sources under {root}")
    return tuple(docs)


# --- pydoc ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _pydoc_documents() -> tuple[str, ...]:
    """The documentation topics of `help()` (`pydoc_data.topics`), one document each, in sorted topic order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise DataError("--data pydoc needs the standard library's pydoc_data package, which this Python lacks "
                        "(some distributions ship it separately)") from e
    docs = tuple(topics[name].strip() + "\n" for name in sorted(topics) if topics[name].strip())
    if not docs:
        raise DataError("--data pydoc: pydoc_data.topics holds no text")
    return docs


# --- the train / eval split ------------------------------------------------------------------------


def _check_split(split: str, eval_fraction: float) -> None:
    if split not in ("train", "eval", "all"):
        raise DataError(f"split={split!r} is invalid: use 'train', 'eval' or 'all'")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction!r} is invalid: it must lie in [0, 1)")


def _key(seed: int, text: str) -> int:
    """A 64-bit hash of (seed, text), stable across runs, processes and Python versions."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{text}".encode(), digest_size=8).digest(), "big")


def _held_out_count(n: int, eval_fraction: float) -> int:
    k = round(eval_fraction * n)
    # a positive fraction of two or more items holds out at least one and keeps at least one
    return min(max(k, 1), n - 1) if eval_fraction > 0 and n >= 2 else k


def _held_out_keys(items: Sequence[str], eval_fraction: float, seed: int) -> list[str]:
    k = _held_out_count(len(items), eval_fraction)
    return sorted(items, key=lambda s: (_key(seed, s), s))[:k]


def _held_out(docs: Sequence[str], eval_fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: those of lowest hash, identical documents together."""
    k = _held_out_count(len(docs), eval_fraction)
    if k == 0:
        return set()
    keys = [_key(seed, d) for d in docs]
    cutoff = sorted(keys)[k - 1]
    return {i for i, key in enumerate(keys) if key <= cutoff}


# --- packing and batching --------------------------------------------------------------------------


def pack_sequences(
    texts: Sequence[str], tokenizer: Any, seq_len: int, *, add_eos: bool = True, drop_last: bool = True
) -> Tensor:
    """Tokenize `texts`, join them into one stream and cut it into rows of `seq_len` tokens.

    Documents are tokenized without special tokens and each is followed by the tokenizer's EOS
    (its BOS if it has no EOS) when `add_eos`. A final partial row is dropped (`drop_last`) or
    completed with tokens from the start of the stream, so that every row is real text.

    Returns:
        int64 `[N, seq_len]`.
    """
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len!r} is invalid: it must be >= 1")
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise DataError("no text to pack: the documents are empty")
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if add_eos and sep is None:
        raise DataError("the tokenizer has neither an EOS nor a BOS token to separate documents; pass add_eos=False")
    pieces = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        ids = tokenizer(list(texts[start : start + _TOKENIZE_CHUNK]), add_special_tokens=False, verbose=False)
        for doc in ids["input_ids"]:
            pieces.append(np.asarray(doc + [sep] if add_eos else doc, dtype=np.int64))
    stream = np.concatenate(pieces)
    n, rest = divmod(len(stream), seq_len)
    if n == 0:
        raise DataError(
            f"{len(stream)} tokens found in {len(texts)} documents, but one sequence needs seq_len={seq_len}: "
            "give more text or a smaller --seq-len"
        )
    rows = stream[: n * seq_len].reshape(n, seq_len)
    if rest and not drop_last:
        last = np.concatenate([stream[n * seq_len :], stream[: seq_len - rest]])
        rows = np.concatenate([rows, last[None]])
    return torch.from_numpy(rows)


def document_rows(texts: Sequence[str], tokenizer: Any, seq_len: int, *, rows: int | None = None) -> Tensor:
    """Rows of `seq_len` tokens that each begin at a document start, as a model reads text in real use.

    Each document is tokenized the tokenizer's default way (a BOS where it adds one, unless the text
    already begins with it, as a chat template's output may) and followed by the EOS (its BOS if it has
    no EOS) unless the text already ends with it, as a chat template's last turn does. A row takes
    documents in order from its first one until it holds `seq_len` tokens, cutting the last one; the
    next row begins at the document after the last one this row touched, so no document is in two rows.
    A final row that the documents cannot fill is dropped. `pack_sequences` instead cuts one stream of
    documents anywhere (training, and `kvpop eval --packing concat`).

    Args:
        texts: documents, in order.
        seq_len: tokens per row, >= 1.
        rows: stop after this many rows (None: as many as the documents fill).
    Returns:
        int64 `[N, seq_len]`, N >= 1.
    """
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len!r} is invalid: it must be >= 1")
    if rows is not None and rows < 1:
        raise DataError(f"rows={rows!r} is invalid: it must be >= 1 (or None for every row)")
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise DataError("no text to evaluate: the documents are empty")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    eos_text = tokenizer.eos_token if tokenizer.eos_token_id is not None else tokenizer.bos_token
    bos_text = tokenizer.bos_token

    def tokens(text: str) -> list[int]:
        ids = tokenizer(text, add_special_tokens=not (bos_text and text.startswith(bos_text)), verbose=False)
        ids = list(ids["input_ids"])
        if eos is not None and not (eos_text and text.rstrip().endswith(eos_text)):
            ids.append(eos)
        return ids

    out: list[list[int]] = []
    row: list[int] = []
    for text in texts:
        row += tokens(text)
        if len(row) >= seq_len:
            out.append(row[:seq_len])
            row = []
            if rows is not None and len(out) == rows:
                break
    if not out:
        raise DataError(
            f"{len(texts)} documents hold fewer than seq_len={seq_len} tokens together: give more text or a smaller "
            "--seq-len"
        )
    return torch.tensor(out, dtype=torch.long)


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    """The permutation of `n` rows used in `epoch`; depends only on (`n`, `seed`, `epoch`). int64 `[n]`."""
    generator = torch.Generator().manual_seed(_key(seed, f"epoch {epoch}") >> 1)
    return torch.randperm(n, generator=generator)


def batches(tokens: Tensor, batch_size: int, seed: int, start_step: int = 0) -> Iterator[Tensor]:
    """Yield `[batch_size, S]` batches of the rows of `tokens` forever, reshuffled every epoch.

    The rows are read as one endless stream, epoch after epoch, each epoch in the order of
    `epoch_order(N, seed, epoch)`; step `i` takes stream items `[i * batch_size, (i + 1) * batch_size)`,
    so a batch may straddle two epochs. Starting at `start_step` gives exactly the batches an
    uninterrupted run gives from that step on, which is what exact resumption needs.

    Args:
        tokens: int64 `[N, S]` from `pack_sequences`.
        batch_size: rows per batch, >= 1 (may exceed N).
        seed: seeds every epoch's order.
        start_step: index of the first batch to yield, >= 0.
    """
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise DataError(f"tokens must be a non-empty [N, S] tensor, got shape {tuple(tokens.shape)}")
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size!r} is invalid: it must be >= 1")
    if start_step < 0:
        raise DataError(f"start_step={start_step!r} is invalid: it must be >= 0")
    n = tokens.shape[0]
    epoch, offset = divmod(start_step * batch_size, n)
    order = epoch_order(n, seed, epoch)
    while True:
        parts, need = [], batch_size
        while need:
            take = min(need, n - offset)
            parts.append(order[offset : offset + take])
            offset, need = offset + take, need - take
            if offset == n:
                epoch, offset = epoch + 1, 0
                order = epoch_order(n, seed, epoch)
        yield tokens[torch.cat(parts)]
