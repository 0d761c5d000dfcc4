"""The long-context task suite: every policy answers generated prompts through its real decode path.

    kvpop eval --model smollm2-135m --suite passkey,vt --lengths 1k,2k --depths 0,0.5,1 --samples 2 \
        --policies streaming_llm,kvpop --budgets 512,256 --out runs/suite

Each prompt (`kvpop.eval.tasks`) is prefilled in chunks into a `KVpopCache` of the policy's model
(the dense row: the plain model with Hugging Face's `DynamicCache`), then decoded greedily for the
task's answer tokens, stopping at EOS; nothing is teacher-forced and no mask stands in for the
cache. The answer is scored by exact match in the generated text (`tasks.score`). Each record keeps
the most cache slots any layer and KV head held while answering, which never exceeds the budget.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from kvpop.eval.evaluate import Entry
from kvpop.eval.fillers import check_filler
from kvpop.eval.tasks import TASKS, Sample, check_depth, make_sample, parse_tasks, score

COLLAPSE_SHARE = 0.2
"""A policy has collapsed on a task when its accuracy is at most this share of the dense model's."""
DENSE = "dense"


@dataclass
class SuiteConfig:
    """What the suite generates and how it runs it."""

    tasks: tuple[str, ...] = ("passkey",)
    """Keys of `kvpop.eval.tasks.TASKS`."""
    lengths: tuple[int, ...] = (1024, 2048)
    """Prompt lengths in tokens, chat template included."""
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    """Needle depths in [0, 1] (tasks without a depth run once per length)."""
    samples: int = 2
    """Prompts per (task, length, depth)."""
    seed: int = 0
    filler: str = "prose"
    """`prose`, `champ`, `stdlib` or a local text file or directory (`kvpop.eval.fillers`)."""
    batch_size: int = 1
    """Prompts of one (task, length) decoded together, left-padded."""
    prefill_chunk: int = 2048
    """Prompt tokens per prefill forward."""

    def __post_init__(self):
        self.tasks = tuple(parse_tasks(",".join(self.tasks)))
        self.lengths, self.depths = tuple(self.lengths), tuple(self.depths)
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths={self.lengths} must be positive token counts")
        if not self.depths:
            raise ValueError("depths is empty: give at least one depth in [0, 1]")
        for d in self.depths:
            check_depth(d)
        for name in ("samples", "batch_size", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_filler(self.filler)


def parse_lengths(spec: str) -> list[int]:
    """`1k,2k,4096` -> [1024, 2048, 4096] (`k` = 1024)."""
    out = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        m = re.fullmatch(r"(\d+)(k?)", part)
        if m is None or int(m[1]) < 1:
            raise ValueError(f"length {part!r} is not a token count: use e.g. 1024, 2048 or 1k, 2k")
        out.append(int(m[1]) * (1024 if m[2] else 1))
    if not out:
        raise ValueError(f"no lengths in {spec!r}: use e.g. 1k,2k")
    return out


def parse_depths(spec: str) -> list[float]:
    """`0,0.5,1` -> [0.0, 0.5, 1.0], each checked to lie in [0, 1]."""
    try:
        out = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"depths {spec!r} must be numbers in [0, 1], e.g. 0,0.25,0.5,0.75,1") from None
    if not out:
        raise ValueError(f"no depths in {spec!r}: use e.g. 0,0.5,1")
    for d in out:
        check_depth(d)
    return out


def check_lengths(cfg: SuiteConfig, max_positions: int | None) -> None:
    """Every prompt plus its answer tokens must fit the model's positions."""
    if max_positions is None:
        return
    answer = max(TASKS[t].max_new_tokens for t in cfg.tasks)
    too_long = [n for n in cfg.lengths if n + answer > max_positions]
    if too_long:
        raise ValueError(f"length {too_long[0]} is beyond the model's max_position_embeddings={max_positions} "
                         f"(with up to {answer} answer tokens): allowed lengths are 1..{max_positions - answer}")


def build_samples(cfg: SuiteConfig, tokenizer, max_positions: int | None = None) -> list[Sample]:
    """Every prompt of the suite, ordered by (task, length, depth, index); the same for every policy."""
    check_lengths(cfg, max_positions)
    out = []
    for task in cfg.tasks:
        depths = cfg.depths if TASKS[task].uses_depth else (None,)
        for length in cfg.lengths:
            for depth in depths:
                out += [make_sample(task, tokenizer, length, depth, i, cfg.seed, cfg.filler) for i in range(cfg.samples)]
    return out


def _eos_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def _held(cache, mask: Tensor) -> Tensor:
    """Per row, the most KV entries any layer and KV head holds: int64 [B]."""
    from kvpop.cache import KVpopCache

    if isinstance(cache, KVpopCache):
        return torch.stack([u.amax(-1) for u in cache.slots_used()]).amax(0)
    return mask.sum(-1)  # a dense cache holds every real token


