"""The quality metrics of `kvpop eval` (`DESIGN.md`, "Metrics"), as pure functions and accumulators.

- `TeacherForcedStats`: next-token accuracy and perplexity of the model relative to the dense teacher,
  top-1 agreement with it and mean `KL(teacher || model)`, counted at the positions where eviction
  acts (`>= B`). Sums and counts are accumulated over batches, so the result does not depend on how
  the sequences were batched.
- `RetentionRecall`: the share of the oracle's long-range top-k that a policy also keeps under the
  same budget (the paper's Fig. 7), per layer and KV head, in `O(S log S)` per (sequence, head)
  without an `S x S` tensor. `oracle_priorities` computes the oracle's ranking (`docs/method.md` Sec. 4-5)
  from the dense model itself; `model_recall` is the whole measurement for one model.
- `is_correct` / `pass_at_1`: final answers scored with `math-verify`.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from kvpop.attention import Capture, LayerRecord
from kvpop.config import KVpopConfig
from kvpop.ops.target import future_attention_target
from kvpop.policy import eviction_times
from kvpop.retrofit import kvpop_modules
from kvpop.train.loss import teacher_priority

MATH_VERIFY_INSTALL = "pip install 'math-verify>=0.9'"

# --- teacher-forced metrics ----------------------------------------------------------------------


@dataclass(frozen=True)
class TeacherForcedResult:
    """Teacher-forced quality of a model against the dense teacher over the counted positions."""

    positions: int
    """Number of counted positions (each predicts the next token)."""
    accuracy_dense: float
    """Next-token accuracy of the dense teacher (argmax equals the next token)."""
    accuracy: float
    """Next-token accuracy of the model."""
    rel_accuracy: float
    """`accuracy / accuracy_dense` (NaN when the teacher gets nothing right)."""
    ppl_dense: float
    """Perplexity of the dense teacher, `exp(mean NLL)`."""
    ppl: float
    """Perplexity of the model."""
    ppl_ratio: float
    """`ppl / ppl_dense`, computed as `exp(mean NLL difference)`."""
    top1_agreement: float
    """Share of positions where the model's argmax equals the teacher's."""
    kl: float
    """Mean `KL(teacher || model)` of the next-token distributions, in nats."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def counted_positions(
    input_ids: Tensor,  # [B, S]
    start: int,
    valid: Tensor | None = None,  # [B, S]
) -> Tensor:
    """Which positions the teacher-forced metrics count: bool [B, S].

    Position `p` counts when its token and the next one are real and its position within the
    sequence (padding not counted) is `>= start`; the last token of a row has no next token and
    never counts. With `start = B` (the budget) only positions where eviction acts are counted.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start={start!r} must be an integer >= 0")
    if valid is None:
        valid = torch.ones_like(input_ids, dtype=torch.bool)
    elif valid.shape != input_ids.shape:
        raise ValueError(f"valid must match input_ids {tuple(input_ids.shape)}, got {tuple(valid.shape)}")
    valid = valid.bool()
    position = valid.long().cumsum(-1) - 1
    counted = torch.zeros_like(valid)
    counted[:, :-1] = valid[:, :-1] & valid[:, 1:] & (position[:, :-1] >= start)
    return counted


class HiddenLogits:
    """A model's logits [B, S, V] held as the hidden states its output head reads, [B, S, D]; a slice of positions
    is projected only when it is read (`logit_positions`).

    At 32k tokens and Gemma 3's 262,144-token vocabulary, one pass's float32 logits take 34 GB and its hidden
    states 84 MB: the teacher-forced metrics read the logits a chunk of positions at a time anyway.
    """

    def __init__(self, hidden: Tensor, head, vocab: int):  # hidden [B, S, D]; head: [B, s, D] -> [B, s, V]
        self.hidden, self.head, self.vocab = hidden, head, vocab

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:2], self.vocab))

    def dim(self) -> int:
        return 3

    def rows(self, a: int, b: int) -> HiddenLogits:
        return HiddenLogits(self.hidden[a:b], self.head, self.vocab)

    def positions(self, a: int, b: int) -> Tensor:
        return self.head(self.hidden[:, a:b])


def logit_positions(logits: Tensor | HiddenLogits, a: int, b: int) -> Tensor:
    """Positions `a:b` of logits [B, S, V], a tensor or `HiddenLogits`: [B, b - a, V]."""
    return logits.positions(a, b) if isinstance(logits, HiddenLogits) else logits[:, a:b]


def logit_rows(logits: Tensor | HiddenLogits, a: int, b: int) -> Tensor | HiddenLogits:
    """Rows (sequences) `a:b` of logits [B, S, V], a tensor or `HiddenLogits`."""
    return logits.rows(a, b) if isinstance(logits, HiddenLogits) else logits[a:b]


class TeacherForcedStats:
    """Accumulates teacher-forced metrics over batches: sums and counts, never means of means.

        stats = TeacherForcedStats()
        for ids in batches:
            stats.update(dense(ids).logits, model(ids).logits, ids, start=cfg.budget)
        print(stats.result().as_dict())
    """

    def __init__(self, chunk: int = 256):
        if chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be >= 1")
        self.chunk = chunk
        self.positions = 0
        self._sums = dict.fromkeys(("correct_dense", "correct", "nll_dense", "nll", "agree", "kl"), 0.0)

    @torch.no_grad()
    def update(
        self,
        dense_logits: Tensor | HiddenLogits,  # [B, S, V]
        logits: Tensor | HiddenLogits,  # [B, S, V]
        input_ids: Tensor,  # [B, S]
        start: int,
        valid: Tensor | None = None,  # [B, S]
    ) -> TeacherForcedResult | None:
        """Add one batch; returns the batch's own metrics (None if it counted no position).

        Args:
            dense_logits: [B, S, V], the dense teacher's logits (any float dtype, or `HiddenLogits`).
            logits: [B, S, V], the model's logits (likewise).
            input_ids: int64 [B, S]; the target of position `p` is `input_ids[:, p + 1]`.
            start: first counted position within a sequence, usually the budget `B`.
            valid: optional bool [B, S], False for padding.
        """
        if dense_logits.shape != logits.shape or dense_logits.dim() != 3:
            raise ValueError(
                f"dense_logits and logits must both be [B, S, V], got {tuple(dense_logits.shape)} and {tuple(logits.shape)}"
            )
        if tuple(input_ids.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"input_ids must be [B, S] = {tuple(logits.shape[:2])}, got {tuple(input_ids.shape)}")
        counted = counted_positions(input_ids, start, valid)
        S = input_ids.shape[1]
        sums = dict.fromkeys(self._sums, 0.0)
        # chunks over positions bound the float32 copies to [B, chunk, V]
        for a in range(0, S - 1, self.chunk):
            b = min(a + self.chunk, S - 1)
            m = counted[:, a:b]
            if not m.any():
                continue
            target = input_ids[:, a + 1 : b + 1, None]
            lp_dense = logit_positions(dense_logits, a, b).float().log_softmax(-1)
            lp = logit_positions(logits, a, b).float().log_softmax(-1)
            top_dense = lp_dense.argmax(-1)
            top = lp.argmax(-1)
            p_dense = lp_dense.exp()
            # 0 * log 0 = 0: tokens the teacher rules out contribute nothing
            kl = torch.where(p_dense > 0, p_dense * (lp_dense - lp), 0.0).sum(-1)
            per_position = {
                "correct_dense": top_dense == target[..., 0],
                "correct": top == target[..., 0],
                "nll_dense": -lp_dense.gather(-1, target)[..., 0],
                "nll": -lp.gather(-1, target)[..., 0],
                "agree": top_dense == top,
                "kl": kl,
            }
            for name, value in per_position.items():
                sums[name] += value[m].double().sum().item()
        for name, value in sums.items():
            self._sums[name] += value
        n = int(counted.sum().item())
        self.positions += n
        return _result(sums, n) if n else None

    def result(self) -> TeacherForcedResult:
        if self.positions == 0:
            raise ValueError("no position was counted: every sequence must be longer than start + 1 tokens")
        return _result(self._sums, self.positions)


def _result(s: dict[str, float], n: int) -> TeacherForcedResult:
    """Means over `n` counted positions of the sums `s` (`TeacherForcedStats`)."""
    acc_dense, acc = s["correct_dense"] / n, s["correct"] / n
    return TeacherForcedResult(
        positions=n,
        accuracy_dense=acc_dense,
        accuracy=acc,
        rel_accuracy=acc / acc_dense if acc_dense > 0 else math.nan,
        ppl_dense=math.exp(s["nll_dense"] / n),
        ppl=math.exp(s["nll"] / n),
        ppl_ratio=math.exp((s["nll"] - s["nll_dense"]) / n),
        top1_agreement=s["agree"] / n,
        kl=s["kl"] / n,
    )


def teacher_forced_metrics(
    dense_logits: Tensor | HiddenLogits,  # [B, S, V]
    logits: Tensor | HiddenLogits,  # [B, S, V]
    input_ids: Tensor,  # [B, S]
    start: int,
    valid: Tensor | None = None,  # [B, S]
) -> TeacherForcedResult:
    """`TeacherForcedStats` over a single batch."""
    stats = TeacherForcedStats()
    stats.update(dense_logits, logits, input_ids, start, valid)
    return stats.result()


# --- retention recall against the oracle ---------------------------------------------------------


def _check_recall_args(teacher: Tensor, model: Tensor, topk: int) -> None:
    if teacher.shape != model.shape or teacher.dim() != 3:
        raise ValueError(
            f"teacher and model priorities must both be [B, H, S], got {tuple(teacher.shape)} and {tuple(model.shape)}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r} must be an integer >= 1: recall of an empty top-k is undefined")


def recall_sums(
    teacher: Tensor,  # [B, H, S]
    model: Tensor,  # [B, H, S]
    sink: int,
    window: int,
    topk: int,
) -> tuple[Tensor, int]:
    """Sum over queries of the top-k retention recall, and the number of queries.

    At query `q` a rule retains, of the eligible tokens `sink <= t <= q - window`, those with
    `q < e[t]` (its eviction times); from `q = sink + window + topk` on, both rules retain exactly
    `topk` of them, and `recall(q) = |both retain| / topk`. The count of tokens retained by both is
    `sum_t [t + window <= q < min(e_teacher[t], e_model[t])]`: a difference array over `q` (+1 where
    a token enters the long-range set, -1 where the first of the two rules evicts it) and a cumsum.

    Args:
        teacher: float32 [B, H, S], the oracle's static priorities.
        model: float32 [B, H, S], the policy's static priorities.
        sink, window, topk: the budget split of `docs/method.md` Sec. 1; `topk >= 1`.
    Returns:
        (float64 [B, H] sum of `recall(q)` over `q = sink + window + topk .. S - 1`, number of those queries).
    """
    _check_recall_args(teacher, model, topk)
    B, H, S = teacher.shape
    first = sink + window + topk
    if S <= first:
        return torch.zeros(B, H, dtype=torch.float64, device=teacher.device), 0
    leave = torch.minimum(eviction_times(teacher, sink, window, topk), eviction_times(model, sink, window, topk))
    t = torch.arange(S, device=teacher.device)
    enter = (t + window).clamp(max=S).expand(B, H, S)
    live = ((t >= sink) & (enter < leave)).long()
    diff = torch.zeros(B, H, S + 1, dtype=torch.long, device=teacher.device)
    diff.scatter_add_(-1, enter, live).scatter_add_(-1, leave, -live)
    both = diff.cumsum(-1)[..., first:S]  # [B, H, S - first]
    return both.sum(-1).double() / topk, S - first


def retention_recall(
    teacher: Tensor,  # [B, H, S]
    model: Tensor,  # [B, H, S]
    sink: int,
    window: int,
    topk: int,
) -> Tensor:
    """Mean top-k retention recall of `model` against `teacher` per KV head: float64 [H].

    Averaged over the sequences of the batch and the queries `q >= sink + window + topk`
    (see `recall_sums`). Raises if the sequences are too short to have such a query.
    """
    sums, n = recall_sums(teacher, model, sink, window, topk)
    if n == 0:
        raise ValueError(
            f"sequences of length {teacher.shape[-1]} have no query q >= sink + window + topk = {sink + window + topk}"
        )
    return sums.mean(0) / n


@dataclass(frozen=True)
class RecallResult:
    """Top-k retention recall against the oracle, averaged over sequences and queries."""

    per_head: Tensor
    """float64 [L, H]: per layer and KV head."""
    per_layer: Tensor
    """float64 [L]: mean over the KV heads of each layer."""
    mean: float
    """Mean over layers and heads."""
    queries: int
    """Number of (sequence, query) pairs averaged per head."""

    def as_dict(self) -> dict:
        return {
            "per_head": self.per_head.tolist(),
            "per_layer": self.per_layer.tolist(),
            "mean": self.mean,
            "queries": self.queries,
        }


class RetentionRecall:
    """Accumulates retention recall over batches of sequences, one list of per-layer priorities each.

        recall = RetentionRecall(sink=4, window=128, topk=384)
        for ids in batches:
            recall.update(oracle_priorities(model, ids), policy_priorities(model, ids))
        print(recall.result().per_layer)

    With per-layer budgets (`topk` a list), layer `l` is averaged over its own queries
    `q >= sink + window + topk[l]`; a layer with `topk[l] = 0` has no recall (NaN, left out of the means).
    """

    def __init__(self, sink: int, window: int, topk: int | Sequence[int]):
        per_layer = list(topk) if isinstance(topk, (list, tuple)) else None
        if per_layer is not None:
            if not per_layer or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in per_layer) \
                    or max(per_layer) < 1:
                raise ValueError(f"topk={topk!r} must be integers >= 0, one per layer, at least one of them >= 1")
        elif isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk={topk!r} must be an integer >= 1: recall of an empty top-k is undefined")
        self.sink, self.window, self.topk = sink, window, topk
        self._sums: Tensor | None = None  # float64 [L, H]
        self._queries: Tensor | None = None  # int64 [L], (sequence, query) pairs per layer

    def _layer_topk(self, layer: int) -> int:
        return self.topk[layer] if isinstance(self.topk, (list, tuple)) else self.topk

    @property
    def queries(self) -> int:
        """(sequence, query) pairs averaged per head (of the layers with the smallest top-k, if they differ)."""
        return 0 if self._queries is None else int(self._queries.max())

    def update(self, teacher: Sequence[Tensor], model: Sequence[Tensor]) -> None:
        """Add one batch: per layer, teacher and model static priorities, each float32 [B, H, S]."""
        if len(teacher) != len(model) or not teacher:
            raise ValueError(f"need one teacher and one model priority per layer, got {len(teacher)} and {len(model)}")
        if isinstance(self.topk, (list, tuple)) and len(self.topk) != len(teacher):
            raise ValueError(f"topk has {len(self.topk)} layers, the priorities {len(teacher)}")
        sums, counts = [], []
        for layer, (a, b) in enumerate(zip(teacher, model)):
            k = self._layer_topk(layer)
            if k == 0:
                sums.append(torch.zeros(a.shape[1], dtype=torch.float64))
                counts.append(0)
                continue
            layer_sums, n = recall_sums(a, b, self.sink, self.window, k)
            sums.append(layer_sums.sum(0).cpu())
            counts.append(n * a.shape[0])
        batch, counts = torch.stack(sums), torch.tensor(counts)  # [L, H], [L]
        if self._sums is None:
            self._sums, self._queries = batch, counts
        elif self._sums.shape != batch.shape:
            raise ValueError(f"layers x heads changed between batches: {tuple(self._sums.shape)} then {tuple(batch.shape)}")
        else:
            self._sums += batch
            self._queries += counts

    def result(self) -> RecallResult:
        if self._sums is None or self.queries == 0:
            k = max(self.topk) if isinstance(self.topk, (list, tuple)) else self.topk
            raise ValueError(
                "no query was counted: sequences must be longer than sink + window + topk = "
                f"{self.sink + self.window + k}"
            )
        # a layer without queries (top-k 0, or too short for its top-k) has no recall: NaN, out of the mean
        per_head = self._sums / self._queries[:, None].double()  # 0 / 0 = NaN
        per_layer = per_head.mean(-1)
        return RecallResult(per_head, per_layer, per_head.nanmean().item(), self.queries)


def priorities_from_records(
    records: Sequence[LayerRecord],
    cfg: KVpopConfig,
    window: int | None = None,
) -> list[Tensor]:
    """The oracle's static priorities from the records of a dense forward (`docs/method.md` Sec. 4-5).

    `r_tgt` is the future attention mass of each key under the dense model's own attention (its
    dense log-normaliser), with the target settings of `cfg`; the priority adds the layer's decay.

    Args:
        records: one `LayerRecord` per layer, from a forward with `kvpop_dense=True`.
        cfg: the model's `KVpopConfig` (target eps, aggregation, count normalisation, decay step).
        window: the `w` of the target, by default `cfg.window`; pass the window of the budget under
            evaluation when it differs.
    Returns:
        one float32 [B, Hkv, S] tensor per layer, in layer order.
    """
    window = cfg.window if window is None else window
    out = []
    for rec in sorted(records, key=lambda r: r.layer_idx):
        if not bool(rec.valid.all()):
            raise ValueError("oracle priorities need unpadded sequences: the target has no notion of padding")
        r_tgt = future_attention_target(
            rec.query, rec.key, rec.lse, window, scale=rec.scale,
            eps=cfg.target_eps, agg=cfg.target_agg, count_norm=cfg.target_count_norm, softcap=rec.softcap,
        )
        out.append(teacher_priority(r_tgt, rec.log_gamma, cfg.decay_step))
    return out


@torch.no_grad()
def oracle_priorities(model: nn.Module, input_ids: Tensor, window: int | None = None) -> list[Tensor]:
    """Run a retrofitted model densely and return the oracle's static priorities per layer.

    Args:
        model: a model retrofitted with `kvpop.retrofit`.
        input_ids: int64 [B, S], unpadded.
        window: the `w` of the target, by default the model's `KVpopConfig.window`.
    Returns:
        one float32 [B, Hkv, S] tensor per layer.
    """
    cfg = kvpop_modules(model).config
    records = Capture()
    model(input_ids=input_ids, kvpop_dense=True, kvpop_capture=records, use_cache=False, logits_to_keep=1)
    return priorities_from_records(records, cfg, window)


@torch.no_grad()
def policy_priorities(model: nn.Module, input_ids: Tensor) -> list[Tensor]:
    """The static priorities a retrofitted model's own policy gives every token, per layer.

    Args:
        model: a model retrofitted with `kvpop.retrofit`.
        input_ids: int64 [B, S].
    Returns:
        one float32 [B, Hkv, S] tensor per layer.
    """
    records = Capture()
    model(input_ids=input_ids, kvpop_capture=records, use_cache=False, logits_to_keep=1)
    return [rec.priority.detach() for rec in sorted(records, key=lambda r: r.layer_idx)]


@torch.no_grad()
def model_recall(model: nn.Module, sequences: Iterable[Tensor]) -> RecallResult:
    """Top-k retention recall of a retrofitted model's own static priorities against the oracle of the same
    model (its dense pass, its decay): the `recall` of `kvpop eval`, without the logits.

    Args:
        model: a model retrofitted with a static-priority policy (a trained KVpop scorer, the oracle).
        sequences: int64 [B, S] batches, unpadded, on the model's device.
    """
    cfg = kvpop_modules(model).config
    recall = RetentionRecall(cfg.sink, cfg.window, list(cfg.layer_topk) if cfg.layer_topk else cfg.topk)
    for ids in sequences:
        recall.update(oracle_priorities(model, ids), policy_priorities(model, ids))
    return recall.result()


# --- pass@1 with math-verify ---------------------------------------------------------------------

# ", or equivalently 252", ", or approximately 35.7%": each alternative of a reference answer counts
_ALTERNATIVES = re.compile(r",\s*or\s+(?:equivalently\s+|approximately\s+|an equivalent form such as\s+)?", re.I)
_REMARK = re.compile(r"\((?:i\.e\.|e\.g\.|that is)[^)]*\)", re.I)
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
# a word of 3+ letters ends the maths unless it is a function that parses; "sum", "floor" and the like
# parse wrongly, so they end it too; 2-letter runs are products ("xy") unless they are English
_FUNCTIONS = frozenset({"sqrt", "exp", "log", "sin", "cos", "tan"})
_SHORT_WORDS = frozenset({"no", "is", "it", "or", "at", "as", "an", "be", "by", "if", "in", "of", "on", "to", "so", "we"})
_PLAIN_TO_LATEX = (
    (re.compile(r"\bC\(\s*([^(),]+?)\s*,\s*([^(),]+?)\s*\)"), r"\\binom{\1}{\2}"),
    (re.compile(r"\bfloor\(([^()]*)\)"), r"{\\lfloor \1 \\rfloor}"),
    (re.compile(r"\bceil\(([^()]*)\)"), r"{\\lceil \1 \\rceil}"),
)
_ANSWER_LINE = re.compile(r"answer\s*(?:is\s*:?|:)\s*(.+?)\s*$", re.I | re.M)


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: the last `\\boxed{...}`, else the rest of the last line
    that says `answer:` / `answer is` (the champ solutions end with `Answer: ...`), else None.

    A completion that states no final answer is not searched for a stray number.
    """
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(completion)
    return lines[-1].strip() if lines else None


