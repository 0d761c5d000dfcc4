"""The retention rule of KVpop (`KVPOP.md` Sec. 1-2): static priorities, eviction and the mask.

Every execution - the dense reference, the training/prefill attention and the decoding cache -
reduces to two facts per token: its static priority `pi[t]`, and the first query position at which
it is out of the long-range top-k (its eviction position). This module states the rule on plain
tensors; `ops/topk` computes it fast.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kvpop.config import KVpopConfig
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
    """The dense retention mask `M[b, h, q, t]` of `KVPOP.md` Sec. 2 (reference; `S x S`).

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
    return eviction_positions(priority.float(), pos, valid, sink, window, topk).clamp(max=S)


class LayerPolicy(nn.Module):
    """What one attention layer needs to rank its tokens: a scorer and the per-head decay `gamma_h`.

    This is the policy interface the sparse attention and the cache call; a baseline supplies its
    own `priority` (and nothing else) to reuse the whole eviction machinery.
    """

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__()
        from kvpop.scorers import MLPScorer

        self.decay_step = cfg.decay_step
        self.scorer = MLPScorer(num_kv_heads, head_dim, cfg.scorer_hidden)
        # gamma_h = sigmoid(theta_h): always in (0, 1)
        self.theta = nn.Parameter(torch.full((num_kv_heads,), math.log(cfg.gamma_init / (1 - cfg.gamma_init))))

    @property
    def log_gamma(self) -> Tensor:
        """float32 [H], `log(gamma_h) < 0`."""
        return nn.functional.logsigmoid(self.theta.float())

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Static priorities of new tokens (differentiable in the scorer and gamma only).

        Args:
            key, value: [B, H, N, D] as cached.
            position: int64 [B, N] or [B, H, N].
        Returns:
            float32 [B, H, N].
        """
        return static_priority(self.scorer(key, value), position, self.log_gamma, self.decay_step)


__all__ = [
    "LayerPolicy","NEVER", "eviction_times", "mask_from_eviction", "retention_mask", "static_priority"]