@torch.no_grad()
def greedy(model, cache, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, eos_ids: Sequence[int],
           chunk: int = 2048) -> tuple[Tensor, Tensor]:
    """Chunked prefill into `cache`, then greedy decoding, as `generate` would run them.

    Args:
        input_ids: int64 [B, S], left-padded.
        attention_mask: [B, S], 0 on padding.
    Returns:
        the new tokens [B, n] (n <= max_new_tokens; rows go on after their EOS until all rows have one),
        and per row the most cache entries held at any step (int64 [B]).
    """
    from kvpop.cache import cache_kwargs

    kw = cache_kwargs(model, cache)
    mask = attention_mask.long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    S = input_ids.shape[1]
    for i in range(0, S, chunk):
        j = min(S, i + chunk)
        logits = model(input_ids=input_ids[:, i:j], attention_mask=mask[:, :j], position_ids=pos[:, i:j], **kw,
                       use_cache=True, logits_to_keep=1).logits
    held = _held(cache, mask)
    nxt = logits[:, -1].argmax(-1)
    eos = torch.tensor(eos_ids, device=input_ids.device)
    done = torch.isin(nxt, eos)
    out, position = [nxt], pos[:, -1] + 1
    for _ in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position[:, None], **kw,
                       use_cache=True).logits
        held = torch.maximum(held, _held(cache, mask))
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        done |= torch.isin(nxt, eos)
        position = position + 1
    return torch.stack(out, dim=1), held


def _label(entry: Entry | None) -> str:
    if entry is None:
        return DENSE
    if entry.trained is None:
        return entry.name
    return f"{entry.name}[{'/'.join(Path(entry.trained).parts[-2:])}]"


def _batches(samples: Sequence[Sample], size: int) -> Iterable[list[Sample]]:
    """Runs of at most `size` samples of one (task, length): one answer length, prompts within a few tokens."""
    group: list[Sample] = []
    for s in samples:
        if group and (len(group) == size or (group[0].task, group[0].length) != (s.task, s.length)):
            yield group
            group = []
        group.append(s)
    if group:
        yield group


@torch.no_grad()
def run_suite(base: nn.Module, tokenizer, entries: Sequence[Entry], samples: Sequence[Sample], *,
              dense: bool = True, batch_size: int = 1, prefill_chunk: int = 2048, seed: int = 0,
              device: str | torch.device | None = None, progress: bool = True) -> list[dict]:
    """Every sample through the dense model (if `dense`) and every entry; one record per (entry, sample).

    `base` is the plain model; training-free entries retrofit it for their run and detach after,
    trained entries load their directory. Untrained scorers are seeded from `seed`.
    """
    from kvpop.cache import KVpopCache
    from kvpop.eval.generation import left_pad
    from kvpop.retrofit import detach, kvpop_modules, load, retrofit

    if getattr(base, "kvpop", None) is not None:
        raise ValueError("run_suite needs the plain base model; pass retrofitted ones as entries")
    device = torch.device(device) if device is not None else next(base.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records: list[dict] = []
    for entry in ([None] if dense else []) + list(entries):
        if entry is not None and entry.cfg.policy == "oracle":
            raise ValueError("the oracle ranks tokens by future attention and cannot decode: leave it out of the suite")
        torch.manual_seed(seed)
        if entry is None:
            model = base
        elif entry.trained is None:
            model = retrofit(base, entry.cfg)
        else:
            # the entry's config: a directory's own, or its weights at another split (per-layer budgets, a TOVA pool)
            model = load(entry.trained, device=device, config=entry.cfg)
        budget = None if entry is None else kvpop_modules(model).config.budget
        eos = _eos_ids(model, tokenizer)
        label, start = _label(entry), time.perf_counter()
        bar = _progress(len(samples), f"suite {label}" + ("" if budget is None else f" B={budget}"), progress)
        try:
            for group in _batches(samples, batch_size):
                ids, mask = left_pad([s.input_ids for s in group], pad, device)
                cache = _dense_cache(model) if entry is None else KVpopCache(model)
                new, held = greedy(model, cache, ids, mask, group[0].max_new_tokens, eos, prefill_chunk)
                for row, s in enumerate(group):
                    records.append(_record(s, label, budget, entry, tokenizer, new[row].tolist(), eos,
                                           int(held[row])))
                bar.update(len(group))
        finally:
            bar.close()
            if entry is not None and entry.trained is None:
                detach(model)
        print(f"kvpop eval --suite: {label}" + ("" if budget is None else f" at B={budget}") +
              f": {len(samples)} prompts in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return records


def _dense_cache(model):
    """Hugging Face's `DynamicCache`, told the model's layer types (sliding-window layers) where it accepts them."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", disable=not enabled, leave=False)


def _record(s: Sample, label: str, budget: int | None, entry: Entry | None, tokenizer, new: list[int],
            eos: Sequence[int], held: int) -> dict:
    cut = next((i for i, t in enumerate(new) if t in eos), len(new))
    output = tokenizer.decode(new[:cut], skip_special_tokens=True)
    correct, found = score(s, output)
    n = len(s.input_ids)
    return {
        "policy": label, "budget": budget, "trained": None if entry is None else entry.trained,
        "task": s.task, "family": s.family, "length": s.length, "depth": s.depth, "index": s.index,
        "prompt_tokens": n, "cr": None if budget is None else round(1 - budget / n, 4),
        "answers": list(s.answers), "output": output, "correct": correct, "found": found,
        "new_tokens": cut, "slots_max": held,
    }


__all__ = ["COLLAPSE_SHARE", "DENSE", "SuiteConfig", "build_samples", "check_lengths", "greedy", "parse_depths",
           "parse_lengths", "run_suite"]