def _strip(text: str) -> str:
    text = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text.rstrip(".;").strip()


def _normalise(text: str) -> str:
    """For the string fallback: no LaTeX text wrappers, `$`, spaces, case or trailing full stop."""
    text = _TEXT.sub(r"\1", _strip(text))
    text = re.sub(r"\\[,;:! ]", "", text).replace("$", "")
    return re.sub(r"\s+", "", text).lower().rstrip(".")


def _math_part(text: str) -> str | None:
    """The mathematical part of an answer, as LaTeX, or None if it is prose ("No such values").

    Drops "(i.e., ...)" remarks, reads "A and B" and "A or B" as the set "A, B", turns plain-text `C(n, k)`,
    `floor(x)`, `ceil(x)` into LaTeX, and cuts at the first English word ("3 is the only possible
    value" -> "3", "98 values" -> "98"); an answer that starts with a word has no maths.
    """
    text = _TEXT.sub(r" \1 ", _strip(text))
    text = _REMARK.sub(" ", text)
    text = re.sub(r"\s+(?:and|or)\s+", ", ", text)
    for pattern, latex in _PLAIN_TO_LATEX:
        text = pattern.sub(latex, text)
    for word in _WORD.finditer(text):
        w = word.group().lower()
        if w in _SHORT_WORDS or (len(w) > 2 and w not in _FUNCTIONS):
            text = text[: word.start()]
            break
    text = text.strip().rstrip(",;:=( ")
    return text or None


