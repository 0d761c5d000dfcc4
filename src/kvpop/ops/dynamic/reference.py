"""The prefill of a dynamic policy (TOVA, H2O) as the decode step runs it: one token at a time (reference).

Each step is `cache.decode_step` without the values: the token leaving the window (position
`p - window`) replaces the weakest long-range slot if it beats it (ties: the newer token wins), the
new token takes its sink or window-ring slot, and the query's probabilities over the occupied slots
(`step_probs`) update every slot's priority. KVpop-cascade (`pool`) splits the long-range slots in a static
pool, which the leaving token meets first by its carried static priority, and a pool ranked by the score,
which the loser of that meets. Slow (about 20 small operations per token), obviously the step semantics; `walk.py` is the same loop with fewer operations, `kernel.py` the Triton form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.ops.attention.reference import step_probs
from kvpop.ops.dynamic.score import LAYER_CASCADES, Score, score_update


def weakest_slot(rank: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The weakest of some slots by (rank, position), [B, H, 1] each: its index among them, its rank and its position.
    Among equal ranks the older token is weaker; empty slots (-inf, -1) go first."""
    low = rank.amin(-1, keepdim=True)
    widx = torch.where(rank == low, pos, torch.iinfo(torch.long).max).argmin(-1, keepdim=True)
    return widx, low, pos.gather(2, widx)


def write_slot(buf: Tensor, dst: Tensor, new: Tensor) -> None:
    """`buf[b, h, dst[b, h, 0]] = new[b, h, 0]` for every (b, h), in place: buf [B, H, N] or [B, H, N, D], dst [B, H, 1],
    new [B, H, 1] or [B, H, 1, D].

    The same write as `buf.scatter_(2, dst, new)`, one slot per (b, h), as an `index_put_`: inductor writes that into
    the buffer, where it copies a scattered graph input whole first and back after (two 4 MB copies per layer and
    buffer at the 8B shape's 2048 slots, about 12 us of a compiled decode step's layer on an H100)."""
    B, H = dst.shape[:2]
    b = torch.arange(B, device=dst.device)[:, None]
    h = torch.arange(H, device=dst.device)[None, :]
    buf.index_put_((b, h, dst[..., 0]), new[:, :, 0])


