"""How TOVA and H2O turn one step's attention probabilities into slot priorities (shared by every backend).

The policies (`baselines/tova.py`, `baselines/h2o.py`) call `score_update` too, so the decode step
and the prefill walks apply the very same float operations.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

Score = Literal["max", "mean", "sum", "prior", "cascade", "cascade_mean"]
SCORES = ("max", "mean", "sum", "prior", "cascade", "cascade_mean")
"""`max`: TOVA, the largest probability over a KV head's query heads; `mean`: TOVA averaged over every
query head of the layer (all KV heads then rank alike); `sum`: H2O, probabilities summed over the
query heads and accumulated over steps; `prior`: KVpop-TOVA (`KVpopConfig.tova_prior`, an extension),
`mean` plus the slot's own static prior (the learned scorer's prediction of its future attention, fixed
at insertion and equal in every KV head of the layer); `cascade`: KVpop-cascade (`KVpopConfig.tova_pool`, an
extension), `max` for the slots' TOVA score, while each slot also carries its static priority (the walks'
`slot_prior`), which ranks the static pool (`ops.dynamic.dynamic_walk`'s `pool`); `cascade_mean`: the layer-wide
KVpop-cascade (`tova_pool` with `tova_head_average`), `mean` for the TOVA score, which is then one ranking for the
layer: the TOVA pool takes the token leaving the window first and holds the same tokens in every KV head, and
the per-head static pool keeps the best of what it evicts."""


def score_update(score: Score, priority: Tensor, probs: Tensor, occupied: Tensor | None,
                 prior: Tensor | None = None) -> Tensor:
    """New slot priorities after one step.

    Args:
        score: one of `SCORES`.
        priority: float32 [B, Hkv, N], the slots' priorities before the step.
        probs: float32 [B, Hkv, G, N], the step's attention probabilities over the slots.
        occupied: bool [B, Hkv, N]; None: every slot (the same bits as an all-True mask).
        prior: float32 [B, Hkv, N], the slots' static priors; needed by `prior` only.
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
    elif score in ("mean", "prior", "cascade_mean"):
        per_slot = probs.permute(0, 3, 1, 2).contiguous().view(B, N, H * G)
        new = (per_slot.sum(-1) / (H * G))[:, None].expand_as(priority)
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