def _timeout() -> int | None:
    # math-verify's timeout uses signal.alarm, which only the main thread may set
    return 5 if threading.current_thread() is threading.main_thread() else None


def _math_verify():
    try:
        import math_verify
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"scoring answers needs math-verify: {MATH_VERIFY_INSTALL}") from e
    return math_verify


def _parse(text: str) -> list:
    return _math_verify().parse(f"${text}$", parsing_timeout=_timeout())


def is_correct(completion: str, answer: str) -> bool:
    """Whether the final answer of `completion` (see `extract_answer`) matches the reference `answer`.

    The reference may list alternatives ("C(10, 5), or equivalently 252"); matching any of them is
    correct. Each alternative is compared twice, and either match counts: (1) its mathematical part
    (see `_math_part`) and the prediction's are parsed by math-verify and checked for equivalence
    (so "\\frac{1}{2}" equals "0.5" and "x^4+x^2+1" equals "(x^2+x+1)(x^2-x+1)"); (2) the normalised
    strings are equal. (2) is the only check for prose answers ("No", "The sequence does not exist"),
    whose parse fails or would be a meaningless product of letters.
    """
    predicted = extract_answer(completion)
    if predicted is None or not predicted.strip():
        return False
    verify = _math_verify().verify
    predicted_math = _math_part(predicted)
    predicted_parsed = _parse(predicted_math) if predicted_math else []
    for alternative in _ALTERNATIVES.split(answer):
        if _normalise(alternative) == _normalise(predicted):
            return True
        gold_math = _math_part(alternative)
        if predicted_parsed and gold_math:
            gold = _parse(gold_math)
            if gold and verify(gold, predicted_parsed, timeout_seconds=_timeout()):
                return True
    return False


def pass_at_1(samples: list[list[str]], answers: list[str]) -> float:
    """pass@1 estimated from `n` sampled completions per problem: the mean over problems of the
    share of correct samples (the unbiased estimator of pass@1 from `n` samples).

    Args:
        samples: per problem, its sampled completions (at least one).
        answers: per problem, the reference answer.
    """
    if len(samples) != len(answers):
        raise ValueError(f"got {len(samples)} lists of samples for {len(answers)} answers")
    if not answers:
        raise ValueError("pass@1 of no problems is undefined")
    shares = []
    for i, (completions, answer) in enumerate(zip(samples, answers)):
        if not completions:
            raise ValueError(f"problem {i} has no samples")
        shares.append(sum(is_correct(c, answer) for c in completions) / len(completions))
    return sum(shares) / len(shares)


__all__ = [
    "MATH_VERIFY_INSTALL",
    "RecallResult",
    "RetentionRecall",
    "TeacherForcedResult",
    "TeacherForcedStats",
    "counted_positions",
    "extract_answer",
    "is_correct",
    "model_recall",
    "oracle_priorities",
    "pass_at_1",
    "policy_priorities",
    "priorities_from_records",
    "recall_sums",
    "retention_recall",
    "teacher_forced_metrics",
]
