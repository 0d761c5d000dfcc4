"""Long-generation fidelity: each policy writes text with its bounded cache, the dense model scores it.

    kvpop eval --model smollm2-135m --generate 1024 --problems 4 --samples 1 --budgets 256 \
        --policies streaming_llm,tova,tova_windowed,h2o,h2o_windowed --out runs/fidelity

Teacher-forced tables say how well a policy predicts fixed text; this is the paper's regime instead:
the text a policy writes itself, free-running, once its cache has started evicting. For each held-out
champ problem (its chat prompt, `champ_prompt`), every policy at every budget generates up to `N`
tokens after prefilling the prompt, one token per step (`kvpop.eval.generation`: a CUDA-graph decode
step on a GPU): greedily, and `samples` times at temperature 0.7 with a seed per (problem, sample).
Every policy draws the same seeds, and a row's random numbers depend on its seed and step only
(`kvpop.sampling`), so all rows take the same random numbers and agree with the dense row until
their caches make them differ. The `dense` row is the model with its own unbounded cache. Generation
stops at the EOS token (unless `ignore_eos`). Then one teacher-forced pass of the original model (no
retrofit) over prompt + generation scores the text (`dense_scores`):

- `nll`: mean negative log-likelihood of the generated tokens under the dense model; `nll_past_budget`
  the same over the counted steps only (below);
- `agreement` (on-policy): the share of counted steps whose token is the dense model's argmax on the
  same prefix (`onpolicy_agreement`). Step `i` (generated token `i`, predicted at position
  `p = P + i - 1` of a prompt of `P` tokens, after the model has read `p + 1` tokens) counts when
  `p >= budget`: the cache is full and has evicted, the positions the teacher-forced metrics count;
- `repetition`: the share of the generation's 4-grams that occurred earlier in it (`repeated_ngrams`);
- `pass_at_1`: the final answer, in the text up to the first EOS, checked by math-verify
  (`kvpop.eval.metrics.is_correct`); reported even when it is 0 (a 135M model rarely solves these problems).

Sums are pooled over tokens (steps, 4-grams) of all generations of a row; the `*_se` fields are the
standard error over generations of the per-generation values, the spread to read differences against.

Generations take minutes each on a CPU, so a run can keep them in a JSON-lines `store`
(`kvpop eval --generate` uses OUT/generations.jsonl): each is appended when done, and a later run with
the same settings reuses it instead of generating again (after an interruption, or to add policies,
budgets or samples next to the ones done). The key of a sampled generation names its sampler
(`kvpop.sampling.SAMPLER`): texts drawn by the earlier per-row CPU generators are not reused. Greedy
keys stay as they were: argmax decoding is the same on either backend, up to the rounding by which
batch sizes always differed.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvpop.eval.generation import Backend, generate_batch, generate_tokens
from kvpop.sampling import SAMPLER

if TYPE_CHECKING:
    from kvpop.eval.evaluate import Entry

SAMPLE_TEMPERATURE = 0.7
NGRAM = 4
BOXED_HINT = "\nPut the final answer in \\boxed{}."


# --- the metrics, on plain token lists and tensors -------------------------------------------------


def onpolicy_agreement(
    tokens: Sequence[int], dense_argmax: Sequence[int], prompt_len: int, budget: int
) -> tuple[int, int]:
    """Agreeing and counted steps of one generation: `(agree, counted)`.

    Step `i` is counted when its prediction position `p = prompt_len + i - 1` is `>= budget` (the cache
    has read more than `budget` tokens, so it is full and has evicted); it agrees when `tokens[i]` equals
    `dense_argmax[i]`, the dense model's argmax at `p` on the same prefix.
    """
    if len(tokens) != len(dense_argmax):
        raise ValueError(f"got {len(tokens)} tokens and {len(dense_argmax)} dense argmaxes")
    if prompt_len < 1 or budget < 0:
        raise ValueError(f"prompt_len={prompt_len} must be >= 1 and budget={budget} >= 0")
    first = max(0, budget - prompt_len + 1)
    counted = list(range(first, len(tokens)))
    return sum(int(tokens[i]) == int(dense_argmax[i]) for i in counted), len(counted)


def repeated_ngrams(tokens: Sequence[int], n: int = NGRAM) -> tuple[int, int]:
    """Repeated and all `n`-grams of a token list: `(repeated, total)`.

    Of the `len - n + 1` n-grams (one per start), those that also start at an earlier index are repeated.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(int(t) for t in tokens[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated, max(0, len(tokens) - n + 1)


@torch.no_grad()
def dense_scores(
    base: nn.Module, prompt: Sequence[int], tokens: Sequence[int], chunk: int = 512
) -> tuple[Tensor, Tensor]:
    """One teacher-forced pass of the dense model over prompt + generation.

    Args:
        base: the original model (no retrofit: its own attention).
        prompt, tokens: the prompt's token ids and the generated ones (at least one).
    Returns:
        float32 [n] log-probabilities of the generated tokens, and int64 [n] the dense argmax at the
        position that predicts each of them.
    """
    if not tokens or not prompt:
        raise ValueError("need a non-empty prompt and at least one generated token to score")
    if getattr(base, "kvpop", None) is not None:
        raise ValueError("the scorer of generations is the dense model: pass the base model, not a retrofitted one")
    device = next(base.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    n = len(tokens)
    # positions P-1 .. P+n-2 predict the generated tokens: the last n+1 logits without the final one
    logits = base(ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1]  # [n, V]
    target = ids[0, -n:]
    logp, top = [], []
    for a in range(0, n, chunk):
        lp = logits[a : a + chunk].float().log_softmax(-1)
        logp.append(lp.gather(-1, target[a : a + chunk, None])[:, 0])
        top.append(lp.argmax(-1))
    return torch.cat(logp).cpu(), torch.cat(top).cpu()


# --- generation ------------------------------------------------------------------------------------


def champ_prompt(tokenizer, problem: str) -> list[int]:
    """A champ problem as a user turn asking for a boxed answer, with the generation prompt: token ids.

    A base model without a chat template gets the problem as plain text, then `Solution:` (its BOS first)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(f"Problem: {problem}{BOXED_HINT}\n\nSolution:")["input_ids"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": problem + BOXED_HINT}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sample_seed(seed: int, problem: int, sample: int) -> int:
    """The seed of sample `sample` of problem `problem`: the same for every policy."""
    return seed * 1_000_003 + problem * 1_009 + sample


# --- rows ------------------------------------------------------------------------------------------


@dataclass
class Generation:
    """One generated text and its scores."""

    policy: str
    budget: int | None
    """None for the dense row (it is scored at every budget)."""
    problem: int
    mode: str
    """`greedy` or `sampled`."""
    seed: int | None
    prompt_len: int
    tokens: list[int]
    text: str
    seconds: float
    logp: list[float] = field(default_factory=list)
    """Dense log-probability of each generated token."""
    dense_argmax: list[int] = field(default_factory=list)
    correct: bool = False


@dataclass
class FidelityRow:
    """A policy at a budget in one mode, over all problems (and samples)."""

    policy: str
    budget: int
    mode: str
    generations: int
    tokens: float
    """Mean generated tokens per generation."""
    nll: float
    nll_se: float
    nll_past_budget: float
    agreement: float
    agreement_se: float
    counted_steps: int
    repetition: float
    repetition_se: float
    pass_at_1: float
    seconds_per_generation: float
    sink: int | None = None
    window: int | None = None
    topk: int | None = None
    variant: str | None = None
    trained: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def summarise(gens: Sequence[Generation], policy: str, budget: int, mode: str) -> FidelityRow:
    """Pool the scores of one row's generations (the dense row's at `budget`)."""
    if not gens:
        raise ValueError(f"no generation for {policy} at budget {budget} ({mode})")
    nll_sum = nll_n = past_sum = past_n = agree = counted = rep = grams = 0
    per_nll, per_agree, per_rep = [], [], []
    for g in gens:
        nll = [-x for x in g.logp]
        a, c = onpolicy_agreement(g.tokens, g.dense_argmax, g.prompt_len, budget)
        r, t = repeated_ngrams(g.tokens)
        past = nll[len(g.tokens) - c :]
        nll_sum, nll_n = nll_sum + sum(nll), nll_n + len(nll)
        past_sum, past_n = past_sum + sum(past), past_n + len(past)
        agree, counted, rep, grams = agree + a, counted + c, rep + r, grams + t
        per_nll.append(_ratio(sum(nll), len(nll)))
        per_agree.append(_ratio(a, c))
        per_rep.append(_ratio(r, t))
    return FidelityRow(
        policy=policy, budget=budget, mode=mode, generations=len(gens),
        tokens=sum(len(g.tokens) for g in gens) / len(gens),
        nll=_ratio(nll_sum, nll_n), nll_se=_mean_se(per_nll)[1], nll_past_budget=_ratio(past_sum, past_n),
        agreement=_ratio(agree, counted), agreement_se=_mean_se(per_agree)[1], counted_steps=counted,
        repetition=_ratio(rep, grams), repetition_se=_mean_se(per_rep)[1],
        pass_at_1=sum(g.correct for g in gens) / len(gens),
        seconds_per_generation=sum(g.seconds for g in gens) / len(gens),
    )


# --- the runner ------------------------------------------------------------------------------------


def run_fidelity(
    base: nn.Module,
    tokenizer,
    entries: Sequence[Entry],
    problems: Sequence[dict],
    new_tokens: int,
    *,
    samples: int = 0,
    temperature: float = SAMPLE_TEMPERATURE,
    seed: int = 0,
    ignore_eos: bool = False,
    batch: int = 1,
    store: str | Path | None = None,
    tag: str = "",
    backend: Backend = "fast",
    log=None,
) -> tuple[list[FidelityRow], list[Generation]]:
    """Generate with the dense model and every entry, score everything with the dense model.

    Args:
        base: the original model (not retrofitted); it generates the `dense` row and scores every text.
        entries: the policies and budgets (`kvpop.eval.evaluate.training_free` / `from_directory`); the
            oracle, which needs the future, is refused.
        problems: champ problems (`kvpop.train.data.champ_problems`): `problem` and `answer`.
        new_tokens: tokens per generation (N), at most; it stops earlier at EOS unless `ignore_eos`.
        samples: sampled generations per problem at `temperature`, besides the greedy one.
        batch: generations run together in one batch (`generate_batch`): 1 on a CPU, more on a GPU.
        store: a JSON-lines file of finished generations, appended to and reused (see the module docstring).
        tag: names the model in the store's keys (e.g. `--model`), so that one store never mixes models.
        backend: `generate_batch`'s, "fast" (the default) or "reference".
    Returns:
        the rows (per budget: dense, then every entry; greedy, then sampled) and every generation.
    """
    from kvpop.cache import KVpopCache
    from kvpop.eval.evaluate import WINDOWED
    from kvpop.eval.metrics import is_correct
    from kvpop.retrofit import detach, load, retrofit

    if not problems:
        raise ValueError("no problems to generate for")
    if samples < 0 or batch < 1:
        raise ValueError(f"samples={samples} must be >= 0 and batch={batch} >= 1")
    for e in entries:
        if e.cfg.policy == "oracle":
            raise ValueError("the oracle ranks tokens by future attention, so it cannot generate: drop it")
    log = log or (lambda msg: None)
    eos = None if ignore_eos else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    device = next(base.parameters()).device
    prompts = [champ_prompt(tokenizer, p["problem"]) for p in problems]
    plan = [(i, "greedy", None) for i in range(len(problems))]
    plan += [(i, "sampled", sample_seed(seed, i, j)) for i in range(len(problems)) for j in range(samples)]

    done = _read_store(store)

    def key(rule, i, mode, s) -> str:
        what = [tag, rule, hashlib.sha1(json.dumps(prompts[i]).encode()).hexdigest(), mode, s, new_tokens, eos,
                temperature if mode == "sampled" else 0.0]
        if mode == "sampled":
            # a sampled text is only reproduced by the same random numbers; greedy keys are unchanged
            what.append(SAMPLER)
        return json.dumps(what)

    def run(open_model, rule, policy, budget) -> tuple[list[Generation], nn.Module | None]:
        gens, model, todo = {}, None, []
        for item in plan:
            k = key(rule, *item)
            if k in done:
                gens[item] = Generation(**{**done[k], "policy": policy, "budget": budget, "problem": item[0]})
            else:
                todo.append(item)
        for mode in ("greedy", "sampled"):
            items = [t for t in todo if t[1] == mode]
            for a in range(0, len(items), batch):
                group = items[a : a + batch]
                if model is None:
                    model, make_cache = open_model()
                start = time.perf_counter()
                outs = generate_batch(model, [prompts[i] for i, _, _ in group], new_tokens, make_cache(),
                                      temperature=temperature if mode == "sampled" else 0.0,
                                      seeds=[0 if s is None else s for _, _, s in group], eos_token_id=eos,
                                      pad_token_id=pad, backend=backend)
                seconds = (time.perf_counter() - start) / len(group)
                for (i, _, s), tokens in zip(group, outs):
                    g = gens[(i, mode, s)] = Generation(policy, budget, i, mode, s, len(prompts[i]), tokens,
                                                        tokenizer.decode(tokens, skip_special_tokens=True), seconds)
                    if store is not None:
                        with open(store, "a") as f:
                            f.write(json.dumps({"key": key(rule, i, mode, s), **asdict(g)}) + "\n")
                log(f"{policy} B={budget} {mode} problems {[i for i, _, _ in group]}: "
                    f"{[len(t) for t in outs]} tokens, {seconds:.1f} s per generation")
        return [gens[item] for item in plan], model

    # the dense model: each backend makes its own unbounded cache
    generations, _ = run(lambda: (base, lambda: None), "dense", "dense", None)
    for entry in entries:
        rule = json.dumps([entry.trained, entry.cfg.to_dict()], sort_keys=True)

        def load_entry(e=entry):
            # a directory at its entry's config: its own, or its weights at another split (per-layer budgets, a TOVA pool)
            m = load(e.trained, device=device, config=e.cfg) if e.trained else retrofit(base, e.cfg)
            return m, lambda: KVpopCache(m)

        gens, model = [], None
        try:
            gens, model = run(load_entry, rule, entry.name, entry.budget)
        finally:
            if model is not None and not entry.trained:
                detach(model)
        generations += gens
    for g in generations:
        logp, top = dense_scores(base, prompts[g.problem], g.tokens)
        g.logp, g.dense_argmax = [round(float(x), 5) for x in logp], top.tolist()
        # the answer a user gets ends at the first EOS, also when the generation went on past it
        end = g.tokens.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in g.tokens else len(g.tokens)
        answer = tokenizer.decode(g.tokens[:end], skip_special_tokens=True)
        g.correct = is_correct(answer, problems[g.problem]["answer"])

    rows = []
    modes = ("greedy", "sampled") if samples else ("greedy",)
    for budget in sorted({e.budget for e in entries}, reverse=True):
        for mode in modes:
            dense = [g for g in generations if g.policy == "dense" and g.mode == mode]
            rows.append(summarise(dense, "dense", budget, mode))
            for entry in (e for e in entries if e.budget == budget):
                gens = [g for g in generations if g.policy == entry.name and g.budget == budget and g.mode == mode]
                row = summarise(gens, entry.name, budget, mode)
                c = entry.cfg
                row.sink, row.window, row.topk, row.trained = c.sink, c.window, c.topk, entry.trained
                if entry.trained is None and c.policy in ("tova", "h2o"):
                    row.variant = "windowed" if entry.name in WINDOWED else "paper"
                rows.append(row)
    return rows, generations


def _read_store(store: str | Path | None) -> dict[str, dict]:
    """Finished generations by key, from a JSON-lines store (an unfinished last line is ignored)."""
    if store is None or not Path(store).exists():
        return {}
    done = {}
    for line in Path(store).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        key = record.pop("key")
        done[key] = {k: record[k] for k in ("mode", "seed", "prompt_len", "tokens", "text", "seconds")}
    return done


def format_fidelity_table(rows: Sequence[FidelityRow]) -> str:
    """The rows as plain text: dense NLL (all generated tokens; past the budget), agreement, repetition, pass@1."""
    head = (f"{'budget':>6} {'mode':<7} {'policy':<20} {'gens':>4} {'tokens':>6} {'NLL':>7} {'+-':>6} "
            f"{'NLL>B':>7} {'agree':>6} {'+-':>6} {'steps':>6} {'rep4':>6} {'pass@1':>6} {'s/gen':>6}")
    lines = [head, "-" * len(head)]

    def f(x: float, spec: str) -> str:
        return "-" if x is None or math.isnan(x) else format(x, spec)

    for r in rows:
        lines.append(
            f"{r.budget:>6} {r.mode:<7} {r.policy:<20} {r.generations:>4} {r.tokens:>6.0f} {f(r.nll, '.4f'):>7} "
            f"{f(r.nll_se, '.4f'):>6} {f(r.nll_past_budget, '.4f'):>7} {f(r.agreement, '.3f'):>6} "
            f"{f(r.agreement_se, '.3f'):>6} {r.counted_steps:>6} {f(r.repetition, '.3f'):>6} {r.pass_at_1:>6.3f} "
            f"{r.seconds_per_generation:>6.1f}"
        )
    return "\n".join(lines)


def plot_nll_by_position(generations: Sequence[Generation], budgets: Sequence[int], path: str | Path,
                         bin_size: int = 64, title: str = "") -> Path:
    """Dense NLL of the generated tokens against their position (prompt included), mean per bin of
    `bin_size` positions; one panel per (mode, budget), every policy of that budget and the dense row."""
    import numpy as np
    from matplotlib.figure import Figure

    from kvpop.eval.plots import _save

    modes = [m for m in ("greedy", "sampled") if any(g.mode == m for g in generations)]
    budgets = sorted(set(budgets), reverse=True)
    fig = Figure(figsize=(5.5 * len(budgets), 3.4 * len(modes)))
    axes = fig.subplots(len(modes), len(budgets), squeeze=False)
    for (mi, mode), (bi, budget) in ((m, b) for m in enumerate(modes) for b in enumerate(budgets)):
        ax = axes[mi][bi]
        policies = ["dense"] + sorted({g.policy for g in generations if g.budget == budget} - {"dense"})
        for policy in policies:
            # the dense row has no budget: the same texts in every panel
            gens = [g for g in generations if g.policy == policy and g.mode == mode and g.budget in (None, budget)]
            sums: dict[int, list[float]] = {}
            for g in gens:
                for i, lp in enumerate(g.logp):
                    sums.setdefault((g.prompt_len + i) // bin_size, []).append(-lp)
            if not sums:
                continue
            x = np.array(sorted(sums))
            y = np.array([np.mean(sums[k]) for k in x])
            ax.plot((x + 0.5) * bin_size, y, label=policy, lw=2.0 if policy == "dense" else 1.2,
                    color="black" if policy == "dense" else None)
        ax.axvline(budget, color="grey", ls="--", lw=1)
        ax.set_title(f"B = {budget}, {mode}")
        ax.set_xlabel("position (prompt + generated)")
        ax.set_ylabel("dense NLL of the generated token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


__all__ = [
    "SAMPLE_TEMPERATURE",
    "FidelityRow",
    "Generation",
    "champ_prompt",
    "dense_scores",
    "format_fidelity_table",
    "generate_batch",
    "generate_tokens",
    "onpolicy_agreement",
    "plot_nll_by_position",
    "repeated_ngrams",
    "run_fidelity",
    "sample_seed",
    "summarise",
]
