"""The retention rule as a predicate over (query, key) pairs, given each key's eviction position.

Shared by the dense CPU mask and FlexAttention's `mask_mod`, so both evaluate the same expression.
"""

from __future__ import annotations

from torch import Tensor


def mask_from_eviction(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, Hk, N] (Hk = 1 or H)
    k_valid: Tensor,  # [B, Hk, N]
    evict: Tensor,  # [B, H, N]
    sink: int,
    window: int,
) -> Tensor:
    """The rule as a predicate over (query, key) pairs, given each key's eviction position.

    Key `t` is visible to query `q` iff both are real tokens, `pos_t <= pos_q`, and `t` is a sink,
    in the window (`pos_t > pos_q - window`) or not yet evicted (`pos_q < evict_t`).

    Returns:
        bool [B, H, Q, N].
    """
    qp = q_pos[:, None, :, None]
    kp = k_pos[:, :, None, :]
    keep = (kp < sink) | (kp > qp - window) | (qp < evict[:, :, None, :])
    return keep & (kp <= qp) & q_valid[:, None, :, None] & k_valid[:, :, None, :]
