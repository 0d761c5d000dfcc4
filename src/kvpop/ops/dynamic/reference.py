"""The prefill of a dynamic policy (TOVA, H2O) as the decode step runs it: one token at a time (reference).

Each step is `cache.decode_step` without the values: the token leaving the window (position
`p - window`) replaces the weakest long-range slot if it beats it (ties: the newer token wins), the
new token takes its sink or window-ring slot, and the query's probabilities over the occupied slots
(`step_probs`) update every slot's priority. Slow (about 20 small operations per token), obviously
the step semantics; `walk.py` is the same loop with fewer operations, `kernel.py` the Triton form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.ops.attention.reference import step_probs
from kvpop.ops.dynamic.score import Score, score_update


def dynamic_walk_reference(
    query: Tensor,  # [B, Hq, C, D]
    key: Tensor,  # [B, H, C, D]
    slot_keys: Tensor,  # [B, H, N, D]
    slot_pos: Tensor,  # [B, H, N]
    slot_pri: Tensor,  # [B, H, N]
    position: Tensor,  # [B, C]
    valid: Tensor,  # [B, C]
    priority: Tensor,  # [B, H, C]
    sink: int,
    window: int,
    topk: int,
    scale: float,
    score: Score,
    slot_prior: Tensor | None = None,  # [B, H, N]
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Insert `C` tokens into `N = sink + window + topk` slots step by step; see `dynamic_walk`."""
    s, w, k = sink, window, topk
    B, H, C, D = key.shape
    N = slot_pos.shape[-1]
    # the decode step's buffers: the slots plus a scratch slot that masked writes target
    keys = torch.cat([slot_keys, slot_keys.new_zeros(B, H, 1, D)], dim=2)
    pos = torch.cat([slot_pos, slot_pos.new_full((B, H, 1), -1)], dim=2)
    pri = torch.cat([slot_pri, slot_pri.new_full((B, H, 1), float("-inf"))], dim=2)
    # `prior` (KVpop-TOVA): each slot's static prior moves with its token, like its priority
    bufs = [pri]
    if slot_prior is not None:
        bufs.append(torch.cat([slot_prior.float(), pri.new_full((B, H, 1), float("-inf"))], dim=2))
    evicted = torch.full((B, H, C), -1, dtype=torch.long, device=key.device)
    for j in range(C):
        p, real = position[:, j], valid[:, j]
        slot = torch.where(p < s, p.clamp(min=0), s + (p - s).clamp(min=0) % w)
        idx = slot[:, None, None].expand(B, H, 1)
        leaving = (real & (p >= s + w))[:, None, None]
        leave_pos, leave_pri = pos.gather(2, idx), pri.gather(2, idx)
        out = leave_pos
        if k > 0:
            top_pos, top_pri = pos[:, :, s + w : N], pri[:, :, s + w : N]
            weakest_pri = top_pri.amin(-1, keepdim=True)
            # among equal weakest priorities the older token is weaker; empty slots (-inf, -1) go first
            oldest = torch.where(top_pri == weakest_pri, top_pos, torch.iinfo(torch.long).max)
            widx = oldest.argmin(-1, keepdim=True)
            weakest_pos = top_pos.gather(2, widx)
            beats = (leave_pri > weakest_pri) | ((leave_pri == weakest_pri) & (leave_pos > weakest_pos))
            promote = leaving & beats & (leave_pri > float("-inf"))
            out = torch.where(promote, weakest_pos, leave_pos)
            dst = torch.where(promote, widx + s + w, N)
            keys.scatter_(2, dst[..., None].expand(-1, -1, -1, D), keys.gather(2, idx[..., None].expand(-1, -1, -1, D)))
            pos.scatter_(2, dst, leave_pos)
            for buf in bufs:
                buf.scatter_(2, dst, buf.gather(2, idx))
        evicted[:, :, j] = torch.where(leaving, out, -1)[..., 0]
        dst = torch.where(real[:, None, None], idx, N)
        keys.scatter_(2, dst[..., None].expand(-1, -1, -1, D), key[:, :, j : j + 1].to(keys.dtype))
        pos.scatter_(2, dst, p[:, None, None].expand(B, H, 1))
        for buf in bufs:  # a new token's prior is its priority at insertion
            buf.scatter_(2, dst, priority[:, :, j : j + 1].float())
        occupied = pos[:, :, :N] >= 0
        probs = step_probs(query[:, :, j : j + 1], keys[:, :, :N], occupied, scale)
        prior = None if slot_prior is None else bufs[1][:, :, :N]
        updated = score_update(score, pri[:, :, :N], probs, occupied, prior)
        pri[:, :, :N] = torch.where(real[:, None, None], updated, pri[:, :, :N])
    return evicted, pos[:, :, :N], pri[:, :, :N], (None if slot_prior is None else bufs[1][:, :, :N])
