"""Side-by-side evaluation of eviction policies on held-out text: the engine behind `kvpop eval`.

    kvpop eval --model smollm2-135m --data champ --seq-len 2048 --budgets 512,256 \
        --policies streaming_llm,tova,tova_windowed,h2o,h2o_windowed,oracle --trained runs/b512/final --sequences 3

Every policy and budget sees the same sequences; every number is teacher-forced against one dense
pass of the original base model (`--model`, run with `kvpop_dense=True`), counted at positions
`>= budget` where eviction acts (`DESIGN.md`, Metrics). A trained directory holds its own, possibly
distilled, base weights; it is still compared with the original base, the model it must stand in
for, and must have been trained from it (its recorded base identity is checked). The sequences
begin at a document start, formatted as in real use (`held_out_rows`). TOVA and H2O run as their
papers define them (`tova`, `h2o`) and as kvpop's windowed variant (`tova_windowed`, `h2o_windowed`,
`WINDOWED`); per budget the table marks the stronger of each pair (lower KL on the same sequences)
and the headline keeps only that one. Static-priority policies (KVpop, the oracle) also get their
top-k retention recall against the oracle of the evaluated model, per layer and head (paper Fig. 7).
DMS rows also get `avg_cache_fraction`: the entries its heads really hold / budget, averaged over
layers, KV heads and queries `>= budget` (its per-head retention is ragged inside the fixed buffer).
Because the training mask equals the decoding cache, these are the numbers a user gets generating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kvpop.attention import Capture
from kvpop.config import POLICIES, KVpopConfig
from kvpop.eval.metrics import (
    HiddenLogits,
    RetentionRecall,
    TeacherForcedStats,
    logit_rows,
    priorities_from_records,
    teacher_forced_metrics,
)
from kvpop.retrofit import base_identity, detach, kvpop_modules, load, read_base, read_config, retrofit, same_base


@dataclass
class Entry:
    """One row of the comparison: a policy at a budget, training-free or from a trained directory."""

    name: str
    """Row label, e.g. `kvpop`, `streaming_llm`."""
    budget: int
    cfg: KVpopConfig
    trained: str | None = None
    """A `kvpop.save` directory (its own config and weights), or None for a training-free policy."""
    stats: TeacherForcedStats = field(default_factory=TeacherForcedStats, repr=False)
    recall: RetentionRecall | None = field(default=None, repr=False)
    cache_sum: float = field(default=0.0, repr=False)
    """DMS: sum over (layer, KV head, query >= budget) of entries held / budget, and its count."""
    cache_count: int = field(default=0, repr=False)
    per_sequence: list[tuple[float, float]] = field(default_factory=list, repr=False)
    """(KL, top-1 agreement) of each sequence on its own: the spread behind the pooled row."""


WINDOWED = {"tova_windowed": "tova", "h2o_windowed": "h2o"}
"""Row names of kvpop's windowed TOVA and H2O (4 sinks, a window of B/4; `KVpopConfig.for_budget(windowed=True)`),
beside `tova` and `h2o` as their papers define them."""
TRAINING_FREE = ("streaming_llm", "tova", "tova_windowed", "h2o", "h2o_windowed", "oracle")
"""The training-free rows `kvpop eval` runs by default."""
PACKINGS = ("document", "concat")


def training_free(name: str, budget: int, sink: int | None = None,
                  layer_budgets: Sequence[int] | None = None) -> Entry:
    """A baseline row at `budget` with the split its policy expects (`KVpopConfig.for_budget`).

    `name` is a policy (`tova`, `h2o`: as their papers define them) or a windowed variant (`WINDOWED`).
    `sink` overrides the policy's own number of sinks. `layer_budgets`: per-layer budgets `B_l` at the
    same total memory (`sum_l B_l = L x budget`, `kvpop budgets` makes them); the row is then labelled
    `<name>+layers`.
    """
    policy = WINDOWED.get(name, name)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join((*TRAINING_FREE, 'kvpop'))}")
    cfg = KVpopConfig.for_budget(budget, sink=sink, policy=policy, windowed=name in WINDOWED)
    entry = Entry(name, budget, cfg)
    return entry if layer_budgets is None else with_layer_budgets(entry, layer_budgets)


def held_out_rows(
    data: str,
    tokenizer,
    seq_len: int,
    sequences: int,
    *,
    packing: str = "document",
    split: str = "eval",
    text_field: str | None = None,
    seed: int = 0,
) -> Tensor:
    """The evaluated sequences: int64 [N, seq_len], N <= `sequences`.

    `document` (the default): every row begins at a document start, formatted as in real use: champ as
    a chat (the problem as the user turn, the solution as the assistant turn) when the tokenizer has a
    chat template, a BOS where the tokenizer adds one, and the following documents, formatted the same
    way, when one is shorter than `seq_len` (`kvpop.train.data.document_rows`). `concat`: one stream of plain documents ("Problem: ... Solution: ..." for champ) cut every
    `seq_len` tokens, so that a row begins mid-document and its first tokens are arbitrary (`pack_sequences`).

    A mixture (`champ,pystdlib:0.5`, `kvpop.train.mix`) divides `sequences` among its sources by their
    weights and gives each source's rows, source after source.
    """
    from kvpop.train.data import document_rows, load_texts, pack_sequences
    from kvpop.train.mix import parse_mixture, split_count

    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r} is invalid: use one of {PACKINGS}")
    if sequences < 1:
        raise ValueError(f"sequences={sequences!r} must be >= 1")
    parts = parse_mixture(data)
    if len(parts) > 1:
        return torch.cat([held_out_rows(p.source, tokenizer, seq_len, n, packing=packing, split=split,
                                        text_field=text_field, seed=seed)
                          for p, n in zip(parts, split_count(parts, sequences))])
    chat = packing == "document" and data == "champ" and bool(getattr(tokenizer, "chat_template", None))
    texts = load_texts(data, split=split, text_field=text_field, tokenizer=tokenizer, seed=seed, chat=chat)
    if packing == "concat":
        return pack_sequences(texts, tokenizer, seq_len)[:sequences]
    return document_rows(texts, tokenizer, seq_len, rows=sequences)


def from_directory(path: str, name: str | None = None, rule: str | None = None) -> Entry:
    """A trained directory, labelled `name` or else by its policy (`kvpop`, `dms`, `streaming_llm_plus`), run as
    `kvpop.load` runs it: a KVpop-mlp as the recommended policy unless `rule="static"` (`KVpopConfig.for_rule`)."""
    cfg = read_config(path).for_rule(rule)
    return Entry(name or cfg.policy, cfg.budget, cfg, trained=str(path))


def check_base(path: str, base: nn.Module) -> bool:
    """Refuse a trained directory whose recorded base is not `base`: its numbers against `base` would mean
    nothing. False when the directory records no base (written by an older kvpop), True when it matches."""
    recorded = read_base(path)
    if recorded is None:
        return False
    current = base_identity(base)
    why = None if current is None else same_base(recorded, current)
    if why is not None:
        name = recorded.get("name")
        raise ValueError(f"{path} was trained from another base model than the one given ({why}); evaluate it "
                         f"against the model it was trained from{f' ({name})' if name else ''}")
    return True


def with_layer_budgets(entry: Entry, budgets: Sequence[int]) -> Entry:
    """`entry` (a trained static scorer or a training-free policy) at per-layer budgets `B_l`, the same memory.

    A static scorer ranks the same way whatever the top-k, so a trained directory needs no retraining; it runs its
    saved config (the static rule it was trained for) at those budgets.
    """
    cfg = read_config(entry.trained) if entry.trained else entry.cfg
    if cfg.layer_topk is not None or cfg.policy in ("streaming_llm", "streaming_llm_plus", "dms"):
        raise ValueError(f"{entry.name}: per-layer budgets need a uniform ranked split, got policy "
                         f"{cfg.policy!r} with layer_topk={cfg.layer_topk}")
    return Entry(f"{entry.name}+layers", entry.budget, cfg.with_layer_budgets(list(budgets)), trained=entry.trained)


def with_tova_pool(entry: Entry, pool: int, layer: bool = False, decay: float | None = None) -> Entry:
    """A trained KVpop-mlp directory run as KVpop-cascade with `pool` TOVA slots (`KVpopConfig.with_tova_pool` of the
    saved config): `NAME+poolN`, or with `layer` the layer-wide cascade at TOVA's split of its budget, `NAME+lpoolN`,
    whose pool ranks by the accumulated attention with `decay` (`NAME+lpoolN+h2o` at 1, `NAME+lpoolN+dD` below). The
    cascade's scorer trains as KVpop-mlp's, so the same weights serve it."""
    if not entry.trained:
        raise ValueError(f"{entry.name}: a TOVA pool applies to a trained KVpop-mlp directory, not a training-free row")
    try:
        cfg = read_config(entry.trained).with_tova_pool(pool, layer=layer, decay=decay)
    except ValueError as err:
        raise ValueError(f"{entry.name}: {err}") from None
    rank = "" if decay is None else "+h2o" if decay == 1 else f"+d{decay:g}"
    return Entry(f"{entry.name}+{'l' if layer else ''}pool{pool}{rank}", entry.budget, cfg, trained=entry.trained)


def with_decision_chunk(entry: Entry, chunk: int) -> Entry:
    """`entry` (TOVA's paper rule or a layer-wide KVpop-cascade) deciding once every `chunk` steps, `NAME+chunkC`
    (`KVpopConfig.with_decision_chunk`): the same memory (the ring counts in the budget) and weights."""
    try:
        cfg = entry.cfg.with_decision_chunk(chunk)
    except ValueError as err:
        raise ValueError(f"{entry.name}: {err}") from None
    return Entry(f"{entry.name}+chunk{chunk}", entry.budget, cfg, trained=entry.trained)


HELD_LOGITS_BYTES = 2 << 30
"""A pass whose float32 logits take at most this many bytes keeps them (`output_logits`)."""


def output_logits(model: nn.Module, ids: Tensor, held_bytes: int = HELD_LOGITS_BYTES, **kwargs
                  ) -> Tensor | HiddenLogits:
    """One pass's logits [B, S, V] for the teacher-forced metrics: float32, or as `HiddenLogits` where they would
    take more than `held_bytes` (Gemma 3's 262,144-token vocabulary at 8k tokens and more).

    Held logits are projected once, in the forward; `HiddenLogits` are projected again each time the metrics read
    them (the dense pass's once per row compared with it), so they are for passes too large to hold. The pass then
    keeps the final norm's output [B, S, D] (a forward hook) and computes only the last position's logits; the
    model's own output head (with Gemma 2's soft-capping) projects the rest a chunk at a time. That projection is
    checked against the model's logits at the last position: a model whose head does more (or that has no final
    `norm` in its decoder) gets its float32 logits [B, S, V] from a second, plain pass.
    """
    head = model.get_output_embeddings()
    try:
        norm = getattr(model.get_decoder(), "norm", None)
    except (AttributeError, NotImplementedError):
        norm = None
    large = isinstance(head, nn.Linear) and ids.numel() * head.out_features * 4 > held_bytes
    if large and isinstance(norm, nn.Module):
        seen: list[Tensor] = []
        hook = norm.register_forward_hook(lambda _module, _inputs, out: seen.append(out))
        try:
            last = model(ids, **kwargs, use_cache=False, logits_to_keep=1).logits.float()  # [B, 1, V]
        finally:
            hook.remove()
        hidden = seen[-1] if seen and isinstance(seen[-1], Tensor) else None
        if hidden is not None and hidden.shape[:2] == ids.shape:
            cap = getattr(model.config, "final_logit_softcapping", None)

            def project(h: Tensor) -> Tensor:  # as the model's forward computes its logits from the norm's output
                out = head(h)
                return (torch.tanh(out / cap) * cap if cap else out).float()

            logits = HiddenLogits(hidden, project, head.out_features)
            S = ids.shape[1]
            if (logits.positions(S - 1, S) - last).abs().le(_rounding_bound(hidden[:, -1:], head.weight, last)).all():
                return logits
    return model(ids, **kwargs, use_cache=False).logits.float()


def _rounding_bound(h: Tensor, weight: Tensor, logits: Tensor) -> Tensor:
    """How far the same head's product `h @ weight.T` may round apart on two shapes: the output's own rounding (a few
    units of `h`'s dtype, relative) and float32 sums taken in another order (bounded by the sum of the products'
    magnitudes). A head that computes anything else, a scale of 1.1 say, lands far outside it."""
    eps_out, eps_sum = torch.finfo(h.dtype).eps, torch.finfo(torch.float32).eps
    magnitude = h.abs().float() @ weight.abs().float().T  # [B, 1, V]
    return 4 * eps_out * logits.abs() + 4 * h.shape[-1] * eps_sum * magnitude + 1e-6


def run_as(model: nn.Module, cfg: KVpopConfig) -> nn.Module:
    """Run a loaded directory's weights under another config with the same parameters (another pool, rule or split),
    in place: the policies are rebuilt for `cfg` and take the trained scorers back."""
    mods = kvpop_modules(model)
    state, base, training = mods.state_dict(), mods.base, mods.training
    detach(model)
    retrofit(model, cfg)
    mods = kvpop_modules(model)
    mods.load_state_dict(state)
    mods.base = base
    mods.train(training)
    return model


class Evaluator:
    """Runs `entries` over sequences, keeping one base model and loading trained ones once."""

    def __init__(self, base: nn.Module, entries: Sequence[Entry], device: torch.device | str = "cpu"):
        self.base, self.entries, self.device = base, list(entries), torch.device(device)
        for entry in self.entries:
            if entry.trained is not None:
                check_base(entry.trained, base)
        self._trained: dict[str, nn.Module] = {}
        # the dense reference: the base run with kvpop_dense=True; attached as the oracle, its capture
        # carries the oracle's decay, so training-free oracle rows reuse this pass instead of their own
        self._reference_cfg = KVpopConfig(sink=1, window=1, topk=1, policy="oracle")

    def _model(self, entry: Entry) -> nn.Module:
        if entry.trained is None:
            return retrofit(self.base, entry.cfg)
        if entry.trained not in self._trained:
            self._trained[entry.trained] = load(entry.trained, device=self.device, config=entry.cfg)
        model = self._trained[entry.trained]
        # one copy of a directory's weights for all its rows: another rule, pool or split (`with_tova_pool`,
        # `with_layer_budgets`) rebuilds the policies over the same weights
        if kvpop_modules(model).config != entry.cfg:
            run_as(model, entry.cfg)
        return model

    def _release(self, entry: Entry, model: nn.Module) -> None:
        if entry.trained is None:
            detach(model)

    @torch.no_grad()
    def add(self, input_ids: Tensor, progress=None) -> None:
        """Evaluate every entry on one batch of unpadded sequences [B, S].

        `progress`: a tqdm bar, advanced by one after the dense pass and after each entry.
        """
        ids = input_ids.to(self.device)
        dense, reference = self.reference(ids)
        if progress is not None:
            progress.update(1)
        for entry in self.entries:
            self.add_entry(entry, ids, dense, reference)
            if progress is not None:
                progress.update(1)

    @torch.no_grad()
    def reference(self, ids: Tensor) -> tuple[Tensor | HiddenLogits, Capture]:
        """The dense pass every entry is compared with: its logits [B, S, V] (`output_logits`) and its capture."""
        model = retrofit(self.base, self._reference_cfg)
        reference = Capture()
        dense = output_logits(model, ids, kvpop_dense=True, kvpop_capture=reference)
        detach(model)
        return dense, reference

    @torch.no_grad()
    def add_entry(self, entry: Entry, ids: Tensor, dense: Tensor | HiddenLogits, reference: Capture) -> None:
        """One entry on one batch, against the dense pass of `reference`."""
        model = self._model(entry)
        try:
            logits, recall = self._run(entry, model, ids, reference)
        finally:
            self._release(entry, model)
        batch = entry.stats.update(dense, logits, ids, start=entry.budget)
        if ids.shape[0] == 1 and batch is not None:  # the batch is the sequence: no second pass over its [S, V] logits
            entry.per_sequence.append((batch.kl, batch.top1_agreement))
        else:
            for b in range(ids.shape[0]):
                one = teacher_forced_metrics(logit_rows(dense, b, b + 1), logit_rows(logits, b, b + 1), ids[b : b + 1],
                                             start=entry.budget)
                entry.per_sequence.append((one.kl, one.top1_agreement))
        if recall is not None:
            if entry.recall is None:
                c = entry.cfg
                entry.recall = RetentionRecall(c.sink, c.window, list(c.layer_topk) if c.layer_topk else c.topk)
            entry.recall.update(*recall)

    def _run(self, entry: Entry, model: nn.Module, ids: Tensor, reference: Capture
             ) -> tuple[Tensor | HiddenLogits, tuple | None]:
        cfg = kvpop_modules(model).config
        if cfg.policy == "dms":
            return self._run_dms(entry, model, ids), None
        if model.kvpop.policies[0].dynamic or cfg.topk == 0:
            # TOVA / H2O: the decode step's decisions by the prefill walk (`ops.dynamic`, bit-equal to
            # token-by-token decoding), then one sparse attention: the logits a user's decode would give
            return output_logits(model, ids), None
        # static priorities: the oracle of this very model (dense pass), then its own sparse pass
        if entry.trained is None and cfg.gamma_init == self._reference_cfg.gamma_init:
            dense = reference  # same weights, same decay: the reference pass already has it
        else:
            dense = Capture()
            model(ids, kvpop_dense=True, kvpop_capture=dense, use_cache=False, logits_to_keep=1)
        teacher = priorities_from_records(dense, cfg)
        if cfg.policy == "oracle":
            return output_logits(model, ids, kvpop_priority=teacher), (teacher, teacher)
        sparse = Capture()
        logits = output_logits(model, ids, kvpop_capture=sparse)
        return logits, (teacher, [r.priority.detach() for r in sparse])

    def _run_dms(self, entry: Entry, model: nn.Module, ids: Tensor) -> Tensor | HiddenLogits:
        """DMS's hard decisions through the shared rule, and the cache sizes they really use."""
        from kvpop.baselines.dms import cache_fraction
        from kvpop.ops.topk import eviction_positions

        cfg = kvpop_modules(model).config
        records = Capture()
        logits = output_logits(model, ids, kvpop_capture=records)
        for rec in records:
            evict = eviction_positions(rec.priority, rec.position[:, None], rec.valid[:, None], cfg.sink, cfg.window,
                                       cfg.topk)
            total, count = cache_fraction(evict, cfg.sink, cfg.window, cfg.budget)
            entry.cache_sum += total
            entry.cache_count += count
        return logits

    def rows(self, seq_len: int) -> list[dict]:
        rows = []
        for e in self.entries:
            r = e.stats.result()
            row = {
                "policy": e.name,
                "budget": e.budget,
                "cr": round(1 - e.budget / seq_len, 4),
                "rel_accuracy": r.rel_accuracy,
                "top1_agreement": r.top1_agreement,
                "kl": r.kl,
                "ppl_ratio": r.ppl_ratio,
                "accuracy": r.accuracy,
                "accuracy_dense": r.accuracy_dense,
                "positions": r.positions,
                "sequences": len(e.per_sequence),
                "kl_se": _standard_error([kl for kl, _ in e.per_sequence]),
                "kl_per_sequence": [kl for kl, _ in e.per_sequence],
                "top1_per_sequence": [agree for _, agree in e.per_sequence],
                "sink": e.cfg.sink,
                "window": e.cfg.window,
                "topk": e.cfg.topk,
                "layer_topk": list(e.cfg.layer_topk) if e.cfg.layer_topk else None,
                "trained": e.trained,
                "rule": e.cfg.describe(),
            }
            if e.recall is not None:
                rec = e.recall.result()
                row["recall"] = rec.mean
                row["recall_per_layer"] = [float(x) for x in rec.per_layer]
            if e.cfg.policy == "dms":
                row["avg_cache_fraction"] = e.cache_sum / max(1, e.cache_count)
            rows.append(row)
        mark_stronger_variants(rows)
        return rows


def _standard_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean of `values` (None for fewer than two)."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def mark_stronger_variants(rows: Sequence[dict]) -> None:
    """Per budget, mark the stronger of TOVA's (H2O's) two variants: the lower KL on the same sequences.

    Each `tova` / `h2o` / `tova_windowed` / `h2o_windowed` row gets `variant` (`paper` or `windowed`);
    where both variants of a policy were run at a budget, both get `stronger` (True for the lower KL).
    """
    for row in rows:
        if row["policy"] in ("tova", "h2o") and not row.get("trained"):
            row["variant"] = "paper"
        elif row["policy"] in WINDOWED:
            row["variant"] = "windowed"
    for windowed, paper in WINDOWED.items():
        for budget in {r["budget"] for r in rows}:
            pair = [r for r in rows if r["budget"] == budget and r["policy"] in (paper, windowed) and "variant" in r]
            if len(pair) == 2:
                best = min(pair, key=lambda r: r["kl"])
                for r in pair:
                    r["stronger"] = r is best


def format_table(rows: Sequence[dict]) -> str:
    """The comparison as a plain-text table, one line per (budget, policy).

    `+-` is the standard error of the KL over the sequences; `cache` the share of the budget a policy
    really holds (DMS, `avg_cache_fraction`; the others fill it); `*` marks the stronger of TOVA's (H2O's)
    paper and windowed variants at that budget.
    """
    head = (f"{'budget':>6} {'CR':>5}  {'policy':<20} {'rel acc':>8} {'top-1 agr':>9} {'KL':>8} {'+-':>7} "
            f"{'ppl ratio':>9} {'recall':>7} {'cache':>6}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (-r["budget"], r["policy"])):
        recall = f"{r['recall']:.3f}" if r.get("recall") is not None else "-"
        cache = f"{r['avg_cache_fraction']:.3f}" if r.get("avg_cache_fraction") is not None else "-"
        name = r["policy"] + (" *" if r.get("stronger") else "")
        spread = f"{r['kl_se']:.4f}" if r.get("kl_se") is not None else "-"
        lines.append(
            f"{r['budget']:>6} {r['cr']:>5.0%}  {name:<20} {r['rel_accuracy']:>8.3f} {r['top1_agreement']:>9.3f} "
            f"{r['kl']:>8.4f} {spread:>7} {r['ppl_ratio']:>9.3f} {recall:>7} {cache:>6}"
        )
    if any("stronger" in r for r in rows):
        lines.append("* the stronger of the paper's and kvpop's windowed variant at this budget (lower KL)")
    return "\n".join(lines)


def headline(rows: Sequence[dict]) -> dict:
    """The JSON object `kvpop demo` and `kvpop eval` print last: the issue's fields only.

    Of TOVA's (H2O's) two variants only the stronger at each budget is kept, named `tova` (`h2o`) with
    its `variant`; a DMS row carries `avg_cache_fraction`, without which its budget is not comparable.
    """
    keys = ("policy", "budget", "cr", "rel_accuracy", "top1_agreement", "kl", "ppl_ratio")
    out = []
    for r in rows:
        if r.get("stronger") is False:
            continue
        row = {k: r[k] for k in keys}
        if "variant" in r:
            row.update(policy=WINDOWED.get(r["policy"], r["policy"]), variant=r["variant"])
        if r.get("avg_cache_fraction") is not None:
            row["avg_cache_fraction"] = r["avg_cache_fraction"]
        out.append(row)
    return {"rows": out}




@torch.no_grad()
def rollouts_pass_at_1(model: nn.Module, tokenizer, problems: Sequence[dict], samples: int, max_new_tokens: int,
                       temperature: float = 0.7, seed: int = 0) -> tuple[float, list[list[str]]]:
    """pass@1 over `samples` sampled answers per problem, generated with the bounded cache, scored by math-verify."""
    from kvpop.cache import KVpopCache, cache_kwargs
    from kvpop.eval.metrics import pass_at_1

    device = next(model.parameters()).device
    completions = []
    for i, problem in enumerate(problems):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem["problem"] + "\nPut the final answer in \\boxed{}."}],
            tokenize=False, add_generation_prompt=True)
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
        outs = []
        for j in range(samples):
            torch.manual_seed(seed + 1000 * i + j)
            gen = model.generate(**inputs, **cache_kwargs(model, KVpopCache(model)), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=temperature, pad_token_id=tokenizer.pad_token_id)
            outs.append(tokenizer.decode(gen[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
        completions.append(outs)
    return pass_at_1(completions, [p["answer"] for p in problems]), completions


__all__ = ["PACKINGS", "TRAINING_FREE", "WINDOWED", "Entry", "Evaluator", "format_table", "from_directory", "headline",
           "held_out_rows", "mark_stronger_variants", "rollouts_pass_at_1", "training_free", "with_layer_budgets"]
