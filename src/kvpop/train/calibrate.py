"""KVpop-TOVA's prior in attention units: calibrating the scorer's per-head bias `b2` while it trains.

The boundary loss ranks tokens by differences of priorities, so it leaves each head's offset free: the
MLP's `b2` gets no gradient (`pi_hat[t_new] - pi_hat[t_bnd]` cancels it) and `exp(r)` has no scale. KVpop-TOVA
(`KVpopConfig.tova_prior`) adds `exp(r)` to an attention probability, so there the offset matters. After each
optimizer step the trainer moves `b2` toward the mean of `r_tgt - r` over the tokens the loss compares (the
teacher's boundary pairs, the decisions the prior will take part in); ranking, loss and gradients are
unchanged by it, so the scorer trains exactly as KVpop-mlp does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.train.loss import BoundaryPairs

STEP = 0.5
"""Share of the measured offset applied per optimizer step: the error halves every step, and one batch's noise
moves the bias by half of it only."""


def prior_offset(pi_tgt: Tensor, pi_hat: Tensor, pairs: BoundaryPairs) -> tuple[Tensor, Tensor]:
    """Per head, the sum and the count of `pi_tgt - pi_hat` over the tokens of the valid boundary pairs.

    `pi_tgt - pi_hat = r_tgt - r` token by token: both priorities carry the same decay term.

    Args:
        pi_tgt, pi_hat: float [B, H, S], the teacher's and the student's static priorities.
        pairs: `boundary_labels` of `pi_tgt`.
    Returns:
        float32 sums [H] and counts [H] (no gradient).
    """
    with torch.no_grad():
        d = (pi_tgt.float() - pi_hat.detach().float())
        both = d.gather(-1, pairs.t_new) + d.gather(-1, pairs.t_bnd)  # [B, H, S]
        valid = pairs.valid
        return torch.where(valid, both, 0.0).sum(dim=(0, 2)), 2.0 * valid.sum(dim=(0, 2)).float()


def shift_bias(bias: Tensor, sums: Tensor, counts: Tensor, step: float = STEP) -> None:
    """Move a scorer's per-head bias [H] by `step` times the mean offset, where a head had pairs (in place)."""
    with torch.no_grad():
        mean = torch.where(counts > 0, sums / counts.clamp(min=1.0), 0.0)
        bias.add_(step * mean.to(bias.dtype))


__all__ = ["STEP", "prior_offset", "shift_bias"]
