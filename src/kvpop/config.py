"""KVpopConfig: every knob of the method in one validated dataclass (`docs/method.md`, Sec. 1-5).

A bad value raises `ValueError` naming the field, the value and what is allowed, so a typo on the
command line never turns into a silently different experiment.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

POLICIES = ("kvpop", "streaming_llm", "streaming_llm_plus", "tova", "h2o", "oracle", "dms")
RECENCY_POLICIES = ("streaming_llm", "streaming_llm_plus")
SCORERS = ("mlp", "mlstm", "evidence")
SCORER_KEYS = ("cached", "pre_rope")
EVIDENCE_MIXES = ("concat", "additive")
PAPER_SPLITS = ("tova", "h2o")
"""Policies whose `for_budget` split follows their paper unless `windowed=True` asks for kvpop's variant."""
AGGREGATIONS = ("max", "mean")

DEFAULT_BUDGET = 512
"""The budget every entry point starts from (`KVpopConfig()`, `for_budget`, the CLI's `--budget`): the
CPU scale of the project (`DESIGN.md`), a quarter of a 2048-token sequence (CR 75 %); the paper's GPU
setting is 2048 of 8192. Split as `for_budget` splits any budget: 4 sinks, a window of a quarter, the rest top-k."""
DEFAULT_SINK = 4


RULES = ("cascade", "static")
"""How a trained KVpop-mlp directory runs (`KVpopConfig.for_rule`, `kvpop.load(rule=...)`, the CLI's `--rule`):
`cascade`, the recommended policy (the default), or `static`, the paper's static rule."""
RECOMMENDED_POOL_FRACTION = (3, 4)
"""The recommended policy's pool, as a fraction of the layer-wide cascade's `budget - 1` long-range slots."""
RECOMMENDED_POOL_DECAY: float | None = None
"""The recommended policy's pool ranking (`KVpopConfig.pool_decay`): None, TOVA's latest attention."""


def recommended_pool(budget: int) -> int:
    """The recommended policy's pool at `budget`: 3/4 of the `budget - 1` long-range slots of the layer-wide cascade,
    rounded down (the rest is the per-head static pool ranked by the learned priority).

    One fraction at every budget and compression ratio. Development rows support it: on the GPU at S = 8192 it was
    the best of 1/2, 3/4 and 7/8 at B = 1024 and level with 7/8 at B = 2048.
    """
    if not _is_int(budget) or budget < 1:
        raise ValueError(f"budget={budget!r} must be an integer >= 1")
    num, den = RECOMMENDED_POOL_FRACTION
    return (budget - 1) * num // den


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"KVpopConfig.{name}={value!r} is invalid: {allowed}")


