"""The dense model's own generations, written as training text (`kvpop selfgen`).

    kvpop selfgen --model smollm2-135m --out runs/selfgen.jsonl --sequences 256 --tokens 4096 --temperature 0,0.7
    kvpop train --model smollm2-135m --data champ:0.5,runs/selfgen.jsonl:0.5 ...

champ's documents are solutions written in one go, without the failures of a small model left to
generate on its own: on long generations it often falls into a loop (a solution ending in thousands
of "0" tokens), where it attends far back into the recent run while a scorer trained on champ keeps
the old context. The paper distils on model-generated reasoning traces; this writes that regime for
any model kvpop loads: the dense model (no eviction) continues held-in prompts, and each prompt with
its continuation is one training document.

The prompts (`--prompts`) are champ's training-split problems by default, never its eval split
(`champ_problems("train")`), each rendered as `kvpop eval --generate` renders the held-out ones
(`kvpop.eval.fidelity.champ_prompt`: a user turn asking for a boxed answer, with the generation
prompt), or as the head of a plain champ document ("Problem: ...\\n\\nSolution:") for a model without a
chat template. Any other source `--data` takes (a file, a directory, `pystdlib`, ...) gives its
training-split documents, each as a user turn (plain text without a chat template). They come in an
order shuffled by `seed`; sequence `i` continues prompt `i mod P`, so more sequences than prompts
take the prompts again, at other seeds. A prompt whose tokens and `tokens` new ones exceed the
model's positions is left out (a note says how many).

`temperatures` divides the sequences evenly, in blocks (`0,0.7` and 10 sequences: 0-4 greedy, 5-9 at
0.7), so that the temperatures continue different prompts. Generation is `generate_batch`'s fast path
on the dense model (`kvpop.decode.Decoder`: the step captured as a CUDA graph on CUDA, eager on a
CPU), `batch` left-padded prompts at a time, sampled with `kvpop.sampling`: row `i` draws with seed
`row_seed(seed, i)` alone, so a sequence does not depend on `batch` (on CUDA, up to the rounding by
which captured steps of different batch sizes differ: greedy texts agree until a near-tie of the
logits). Each row stops at the EOS token (kept) or after `tokens` tokens; a row that stops early is
written all the same, however short, and the summary counts those under `min_tokens`.

Each line of the JSONL file:

    {"text": prompt + continuation, "prompt_tokens": int, "generated_tokens": int,
     "temperature": float, "seed": int, "model": str}

Nothing finished is lost: each sequence is appended to `FILE.jsonl.partial` as soon as its batch ends
(after a header naming the run), and `FILE.jsonl` is written whole from it at the end. A run stopped by
a time limit or Ctrl-C is continued by the same command (`resume`; a partial file of another run is
refused, `--force` starts over), so a time limit costs at most the batch that was running.

`text` is the prompt's and the generated tokens decoded together with their special tokens (the chat
markers, the EOS): what the model read and wrote (tokenized again, the same tokens, except where the
model wrote a split the tokenizer would not make, or bytes that are no valid UTF-8). `kvpop train
--data FILE.jsonl` reads the `text` field; like any file source, 10 % of the lines (by hash) are held
out for `kvpop eval --data FILE.jsonl`. `seed` is the row's sampling seed (`row_seed`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpop.eval.fidelity import champ_prompt, repeated_ngrams
from kvpop.eval.generation import generate_batch

MIN_TOKENS = 256
"""The default `min_tokens`: a generation shorter than this is counted in the summary (it is written all the same)."""


@dataclass(frozen=True)
class SelfgenConfig:
    """What `kvpop selfgen` generates; the checks name the command's flags."""

    sequences: int = 64
    """Generated sequences (`--sequences`)."""
    tokens: int = 2048
    """New tokens per sequence, at most: a row stops at EOS (`--tokens`)."""
    temperatures: tuple[float, ...] = (0.0, 0.7)
    """Sampling temperatures, 0 greedy; the sequences are divided evenly among them (`--temperature`)."""
    seed: int = 0
    """Shuffles the prompts and seeds every row's sampling (`--seed`)."""
    batch: int = 1
    """Rows generated together, left-padded (`--batch`)."""
    min_tokens: int | None = None
    """Rows that stop at EOS before this many tokens are still written; the summary counts them (`--min-tokens`;
    None: `MIN_TOKENS`, or `tokens` if fewer)."""
    prompts: str = "champ"
    """The prompt source: `champ` (its training-split problems) or anything `--data` takes (`--prompts`)."""
    text_field: str | None = None
    """The record field of a file or dataset `prompts` that holds the prompt (`--text-field`)."""

    def __post_init__(self) -> None:
        if self.sequences < 1:
            raise ValueError(f"--sequences {self.sequences}: must be >= 1")
        if self.tokens < 1:
            raise ValueError(f"--tokens {self.tokens}: must be >= 1")
        if self.batch < 1:
            raise ValueError(f"--batch {self.batch}: must be >= 1")
        if self.min_tokens is None:
            # frozen: the resolved default is set once, here
            object.__setattr__(self, "min_tokens", min(MIN_TOKENS, self.tokens))
        if not 0 <= self.min_tokens <= self.tokens:
            raise ValueError(f"--min-tokens {self.min_tokens}: must lie in [0, --tokens {self.tokens}]")
        if not self.temperatures:
            raise ValueError("--temperature: give at least one temperature")
        for t in self.temperatures:
            if not (math.isfinite(t) and t >= 0):
                raise ValueError(f"--temperature {t}: a temperature must be a finite number >= 0 (0: greedy)")
        if len(set(self.temperatures)) < len(self.temperatures):
            raise ValueError(f"--temperature {','.join(map(str, self.temperatures))}: a temperature is given twice")
        if len(self.temperatures) > self.sequences:
            raise ValueError(f"--sequences {self.sequences} cannot be divided among the {len(self.temperatures)} "
                             f"temperatures {','.join(map(str, self.temperatures))}: ask for "
                             f"{len(self.temperatures)} or more, or give fewer temperatures")


