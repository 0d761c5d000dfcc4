"""Haystack text for the long-context suite (`kvpop.eval.tasks`): generated or read locally, never downloaded.

A filler is an endless, seeded stream of text chunks. The suite cuts it into words (each keeping its
trailing whitespace, so the text is reproduced exactly) and inserts needles only where a sentence
or a line ends. The sources:

- `prose`: sentences from a small seeded grammar (`kvpop.train.prose`; no digits, so a number needle is never
  echoed);
- `champ`: held-out champ math solutions (the `champ-dataset` package, as `kvpop.train.data` reads it);
- `stdlib`: Python standard-library source files, read in sorted order from this interpreter;
- any path to a local text file (or a directory of `.txt` / `.md` / `.py` files).
"""

from __future__ import annotations

import functools
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from kvpop.train.prose import prose_sentences

FILLERS = ("prose", "champ", "stdlib")
"""Named fillers; a local file or directory path works as well."""

# one word with its trailing whitespace; a text is the concatenation of its words (after leading space)
_WORD = re.compile(r"\S+\s*")
# a sentence ends with . ! ? (and perhaps a closing quote or bracket) before whitespace
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+$")
MAX_SENTENCE_WORDS = 40
"""A long sentence (or code line) gets a boundary every this many words, so depths stay fine-grained."""
VOCABULARY_PATIENCE = 5000
"""Words read without a new one before `Words.vocabulary` turns to pseudo-words."""

@functools.lru_cache(maxsize=1)
def _champ_texts() -> tuple[str, ...]:
    from kvpop.train.data import load_texts

    return tuple(load_texts("champ", split="eval"))


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = tuple(sorted(p for p in root.glob("*.py") if p.is_file()))
    if not files:
        raise ValueError(f"no Python source files under the standard library directory {root}")
    return files


@functools.lru_cache(maxsize=512)
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=8)
def _local_files(path: str) -> tuple[Path, ...]:
    p = Path(path)
    if p.is_file():
        return (p,)
    files = tuple(sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md", ".py") and f.is_file()))
    if not files:
        raise ValueError(f"--filler {path}: the directory holds no .txt, .md or .py files")
    return files


def _cycle(docs, rng: random.Random) -> Iterator[str]:
    """The documents in order from a seeded start, round and round (empty ones skipped)."""
    start = rng.randrange(len(docs))
    i = start
    while True:
        text = docs[i] if isinstance(docs[i], str) else _read(docs[i])
        if text.strip():
            yield text.strip() + "\n\n"
        i = (i + 1) % len(docs)
        if i == start and not any((d if isinstance(d, str) else _read(d)).strip() for d in docs):
            raise ValueError("the filler has no text")


def check_filler(name: str) -> None:
    """Raise a clear error for a filler that is neither a known name nor an existing path."""
    if name in FILLERS or Path(name).exists():
        return
    raise ValueError(f"unknown filler {name!r}: use one of {', '.join(FILLERS)}, or a path to a local text file "
                     "or directory")


def filler_texts(name: str, rng: random.Random) -> Iterator[str]:
    """An endless stream of text chunks of filler `name`, deterministic from `rng`."""
    check_filler(name)
    if name == "prose":
        return prose_sentences(rng)
    if name == "champ":
        return _cycle(_champ_texts(), rng)
    if name == "stdlib":
        return _cycle(_stdlib_files(), rng)
    return _cycle(_local_files(name), rng)


def is_code(name: str) -> bool:
    """Whether the filler is source code: needles then go on lines of their own."""
    return name == "stdlib" or Path(name).suffix == ".py"


class Words:
    """A filler's words (each with its trailing whitespace), fetched from the stream as needed.

    `ends[i]` says whether a needle may go right after word `i`: a line ends there, or a sentence
    (not in source code), or a long run of words had no such place.
    """

    def __init__(self, name: str, rng: random.Random):
        self.texts = filler_texts(name, rng)
        # in source code only a line end is a place for a needle ("e.g." or "x.y" is no sentence end)
        self.code = is_code(name)
        self.words: list[str] = []
        self.ends: list[bool] = []
        self._since_end = 0
        # `vocabulary`'s state: the words found so far, how far the filler was read, the pseudo-word source
        self._vocab: dict[str, None] = {}
        self._scanned = self._last_new = 0
        self._pseudo = random.Random(rng.random())

    def extend_to(self, n: int) -> None:
        """Make at least `n` words available."""
        while len(self.words) < n:
            chunk = next(self.texts)
            for word in _WORD.findall(chunk.lstrip()):
                self._since_end += 1
                end = ("\n" in word or self._since_end >= MAX_SENTENCE_WORDS
                       or (not self.code and bool(_SENTENCE_END.search(word))))
                self.words.append(word)
                self.ends.append(end)
                if end:
                    self._since_end = 0

    def vocabulary(self, n: int) -> list[str]:
        """The first `n` distinct lower-case alphabetic words of 3-10 letters, in order of first appearance.

        A small filler (the prose grammar) repeats its words forever: once it brings nothing new for
        `VOCABULARY_PATIENCE` words, seeded pseudo-words from syllables follow. A longer list keeps the
        shorter one as its start.
        """
        vocab = self._vocab
        while len(vocab) < n and self._scanned - self._last_new < VOCABULARY_PATIENCE:
            self.extend_to(self._scanned + 1)
            for w in re.findall(r"[A-Za-z]+", self.words[self._scanned]):
                if 3 <= len(w) <= 10 and w.lower() not in vocab:
                    vocab[w.lower()] = None
                    self._last_new = self._scanned
            self._scanned += 1
        syllables = ("ka", "lo", "mi", "ten", "ru", "sa", "vel", "dor", "ni", "pa", "zu", "rim", "ost", "fe", "gal")
        while len(vocab) < n:
            vocab.setdefault("".join(self._pseudo.choice(syllables) for _ in range(self._pseudo.randint(2, 4))), None)
        return list(vocab)[:n]


__all__ = ["FILLERS", "Words", "check_filler", "filler_texts", "is_code", "prose_sentences"]
