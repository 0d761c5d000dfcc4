"""Training data from a mixture of sources, `--data champ:0.5,pystdlib:0.3,prose:0.2`, for `kvpop train`.

    from kvpop.train.mix import parse_mixture, training_rows
    parse_mixture("champ,pystdlib:0.5")        # (Part('champ', weight 1, share 2/3), Part('pystdlib', 0.5, 1/3))
    pool = training_rows("champ:2,prose", tokenizer, seq_len=2048, pool_tokens=2**22)
    pool.tokens                                # int64 [N, 2048], N = ceil(pool_tokens / seq_len)
    pool.sources                               # int64 [N], the part each row was cut from

The syntax: sources separated by commas, each `SOURCE` or `SOURCE:WEIGHT`. A SOURCE is anything
`--data` takes alone (`kvpop.train.data.load_texts`: a named source, a file, a directory, a dataset
name, `name:config` included), a WEIGHT a positive number (default 1); the weights are normalised to
shares. A spec without a comma is one source, read exactly as before mixtures existed. The JSONL file
`kvpop selfgen` writes (`kvpop.eval.selfgen`: the dense model's own generations of champ's training
problems) is such a source: `--data champ:0.5,runs/selfgen.jsonl:0.5` mixes the generation regime in.

The pool of `ceil(pool_tokens / seq_len)` rows is divided among the sources by their shares (largest
remainders; at least one row each). Each source's rows are cut from its own stream of training
documents as `pack_sequences` cuts a single source's (the first row at a document start, the others
anywhere): no row holds two sources. A source whose training split runs out before its share is
repeated, a second pass over its documents, as a single source is when the run outlasts its pool.
`batches` shuffles the pool every epoch, so batches draw each source in proportion to its share.
The pool depends on the spec, the tokenizer, `seq_len`, `pool_tokens`, `seed`, `eval_fraction` and
`chat` only: with `--max-tokens` set, runs of any `--steps` see the same rows in the same order.
`chat` renders the champ part as a chat (the other parts stay plain text); `text_field` applies to
every file or dataset part. A held-out source (`HELD_OUT_SOURCES`: pydoc) is refused in training.

`kvpop eval --data` takes the same spec (`kvpop.eval.evaluate.held_out_rows`): `--sequences` divided
by the shares in the same way, each source giving its own held-out rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvpop.train.data import HELD_OUT_SOURCES, NAMED_SOURCES, DataError, check_source, load_texts, pack_sequences

# a weight as written after the last colon of a part: 0.5, 2, 1e-1, and (refused later) -1, 0, inf
_WEIGHT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|infinity|nan)", re.IGNORECASE)


@dataclass(frozen=True)
class Part:
    """One source of a mixture."""

    source: str
    """What `load_texts` reads: a named source, a path or a dataset name."""
    weight: float
    """As written (1 when none was)."""
    share: float
    """`weight` over the sum of the weights: the part's share of the rows."""


@dataclass(frozen=True)
class Pool:
    """The packed training rows of one run."""

    tokens: Tensor  # [N, S] int64
    sources: Tensor  # [N] int64: the index in `parts` of each row's source
    parts: tuple[Part, ...]
    passes: tuple[float, ...]
    """Per part: 1 where its training documents fill its rows, else rows over the rows they give (repeated)."""

    def summary(self) -> list[dict[str, Any]]:
        """Per part: source, weight, share, rows and passes (saved in the run's `config.json`)."""
        rows = torch.bincount(self.sources, minlength=len(self.parts)).tolist()
        return [{"source": p.source, "weight": p.weight, "share": round(p.share, 6), "rows": r,
                 "passes": round(passes, 3)} for p, r, passes in zip(self.parts, rows, self.passes)]


def parse_mixture(spec: str) -> tuple[Part, ...]:
    """The parts of a `--data` spec (see the module docstring); one part, weight 1, for a single source.

    Raises:
        DataError: naming the bad value: an empty part, a weight that is no positive finite number, a
            source given twice, a held-out source in a mixture, a source that can be none (not named,
            no such path, no `datasets` package for a dataset name).
    """
    if not spec or not spec.strip():
        raise DataError(f"--data {spec!r} is empty: give a source, or sources separated by commas")
    if "," not in spec or Path(spec).expanduser().exists():
        source, colon, tail = spec.rpartition(":")
        if colon and _WEIGHT.fullmatch(tail.strip()) and (source in NAMED_SOURCES or Path(source).exists()):
            raise DataError(f"--data {spec!r}: a weight applies within a mixture of two or more sources "
                            f"(--data {spec},pystdlib); one source is all the data: --data {source}")
        return (Part(spec, 1.0, 1.0),)
    items = []
    for item in spec.split(","):
        source, colon, tail = item.rpartition(":")
        if colon and _WEIGHT.fullmatch(tail.strip()):
            weight = float(tail)
            if not (math.isfinite(weight) and weight > 0):
                raise DataError(f"--data {spec!r}: the weight of {source.strip()!r} is {tail.strip()}; a weight "
                                "must be a finite number above 0")
        else:
            source, weight = item, 1.0
        source = source.strip()
        if not source:
            raise DataError(f"--data {spec!r} has an empty source: write SOURCE or SOURCE:WEIGHT between commas, "
                            "e.g. champ:0.5,pystdlib:0.3,prose:0.2")
        items.append((source, weight))
    names = [s for s, _ in items]
    twice = sorted({s for s in names if names.count(s) > 1})
    if twice:
        raise DataError(f"--data {spec!r} names {', '.join(map(repr, twice))} more than once: give each source once, "
                        "with its weight")
    held = [s for s in names if s in HELD_OUT_SOURCES]
    if held:
        raise DataError(f"--data {spec!r}: {held[0]!r} is held out for out-of-domain evaluation and never mixed in; "
                        f"evaluate on it alone (kvpop eval --data {held[0]})")
    for source in names:
        try:
            check_source(source)
        except DataError as e:
            raise DataError(f"--data {spec!r}: {e}") from None
    total = sum(w for _, w in items)
    return tuple(Part(s, w, w / total) for s, w in items)