@dataclass(frozen=True)
class Row:
    """One sequence to generate."""

    index: int
    prompt: int
    """Index into the prompt list."""
    temperature: float
    seed: int


def parse_temperatures(spec: str) -> tuple[float, ...]:
    """`--temperature` as floats: one number or a comma list (`0,0.7`); the values are checked by `SelfgenConfig`."""
    try:
        return tuple(float(t) for t in spec.split(","))
    except ValueError:
        raise ValueError(f"--temperature {spec!r}: must be a number or comma-separated numbers, e.g. 0,0.7") from None


def row_seed(seed: int, index: int) -> int:
    """The sampling seed of sequence `index`: distinct for every sequence of a run."""
    return seed * 1_000_003 + index


def render_prompt(tokenizer, user: str) -> list[int]:
    """`user` as a user turn with the generation prompt where the tokenizer has a chat template, else as it is."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(user)["input_ids"]


def load_prompts(source: str, tokenizer, *, text_field: str | None = None) -> list[list[int]]:
    """The training-split prompts of `source` as token ids, in the source's order (see the module docstring)."""
    from kvpop.train.data import champ_problems, load_texts

    if source == "champ":
        problems = [p["problem"] for p in champ_problems("train")]
        if getattr(tokenizer, "chat_template", None):
            return [champ_prompt(tokenizer, p) for p in problems]
        return [render_prompt(tokenizer, f"Problem: {p}\n\nSolution:") for p in problems]
    if "," in source:
        raise ValueError(f"--prompts {source!r}: give one source, not a mixture")
    return [render_prompt(tokenizer, doc) for doc in load_texts(source, split="train", text_field=text_field,
                                                                tokenizer=tokenizer)]