@dataclass
class KVpopConfig:
    """The bounded cache, the scorer and the loss of KVpop.

    The cache keeps per (layer, KV head) `budget = sink + window + topk` entries.
    """

    sink: int = DEFAULT_SINK
    """Number of sink tokens (positions `t < sink`), always retained. >= 0."""
    window: int = DEFAULT_BUDGET // 4
    """Protected window of the most recent tokens, the current one included. >= 1."""
    topk: int = DEFAULT_BUDGET - DEFAULT_SINK - DEFAULT_BUDGET // 4
    """Long-range slots filled by the learned ranking of older tokens. >= 0 (0 = StreamingLLM pattern)."""
    layer_topk: tuple[int, ...] | None = None
    """Per-layer budgets (an extension, `docs/method.md` Sec. 8): layer `l` keeps `sink + window + layer_topk[l]`
    entries per KV head. Their mean must equal `topk`, so the total memory is that of the uniform split
    (`sum_l B_l = L x budget`). None: `topk` in every layer. `kvpop budgets` allocates them from measured
    per-layer sensitivity; `for_layer(l)` is the config layer `l` runs."""
    policy: Literal["kvpop", "streaming_llm", "streaming_llm_plus", "tova", "h2o", "oracle", "dms"] = "kvpop"
    """Eviction policy: `kvpop` (learned scorer) or a baseline (`kvpop.baselines`)."""
    scorer: Literal["mlp", "mlstm", "evidence"] = "mlp"
    """Scorer architecture (Sec. 3): `mlp`, the stateless KVpop-mlp, or `mlstm`, the stateful KVpop; or `evidence`
    (Sec. 7b, opt-in): an MLP over `[k; v]` and the attention the token received from its window's queries, read
    out when it leaves the window."""
    scorer_hidden: int = 256
    """Hidden size of the MLP scorer (and of the evidence scorer's MLP). >= 1."""
    scorer_keys: Literal["cached", "pre_rope"] = "cached"
    """mlp / evidence: the key the scorer reads. `cached` (the paper): as cached, RoPE applied; `pre_rope`: the
    cached key with its position's rotation undone (`kvpop.rope`), so the score sees content, not position."""
    evidence_mix: Literal["concat", "additive"] = "concat"
    """evidence only: how the window features `phi` enter the score. `concat`: one MLP over `[k; v; phi]`;
    `additive`: the MLP over `[k; v]` plus a per-head linear term in `phi` (zero at init)."""
    delay: int | None = None
    """mLSTM only: a token is read out `delay` steps after its insertion, in [0, window]. None means
    `window` (the method: read out when it leaves the window); 0 reads it out at insertion (the ablation)."""
    mlstm_dim: int | None = None
    """mLSTM only: memory size `d` (state `d x d`); None means the head dim `D`. >= 1."""
    mlstm_hidden: int = 64
    """mLSTM only: hidden size of the head from the readout to the score; 0 makes it linear. >= 0."""
    match_mlp_memory: bool = False
    """mLSTM only: count the memory against the budget, so that the total equals the MLP variant's:
    `topk` shrinks by `state_entries = ceil((d*d + d) / (2D))` KV entries. The head dim `D` is known only
    at retrofit time, which resolves it (`resolve`); the retrofitted model holds and saves the result."""
    decay_step: int = 128
    """Decay step `n` of the static priority `pi[t] = r[t] - floor(t / n) * log(gamma)`. >= 1."""
    gamma_init: float = 0.9
    """Initial per-head decay `gamma_h = sigmoid(theta_h)`, strictly between 0 and 1."""
    tova_prior: float | None = None
    """KVpop-TOVA (an extension, `docs/method.md` Sec. 8; mlp scorer only). None: the paper's static rule. A weight
    `alpha >= 0`: decode and evaluate dynamically, ranking each slot by TOVA's evidence (the latest query's
    attention averaged over every query head of the layer, as TOVA's paper ranks) plus `alpha * exp(r)`, the scorer's prediction of the
    token's future attention, fixed at insertion. The scorer trains as KVpop-mlp (the static rule), with its
    per-head bias `b2` calibrated so that `exp(r)` estimates the target's future attention mass. Measured worse
    than TOVA at every weight tried (docs/policies.md)."""
    tova_pool: int = 0
    """KVpop-cascade (an extension, `docs/method.md` Sec. 8; mlp scorer only): how many of the `topk` long-range slots
    form a pool ranked by TOVA (the latest query's attention, per KV head) that takes the static rule's rejects.
    0: the paper's static rule. With `n > 0`, a token leaving the window competes for the `topk - n` static slots
    by its learned priority; the loser of that competes for the `n` TOVA slots by its current attention; the
    loser of that is evicted. The scorer trains as KVpop-mlp; decoding and evaluation are dynamic, like TOVA's.
    In [0, topk] (each layer's top-k with `layer_topk`)."""
    tova_head_average: bool = False
    """TOVA: rank by the attention averaged over all query heads of the layer (the original) instead of per KV
    head (max over its query heads). KVpop-cascade (`tova_pool > 0`): the layer-wide cascade, whose TOVA pool
    ranks so too (one ranking for every KV head) and therefore takes the token leaving the window first; the
    per-head static pool keeps the best of what it evicts by the learned priority (`KVpopConfig.for_budget`
    gives it TOVA's split)."""
    pool_decay: float | None = None
    """The layer-wide KVpop-cascade only (`tova_pool` with `tova_head_average`): what ranks its pool. None: TOVA's
    paper score, the latest query's attention averaged over the layer's query heads. A decay `d` in (0, 1]: that
    attention accumulated over the steps, each step's score `d x` the previous one plus the latest (score
    "cascade_sum"): `d = 1` is H2O's accumulated attention, `d < 1` weighs a step `age` steps ago by `d ** age`.
    At TOVA's split (window 1) H2O's sum lets almost no new token into the pool, so the last tokens fall to the
    static pool and many are evicted: measured 10-20x TOVA's pool's KL on development rows (SmolLM2, S = 2048)."""
    decision_chunk: int = 1
    """How often TOVA's head-averaged rule and the layer-wide KVpop-cascade decide (`ops/dynamic/chunked.py`). 1 (the
    default): after every token, the per-token rules. `C > 1`: the chunked rule, an extension: the window is a ring
    of `C` slots that a chunk's tokens fill, nothing is evicted while it fills, then one decision from the chunk's
    `C` queries (each candidate's attention averaged over the layer's query heads and the queries that see it) keeps
    the best `topk` of the held tokens and the chunk's and empties the ring. The cache holds at most
    `topk + C = budget` tokens (and the chunk's queries, `C` per query head, for the decision), and a prefill takes
    `S / C` rounds instead of `S`. TOVA with `tova_head_average` and
    the layer-wide cascade with `pool_decay` None only, split as `with_decision_chunk` splits them (no sinks, the
    window the ring: `window = C`). H2O with no sinks (its paper's split) too, its split unchanged (`C <= window`):
    the window's newest `C` slots are the ring, its other `window - C` tokens stay at every decision, and each KV
    head keeps the `topk` best of the rest by the attention accumulated over the steps, the chunk's added at each
    decision."""
    dms_temperature: float = 0.1
    """DMS only: temperature of the Gumbel-sigmoid relaxation of the eviction gates in training. > 0."""
    dms_target_retention: float | None = None
    """DMS only: share `rho` of the tokens past the window that the compression loss lets each head keep,
    in [0, 1]. None: `topk / (S - sink - window)` with `S` the training length (`kvpop train` resolves and
    saves it), so that the expected retained long-range tokens at a sequence's end equal `topk`."""
    dms_loss_weight: float = 1.0
    """DMS only: weight of the compression loss `|retention - rho|` against the KL. >= 0."""

    # --- loss knobs (Sec. 4-5); the training issue consumes them ---
    target_eps: float = 1e-6
    """`eps` of the future-attention target `log(eps + m)`. > 0."""
    target_agg: Literal["max", "mean"] = "max"
    """How the target aggregates the G query heads of a KV head."""
    target_count_norm: bool = True
    """Divide the future mass by `N_t` (Sec. 4); False gives the paper's B.1 variant."""
    loss_tau: float = 1.0
    """Temperature of the boundary loss. > 0."""
    loss_margin_delta: float = 1.0
    """Margin weight `tanh(Delta / delta)`; 0 disables margin weighting. >= 0."""
    loss_balance: bool = True
    """Keep/drop balancing of Sec. 5 (paper B.5)."""
    loss_balance_clip: tuple[float, float] = (0.2, 5.0)
    """Clip range `[c_min, c_max]` of the balancing weights, 0 < c_min <= c_max."""
    loss_query_fraction: float = 1.0
    """Share of eligible queries `q >= sink + window + topk` sampled per sequence, in (0, 1]."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata saved with the model (e.g. the command that trained it)."""

    def __post_init__(self) -> None:
        for name, lo in (("sink", 0), ("window", 1), ("topk", 0), ("scorer_hidden", 1), ("decay_step", 1)):
            value = getattr(self, name)
            _check(_is_int(value) and value >= lo, name, value, f"must be an integer >= {lo}")
        _check(self.policy in POLICIES, "policy", self.policy, f"must be one of {POLICIES}")
        _check(self.scorer in SCORERS, "scorer", self.scorer, f"must be one of {SCORERS}")
        _check(self.scorer_keys in SCORER_KEYS, "scorer_keys", self.scorer_keys, f"must be one of {SCORER_KEYS}")
        _check(self.scorer_keys == "cached" or (self.policy == "kvpop" and self.scorer in ("mlp", "evidence")),
               "scorer_keys", self.scorer_keys, "'pre_rope' applies only to policy='kvpop' with scorer 'mlp' or 'evidence'")
        _check(self.evidence_mix in EVIDENCE_MIXES, "evidence_mix", self.evidence_mix, f"must be one of {EVIDENCE_MIXES}")
        _check(self.evidence_mix == "concat" or (self.policy == "kvpop" and self.scorer == "evidence"),
               "evidence_mix", self.evidence_mix, "applies only to policy='kvpop' with scorer='evidence'")
        _check(self.delay is None or (_is_int(self.delay) and 0 <= self.delay <= self.window), "delay", self.delay,
               f"must be None (= window) or an integer in [0, window={self.window}]")
        _check(self.mlstm_dim is None or (_is_int(self.mlstm_dim) and self.mlstm_dim >= 1), "mlstm_dim",
               self.mlstm_dim, "must be None (= head dim) or an integer >= 1")
        _check(_is_int(self.mlstm_hidden) and self.mlstm_hidden >= 0, "mlstm_hidden", self.mlstm_hidden,
               "must be an integer >= 0")
        _check(isinstance(self.match_mlp_memory, bool), "match_mlp_memory", self.match_mlp_memory, "must be a bool")
        uses_mlstm = self.policy == "kvpop" and self.scorer == "mlstm"
        for name in ("delay", "mlstm_dim"):
            _check(uses_mlstm or getattr(self, name) is None, name, getattr(self, name),
                   "applies only to policy='kvpop' with scorer='mlstm' (leave it None)")
        _check(uses_mlstm or not self.match_mlp_memory, "match_mlp_memory", self.match_mlp_memory,
               "applies only to policy='kvpop' with scorer='mlstm'")
        _check(self.tova_prior is None or (isinstance(self.tova_prior, (int, float)) and not isinstance(self.tova_prior, bool)
                                           and 0.0 <= self.tova_prior < math.inf), "tova_prior", self.tova_prior,
               "must be None (the static rule) or a finite weight >= 0")
        _check(self.tova_prior is None or (self.policy == "kvpop" and self.scorer == "mlp"), "tova_prior",
               self.tova_prior, "applies only to policy='kvpop' with scorer='mlp' (a prior fixed at insertion)")
        _check(_is_int(self.tova_pool) and 0 <= self.tova_pool <= self.topk, "tova_pool", self.tova_pool,
               f"must be an integer in [0, topk={self.topk}] (long-range slots given to the TOVA pool)")
        _check(self.tova_pool == 0 or (self.policy == "kvpop" and self.scorer == "mlp"), "tova_pool", self.tova_pool,
               "applies only to policy='kvpop' with scorer='mlp' (a static priority fixed at insertion)")
        _check(self.tova_pool == 0 or self.tova_prior is None, "tova_pool", self.tova_pool,
               f"and tova_prior={self.tova_prior!r} are two different extensions: give one of them")
        _check(isinstance(self.tova_head_average, bool), "tova_head_average", self.tova_head_average, "must be a bool")
        _check(not self.tova_head_average or self.policy == "tova" or self.tova_pool > 0, "tova_head_average",
               self.tova_head_average, "applies to policy='tova' and to KVpop-cascade (tova_pool > 0) only")
        _check(self.pool_decay is None or (isinstance(self.pool_decay, (int, float)) and not isinstance(self.pool_decay, bool)
                                           and 0.0 < self.pool_decay <= 1.0), "pool_decay", self.pool_decay,
               "must be None (TOVA's latest attention) or a decay in (0, 1] (1: H2O's accumulated attention)")
        _check(self.pool_decay is None or (self.tova_pool > 0 and self.tova_head_average), "pool_decay", self.pool_decay,
               "applies to the layer-wide KVpop-cascade only (tova_pool > 0 with tova_head_average=True)")
        _check(_is_int(self.decision_chunk) and self.decision_chunk >= 1, "decision_chunk", self.decision_chunk,
               "must be an integer >= 1 (1: decide after every token)")
        _check(self.decision_chunk == 1 or self.chunkable, "decision_chunk", self.decision_chunk,
               "applies to TOVA with tova_head_average, to the layer-wide KVpop-cascade (tova_pool > 0, "
               "tova_head_average, pool_decay None) and to H2O without sinks")
        if self.policy == "h2o":
            _check(self.decision_chunk <= self.window, "decision_chunk", self.decision_chunk,
                   f"is H2O's ring, the newest part of its window: at most window = {self.window}")
        else:
            _check(self.decision_chunk == 1 or (self.sink == 0 and self.window == self.decision_chunk),
                   "decision_chunk", self.decision_chunk, f"needs no sinks and the window as its ring (window = "
                   f"decision_chunk), got sink {self.sink}, window {self.window}: KVpopConfig.with_decision_chunk "
                   "splits a budget so")
        _check(self.policy not in RECENCY_POLICIES or self.topk == 0, "topk", self.topk,
               f"must be 0 for policy {self.policy!r}, which keeps only sinks and the window "
               f"(use window = budget - sink; KVpopConfig.for_budget does it)")
        _check(isinstance(self.gamma_init, (int, float)) and 0.0 < self.gamma_init < 1.0, "gamma_init", self.gamma_init,
               "must lie strictly between 0 and 1")
        _check(self.dms_temperature > 0 and math.isfinite(self.dms_temperature), "dms_temperature",
               self.dms_temperature, "must be a finite number > 0")
        _check(self.dms_target_retention is None or 0.0 <= self.dms_target_retention <= 1.0, "dms_target_retention",
               self.dms_target_retention, "must be None (derived from the budget) or lie in [0, 1]")
        _check(self.dms_loss_weight >= 0 and math.isfinite(self.dms_loss_weight), "dms_loss_weight",
               self.dms_loss_weight, "must be a finite number >= 0")
        _check(self.target_eps > 0 and math.isfinite(self.target_eps), "target_eps", self.target_eps, "must be a finite number > 0")
        _check(self.target_agg in AGGREGATIONS, "target_agg", self.target_agg, f"must be one of {AGGREGATIONS}")
        _check(self.loss_tau > 0 and math.isfinite(self.loss_tau), "loss_tau", self.loss_tau, "must be a finite number > 0")
        _check(self.loss_margin_delta >= 0 and math.isfinite(self.loss_margin_delta), "loss_margin_delta",
               self.loss_margin_delta, "must be a finite number >= 0")
        clip = tuple(float(c) for c in self.loss_balance_clip)
        _check(len(clip) == 2 and 0 < clip[0] <= clip[-1] < math.inf, "loss_balance_clip", self.loss_balance_clip,
               "must be a pair (c_min, c_max) with 0 < c_min <= c_max < inf")
        self.loss_balance_clip = clip
        _check(0.0 < self.loss_query_fraction <= 1.0, "loss_query_fraction", self.loss_query_fraction, "must lie in (0, 1]")
        if self.layer_topk is not None:
            layer_topk = tuple(self.layer_topk) if isinstance(self.layer_topk, (list, tuple)) else None
            _check(layer_topk is not None and len(layer_topk) >= 1 and all(_is_int(k) and k >= 0 for k in layer_topk),
                   "layer_topk", self.layer_topk, "must be None or a non-empty sequence of integers >= 0, one per layer")
            _check(self.policy not in RECENCY_POLICIES + ("dms",), "layer_topk", self.layer_topk,
                   f"per-layer budgets apply to ranked policies (kvpop, tova, h2o, oracle), not {self.policy!r}")
            _check(self.tova_pool <= min(layer_topk), "layer_topk", self.layer_topk,
                   f"every layer's top-k must hold the TOVA pool (tova_pool={self.tova_pool})")
            _check(sum(layer_topk) == len(layer_topk) * self.topk, "layer_topk", self.layer_topk,
                   f"must sum to layers x topk = {len(layer_topk)} x {self.topk} = {len(layer_topk) * self.topk} "
                   f"(the memory of the uniform split), got {sum(layer_topk)}")
            self.layer_topk = layer_topk

    @property
    def budget(self) -> int:
        """Entries kept per (layer, KV head): `sink + window + topk`."""
        return self.sink + self.window + self.topk

    @property
    def readout_delay(self) -> int:
        """mLSTM: steps between a token's insertion and its readout (`delay`, or `window` when None)."""
        return self.window if self.delay is None else self.delay

    def state_entries(self, head_dim: int) -> int:
        """KV entries one head's scorer state costs: `ceil((d*d + d) / (2D))` for the mLSTM (Sec. 3), else 0."""
        if self.policy != "kvpop" or self.scorer != "mlstm":
            return 0
        d = self.mlstm_dim or head_dim
        return -(-(d * d + d) // (2 * head_dim))

    def effective_topk(self, head_dim: int) -> int:
        """The top-k a model of head dim `D` gets: `topk - state_entries(D)` with `match_mlp_memory`, else `topk`."""
        if not self.match_mlp_memory:
            return self.topk
        entries = self.state_entries(head_dim)
        _check(self.topk >= entries, "topk", self.topk,
               f"must be >= the {entries} KV entries of the mLSTM state (d={self.mlstm_dim or head_dim}, "
               f"head dim {head_dim}) with match_mlp_memory=True")
        return self.topk - entries

    def resolve(self, head_dim: int) -> KVpopConfig:
        """The config a model of head dim `D` runs: `topk` made effective (idempotent).

        With `match_mlp_memory` the result has `topk = effective_topk(D)` and `match_mlp_memory=False`, so
        that it is not reduced twice when loaded; `extra["match_mlp_memory"]` records what it came from.
        """
        if not self.match_mlp_memory:
            return self
        entries = self.state_entries(head_dim)
        record = {"mlp_topk": self.topk, "state_entries": entries, "head_dim": head_dim}
        layer_topk = None
        if self.layer_topk is not None:
            _check(min(self.layer_topk) >= entries, "layer_topk", self.layer_topk,
                   f"every layer needs >= the {entries} KV entries of the mLSTM state with match_mlp_memory=True")
            layer_topk = tuple(k - entries for k in self.layer_topk)
        return dataclasses.replace(self, topk=self.effective_topk(head_dim), layer_topk=layer_topk,
                                   match_mlp_memory=False, extra={**self.extra, "match_mlp_memory": record})

    def for_layer(self, layer: int) -> KVpopConfig:
        """The config layer `layer` runs: `topk = layer_topk[layer]` (itself when the budgets are uniform)."""
        if self.layer_topk is None:
            return self
        if not 0 <= layer < len(self.layer_topk):
            raise ValueError(f"layer={layer} is out of range: layer_topk has {len(self.layer_topk)} layers")
        return dataclasses.replace(self, topk=self.layer_topk[layer], layer_topk=None)

    def with_layer_budgets(self, budgets: tuple[int, ...] | list[int]) -> KVpopConfig:
        """This split with per-layer budgets `B_l` (`sum_l B_l = L x budget`): `layer_topk = B_l - sink - window`."""
        low = self.sink + self.window
        _check(all(_is_int(b) and b >= low for b in budgets), "layer_topk", budgets,
               f"per-layer budgets must be integers >= sink + window = {low}")
        return dataclasses.replace(self, layer_topk=tuple(b - low for b in budgets))

    @property
    def chunkable(self) -> bool:
        """Whether the chunked rule applies (`decision_chunk`): TOVA's head-averaged rule, the layer-wide
        KVpop-cascade ranking its pool by TOVA's latest attention, or H2O without sinks."""
        if self.policy == "h2o":
            return self.sink == 0
        return self.tova_head_average and self.pool_decay is None and (self.policy == "tova" or self.tova_pool > 0)

    @property
    def chunk_layout(self) -> tuple[int, int, int | None]:
        """The chunked rule's slots besides its ring of `decision_chunk` (`ops.dynamic.chunked`): (the long-range slots
        a decision keeps, how many of them form the pool ranked by the chunk's score, how many newest tokens stay
        whatever they scored). TOVA and the layer-wide cascade: (topk, tova_pool or all of topk, None). H2O:
        (window - C + topk, 0, window - C), the older part of its window held among the long-range slots."""
        C = self.decision_chunk
        if self.policy == "h2o":
            return self.window - C + self.topk, 0, self.window - C
        return self.topk, self.tova_pool or self.topk, None

    @property
    def static_mlp(self) -> bool:
        """KVpop-mlp with the paper's static rule (no KVpop-TOVA prior, no cascade): the configs a TOVA pool extends."""
        return self.policy == "kvpop" and self.scorer == "mlp" and self.tova_prior is None and not self.tova_pool

    def with_tova_pool(self, pool: int, layer: bool = False, decay: float | None = None) -> KVpopConfig:
        """This KVpop-mlp config run as KVpop-cascade with `pool` TOVA slots (the same scorer weights serve it).

        `layer`: the layer-wide cascade (`tova_head_average`) at TOVA's split of the same budget (no sinks, a window
        of 1, `budget - 1` long-range slots), `pool` of them in the pool TOVA's paper ranking fills first; with
        `decay` (`pool_decay`) that pool ranks by the accumulated attention instead (1: H2O's).
        """
        _check(self.static_mlp, "tova_pool", pool,
               f"applies to a KVpop-mlp config with the static rule (this one: policy {self.policy!r}, scorer "
               f"{self.scorer!r}, tova_prior={self.tova_prior}, tova_pool={self.tova_pool})")
        _check(layer or decay is None, "pool_decay", decay, "applies to the layer-wide cascade only (layer=True)")
        if not layer:
            return dataclasses.replace(self, tova_pool=pool)
        _check(self.layer_topk is None, "layer_topk", self.layer_topk,
               "the layer-wide cascade takes TOVA's split of one budget; drop the per-layer budgets")
        return dataclasses.replace(self, sink=0, window=1, topk=self.budget - 1, tova_pool=pool, tova_head_average=True,
                                   pool_decay=decay)

    def with_decision_chunk(self, chunk: int) -> KVpopConfig:
        """This TOVA or layer-wide cascade config deciding once every `chunk` steps, in the same memory: the window
        becomes the ring of `chunk` slots and the long-range slots `budget - chunk`; a cascade's pool keeps its share
        of them. `chunk = 1`: the per-token rule at TOVA's split (window 1). H2O keeps its split: the ring is the
        newest `chunk` of its window (`chunk <= window`; `chunk = 1` is the per-token rule)."""
        if self.policy == "h2o":  # the split stays; the checks (no sinks, chunk <= window) are the config's own
            return dataclasses.replace(self, decision_chunk=chunk)
        _check(_is_int(chunk) and 1 <= chunk < self.budget, "decision_chunk", chunk,
               f"must be an integer in [1, budget - 1 = {self.budget - 1}] (room for one long-range slot)")
        topk = self.budget - chunk
        pool = self.tova_pool * topk // self.topk if self.tova_pool else 0
        return dataclasses.replace(self, sink=0, window=chunk, topk=topk, tova_pool=pool, decision_chunk=chunk)

    def at_budget(self, budget: int) -> KVpopConfig:
        """This KVpop-mlp config's scorer at another budget, split as `for_budget` splits it (4 sinks, a window of a
        quarter): a static priority ranks the same way at any top-k, so the same weights serve it."""
        _check(self.static_mlp and self.layer_topk is None, "policy", self.policy,
               "only a KVpop-mlp with the static rule at one budget moves to another budget (at_budget)")
        split = KVpopConfig.for_budget(budget)
        return dataclasses.replace(self, sink=split.sink, window=split.window, topk=split.topk)

    @property
    def static_rule(self) -> KVpopConfig:
        """The paper's static rule of this config: a KVpop-cascade without its pool (the scorer trained as KVpop-mlp's,
        at the same split), any other config as it is."""
        if not self.tova_pool:
            return self
        return dataclasses.replace(self, tova_pool=0, tova_head_average=False, pool_decay=None, decision_chunk=1)

    def for_rule(self, rule: str | None = None) -> KVpopConfig:
        """The config a trained directory saved with this config runs under `rule` (one of `RULES`, or None).

        - None (the default): the recommended policy where it applies, a KVpop-mlp trained for the static rule at
          one budget (`recommended`); any other config as saved (a cascade, per-layer budgets, the mLSTM, DMS, ...);
        - "cascade": the recommended policy; refused for a config it does not apply to;
        - "static": the paper's static rule (`static_rule`).
        The saved config itself is never changed: this is applied when a directory is loaded (`kvpop.load`).
        """
        if rule not in (None, *RULES):
            raise ValueError(f"rule={rule!r} is invalid: use one of {RULES} (or None for the default)")
        if rule == "static":
            return self.static_rule
        if self.tova_pool or (rule is None and not self.recommends_cascade):
            return self
        return self.recommended()

    @property
    def recommends_cascade(self) -> bool:
        """Whether the recommended policy applies: a KVpop-mlp with the static rule at one budget (no per-layer
        budgets) with room for a pool (`recommended_pool(budget) >= 1`)."""
        return self.static_mlp and self.layer_topk is None and recommended_pool(self.budget) >= 1

    def recommended(self) -> KVpopConfig:
        """This KVpop-mlp config as the recommended policy: the layer-wide KVpop-cascade at TOVA's split of its budget,
        its pool `recommended_pool(budget)` slots ranked by `RECOMMENDED_POOL_DECAY` (the same scorer weights)."""
        _check(self.recommends_cascade, "tova_pool", self.tova_pool,
               f"the recommended policy runs a KVpop-mlp trained for the static rule at one budget of at least 3 "
               f"(this one: policy {self.policy!r}, scorer {self.scorer!r}, tova_prior={self.tova_prior}, tova_pool="
               f"{self.tova_pool}, layer_topk={self.layer_topk}, budget {self.budget}); run it with rule='static'")
        return self.with_tova_pool(recommended_pool(self.budget), layer=True, decay=RECOMMENDED_POOL_DECAY)

    def describe(self) -> str:
        """What this config's rule does, in one line (the CLI says it when a trained directory loads)."""
        split = f"{self.sink} sinks, window {self.window}"
        if self.decision_chunk > 1 and self.policy == "h2o":
            split = (f"no sinks, window {self.window} (its newest {self.decision_chunk} a ring); one decision every "
                     f"{self.decision_chunk} steps")
        elif self.decision_chunk > 1:
            split = f"no sinks, a ring of {self.window} slots; one decision every {self.decision_chunk} steps"
        if self.policy != "kvpop":
            return f"policy {self.policy} at budget {self.budget} ({split}, {self.topk} long-range slots)"
        if self.tova_pool and self.tova_head_average:
            rank = ("TOVA's latest attention" if self.pool_decay is None else "H2O's accumulated attention"
                    if self.pool_decay == 1 else f"the attention accumulated with decay {self.pool_decay}")
            return (f"the layer-wide KVpop-cascade at budget {self.budget}: {self.tova_pool} of {self.topk} long-range "
                    f"slots ranked by {rank} (the layer's head average), {self.topk - self.tova_pool} per KV head by "
                    f"the learned priority ({split})")
        if self.tova_pool:
            return (f"KVpop-cascade at budget {self.budget}: {self.topk - self.tova_pool} of {self.topk} long-range "
                    f"slots per KV head by the learned priority, {self.tova_pool} by TOVA's latest attention ({split})")
        if self.tova_prior is not None:
            return f"KVpop-TOVA at budget {self.budget} (prior weight {self.tova_prior}; {split})"
        per_layer = "" if self.layer_topk is None else ", per-layer budgets"
        return (f"the static rule at budget {self.budget}: {self.topk} long-range slots per KV head ranked by the "
                f"learned priority ({split}{per_layer}), scorer {self.scorer}")

    def check_layers(self, num_layers: int) -> None:
        """Raise unless `layer_topk` (if given) has one entry per layer of a model with `num_layers` layers."""
        _check(self.layer_topk is None or len(self.layer_topk) == num_layers, "layer_topk", self.layer_topk,
               f"must have one entry per layer of the model ({num_layers}), got {len(self.layer_topk or ())}")

    def compression_ratio(self, seq_len: int) -> float:
        """`CR = 1 - budget / seq_len` (0 when the sequence fits the budget)."""
        return max(0.0, 1.0 - self.budget / seq_len)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["loss_balance_clip"] = list(self.loss_balance_clip)
        if self.layer_topk is not None:
            d["layer_topk"] = list(self.layer_topk)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVpopConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown KVpopConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    @classmethod
    def for_budget(cls, budget: int | None = None, sink: int | None = None, window: int | None = None,
                   topk: int | None = None, windowed: bool = False, **kw: Any) -> KVpopConfig:
        """A config with `sink + window + topk == budget`, split the way each policy expects.

        The budget is `DEFAULT_BUDGET` unless given, or implied by a window and a top-k given together;
        the top-k is what the rest leaves. Unless given, `sink` and `window` are:
        - `tova`, as its paper defines it (Oren et al., 2024): no sinks and a window of 1 (only the current
          token is protected); every other slot is ranked by the current query's attention averaged over
          the heads of the layer (`tova_head_average`, unless given); KVpop-TOVA (`tova_prior`) and the
          layer-wide KVpop-cascade (`tova_pool` with `tova_head_average`) split alike;
        - `h2o`, as its paper defines it (Zhang et al., 2023): no sinks; half the budget is the recent
          window, the other half the heavy hitters;
        - `streaming_llm(_plus)`: 4 sinks, the window everything beyond them (top-k 0);
        - every other policy, and `tova` / `h2o` with `windowed=True` (kvpop's earlier variant of them,
          TOVA ranking per KV head by the max over its query heads): 4 sinks and a quarter of the budget.
        The CLI's `--budget/--sink/--window/--topk` come here.
        """
        policy = kw.get("policy", "kvpop")
        if windowed and policy not in PAPER_SPLITS:
            raise ValueError(f"windowed=True applies to the policies {PAPER_SPLITS}, not {policy!r}")
        # KVpop-TOVA and the layer-wide KVpop-cascade rank like TOVA, so they take TOVA's paper split
        like_tova = kw.get("tova_prior") is not None or (kw.get("tova_pool") and kw.get("tova_head_average"))
        paper = (policy in PAPER_SPLITS or like_tova) and not windowed
        if topk is None and policy in RECENCY_POLICIES:
            topk = 0
        if sink is None:
            sink = 0 if paper else DEFAULT_SINK
        if budget is None:
            budget = sink + window + topk if window is not None and topk is not None else DEFAULT_BUDGET
        if window is None:
            if topk is not None:
                window = budget - sink - topk
                if window < 1:
                    raise ValueError(f"budget={budget} leaves no window after sink + topk = {sink} + {topk}")
            elif paper:
                window = max(1, (budget - sink) // 2) if policy == "h2o" else 1
            else:
                window = max(1, budget // 4)
        if paper and policy == "tova":
            kw.setdefault("tova_head_average", True)
        if topk is None:
            topk = budget - sink - window
            if topk < 0:
                raise ValueError(f"budget={budget} is smaller than sink + window = {sink} + {window}")
        if sink + window + topk != budget:
            raise ValueError(f"budget={budget} is not sink + window + topk = {sink} + {window} + {topk}; "
                             "give the budget, or the window and the top-k, not all three")
        return cls(sink=sink, window=window, topk=topk, **kw)
