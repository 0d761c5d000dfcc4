"""The dynamic policies' prefill walk in PyTorch: the decode step's decisions with few operations per token.

Same contract and the same floats as `reference.dynamic_walk_reference` (so the slots equal a
token-by-token replay bit for bit), but per token it runs only what a decision needs (about 20 small
operations instead of the decode step's 70): no values and no attention output; every index, view,
scaled query and per-token input prepared once per chunk; the decision skipped at steps where no row
has a token leaving the window; the occupancy mask dropped once every slot is taken (it then changes
no bit); padding handled only when a chunk has any. The loop over positions remains, since each
decision depends on the last; everything inside it is vectorised over the batch and the heads.
The chunk's attention output is computed afterwards, in one sparse-attention call. The layer-wide cascades
("cascade_mean", "cascade_sum", the recommended policy) have their own loop (`layer_cascade_walk`): each slot one
record, flat indices, one write per buffer and step (`README.md`).

Why the comparison with the weakest slot needs no position tie-break: the token leaving the window is
newer than every long-range token (those left the window earlier), so under "ties go to the newer
token" it wins every tie; the reference's two-part comparison reduces to `leave_pri >= weakest_pri`.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from kvpop.ops.attention.reference import slot_probs
from kvpop.ops.dynamic.reference import move_slot
from kvpop.ops.dynamic.score import LAYER_CASCADES, Score, score_update

_LAST = torch.iinfo(torch.long).max


def dynamic_walk_torch(
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
    """See `ops.dynamic.dynamic_walk`."""
    if score in LAYER_CASCADES:
        return layer_cascade_walk(query, key, slot_keys, slot_pos, slot_pri, slot_prior, position, valid, priority,
                                  sink, window, topk, scale, score, pool, decay, softcap)
    s, w, k = sink, window, topk
    pool = k if pool is None else pool
    static = k - pool  # KVpop-cascade's static pool (ranked by `slot_prior`), the long-range slots before the rest
    B, Hq, C, D = query.shape
    H, N = key.shape[1], slot_pos.shape[-1]
    G = Hq // H
    dev = key.device
    # the decode step's buffers (the slots and a scratch slot), so `slot_probs` sees the same layout
    keys = torch.cat([slot_keys, slot_keys.new_zeros(B, H, 1, D)], dim=2)
    pos = torch.cat([slot_pos, slot_pos.new_full((B, H, 1), -1)], dim=2)
    pri = torch.cat([slot_pri.float(), slot_pri.new_full((B, H, 1), float("-inf"), dtype=torch.float32)], dim=2)
    keys_n, pos_n, pri_n = keys[:, :, :N], pos[:, :, :N], pri[:, :, :N]
    # the long-range slots followed by the scratch slot: a write to index `pool` of these views is dropped
    # (KVpop-cascade: the pool ranked by `pri` is the last `pool` of them)
    lo = s + w + static
    keys_top, pos_top, pri_top = keys[:, :, lo:], pos[:, :, lo:], pri[:, :, lo:]
    top_pos, top_pri = pos[:, :, lo:N], pri[:, :, lo:N]
    # `prior` (KVpop-TOVA; KVpop-cascade's static priority): each slot's prior moves with its token, like its priority
    has_prior = slot_prior is not None
    if has_prior:
        prior = torch.cat([slot_prior.float(), pri.new_full((B, H, 1), float("-inf"))], dim=2)
        prior_n, prior_top = prior[:, :, :N], prior[:, :, lo:]
    if static:
        # the static pool's views, and the views to move a slot anywhere (the scratch slot last)
        st_pos, st_rank = pos[:, :, s + w : lo], prior[:, :, s + w : lo]
        bufs = (keys, pos, pri, prior)

    # per-token inputs, prepared once; each list holds C views
    slot = torch.where(position < s, position.clamp(min=0), s + (position - s).clamp(min=0) % w)  # [B, C]
    padded = not bool(valid.all())  # host syncs: a few per chunk, none per token
    leaving = valid & (position >= s + w)  # [B, C]
    decide = leaving.any(0).tolist()
    every = leaving.all(0).tolist()  # every row has a token leaving: no move to mask
    # a token of priority -inf never takes a long-range slot: only then is that test needed
    finite = bool((priority > float("-inf")).all()) and bool(((slot_pri > float("-inf")) | (slot_pos < 0)).all())
    # the scores but H2O's overwrite every occupied slot's priority after the step, so the priority a moved or new
    # token brings is never read: only "sum" writes it
    accumulate = score == "sum"
    # once a row's position reaches N - 1 its slots may be full; checked from there until they are
    may_fill = (position.amin(0) >= N - 1).tolist()
    dst = torch.where(valid, slot, N) if padded else slot
    idx = slot[:, None, :, None].expand(B, H, C, 1).unbind(2)  # [B, H, 1] each
    idx4 = slot[:, None, :, None, None].expand(B, H, C, 1, D).unbind(2)  # [B, H, 1, D]
    dst1 = dst[:, None, :, None].expand(B, H, C, 1).unbind(2)
    dst4 = dst[:, None, :, None, None].expand(B, H, C, 1, D).unbind(2)
    leave = leaving[:, None, :, None].unbind(2)  # [B, 1, 1]
    real = valid[:, None, :, None].unbind(2)
    new_key = key.to(keys.dtype)[:, :, :, None].unbind(2)  # [B, H, 1, D]
    new_pos = position[:, None, :, None].expand(B, H, C, 1).unbind(2)
    new_pri = priority.float()[..., None].unbind(2)
    # the decode step scales each query (elementwise: the same bits for the whole chunk at once)
    queries = (query.reshape(B, H, G, C, D).float() * scale).transpose(2, 3).contiguous().unbind(2)  # [B, H, G, D]
    last = torch.tensor(_LAST, device=dev)
    scratch = torch.tensor(pool, device=dev)
    scratch_n = torch.tensor(N, device=dev)
    evicted = torch.full((B, H, C, 1), -1, dtype=torch.long, device=dev)
    ev = evicted.unbind(2)
    full = False

    for j in range(C):
        if decide[j]:
            leave_pos, leave_pri = pos.gather(2, idx[j]), pri.gather(2, idx[j])
            if static:
                # KVpop-cascade: the static pool first (the leaving token is the newest: it wins ties), then
                # whichever loses meets the pool ranked by `pri`
                sidx = torch.where(st_rank == st_rank.amin(-1, keepdim=True), st_pos, last).argmin(-1, keepdim=True)
                leave_rank = prior.gather(2, idx[j])
                promote_s = (leave_rank >= st_rank.gather(2, sidx)) & (leave_rank > float("-inf")) & leave[j]
                src = torch.where(promote_s, sidx + (s + w), idx[j])
                if pool:
                    cand_pos, cand_pri = pos.gather(2, src), pri.gather(2, src)
                    widx = torch.where(top_pri == top_pri.amin(-1, keepdim=True), top_pos, last).argmin(-1, keepdim=True)
                    weakest_pri, weakest_pos = top_pri.gather(2, widx), top_pos.gather(2, widx)
                    # the loser may be older than the pool's tokens (a token demoted from the static pool): ties
                    # go to the newer token by position
                    promote = ((cand_pri > weakest_pri) | ((cand_pri == weakest_pri) & (cand_pos > weakest_pos)))
                    promote &= (cand_pri > float("-inf")) & leave[j]
                    torch.where(promote, weakest_pos, cand_pos, out=ev[j])
                    move_slot(bufs, src, torch.where(promote, widx + lo, scratch_n))
                else:
                    ev[j].copy_(pos.gather(2, src))
                move_slot(bufs, idx[j], torch.where(promote_s, sidx + (s + w), scratch_n))
            elif k > 0:
                weakest_pri = top_pri.amin(-1, keepdim=True)
                # among equal weakest priorities the older token is weaker; empty slots (-inf, -1) go first
                weakest_pos, widx = torch.where(top_pri == weakest_pri, top_pos, last).min(-1, keepdim=True)
                promote = leave_pri >= weakest_pri
                if not every[j]:
                    promote &= leave[j]
                if not finite:
                    promote &= leave_pri > float("-inf")
                torch.where(promote, weakest_pos, leave_pos, out=ev[j])
                to = torch.where(promote, widx, scratch)
                keys_top.scatter_(2, to[..., None].expand(B, H, 1, D), keys.gather(2, idx4[j]))
                pos_top.scatter_(2, to, leave_pos)
                if accumulate:
                    pri_top.scatter_(2, to, leave_pri)
                if has_prior:
                    prior_top.scatter_(2, to, prior.gather(2, idx[j]))
            else:
                ev[j].copy_(leave_pos)
            if padded:
                ev[j].masked_fill_(~leave[j], -1)
        keys.scatter_(2, dst4[j], new_key[j])
        pos.scatter_(2, dst1[j], new_pos[j])
        if has_prior:  # a new token's prior is its priority at insertion
            prior.scatter_(2, dst1[j], new_pri[j])
        elif accumulate:
            pri.scatter_(2, dst1[j], new_pri[j])
        if not full and may_fill[j]:
            full = bool((pos_n >= 0).all())
        occupied = None if full else pos_n >= 0
        updated = score_update(score, pri_n, slot_probs(queries[j], keys_n, occupied, softcap), occupied,
                               prior_n if has_prior else None, decay)
        pri_n.copy_(torch.where(real[j], updated, pri_n) if padded else updated)
    return evicted[..., 0], pos_n, pri_n, (prior_n if has_prior else None)


def layer_cascade_walk(
    query: Tensor,  # [B, Hq, C, D]
    key: Tensor,  # [B, H, C, D]
    slot_keys: Tensor,  # [B, H, N, D]
    slot_pos: Tensor,  # [B, H, N]
    slot_pri: Tensor,  # [B, H, N]
    slot_prior: Tensor,  # [B, H, N]
    position: Tensor,  # [B, C]
    valid: Tensor,  # [B, C]
    priority: Tensor,  # [B, H, C]
    sink: int,
    window: int,
    topk: int,
    scale: float,
    score: Score,
    pool: int,
    decay: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`dynamic_walk_torch` for the layer-wide cascades ("cascade_mean", "cascade_sum"): `tova_first_step`'s decisions
    and moves, about 35 operations a token where a loop calling it runs 130.

    A slot's score, position and static priority are one record (float64 holds a float32 and an int64 position below
    2**53 exactly, and orders them as their own types do), and the buffers are indexed flat: reading a slot's record
    is one `index_select`, and a step writes every slot it changes (its moves, then the new token) with one
    `index_copy_` of keys and one of records, from staging rows that the reads fill. The decision is
    `tova_first_step`'s, in fewer operations (`README.md`): the static pool's weakest is sought among the candidate
    and the static pool together, and the candidate goes in if it is not the weakest of them.
    """
    s, w, k = sink, window, topk
    static = k - pool
    lo, top = s + w, s + w + static  # the static pool's first slot, the score pool's first
    B, Hq, C, D = query.shape
    H, N = key.shape[1], slot_pos.shape[-1]
    G, BH, M = Hq // H, B * H, N + 1
    dev, f64, long = key.device, torch.float64, torch.long
    ninf = float("-inf")
    # the decode step's slot layout, a scratch slot last in each row: its matmul sees the same keys
    keys = torch.cat([slot_keys, slot_keys.new_zeros(B, H, 1, D)], dim=2)
    keys_n, keys_flat = keys[:, :, :N], keys.view(BH * M, D)
    rec = torch.stack([slot_pri, slot_pos, slot_prior]).to(f64).view(3, BH, N)
    rec = torch.cat([rec, rec.new_tensor([ninf, -1.0, ninf])[:, None, None].expand(3, BH, 1)], 2)
    rec_flat = rec.view(3, BH * M)
    pri_n, pos_n = rec[0, :, :N].view(B, H, N), rec[1, :, :N].view(B, H, N)
    t_pri, t_pos = rec[0, :, top:N], rec[1, :, top:N]  # the pool ranked by the score, [BH, pool]
    s_rec = rec[1:, :, lo:top]  # the static pool's positions and static priorities, [2, BH, static]
    # each row's first slot as a flat index, [BH, 1]: the per-row values below are such columns
    row = torch.arange(0, BH * M, M, device=dev)[:, None]
    row_t, scratch = row + top, row + N
    inf = torch.tensor(float("inf"), dtype=f64, device=dev)

    # per-token inputs, prepared once; each list holds C views
    slot = torch.where(position < s, position.clamp(min=0), s + (position - s).clamp(min=0) % w)  # [B, C]
    padded = not bool(valid.all())  # host syncs: a few per chunk, none per token
    leaving = valid & (position >= s + w)  # [B, C]
    decide = leaving.any(0).tolist()
    every = leaving.all(0).tolist()  # every row has a token leaving: no move to mask
    # the tests against -inf change a bit only where a token has a score or a static priority of -inf
    held = slot_pos >= 0
    finite = bool((priority > ninf).all()) and bool(((slot_pri > ninf) & (slot_prior > ninf) | ~held).all())
    may_fill = (position.amin(0) >= N - 1).tolist()

    def per_row(x: Tensor) -> Tensor:  # [B, C] -> [C, BH, 1]
        return x[:, None].expand(B, H, C).reshape(BH, C).T[..., None]

    at = row + per_row(slot)  # the leaving token's slot
    leave, real = per_row(leaving).unbind(0), valid[:, None, :, None].unbind(2)  # [BH, 1], [B, 1, 1]
    # each step writes its slots with one `index_copy_` per buffer, from staging rows that its reads fill: the new
    # token's slot and the moves' (the static pool's move, then the score pool's, as `tova_first_step` makes them).
    # A move not made writes the scratch slot; the other slots written are distinct, and every read comes first.
    # Index rows per step: the slots written (the new token's, the moves'), then the moves' sources
    moves = (static > 0) + (pool > 0)
    rows = max(moves, 1)  # without long-range slots the moves' rows are there but unused
    ix = torch.empty(C, 1 + 2 * rows, BH, 1, dtype=long, device=dev)
    ix[:, 0] = row + per_row(torch.where(valid, slot, N) if padded else slot)
    ix[:, 1 + moves :] = at[:, None]  # the moves' sources: the leaving token, unless the static move takes another
    stage_k = torch.empty(C, 1 + rows, BH, D, dtype=keys.dtype, device=dev)
    stage_k[:, 0] = key.permute(2, 0, 1, 3).reshape(C, BH, D)
    # a new token's record: a score of 0 (no attention seen yet), its position and its static priority
    stage_r = torch.empty(C, 3, 1 + rows, BH, dtype=f64, device=dev)
    new_pos = position.to(f64)[:, None].expand(B, H, C)
    new_rec = torch.stack([torch.zeros_like(new_pos), new_pos, priority.to(f64)])  # [3, B, H, C]
    stage_r[:, :, 0] = new_rec.view(3, BH, C).permute(2, 0, 1)
    # the leaving token's record (the last move's row), its score and position; the static pool's candidate's
    # position and static priority (the first move's row), and its slot in the static move's source row
    out, out_pri, out_pos = stage_r[:, :, moves], stage_r[:, 0, moves, :, None], stage_r[:, 1, moves, :, None]
    cand, cand_pr = stage_r[:, :, 1], stage_r[:, 1:, 1, :, None]
    # the score pool's move: its slot (or the scratch slot), and the static move's source, one `where` for both
    to_t_src_s = ix[:, moves : moves + 2]
    to_s, cand_at = ix[:, 1], ix[:, 1 + moves, :, 0]
    to_flat, src_flat = ix[:, : 1 + moves].flatten(1), ix[:, 1 + moves :].flatten(1)
    views = (out, out_pri, out_pos, cand, cand_pr, to_t_src_s, to_s, cand_at, to_flat, src_flat, at[..., 0],
             stage_k.flatten(1, 2), stage_k[:, 1:].flatten(1, 2), stage_r.flatten(2))
    (out, out_pri, out_pos, cand, cand_pr, to_t_src_s, to_s, cand_at, to_flat, src_flat, at_flat, all_k, moved_k,
     all_r) = (v.unbind(0) for v in views)
    # the score pool's move writes the scratch slot where not made; the static move reads the leaving token's slot
    scratch_at = torch.stack([scratch.expand(C, BH, 1), at], dim=1).unbind(0)  # [2, BH, 1]
    # the static pool's candidate and its slots side by side, [2, BH, 1 + static]: positions, static priorities
    side = torch.empty(2, BH, 1 + static, dtype=f64, device=dev)
    side_pos, side_rank = side
    i = torch.empty(BH, 1, dtype=long, device=dev)  # the weakest's side-by-side index
    row_s = row + lo - 1  # a side-by-side index `i >= 1` is static slot `lo + i - 1`
    # while every row's pool has an empty slot, the pool takes the leaving token into one, whose loser is that empty
    # slot (position -1, static priority -inf), which the static pool never takes: the first `spare` deciding steps
    # make no static move (their rows below stay so, the scratch slot)
    spare = 0
    if static and pool and finite:
        ix[:, 1] = scratch
        empty = t_pos < 0
        if bool(((t_pri == ninf) & (rec[2, :, top:N] == ninf) | ~empty).all()):
            spare = int(empty.sum(-1).min())
    early = [d and n <= spare for d, n in zip(decide, itertools.accumulate(decide))]
    queries = (query.reshape(B, H, G, C, D).float() * scale).transpose(2, 3).contiguous().unbind(2)  # [B, H, G, D]
    evicted = torch.full((C, BH, 1), -1, dtype=f64, device=dev)
    ev = evicted.unbind(0)
    full = False

    for j in range(C):
        if decide[j] and moves:
            torch.index_select(rec_flat, 1, at_flat[j], out=out[j])  # the leaving token's record
            if pool:
                # the pool's weakest (lowest score, then oldest; empty slots first): the leaving token is newer than
                # every token there, so it wins a tie of scores
                low = t_pri.amin(-1, keepdim=True)
                w_pos, w_idx = torch.where(t_pri == low, t_pos, inf).min(-1, keepdim=True)
                w_idx += row_t
                promote_t = out_pri[j] >= low
                if not every[j]:
                    promote_t &= leave[j]
                if not finite:
                    promote_t &= out_pri[j] > ninf
                if static and not early[j]:
                    # the static pool's candidate: the pool's weakest where the leaving token took its slot
                    torch.where(promote_t, w_idx, scratch_at[j], out=to_t_src_s[j])
                    torch.index_select(rec_flat, 1, cand_at[j], out=cand[j])
                else:
                    torch.where(promote_t, w_idx, scratch, out=to_t_src_s[j][0])
                if not static:
                    torch.where(promote_t, w_pos, out_pos[j], out=ev[j])
            if static and not early[j]:
                # the candidate and the static pool side by side, weakest first by (static priority, position) and
                # the candidate first in a full tie: it goes in where it is not the weakest, and the weakest goes
                torch.cat([cand_pr[j], s_rec], dim=2, out=side)
                low = side_rank.amin(-1, keepdim=True)
                torch.min(torch.where(side_rank == low, side_pos, inf), -1, keepdim=True, out=(ev[j], i))
                promote_s = i > 0
                if not every[j]:
                    promote_s &= leave[j]
                if not finite:
                    promote_s &= side_rank[:, :1] > ninf
                    torch.where(promote_s, ev[j], side_pos[:, :1], out=ev[j])
                i += row_s
                torch.where(promote_s, i, scratch, out=to_s[j])
            if padded or not every[j]:
                ev[j].masked_fill_(~leave[j], -1)
            torch.index_select(keys_flat, 0, src_flat[j], out=moved_k[j])
            keys_flat.index_copy_(0, to_flat[j], all_k[j])
            rec_flat.index_copy_(1, to_flat[j], all_r[j])
        else:
            if decide[j]:  # no long-range slots: the leaving token goes
                ev[j][:, 0] = rec_flat[1].index_select(0, at_flat[j]).masked_fill(~leave[j][:, 0], -1)
            # the new token alone: the first rows
            keys_flat.index_copy_(0, to_flat[j][:BH], all_k[j][:BH])
            rec_flat.index_copy_(1, to_flat[j][:BH], all_r[j][:, :BH])
        if not full and may_fill[j]:
            full = bool((pos_n >= 0).all())
        occupied = None if full else pos_n >= 0
        probs = slot_probs(queries[j], keys_n, occupied, softcap)
        # "cascade_mean" overwrites every occupied slot's score: the old scores matter only where slots are empty
        updated = score_update(score, pri_n if full and score == "cascade_mean" else pri_n.float(), probs, occupied,
                               None, decay)
        pri_n.copy_(torch.where(real[j], updated, pri_n) if padded else updated)
    f32 = torch.float32
    return (evicted[..., 0].T.long().contiguous().view(B, H, C), pos_n.long(), pri_n.to(f32),
            rec[2, :, :N].reshape(B, H, N).to(f32))