def check_training_data(spec: str) -> tuple[Part, ...]:
    """`parse_mixture`, refusing a held-out source given alone too: what `kvpop train` checks first."""
    parts = parse_mixture(spec)
    if parts[0].source in HELD_OUT_SOURCES:
        raise DataError(f"--data {spec}: it is held out for out-of-domain evaluation (kvpop eval --data {spec}); "
                        "train on other sources")
    return parts


def split_count(parts: Sequence[Part], n: int) -> list[int]:
    """`n` rows divided among `parts` by share: largest remainders (ties to the earlier part), at least one each.

    Args:
        n: rows to divide, >= len(parts).
    """
    if n < len(parts):
        raise DataError(f"{n} sequences cannot hold the {len(parts)} sources of the mixture: ask for {len(parts)} "
                        "or more")
    exact = [p.share * n for p in parts]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: (counts[i] - exact[i], i))[: n - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):
        if counts[i] == 0:
            counts[max(range(len(counts)), key=counts.__getitem__)] -= 1
            counts[i] = 1
    return counts


COUNT_CHUNK = 64
"""Documents per tokenizer call while choosing the training documents: the same choice, far fewer calls."""


def training_rows(
    spec: str,
    tokenizer: Any,
    seq_len: int,
    pool_tokens: int,
    *,
    text_field: str | None = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
    chat: bool = False,
) -> Pool:
    """The training rows of `--data spec`: about `pool_tokens` tokens (see the module docstring).

    A single source gives the rows `kvpop train` always packed: its training documents in order until
    they hold `pool_tokens` tokens, packed whole (the last row's document may run past the budget).
    """
    parts = check_training_data(spec)
    if len(parts) == 1:
        texts = load_texts(spec, split="train", text_field=text_field, tokenizer=tokenizer,
                           eval_fraction=eval_fraction, seed=seed, chat=chat)
        try:
            tokens = _pack_covering(texts, tokenizer, seq_len, pool_tokens)
        except DataError as e:
            raise DataError(f"{spec}: {e}") from None
        return Pool(tokens, torch.zeros(len(tokens), dtype=torch.long), parts, (1.0,))
    if chat and not any(p.source == "champ" for p in parts):
        raise DataError(f"--chat formats champ as a chat, and --data {spec} has no champ part")
    counts = split_count(parts, max(math.ceil(pool_tokens / seq_len), len(parts)))
    rows, passes = [], []
    for part, count in zip(parts, counts):
        try:
            texts = load_texts(part.source, split="train", text_field=text_field, tokenizer=tokenizer,
                               eval_fraction=eval_fraction, seed=seed, chat=chat and part.source == "champ")
            packed = _pack_covering(texts, tokenizer, seq_len, count * seq_len)
        except DataError as e:
            raise DataError(f"--data {spec}: {part.source}: {e}") from None
        passes.append(max(1.0, count / len(packed)))
        rows.append(packed.repeat(math.ceil(count / len(packed)), 1)[:count])
    sources = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(counts))
    return Pool(torch.cat(rows), sources, parts, tuple(passes))


def _pack_covering(texts: Sequence[str], tokenizer: Any, seq_len: int, tokens: int) -> Tensor:
    """`pack_sequences` of the first documents that hold `tokens` tokens (each counted with its EOS)."""
    # documents in order until the budget is covered (champ alone is ~30M tokens), counted a chunk per
    # tokenizer call: one call per document took 53 s of every start of a long run (4.9M tokens, 2 cores)
    chosen, total = [], 0
    for start in range(0, len(texts), COUNT_CHUNK):
        chunk = texts[start : start + COUNT_CHUNK]
        for text, ids in zip(chunk, tokenizer(list(chunk), add_special_tokens=False, verbose=False)["input_ids"]):
            chosen.append(text)
            total += len(ids) + 1
            if total >= tokens:
                return pack_sequences(chosen, tokenizer, seq_len)
    return pack_sequences(chosen, tokenizer, seq_len)


__all__ = ["Part", "Pool", "check_training_data", "parse_mixture", "split_count", "training_rows"]