def plan(cfg: SelfgenConfig, prompts: int) -> list[Row]:
    """The sequences: blocks of the temperatures (sizes differing by at most one), prompts in the shuffled order.

    Args:
        prompts: how many prompts there are (P).
    """
    if prompts < 1:
        raise ValueError("no prompt to generate from")
    order = torch.randperm(prompts, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    per, extra = divmod(cfg.sequences, len(cfg.temperatures))
    rows, index = [], 0
    for k, t in enumerate(cfg.temperatures):
        n = per + (k < extra)
        if t == 0 and n > prompts:
            raise ValueError(f"--temperature 0 gets {n} of the --sequences {cfg.sequences}, but there are only "
                             f"{prompts} prompts and greedy decoding gives one text per prompt: ask for fewer "
                             "sequences or add a temperature above 0")
        for _ in range(n):
            rows.append(Row(index, order[index % prompts], t, row_seed(cfg.seed, index)))
            index += 1
    return rows


def fitting(prompts: Sequence[Sequence[int]], tokens: int, positions: int | None) -> list[list[int]]:
    """The prompts that fit the model with `tokens` new tokens (the last is never fed: `len + tokens - 1` positions)."""
    if positions is None:
        return [list(p) for p in prompts]
    return [list(p) for p in prompts if len(p) + tokens - 1 <= positions]


def generate(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    cfg: SelfgenConfig,
    *,
    model_name: str,
    progress: Callable[[int], Any] | None = None,
    skip: int = 0,
) -> Iterator[tuple[dict[str, Any], list[int]]]:
    """The records of `plan(cfg, len(prompts))[skip:]` and their generated token ids, in order, as each batch ends.

    Args:
        model: the plain (dense) model, not retrofitted.
        prompts: token ids, e.g. from `load_prompts` (then `fitting`).
        model_name: written in every record.
        progress: called with the number of sequences each finished batch holds.
    """
    if getattr(model, "kvpop", None) is not None:
        raise ValueError("the model is retrofitted: selfgen writes the dense model's generations, give its base")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    rows = plan(cfg, len(prompts))[skip:]
    for t in cfg.temperatures:
        block = [r for r in rows if r.temperature == t]
        for start in range(0, len(block), cfg.batch):
            group = block[start : start + cfg.batch]
            outs = generate_batch(model, [prompts[r.prompt] for r in group], cfg.tokens, None, temperature=t,
                                  seeds=[r.seed for r in group], eos_token_id=eos, pad_token_id=pad)
            for r, new in zip(group, outs):
                prompt = list(prompts[r.prompt])
                text = tokenizer.decode(prompt + new, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                yield {"text": text, "prompt_tokens": len(prompt), "generated_tokens": len(new), "temperature": t,
                       "seed": r.seed, "model": model_name}, new
            if progress is not None:
                progress(len(group))


def partial_path(path) -> Path:
    """Where `write` keeps the finished sequences of an unfinished run: `FILE.jsonl.partial` (a directory given to
    `--data` reads `.jsonl` files, not this one)."""
    return Path(f"{path}.partial")


def run_header(cfg: SelfgenConfig, model_name: str, prompts: int) -> dict[str, Any]:
    """What makes the sequences what they are (not `batch`: they do not depend on it): a partial file's first line."""
    return {"model": model_name, "prompts": cfg.prompts, "text_field": cfg.text_field, "prompt_count": prompts,
            "sequences": cfg.sequences, "tokens": cfg.tokens, "temperatures": list(cfg.temperatures), "seed": cfg.seed}


def resume(path, header: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished sequences of an unfinished run into `path` (its `partial_path`), as `write` left them.

    A torn last line (the run stopped while writing it) is dropped. Raises ValueError, naming what differs, when
    the partial file is another run's (other model, prompts, seed, ...): its sequences would not be this plan's.
    """
    part = partial_path(path)
    if not part.exists():
        return []
    lines = part.read_text().splitlines()
    try:
        found = json.loads(lines[0])["kvpop_selfgen"] if lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        found = None
    if found != header:
        diff = ", ".join(f"{k}: {found.get(k)!r} there, {v!r} now" for k, v in header.items()
                         if found.get(k) != v) if isinstance(found, dict) else "no kvpop selfgen header"
        raise ValueError(f"{part} holds the unfinished sequences of another run ({diff}): pass --force to start over, "
                         "or repeat that run's command to finish it")
    done = []
    for line in lines[1:]:
        try:
            done.append(json.loads(line))
        except json.JSONDecodeError:
            break  # torn by a stop mid-write: generated again
    return done[: header["sequences"]]


def write(path, records: Iterator[tuple[dict[str, Any], list[int]]], header: dict[str, Any],
          done: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Write `done` and then `generate`'s records as JSON lines to `path`, which appears whole at the end.

    Every finished sequence is first appended (and fsynced) to `partial_path(path)`, after `header`: a run that
    stops (a time limit, Ctrl-C, a crash) loses only the batch it was generating, and `resume` gives the rest
    back to the same command. At the end `path` is written atomically from them and the partial file removed.

    Returns:
        per record, what `summarise` needs: its temperature, generated tokens and 4-gram counts.
    """
    from kvpop.files import atomic_open, fsync_dir

    part = partial_path(path)
    entries = list(done)
    with open(part, "w") as f:
        # rewritten whole: drops a torn last line before appending
        f.write(json.dumps({"kvpop_selfgen": header}) + "\n")
        for e in entries:
            f.write(json.dumps(e) + "\n")
        f.flush()
        os.fsync(f.fileno())
        for record, new in records:
            repeated, grams = repeated_ngrams(new)
            entry = {"record": record, "stats": {"temperature": record["temperature"], "generated_tokens": len(new),
                                                 "repeated": repeated, "grams": grams}}
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
            entries.append(entry)
    with atomic_open(path, "w") as out:
        for e in entries:
            out.write(json.dumps(e["record"]) + "\n")
    part.unlink()
    fsync_dir(Path(path).parent)
    return [e["stats"] for e in entries]


def summarise(stats: Sequence[dict[str, Any]], tokens: int, min_tokens: int) -> list[dict[str, Any]]:
    """Per temperature, then all together: sequences, mean generated tokens, rows that stopped before `tokens`
    (at EOS) and under `min_tokens`, and the share of repeated 4-grams (pooled over the rows; None without one)."""
    out = []
    groups = [(t, [s for s in stats if s["temperature"] == t]) for t in dict.fromkeys(s["temperature"] for s in stats)]
    if len(groups) > 1:
        groups.append(("all", list(stats)))
    for t, group in groups:
        lengths = [s["generated_tokens"] for s in group]
        grams = sum(s["grams"] for s in group)
        out.append({"temperature": t, "sequences": len(group), "mean_generated_tokens": sum(lengths) / len(group),
                    "stopped_early": sum(n < tokens for n in lengths),
                    "under_min_tokens": sum(n < min_tokens for n in lengths),
                    "repetition": sum(s["repeated"] for s in group) / grams if grams else None})
    return out


def format_summary(rows: Sequence[dict[str, Any]], min_tokens: int) -> str:
    """The summary as a plain-text table."""
    head = (f"{'temperature':>11} {'sequences':>9} {'mean tokens':>11} {'stopped (EOS)':>13} "
            f"{f'< {min_tokens} tokens':>14} {'rep4':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['temperature']!s:>11} {r['sequences']:>9} {r['mean_generated_tokens']:>11.1f} "
                     f"{r['stopped_early']:>13} {r['under_min_tokens']:>14} "
                     f"{'-' if r['repetition'] is None else format(r['repetition'], '.3f'):>6}")
    return "\n".join(lines)


__all__ = ["MIN_TOKENS", "Row", "SelfgenConfig", "fitting", "format_summary", "generate", "load_prompts",
           "parse_temperatures", "plan", "render_prompt", "row_seed", "summarise", "write"]
