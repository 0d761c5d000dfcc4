"""The retention rule of KVpop (`docs/method.md` Sec. 1-2): static priorities, eviction and the mask.

Every execution - the dense reference, the training/prefill attention and the decoding cache -
reduces to two facts per token: its static priority `pi[t]`, and the first query position at which
it is out of the long-range top-k (its eviction position). This module states the rule on plain
tensors; `ops/topk` computes it fast.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from kvpop.config import KVpopConfig
from kvpop.ops.dynamic.score import score_update
from kvpop.ops.topk import NEVER, eviction_positions, mask_from_eviction, retention_mask_reference


def static_priority(score: Tensor, position: Tensor, log_gamma: Tensor, decay_step: int) -> Tensor:
    """`pi[t] = r[t] - floor(t / n) * log(gamma_h)`, in float32.

    Args:
        score: float [B, H, N], the scorer's `r[t]`.
        position: int64 [B, N] or [B, H, N], each token's position within its sequence.
        log_gamma: float [H], `log(gamma_h) < 0`.
        decay_step: `n`.
    Returns:
        float32 [B, H, N].
    """
    if position.dim() == 2:
        position = position[:, None, :]
    steps = torch.div(position, decay_step, rounding_mode="floor").float()
    return score.float() - steps * log_gamma.float()[None, :, None]


def _check_rule_args(priority: Tensor, sink: int, window: int, topk: int) -> None:
    if priority.dim() != 3:
        raise ValueError(f"priority must be [B, H, S], got shape {tuple(priority.shape)}")
    if not priority.is_floating_point():
        raise ValueError(f"priority must be a float tensor, got {priority.dtype}")
    for name, value, lo in (("sink", sink, 0), ("window", window, 1), ("topk", topk, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}={value!r} must be an integer >= {lo}")
    if torch.isnan(priority).any():
        raise ValueError("priority contains NaN; the ranking of NaN is undefined")


def retention_mask(priority: Tensor, sink: int, window: int, topk: int) -> Tensor:
    """The dense retention mask `M[b, h, q, t]` of `docs/method.md` Sec. 2 (reference; `S x S`).

    Args:
        priority: float32 [B, H, S], static priorities of positions `0 .. S-1`.
    Returns:
        bool [B, H, S, S]: query `q` attends key `t`.
    """
    _check_rule_args(priority, sink, window, topk)
    return retention_mask_reference(priority.float(), sink, window, topk)


def eviction_times(priority: Tensor, sink: int, window: int, topk: int) -> Tensor:
    """First query `q` at which an eligible token is not retained; `S` if never (O(S log S)).

    `retention_mask(...)[q, t]` equals `q < e[t]` for `sink <= t <= q - window`.

    Args:
        priority: float32 [B, H, S].
    Returns:
        int64 [B, H, S].
    """
    _check_rule_args(priority, sink, window, topk)
    S = priority.shape[-1]
    pos = torch.arange(S, device=priority.device)
    valid = torch.ones(S, dtype=torch.bool, device=priority.device)
    return eviction_positions(priority.float(), pos, valid, sink, window, topk, ordered=True).clamp(max=S)


class LayerPolicy(nn.Module):
    """How one attention layer ranks its tokens: the interface shared by KVpop and every baseline.

    The eviction machinery (sinks, window, running top-k, cache slots, masks) lives once, in
    `ops/topk`, `attention.py` and `cache.py`; a policy supplies only what differs:

    - `priority(key, value, position)`: each new token's priority at insertion (float32);
    - `dynamic = True` and `update(...)`: priorities that change with the attention each token
      receives (TOVA, H2O). Such policies run step by step, also when teacher-forced;
    - `stateful = True`, `init_state(...)` and `advance(...)`: static priorities that a memory over
      all tokens so far assigns `delay <= window` steps after a token's insertion (the mLSTM scorer).
      Teacher-forced, `priority` scores a whole sequence at once; the cache instead holds the memory
      and asks `advance` for each token's priority when it is due.
    - `evidence = True` (`EvidencePolicy`): static priorities assigned when a token leaves the window,
      from the attention its window's queries gave it. Teacher-forced, `attention_priority` scores a
      whole sequence from its queries; the cache keeps per-window-slot sums (`init_state`) and asks
      `readout` for the token leaving the window.

    A static policy (`dynamic = False`) ranks by priorities fixed before a token becomes eligible, so
    a whole sequence is handled at once by the O(S log S) rule.
    """

    dynamic = False
    score: str | None = None
    """Dynamic policies: how a step's probabilities become priorities, one of `ops.dynamic.SCORES`; the
    prefill walk (`ops/dynamic`) and the decode step's `update` both apply it through `ops.dynamic.score_update`."""
    pool: int | None = None
    """KVpop-cascade (score "cascade") only: how many long-range slots the pool ranked by `update` holds; the others
    form the static pool, ranked by the priority at insertion (`ops.dynamic.dynamic_walk`). None: one pool."""
    tova_first = False
    """The layer-wide KVpop-cascades (scores "cascade_mean", "cascade_sum"): the pool ranked by `update` takes the token
    leaving the window first, and the static pool keeps the best of what it evicts."""
    decay = 1.0
    """Score "cascade_sum" only (`KVpopConfig.pool_decay`): the weight of a slot's accumulated score at each step."""
    chunk = 1
    """Scores "mean" and "cascade_mean" (`KVpopConfig.decision_chunk`): decide once every `chunk` steps from the
    chunk's queries (`ops.dynamic.chunked`); 1: after every token."""
    stateful = False
    evidence = False
    teacher_forced_only = False
    sliding = False
    """A sliding-window layer of a hybrid model (`baselines.SlidingWindowPolicy`): the rule with no sinks and no
    long-range slots, run in every execution, never captured for training."""
    delay = 0
    """Stateful policies: the token read out at step `u` is token `u - delay`."""

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # a buffer, not a fresh tensor, so that it follows the model to its device
        self.register_buffer("no_decay", torch.zeros(num_kv_heads), persistent=False)

    @property
    def log_gamma(self) -> Tensor:
        """float32 [H]: the decay of Sec. 2 (0: no decay)."""
        return self.no_decay

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Priorities of new tokens: float32 [B, H, N] for key/value [B, H, N, D], position int64 [B, N]."""
        B, H, N, _ = key.shape
        return torch.zeros(B, H, N, dtype=torch.float32, device=key.device)

    def scorer_key(self, key: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """The key the scorer reads for cached keys [B, H, N, D]: as cached, unless a policy says otherwise."""
        return key

    def update(self, priority: Tensor, probs: Tensor, occupied: Tensor, prior: Tensor | None = None) -> Tensor:
        """Dynamic policies: new slot priorities after one decode step.

        Args:
            priority: float32 [B, Hkv, N], the slots' priorities before the step.
            probs: float32 [B, Hkv, G, N], the step's attention probabilities over the slots.
            occupied: bool [B, Hkv, N].
            prior: float32 [B, Hkv, N], the slots' static priors (score "prior" only, else None).

        Every dynamic policy turns its `score` into priorities the same way, in `ops.dynamic.score_update`, which the
        prefill walks call too: one definition of the update for the decode step and the walks.
        """
        if self.score is None:
            raise NotImplementedError(f"{type(self).__name__} is not a dynamic policy: it has no update")
        return score_update(self.score, priority, probs, occupied, prior, self.decay)

    def init_state(self, batch: int, device: torch.device) -> tuple[Tensor, ...]:
        """Stateful policies: the memory before any token, a tuple of tensors with the batch as dim 0."""
        raise NotImplementedError

    def advance(
        self,
        state: tuple[Tensor, ...],
        key: Tensor,  # [B, H, C, D]
        value: Tensor,  # [B, H, C, D]
        valid: Tensor,  # bool [B, C], False: a padding step that leaves the memory unchanged
        readout_key: Tensor,  # [B, H, C, D]
        readout_value: Tensor,  # [B, H, C, D]
        readout_position: Tensor,  # int64 [B, C]
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        """Stateful policies: insert C tokens; after step `j`, read out readout token `j` (token `u - delay`).

        Returns:
            the memory after the C tokens, and the readout tokens' static priorities, float32 [B, H, C].
        """
        raise NotImplementedError


class ScorerPolicy(LayerPolicy):
    """KVpop: a learned scorer and a learned per-head decay `gamma_h` (Sec. 2-3)."""

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int, group: int = 1):
        super().__init__(cfg, num_kv_heads, head_dim)
        self.decay_step = cfg.decay_step
        self.group = group  # query heads per KV head
        self.pre_rope = cfg.scorer_keys == "pre_rope"
        self.scorer = self.make_scorer(cfg, num_kv_heads, head_dim)
        # gamma_h = sigmoid(theta_h): always in (0, 1)
        self.theta = nn.Parameter(torch.full((num_kv_heads,), math.log(cfg.gamma_init / (1 - cfg.gamma_init))))

    def make_scorer(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int) -> nn.Module:
        from kvpop.scorers import MLPScorer

        return MLPScorer(num_kv_heads, head_dim, cfg.scorer_hidden)

    @property
    def log_gamma(self) -> Tensor:
        """float32 [H], `log(gamma_h) < 0`."""
        return nn.functional.logsigmoid(self.theta.float())

    def scorer_key(self, key: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """`scorer_keys="pre_rope"`: the cached keys with RoPE undone (float32), else as cached."""
        if not self.pre_rope:
            return key
        from kvpop.rope import unrotate

        return unrotate(key, rope)

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Static priorities of new tokens (differentiable in the scorer and gamma only).

        Args:
            key, value: [B, H, N, D] as cached.
            position: int64 [B, N] or [B, H, N].
        Returns:
            float32 [B, H, N].
        """
        return static_priority(self.scorer(key, value), position, self.log_gamma, self.decay_step)


