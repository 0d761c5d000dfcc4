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
    """How one attention layer ranks its tokens: the interface shared by KVpop and every baseline.

    The eviction machinery (sinks, window, running top-k, cache slots, masks) lives once, in
    `ops/topk`, `attention.py` and `cache.py`; a policy supplies only what differs:

    - `priority(key, value, position)`: each new token's priority at insertion (float32);
    - `dynamic = True` and `update(...)`: priorities that change with the attention each token
      receives (TOVA, H2O). Such policies run step by step, also when teacher-forced.

    A static policy (`dynamic = False`) ranks by priorities fixed at insertion, so a whole
    sequence is handled at once by the O(S log S) rule.
    """

    dynamic = False
    teacher_forced_only = False

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    @property
    def log_gamma(self) -> Tensor:
        """float32 [H]: the decay of Sec. 2 (0: no decay)."""
        return torch.zeros(self.num_kv_heads)

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Priorities of new tokens: float32 [B, H, N] for key/value [B, H, N, D], position int64 [B, N]."""
        B, H, N, _ = key.shape
        return torch.zeros(B, H, N, dtype=torch.float32, device=key.device)

    def update(self, priority: Tensor, probs: Tensor, occupied: Tensor) -> Tensor:
        """Dynamic policies: new slot priorities after one decode step.

        Args:
            priority: float32 [B, Hkv, N], the slots' priorities before the step.
            probs: float32 [B, Hkv, G, N], the step's attention probabilities over the slots.
            occupied: bool [B, Hkv, N].
        """
        raise NotImplementedError


class ScorerPolicy(LayerPolicy):
    """KVpop: a learned scorer and a learned per-head decay `gamma_h` (Sec. 2-3)."""

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__(cfg, num_kv_heads, head_dim)
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
    "NEVER",
    "LayerPolicy",
    "ScorerPolicy",
    "eviction_times",
    "mask_from_eviction",
    "retention_mask",
    "static_priority",
]