def move_slot(buffers, src: Tensor, dst: Tensor) -> None:
    """Copy slot `src` to slot `dst` ([B, H, 1] each; a scratch slot as `dst` drops the copy) in every buffer:
    [B, H, N] ones and [B, H, N, D] ones (keys, values). The walks and the decode step move tokens with it."""
    for buf in buffers:
        s = src[..., None].expand(-1, -1, -1, buf.shape[-1]) if buf.dim() == 4 else src
        write_slot(buf, dst, buf.gather(2, s))


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
    pool: int | None = None,
    decay: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Insert `C` tokens into `N = sink + window + topk` slots step by step; see `dynamic_walk`."""
    s, w, k = sink, window, topk
    pool = k if pool is None else pool
    static = k - pool  # KVpop-cascade's static pool, ranked by `slot_prior`: the long-range slots before the rest
    tova_first = score in LAYER_CASCADES  # the layer-wide cascades: the pool ranked by `pri` takes the token first
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
        out = pos.gather(2, idx)  # nothing long-range (topk 0): the leaving token itself
        if k > 0 and tova_first:
            out = tova_first_step((keys, pos, *bufs), pos, pri, bufs[1], idx, leaving, s + w, static, pool)
        elif k > 0:
            out = static_first_step((keys, pos, *bufs), pos, pri, bufs[1] if static else None, idx, leaving, s + w,
                                    static, pool)
        evicted[:, :, j] = torch.where(leaving, out, -1)[..., 0]
        dst = torch.where(real[:, None, None], idx, N)
        keys.scatter_(2, dst[..., None].expand(-1, -1, -1, D), key[:, :, j : j + 1].to(keys.dtype))
        pos.scatter_(2, dst, p[:, None, None].expand(B, H, 1))
        # a new token's prior is its priority at insertion; with a prior its score starts at 0 (`ops.dynamic.score`)
        new = priority[:, :, j : j + 1].float()
        pri.scatter_(2, dst, new if slot_prior is None else torch.zeros_like(new))
        if slot_prior is not None:
            bufs[1].scatter_(2, dst, new)
        occupied = pos[:, :, :N] >= 0
        probs = step_probs(query[:, :, j : j + 1], keys[:, :, :N], occupied, scale, softcap)
        prior = None if slot_prior is None else bufs[1][:, :, :N]
        updated = score_update(score, pri[:, :, :N], probs, occupied, prior, decay)
        pri[:, :, :N] = torch.where(real[:, None, None], updated, pri[:, :, :N])
    return evicted, pos[:, :, :N], pri[:, :, :N], (None if slot_prior is None else bufs[1][:, :, :N])


def tova_first_step(buffers, pos: Tensor, pri: Tensor, rank: Tensor, idx: Tensor, leaving: Tensor, lo: int,
                    static: int, pool: int) -> Tensor:
    """The layer-wide cascades' decision (scores "cascade_mean", "cascade_sum"), with its moves; returns the evicted
    position [B, H, 1].

    The token leaving the window (slot `idx`) meets the weakest of the pool ranked by `pri` (the last `pool`
    long-range slots; it is the newest, so it wins ties); whichever loses meets the static pool's weakest (the
    `static` slots from `lo`) by (static priority `rank`, position): that loser may be older than the static
    pool's tokens, so the position breaks ties. The loser of that is evicted. `pos`, `pri` and `rank` are among
    `buffers`, every buffer whose slots move with their tokens ([B, H, N + 1] or [B, H, N + 1, D], a scratch
    slot last that absorbs the moves not made). The decode step and the walks share it.
    """
    N = pos.shape[-1] - 1
    leave_pri = pri.gather(2, idx)
    src, promote_t = idx, torch.zeros_like(leaving)
    if pool:
        top = lo + static
        widx, weakest_pri, _ = weakest_slot(pri[:, :, top:N], pos[:, :, top:N])
        promote_t = leaving & (leave_pri >= weakest_pri) & (leave_pri > float("-inf"))
        src = torch.where(promote_t, widx + top, idx)
    cand_pos = pos.gather(2, src)
    out = cand_pos
    if static:
        cand_rank = rank.gather(2, src)
        sidx, weakest_rank, weakest_pos = weakest_slot(rank[:, :, lo : lo + static], pos[:, :, lo : lo + static])
        beats = (cand_rank > weakest_rank) | ((cand_rank == weakest_rank) & (cand_pos > weakest_pos))
        promote_s = leaving & beats & (cand_rank > float("-inf"))
        out = torch.where(promote_s, weakest_pos, cand_pos)
        move_slot(buffers, src, torch.where(promote_s, sidx + lo, N))
    if pool:  # after the move above, which may have read the slot this overwrites
        move_slot(buffers, idx, torch.where(promote_t, widx + lo + static, N))
    return out


def static_first_step(buffers, pos: Tensor, pri: Tensor, rank: Tensor | None, idx: Tensor, leaving: Tensor, lo: int,
                      static: int, pool: int) -> Tensor:
    """The decision of every rule but the layer-wide cascade, with its moves; returns the evicted position [B, H, 1].

    One pool (`static == 0`, every policy but KVpop-cascade): the token leaving the window (slot `idx`) replaces the
    weakest of the `pool` long-range slots from `lo` if it beats it by `pri` (it is the newest, so it wins ties).
    KVpop-cascade (score "cascade"): it first meets the static pool's weakest (the `static` slots from `lo`) by the
    static priority `rank` (it wins ties); whichever loses meets the weakest of the pool ranked by `pri` (the last
    `pool` slots) by (priority, position), since a token demoted from the static pool may be the older one. A -inf
    token (DMS's "evict") never takes a long-range slot, not even an empty one. `pos`, `pri` and `rank` are among
    `buffers`, as in `tova_first_step`. The decode step and the reference walk share it.
    """
    N = pos.shape[-1] - 1
    leave_pos = pos.gather(2, idx)
    src, cand_pos = idx, leave_pos
    if static:
        sidx, weakest_rank, weakest_pos = weakest_slot(rank[:, :, lo : lo + static], pos[:, :, lo : lo + static])
        leave_rank = rank.gather(2, idx)
        beats = (leave_rank > weakest_rank) | ((leave_rank == weakest_rank) & (leave_pos > weakest_pos))
        promote_s = leaving & beats & (leave_rank > float("-inf"))
        src = torch.where(promote_s, sidx + lo, idx)
        cand_pos = pos.gather(2, src)
    out = cand_pos
    if pool:
        top = lo + static
        cand_pri = pri.gather(2, src)
        widx, weakest_pri, weakest_pos = weakest_slot(pri[:, :, top:N], pos[:, :, top:N])
        beats = (cand_pri > weakest_pri) | ((cand_pri == weakest_pri) & (cand_pos > weakest_pos))
        promote = leaving & beats & (cand_pri > float("-inf"))
        out = torch.where(promote, weakest_pos, cand_pos)
        move_slot(buffers, src, torch.where(promote, widx + top, N))  # the scratch slot unless promoted
    if static:  # after the move above, which may have read the slot this overwrites
        move_slot(buffers, idx, torch.where(promote_s, sidx + lo, N))
    return out