class TOVAPriorPolicy(ScorerPolicy):
    """KVpop-TOVA (`KVpopConfig.tova_prior`, an extension): TOVA's evidence plus the learned scorer's prediction.

    The static rule keeps a token for what its `[k; v]` predicts and cannot see that the text has turned
    (a repetition loop, such as a held-out champ sequence with a run of 3,122 "0" tokens: docs/policies.md); TOVA follows the current query
    but forgets what a later query will need. Here a slot's priority after each step is the latest query's
    attention averaged over every query head of the layer (TOVA's paper ranking) plus `alpha * exp(r)`, the
    scorer's estimate of the token's future attention (Sec. 4's target, in the same units once `b2` is
    calibrated) averaged over the layer's KV heads, fixed at insertion and kept per slot
    (`ops.dynamic.score_update`, score "prior"). `alpha = 0` is TOVA's paper ranking.

    In training (`self.training`) it is KVpop-mlp: the static rule, the boundary loss and the target; the
    trainer calibrates `b2` (`kvpop.train.calibrate`). In evaluation and decoding it is dynamic, like TOVA.
    """

    score = "prior"

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int, group: int = 1):
        super().__init__(cfg, num_kv_heads, head_dim, group)
        self.weight = float(cfg.tova_prior)

    @property
    def dynamic(self) -> bool:  # type: ignore[override]
        return not self.training

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Training: the static priorities of KVpop-mlp. Otherwise the prior `alpha * exp(r)`, float32 [B, H, N]."""
        if self.training:
            return super().priority(key, value, position)
        # one prior per token for the whole layer (the mean over its KV heads): TOVA's layer-wide ranking then
        # stays one ranking, and every head keeps the same tokens
        return (self.weight * torch.exp(self.scorer(key, value))).mean(dim=1, keepdim=True).expand(key.shape[:3])


class CascadePolicy(ScorerPolicy):
    """KVpop-cascade (`KVpopConfig.tova_pool`, an extension): the static rule's rejects get a second chance under TOVA.

    The long-range slots split in two pools. The static pool (`topk - tova_pool` slots) is KVpop-mlp's: a token
    leaving the window takes the place of the pool's weakest if its static priority is at least as high. The
    loser of that comparison (the leaving token, or the static token it displaced) then meets the TOVA pool's
    weakest (`tova_pool` slots), ranked per KV head by the latest query's attention (the max over the head's
    query heads, score "cascade"); the weaker of the two is evicted. The static pool keeps what the scorer
    foresees; the TOVA pool keeps what the text reads now, which a priority fixed at insertion cannot follow (a
    repetition loop: docs/policies.md). `tova_pool = 0` is KVpop-mlp, and
    `tova_pool = topk` is TOVA per KV head with the same sinks and window.

    The layer-wide form (`tova_head_average`, score "cascade_mean") ranks the TOVA pool as TOVA's paper does, by the
    latest query's attention averaged over every query head of the layer: one ranking for all KV heads, which TOVA
    needs to be strong (docs/policies.md). So that the pool holds the same tokens in every head,
    the order turns round: the token leaving the window meets the TOVA pool first, and whichever loses meets the
    per-head static pool, which keeps the best of TOVA's evictions by the learned priority. `tova_pool = topk` is
    then TOVA itself (with TOVA's split: no sinks, a window of 1), and `tova_pool = 0` KVpop-mlp at that split.
    With `pool_decay` (score "cascade_sum") the pool ranks by the layer's head-averaged attention accumulated over the
    steps instead of the latest step's: H2O's ranking at `pool_decay = 1`, older steps fading by `pool_decay` per step
    below it. The order and the static pools are the same.

    In training (`self.training`) it is KVpop-mlp: the static rule, the boundary loss and the target. In evaluation
    and decoding it is dynamic, like TOVA; each slot carries its static priority (the cache's `prior`).
    """

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int, group: int = 1):
        super().__init__(cfg, num_kv_heads, head_dim, group)
        self.pool = int(cfg.tova_pool)
        self.tova_first = bool(cfg.tova_head_average)
        self.score = "cascade_sum" if cfg.pool_decay is not None else "cascade_mean" if self.tova_first else "cascade"
        self.decay = 1.0 if cfg.pool_decay is None else float(cfg.pool_decay)
        self.chunk = int(cfg.decision_chunk)

    @property
    def dynamic(self) -> bool:  # type: ignore[override]
        return not self.training


class MLSTMPolicy(ScorerPolicy):
    """KVpop with the stateful mLSTM scorer (Sec. 3): token `t` is scored `delay` steps after its insertion.

    With `delay <= window` a token's priority is known by the query at which it becomes eligible
    (`t + window`), so the retention rule and its O(S log S) form apply unchanged.
    """

    stateful = True

    def make_scorer(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int) -> nn.Module:
        from kvpop.scorers.mlstm import MLSTMScorer

        return MLSTMScorer(num_kv_heads, head_dim, d=cfg.mlstm_dim, hidden=cfg.mlstm_hidden, delay=cfg.readout_delay)

    @property
    def delay(self) -> int:
        return self.scorer.delay

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Static priorities of a whole sequence (teacher-forced): token `t` read out after step `t + delay`.

        Args:
            key, value: [B, H, S, D] as cached.
            position: int64 [B, S] (or [B, H, S]); negative for padding, which the memory skips.
        Returns:
            float32 [B, H, S], differentiable in the scorer and gamma.
        """
        valid = position >= 0
        valid = valid[:, 0] if valid.dim() == 3 else valid
        return static_priority(self.scorer(key, value, valid=valid), position, self.log_gamma, self.decay_step)

    def init_state(self, batch: int, device: torch.device) -> tuple[Tensor, ...]:
        return self.scorer.init_state(batch, device)

    def advance(self, state, key, value, valid, readout_key, readout_value, readout_position):
        if key.shape[2] == 1:
            # decoding: the one-step recurrence
            state = self.scorer.step(state, key[:, :, 0], value[:, :, 0], valid[:, 0])
            score = self.scorer.readout(state, readout_key[:, :, 0], readout_value[:, :, 0])[..., None]
        else:
            state, score = self.scorer.scan(state, key, value, readout_key, readout_value, None, valid)
        return state, static_priority(score, readout_position, self.log_gamma, self.decay_step)


class EvidenceState(NamedTuple):
    """What the cache keeps per layer for the evidence scorer, one entry per window ring slot."""

    acc: Tensor  # float32 [B, H, w, 3, G]: sum, max and latest window-normalised probability of the slot's token
    key: Tensor  # float32 [B, H, w, D] its key before RoPE (`scorer_keys="pre_rope"`), else [B, H, w, 0]


class EvidencePolicy(ScorerPolicy):
    """KVpop with the delayed evidence scorer (`docs/method.md` Sec. 8): token `t` scored when it leaves the window.

    Its score reads `[k_t; v_t]` and what the queries `t .. t + w - 1` of its window gave it
    (`kvpop.ops.evidence`), so it is a delayed scorer with `delay = window`: the priority is known
    by the query at which the token becomes eligible, and the rule applies unchanged.
    """

    evidence = True

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int, group: int = 1):
        self.sink, self.window = cfg.sink, cfg.window
        super().__init__(cfg, num_kv_heads, head_dim, group)

    def make_scorer(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int) -> nn.Module:
        from kvpop.scorers.evidence import EvidenceScorer

        return EvidenceScorer(num_kv_heads, head_dim, self.group, cfg.scorer_hidden, mix=cfg.evidence_mix)

    @property
    def delay(self) -> int:
        return self.window

    def attention_priority(
        self,
        query: Tensor,  # [B, Hq, S, D]
        key: Tensor,  # [B, H, S, D]
        value: Tensor,  # [B, H, S, D]
        position: Tensor,  # int64 [B, S]
        valid: Tensor,  # bool [B, S]
        scale: float,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Static priorities of whole teacher-forced sequences (differentiable in the scorer and gamma only).

        A token whose window runs past the sequence's end is scored from what its window had; it
        never becomes eligible within the sequence, so that score is never used.

        Returns:
            float32 [B, H, S].
        """
        from kvpop.ops.evidence import sequence_evidence

        stats = sequence_evidence(query, key, position, valid, self.sink, self.window, scale)
        return self.readout(self.scorer_key(key, rope), value, stats, position)

    def readout(self, key: Tensor, value: Tensor, stats: Tensor, position: Tensor) -> Tensor:
        """Static priorities of tokens leaving the window.

        Args:
            key: [B, H, N, D], as the scorer reads it (`scorer_key`); value [B, H, N, D].
            stats: [B, H, N, 3, G], their window evidence.
            position: int64 [B, N] or [B, H, N].
        Returns:
            float32 [B, H, N].
        """
        return static_priority(self.scorer(key, value, stats), position, self.log_gamma, self.decay_step)

    def init_state(self, batch: int, device: torch.device) -> EvidenceState:
        H, w = self.num_kv_heads, self.window
        kw = dict(dtype=torch.float32, device=device)
        return EvidenceState(torch.zeros(batch, H, w, 3, self.group, **kw),
                             torch.zeros(batch, H, w, self.head_dim if self.pre_rope else 0, **kw))


__all__ = [
    "NEVER",
    "EvidencePolicy",
    "EvidenceState",
    "LayerPolicy",
    "MLSTMPolicy",
    "ScorerPolicy",
    "CascadePolicy",
    "eviction_times",
    "mask_from_eviction",
    "retention_mask",
    "static_priority",
]
