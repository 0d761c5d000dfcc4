"""The retention rule straight from its definition (`docs/method.md` Sec. 2): dense, slow, obviously right.

Used by tests and as the ground truth every fast path is compared with. It materialises `S x S`
(and an `S x S x S` product), so keep `S` to a few hundred.
"""

from __future__ import annotations

import torch
from torch import Tensor


def beats(priority: Tensor) -> Tensor:
    """`beats[..., u, t]`: token `u` outranks token `t` (higher priority, or equal and newer).

    Args:
        priority: float [B, H, S].
    Returns:
        bool [B, H, S, S].
    """
    pu, pt = priority[..., :, None], priority[..., None, :]
    pos = torch.arange(priority.shape[-1], device=priority.device)
    return (pu > pt) | ((pu == pt) & (pos[:, None] > pos[None, :]))


def retention_mask_reference(priority: Tensor, sink: int, window: int, topk: int) -> Tensor:
    """`M[b, h, q, t]` of `docs/method.md` Sec. 2.

    Args:
        priority: float32 [B, H, S], static priorities.
    Returns:
        bool [B, H, S, S]; `M[q, t]` is True when query `q` attends key `t`.
    """
    S = priority.shape[-1]
    pos = torch.arange(S, device=priority.device)
    q, t = pos[:, None], pos[None, :]
    # eligible[q, u]: u is in E(q) = {s <= u <= q - w}
    eligible = (t >= sink) & (t <= q - window)
    # better[q, t] = #{u in E(q) : u beats t}; t is in the top-k of E(q) iff fewer than k beat it
    better = torch.matmul(eligible.double(), beats(priority).double())
    # a -inf token is never retained past the window (DMS's "evict" decision)
    in_topk = eligible & (better < topk) & (priority[..., None, :] > float("-inf"))
    return (t <= q) & ((t < sink) | (t > q - window) | in_topk)


def eviction_times_from_mask(mask: Tensor, sink: int, window: int) -> Tensor:
    """Eviction times read off a dense mask: first `q` at which an eligible `t` is not retained (`S` if never).

    Args:
        mask: bool [B, H, S, S].
    Returns:
        int64 [B, H, S].
    """
    S = mask.shape[-1]
    pos = torch.arange(S, device=mask.device)
    q, t = pos[:, None], pos[None, :]
    dropped = (t >= sink) & (t <= q - window) & ~mask
    first = torch.where(dropped, q.expand(S, S), torch.full_like(q.expand(S, S), S))
    return first.amin(dim=-2)
