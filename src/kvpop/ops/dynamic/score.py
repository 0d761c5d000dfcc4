"""How TOVA and H2O turn one step's attention probabilities into slot priorities (shared by every backend).

The policies (`baselines/tova.py`, `baselines/h2o.py`) call `score_update` too, so the decode step
and the prefill walks apply the very same float operations.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

Score = Literal["max", "mean", "sum"]
SCORES = ("max", "mean", "sum")
"""`max`: TOVA, the largest probability over a KV head's query heads; `mean`: TOVA averaged over every
query head of the layer (all KV heads then rank alike); `sum`: H2O, probabilities summed over the
query heads and accumulated over steps."""


def score_update(score: Score, priority: Tensor, probs: Tensor, occupied: Tensor | None) -> Tensor:
    """New slot priorities after one step.

    Args:
        score: one of `SCORES`.
        priority: float32 [B, Hkv, N], the slots' priorities before the step.
        probs: float32 [B, Hkv, G, N], the step's attention probabilities over the slots.
        occupied: bool [B, Hkv, N]; None: every slot (the same bits as an all-True mask).
    Returns:
        float32 [B, Hkv, N]; empty slots keep their priority.
    """
    if score == "max":
        new = probs.amax(dim=2)
    elif score == "mean":
        new = probs.mean(dim=(1, 2), keepdim=True)[:, 0].expand_as(priority)
    elif score == "sum":
        new = priority + probs.sum(dim=2)
    else:
        raise ValueError(f"score={score!r} must be one of {SCORES}")
    return new if occupied is None else new.where(occupied, priority)
