"""How TOVA and H2O turn one step's attention probabilities into slot priorities (shared by every backend).

The policies (`baselines/tova.py`, `baselines/h2o.py`) call `score_update` too, so the decode step
and the prefill walks apply the very same float operations.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

Score = Literal["max", "mean", "sum", "prior", "cascade", "cascade_mean", "cascade_sum"]
SCORES = ("max", "mean", "sum", "prior", "cascade", "cascade_mean", "cascade_sum")
"""`max`: TOVA, the largest probability over a KV head's query heads; `mean`: TOVA averaged over every
query head of the layer (all KV heads then rank alike); `sum`: H2O, probabilities summed over the
query heads and accumulated over steps; `prior`: KVpop-TOVA (`KVpopConfig.tova_prior`, an extension),
`mean` plus the slot's own static prior (the learned scorer's prediction of its future attention, fixed
at insertion and equal in every KV head of the layer); `cascade`: KVpop-cascade (`KVpopConfig.tova_pool`, an
extension), `max` for the slots' TOVA score, while each slot also carries its static priority (the walks'
`slot_prior`), which ranks the static pool (`ops.dynamic.dynamic_walk`'s `pool`); `cascade_mean`: the layer-wide
KVpop-cascade (`tova_pool` with `tova_head_average`), `mean` for the TOVA score, which is then one ranking for the
layer: the TOVA pool takes the token leaving the window first and holds the same tokens in every KV head, and
the per-head static pool keeps the best of what it evicts; `cascade_sum`: the layer-wide KVpop-cascade whose pool
ranks by the attention accumulated over the steps (`KVpopConfig.pool_decay`): each step multiplies a slot's score
by `decay` and adds the layer's head-averaged probability, so `decay = 1` is H2O's accumulated attention (its
sum over the steps; averaged over the layer's query heads, one ranking for the layer) and `decay < 1` TOVA's latest
attention plus the accumulated term, older steps weighed by `decay ** age` (`decay = 0` is `cascade_mean`).

With a prior (`prior` and the cascades) a new token's priority goes to its prior, and its score starts at 0 (no
attention seen yet): the accumulating score adds to it, the others overwrite it at the token's first step."""
CASCADES = ("cascade", "cascade_mean", "cascade_sum")
"""KVpop-cascade's scores: two pools of long-range slots (`pool`), each slot carrying its static priority."""
LAYER_CASCADES = ("cascade_mean", "cascade_sum")
"""The layer-wide cascades: one ranking for the layer, whose pool takes the token leaving the window first
(`ops.dynamic.reference.tova_first_step`)."""


def score_update(score: Score, priority: Tensor, probs: Tensor, occupied: Tensor | None,
                 prior: Tensor | None = None, decay: float = 1.0) -> Tensor:
    """New slot priorities after one step.

    Args:
        score: one of `SCORES`.
        priority: float32 [B, Hkv, N], the slots' priorities before the step.
        probs: float32 [B, Hkv, G, N], the step's attention probabilities over the slots.
        occupied: bool [B, Hkv, N]; None: every slot (the same bits as an all-True mask).
        prior: float32 [B, Hkv, N], the slots' static priors; needed by `prior` only.
        decay: `cascade_sum` only, in [0, 1]: the weight of the accumulated score against the step's attention.
    Returns:
        float32 [B, Hkv, N]; empty slots keep their priority.
    """
    # the sums run over the heads innermost and contiguous: then every slot's sum is the same sequence of
    # adds, and slots with equal probabilities get equal priorities, so the rule's "the newer token wins
    # ties" holds. A reduction over outer dims (`probs.mean(dim=(1, 2))`) sums some columns in another
    # order on the CPU (measured: widths 5, 6, 33, ... at 8 x 4 heads), one bit apart (tests/test_dynamic.py)
    B, H, G, N = probs.shape
    if score in ("max", "cascade"):
        # cascade: the pool that TOVA ranks is ranked per KV head, since the static pool's tokens differ by head
        new = probs.amax(dim=2)
    elif score in ("mean", "prior", "cascade_mean", "cascade_sum"):
        per_slot = probs.permute(0, 3, 1, 2).contiguous().view(B, N, H * G)
        new = (per_slot.sum(-1) / (H * G))[:, None].expand_as(priority)
        if score == "cascade_sum":
            # the slots of the pool and the window hold the same tokens in every KV head, so their accumulated
            # scores stay equal across heads, as TOVA's do; `decay = 1` multiplies exactly (H2O's sum)
            new = priority * decay + new
        if score == "prior":
            # the priors are the same in every KV head of the layer (`TOVAPriorPolicy`), so the heads keep the same
            # tokens in the same slots and the layer-wide mean adds up one token's probabilities, as for TOVA
            if prior is None:
                raise ValueError("score='prior' needs the slots' priors (prior=None)")
            new = new + prior
    elif score == "sum":
        new = priority + probs.transpose(2, 3).contiguous().sum(-1)
    else:
        raise ValueError(f"score={score!r} must be one of {SCORES}")
    return new if occupied is None else new.where(occupied, priority)
