"""After a chunk: the tokens the rule still holds go back into the cache's slot layout.

A chunk decides, for each candidate (the slots before it, then its own tokens), the query at which it is
evicted (`ops.topk.eviction_positions`, or a dynamic policy's walk). After the chunk's last real token
`last` a candidate of position `p` is held in:
- sink slot `p` if `p < sink`;
- its window ring slot `sink + (p - sink) % window` if `p > last - window`;
- the next long-range slot `sink + window + (long-range candidates before it)` if it is older and `last < evict`;
and nowhere otherwise. Slots nobody takes are emptied (keys and values 0, position -1, priority -inf).

`write_slots_reference` does that with about 40 small PyTorch operations (a cumulative sum for the long-range
slots, one gather per buffer), `write_slots_kernel` with one Triton launch per call (a program per row of slots
clears its row, then scatters each held candidate's key, value, position and priority into its slot).
`write_slots` picks: the kernel on CUDA, where `generate`'s eager prefill is bound by its launches
(docs/speed.md), the reference elsewhere. Both write the same bytes: each slot's
fields are copied from one candidate or filled.

One decode step (`step_slots`) is the same rule for a single new token (`docs/method.md` Sec. 7): the token leaving the
window replaces the weakest long-range slot if it beats it, then the new token takes its sink or ring slot; the
cascades compare it with two pools in turn (`ops.dynamic.reference.static_first_step`, `tova_first_step`).
`step_slots_reference` is those functions and one write per buffer (reductions, gathers, compares and eight to
fifteen `index_put_`s, each its own kernel inside a captured step); `step_slots_kernel` does it in one launch, a
program per (row, KV head), for every rule. At SmolLM2's size a decode step is bound by the number of kernels per
layer, not by their bytes (docs/speed.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.ops.dynamic.reference import static_first_step, tova_first_step, write_slot
from kvpop.ops.triton_support import available, tl, triton


def retained_slot(
    cand_pos: Tensor,  # [B, H, M] int64, -1: not a token
    evict: Tensor,  # [B, H, M] int64
    last: Tensor,  # [B] int64, the position of each row's last real token
    sink: int,
    window: int,
    n_slots: int,
) -> Tensor:
    """Each candidate's slot after the chunk, int64 [B, H, M]; `n_slots` for a candidate that is gone."""
    s, w = sink, window
    last = last[:, None, None]
    valid = cand_pos >= 0
    sink_kept = valid & (cand_pos < s)
    in_window = valid & (cand_pos >= s) & (cand_pos > last - w)
    top_kept = valid & (cand_pos >= s) & (cand_pos <= last - w) & (last < evict)
    top_slot = s + w + torch.cumsum(top_kept.long(), dim=-1) - 1
    return torch.where(sink_kept, cand_pos,
                       torch.where(in_window, s + (cand_pos - s) % w, torch.where(top_kept, top_slot, n_slots)))


def write_slots_reference(
    slots: tuple[Tensor, Tensor, Tensor, Tensor],  # keys [B, H, N, D], values [B, H, N, Dv], pos, pri [B, H, N]
    cands: tuple[Tensor, Tensor, Tensor, Tensor],  # the candidates' fields, [B, H, M, ...] alike
    evict: Tensor,  # [B, H, M] int64
    last: Tensor,  # [B] int64
    sink: int,
    window: int,
) -> None:
    """Rewrite the slots (in place) with the candidates the rule holds after query `last` (module docstring)."""
    keys = slots[0]
    B, H, n_slots = keys.shape[:3]
    cand_pos = cands[2]
    dest = retained_slot(cand_pos, evict, last, sink, window, n_slots)
    # each slot's candidate (-1: none, the slot is emptied); slot `n_slots` is a scratch column for
    # everything dropped. Then one gather per buffer, of `slots` rows rather than a scatter of every candidate
    n_cand = cand_pos.shape[-1]
    src = torch.full((B, H, n_slots + 1), -1, dtype=torch.long, device=keys.device)
    src = src.scatter_(2, dest, torch.arange(n_cand, device=keys.device).expand(B, H, n_cand))[..., :n_slots]
    held, src = src >= 0, src.clamp(min=0)
    for buf, cand, fill in zip(slots, cands, (0.0, 0.0, -1, float("-inf"))):
        if buf.dim() == 3:
            buf.copy_(torch.where(held, cand.gather(2, src), fill))
        else:
            rows = cand.gather(2, src[..., None].expand(-1, -1, -1, buf.shape[-1]))
            buf.copy_(torch.where(held[..., None], rows, fill))


if triton is not None:

    @triton.jit
    def _write_slots_kernel(
        k_ptr, v_ptr, pos_ptr, pri_ptr,  # the slots, strided [B, H, N(, D)]
        ck_ptr, cv_ptr, cpos_ptr, cpri_ptr, ev_ptr,  # the candidates, strided [B, H, M(, D)]
        last_ptr,  # [B]
        H, N, M, D, DV, SINK, WINDOW,
        sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sp_b, sp_h, sq_b, sq_h,
        ck_b, ck_h, ck_m, cv_b, cv_h, cv_m, cp_b, cp_h, cq_b, cq_h, ce_b, ce_h,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # program = one row of slots (batch, KV head). Last dims are contiguous (stride 1), as the cache keeps them
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // H, i_bh % H
        i_b64, i_h64 = i_b.to(tl.int64), i_h.to(tl.int64)
        o_m = tl.arange(0, BLOCK_M)
        o_d = tl.arange(0, BLOCK_D)
        o_dv = tl.arange(0, BLOCK_DV)
        m_d = o_d < D
        m_dv = o_dv < DV
        k_row = k_ptr + i_b64 * sk_b + i_h64 * sk_h
        v_row = v_ptr + i_b64 * sv_b + i_h64 * sv_h
        pos_row = pos_ptr + i_b64 * sp_b + i_h64 * sp_h
        pri_row = pri_ptr + i_b64 * sq_b + i_h64 * sq_h
        # 1. empty every slot of the row
        n0 = 0
        while n0 < N:
            o_n = n0 + o_m
            m_n = o_n < N
            tl.store(pos_row + o_n, tl.full([BLOCK_M], -1, tl.int64), mask=m_n)
            tl.store(pri_row + o_n, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_n)
            tl.store(k_row + o_n[:, None] * sk_n + o_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], k_ptr.dtype.element_ty),
                     mask=m_n[:, None] & m_d[None, :])
            tl.store(v_row + o_n[:, None] * sv_n + o_dv[None, :],
                     tl.zeros([BLOCK_M, BLOCK_DV], v_ptr.dtype.element_ty), mask=m_n[:, None] & m_dv[None, :])
            n0 += BLOCK_M
        # the clearing stores of every thread land before any thread's slot writes below
        tl.debug_barrier()
        # 2. each held candidate into its slot; `count` long-range candidates so far
        last = tl.load(last_ptr + i_b)
        count = 0
        m0 = 0
        while m0 < M:
            o_c = m0 + o_m
            m_c = o_c < M
            c_pos = tl.load(cpos_ptr + i_b64 * cp_b + i_h64 * cp_h + o_c, mask=m_c, other=-1)
            c_ev = tl.load(ev_ptr + i_b64 * ce_b + i_h64 * ce_h + o_c, mask=m_c, other=0)
            real = c_pos >= 0
            sink_kept = real & (c_pos < SINK)
            in_window = real & (c_pos >= SINK) & (c_pos > last - WINDOW)
            top_kept = real & (c_pos >= SINK) & (c_pos <= last - WINDOW) & (last < c_ev)
            top_slot = SINK + WINDOW + count + tl.cumsum(top_kept.to(tl.int32), axis=0) - 1
            ring = SINK + (c_pos - SINK) % WINDOW
            dest = tl.where(sink_kept, c_pos, tl.where(in_window, ring, tl.where(top_kept, top_slot, -1)))
            keep = dest >= 0
            c_pri = tl.load(cpri_ptr + i_b64 * cq_b + i_h64 * cq_h + o_c, mask=keep, other=0.0)
            tl.store(pos_row + dest, c_pos, mask=keep)
            tl.store(pri_row + dest, c_pri, mask=keep)
            c_k = tl.load(ck_ptr + i_b64 * ck_b + i_h64 * ck_h + o_c[:, None] * ck_m + o_d[None, :],
                          mask=keep[:, None] & m_d[None, :])
            tl.store(k_row + dest[:, None] * sk_n + o_d[None, :], c_k, mask=keep[:, None] & m_d[None, :])
            c_v = tl.load(cv_ptr + i_b64 * cv_b + i_h64 * cv_h + o_c[:, None] * cv_m + o_dv[None, :],
                          mask=keep[:, None] & m_dv[None, :])
            tl.store(v_row + dest[:, None] * sv_n + o_dv[None, :], c_v, mask=keep[:, None] & m_dv[None, :])
            count += tl.sum(top_kept.to(tl.int32), axis=0)
            m0 += BLOCK_M


def step_slots_reference(
    buffers: tuple[Tensor, ...],  # keys [B, H, N + 1, D], values, pos, pri (, prior): slots + scratch slot
    key: Tensor,  # [B, H, 1, D]
    value: Tensor,  # [B, H, 1, Dv]
    p: Tensor,  # [B] int64, the new token's position (-1: a padding step)
    real: Tensor,  # [B] bool
    pri_new: Tensor,  # [B, H] float32, its priority
    sink: int,
    window: int,
    topk: int,
    static: int = 0,
    tova_first: bool = False,
) -> None:
    """One decode step's slot update, in place (module docstring): the rule's move, then the new token's write.

    Masked writes go to the scratch slot (the last), as `cache.decode_step` has them: a step that promotes nothing
    copies the leaving slot there, and a padding step writes its token there. Every rule's step: one pool ranked by
    `pri` (the default), KVpop-TOVA's prior buffer (the fifth, moved with its token), KVpop-cascade's two pools
    (`static` long-range slots ranked by the prior buffer, then `topk - static` by `pri`) and the layer-wide
    cascade's order (`tova_first`). A cascade's score changes only how `pri` is updated after the step, never this.
    """
    B, H = buffers[0].shape[:2]
    s, w, k = sink, window, topk
    idx = new_token_slot(p, s, w)[:, None, None].expand(B, H, 1)
    if k > 0:
        leaving = (real & (p >= s + w))[:, None, None]
        step = tova_first_step if tova_first else static_first_step
        step(buffers, buffers[2], buffers[3], buffers[4] if len(buffers) > 4 else None, idx, leaving, s + w, static,
             k - static)
    write_new_token(buffers, idx, key, value, p, real, pri_new)


def step_slots_torch(
    buffers: tuple[Tensor, ...],
    key: Tensor,
    value: Tensor,
    p: Tensor,
    real: Tensor,
    pri_new: Tensor,
    sink: int,
    window: int,
    topk: int,
    static: int = 0,
    tova_first: bool = False,
) -> None:
    """`step_slots_reference` in fewer PyTorch operations (about 35 for one pool instead of 109, 55 for a cascade
    instead of 188): the CPU's path, where a decode step's cost is its operations, not their bytes.

    The same decisions by the same comparisons, and the same writes in the same order, through flat indices into
    the buffers (which must be contiguous): one read and one write per buffer and move, where the reference builds
    batch and head indices for each. Byte for byte the reference's result (tests/test_slots.py)."""
    B, H, n = buffers[0].shape[:3]
    N = n - 1
    s, w, k = sink, window, topk
    flat = [b.view(B * H * n, -1) if b.dim() == 4 else b.view(B * H * n) for b in buffers]
    pos, pri = buffers[2], buffers[3]
    # each row's first slot, as a flat index; a row's slot `j` is `row + j`
    row = torch.arange(0, B * H * n, n, device=p.device).view(B, H)
    slot = row + new_token_slot(p, s, w)[:, None]  # [B, H]: the new token's slot, which the leaving token holds
    scratch = row + N

    def move(src: Tensor, dst: Tensor) -> None:
        for f in flat:
            f[dst] = f[src]

    def weakest(rank: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor, Tensor]:
        # `ops.dynamic.reference.weakest_slot`: by (rank, position), empty slots first; the first of a full tie
        r = rank[:, :, lo:hi]
        low = r.amin(-1)
        w_pos, w_idx = torch.where(r == low[..., None], pos[:, :, lo:hi], torch.iinfo(torch.long).max).min(-1)
        return low, w_pos, row + lo + w_idx

    if k > 0:
        lo, top = s + w, s + w + static
        pool = k - static
        leaving = (real & (p >= s + w))[:, None]  # [B, 1]
        rank = buffers[4] if len(buffers) > 4 else None
        if tova_first:
            src, promote_t = slot, None
            if pool:
                w_pri, _, w_idx = weakest(pri, top, N)
                leave_pri = flat[3][slot]
                promote_t = leaving & (leave_pri >= w_pri) & (leave_pri > float("-inf"))
                src = torch.where(promote_t, w_idx, slot)
            if static:
                cand_pos, cand_rank = flat[2][src], flat[4][src]
                s_rank, s_pos, s_idx = weakest(rank, lo, top)
                beats = (cand_rank > s_rank) | ((cand_rank == s_rank) & (cand_pos > s_pos))
                move(src, torch.where(leaving & beats & (cand_rank > float("-inf")), s_idx, scratch))
            if pool:
                move(slot, torch.where(promote_t, w_idx, scratch))
        else:
            src, promote_s = slot, None
            if static:
                s_rank, s_pos, s_idx = weakest(rank, lo, top)
                leave_pos, leave_rank = flat[2][slot], flat[4][slot]
                beats = (leave_rank > s_rank) | ((leave_rank == s_rank) & (leave_pos > s_pos))
                promote_s = leaving & beats & (leave_rank > float("-inf"))
                src = torch.where(promote_s, s_idx, slot)
            if pool:
                w_pri, w_pos, w_idx = weakest(pri, top, N)
                cand_pos, cand_pri = flat[2][src], flat[3][src]
                beats = (cand_pri > w_pri) | ((cand_pri == w_pri) & (cand_pos > w_pos))
                move(src, torch.where(leaving & beats & (cand_pri > float("-inf")), w_idx, scratch))
            if static:
                move(slot, torch.where(promote_s, s_idx, scratch))
    # the new token into its slot (a padding step: the scratch slot); with a prior buffer its priority is its prior,
    # and its score starts at 0 (`write_new_token`)
    dst = torch.where(real[:, None], slot, scratch).view(-1)
    new_pri = pri_new.reshape(B * H).float()
    score = new_pri if len(buffers) == 4 else torch.zeros_like(new_pri)
    news = (key.reshape(B * H, -1), value.reshape(B * H, -1), p[:, None].expand(B, H).reshape(B * H), score, new_pri)
    for f, new in zip(flat, news):
        f[dst] = new.to(f.dtype)


def new_token_slot(p: Tensor, sink: int, window: int) -> Tensor:
    """The slot a decode step's new token takes ([B] int64): its sink slot, or its window ring slot (a padding step,
    p = -1, writes nothing: any in-range slot will do for its index)."""
    return torch.where(p < sink, p.clamp(min=0), sink + (p - sink).clamp(min=0) % window)


def write_new_token(buffers: tuple[Tensor, ...], idx: Tensor, key: Tensor, value: Tensor, p: Tensor, real: Tensor,
                    pri_new: Tensor) -> None:
    """The new token into slot `idx` ([B, H, 1]) of every buffer, a padding step's into the scratch slot (the last);
    with a prior buffer (the fifth: KVpop-TOVA, KVpop-cascade) its priority is its prior at insertion, and its score
    in the priority buffer starts at 0, no attention seen yet (`ops.dynamic.score`)."""
    B, H, n = buffers[0].shape[:3]
    dst = torch.where(real[:, None, None], idx, n - 1)
    new_pos = p[:, None, None].expand(B, H, 1)
    new_pri = pri_new[..., None]
    news = (key, value, new_pos, new_pri) if len(buffers) == 4 else (key, value, new_pos, torch.zeros_like(new_pri), new_pri)
    for buf, new in zip(buffers, news):
        write_slot(buf, dst, new.to(buf.dtype))


if triton is not None:

    @triton.jit
    def _weakest_slot(rank_row, pos_row, lo, hi, BLOCK_N: tl.constexpr):
        # the weakest of slots [lo, hi) by (rank, position, slot): empty slots (-inf, -1) first, in slot order, as
        # `ops.dynamic.reference.weakest_slot` (its argmin takes the first of a full tie)
        o_n = tl.arange(0, BLOCK_N)
        big = tl.full([BLOCK_N], 9223372036854775807, tl.int64)
        low = float("inf")
        low_pos = tl.zeros([], tl.int64) + 9223372036854775807
        low_idx = tl.zeros([], tl.int64) + hi
        n0 = lo
        while n0 < hi:
            idx = n0 + o_n
            m_n = idx < hi
            b_rank = tl.load(rank_row + idx, mask=m_n, other=float("inf"))
            b_pos = tl.load(pos_row + idx, mask=m_n, other=9223372036854775807)
            m1 = tl.min(b_rank, axis=0)
            c_pos = tl.where(m_n & (b_rank == m1), b_pos, big)
            m2 = tl.min(c_pos, axis=0)
            m3 = tl.min(tl.where(m_n & (b_rank == m1) & (c_pos == m2), idx.to(tl.int64), big), axis=0)
            # an earlier block keeps its slot on a full tie
            better = (m1 < low) | ((m1 == low) & (m2 < low_pos))
            low = tl.where(better, m1, low)
            low_pos = tl.where(better, m2, low_pos)
            low_idx = tl.where(better, m3, low_idx)
            n0 += BLOCK_N
        return low, low_pos, low_idx

    @triton.jit
    def _move_slot(k_row, v_row, pos_row, pri_row, prior_row, src, dst, sk_n, sv_n, o_d, m_d, o_dv, m_dv,
                   HAS_PRIOR: tl.constexpr):
        # slot `src` copied to slot `dst` in every buffer (`ops.dynamic.reference.move_slot`); the stores of every
        # thread land before the caller's next reads and writes, which may touch the same slots
        row_k = tl.load(k_row + src * sk_n + o_d, mask=m_d)
        row_v = tl.load(v_row + src * sv_n + o_dv, mask=m_dv)
        src_pos = tl.load(pos_row + src)
        src_pri = tl.load(pri_row + src)
        tl.store(k_row + dst * sk_n + o_d, row_k, mask=m_d)
        tl.store(v_row + dst * sv_n + o_dv, row_v, mask=m_dv)
        tl.store(pos_row + dst, src_pos)
        tl.store(pri_row + dst, src_pri)
        if HAS_PRIOR:
            tl.store(prior_row + dst, tl.load(prior_row + src))
        tl.debug_barrier()

    @triton.jit
    def step_slots_fwd_kernel(
        k_ptr, v_ptr, pos_ptr, pri_ptr, prior_ptr,  # the buffers, strided [B, H, N + 1(, D)]: slots, then scratch
        nk_ptr, nv_ptr, p_ptr, real_ptr, npri_ptr,  # the new token: [B, H, 1, D] twice, [B], [B], [B, H]
        H, N, D, DV, SINK, WINDOW, STATIC,
        sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sp_b, sp_h, sq_b, sq_h, sr_b, sr_h,
        nk_b, nk_h, nv_b, nv_h, nq_b, nq_h,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_STATIC: tl.constexpr,
        HAS_POOL: tl.constexpr, HAS_PRIOR: tl.constexpr, TOVA_FIRST: tl.constexpr,
    ):
        # program = one row of slots (batch, KV head); `N` slots, slot `N` is the scratch slot. Long-range slots
        # [lo, lo + STATIC) are the static pool (ranked by the prior buffer), [lo + STATIC, N) the pool ranked by
        # `pri` (every long-range slot for a one-pool rule)
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // H, i_bh % H
        i_b64, i_h64 = i_b.to(tl.int64), i_h.to(tl.int64)
        o_d = tl.arange(0, BLOCK_D)
        o_dv = tl.arange(0, BLOCK_DV)
        m_d = o_d < D
        m_dv = o_dv < DV
        k_row = k_ptr + i_b64 * sk_b + i_h64 * sk_h
        v_row = v_ptr + i_b64 * sv_b + i_h64 * sv_h
        pos_row = pos_ptr + i_b64 * sp_b + i_h64 * sp_h
        pri_row = pri_ptr + i_b64 * sq_b + i_h64 * sq_h
        prior_row = prior_ptr + i_b64 * sr_b + i_h64 * sr_h
        p = tl.load(p_ptr + i_b)
        real = tl.load(real_ptr + i_b) != 0
        # the new token's slot: its sink slot, or its window ring slot (a padding step: any slot; it writes nothing)
        slot = tl.where(p < SINK, tl.maximum(p, 0), SINK + tl.maximum(p - SINK, 0) % WINDOW)
        lo = SINK + WINDOW
        top = lo + STATIC
        # the token leaving the window sits in the slot the new token takes; it is newer than every long-range token
        leaving = real & (p >= SINK + WINDOW)
        if TOVA_FIRST:
            # `ops.dynamic.reference.tova_first_step`: the leaving token meets the `pri` pool's weakest first (ties
            # to it); whichever loses meets the static pool's weakest by (prior, position)
            src = slot.to(tl.int64)
            if HAS_POOL:
                w_pri, w_pos, w_idx = _weakest_slot(pri_row, pos_row, top, N, BLOCK_N)
                leave_pri = tl.load(pri_row + slot)
                promote_t = leaving & (leave_pri >= w_pri) & (leave_pri > float("-inf"))
                src = tl.where(promote_t, w_idx, src)
            if HAS_STATIC:
                cand_pos = tl.load(pos_row + src)
                cand_rank = tl.load(prior_row + src)
                s_rank, s_pos, s_idx = _weakest_slot(prior_row, pos_row, lo, top, BLOCK_N)
                beats = (cand_rank > s_rank) | ((cand_rank == s_rank) & (cand_pos > s_pos))
                promote_s = leaving & beats & (cand_rank > float("-inf"))
                _move_slot(k_row, v_row, pos_row, pri_row, prior_row, src, tl.where(promote_s, s_idx, N), sk_n, sv_n,
                           o_d, m_d, o_dv, m_dv, HAS_PRIOR)
            if HAS_POOL:
                _move_slot(k_row, v_row, pos_row, pri_row, prior_row, slot, tl.where(promote_t, w_idx, N), sk_n, sv_n,
                           o_d, m_d, o_dv, m_dv, HAS_PRIOR)
        else:
            # `ops.dynamic.reference.static_first_step`: the static pool first (ties to the leaving token), whichever
            # loses meets the `pri` pool's weakest by (priority, position); a -inf token never takes a slot
            src = slot.to(tl.int64)
            if HAS_STATIC:
                s_rank, s_pos, s_idx = _weakest_slot(prior_row, pos_row, lo, top, BLOCK_N)
                leave_pos = tl.load(pos_row + slot)
                leave_rank = tl.load(prior_row + slot)
                beats = (leave_rank > s_rank) | ((leave_rank == s_rank) & (leave_pos > s_pos))
                promote_s = leaving & beats & (leave_rank > float("-inf"))
                src = tl.where(promote_s, s_idx, src)
            if HAS_POOL:
                w_pri, w_pos, w_idx = _weakest_slot(pri_row, pos_row, top, N, BLOCK_N)
                cand_pos = tl.load(pos_row + src)
                cand_pri = tl.load(pri_row + src)
                beats = (cand_pri > w_pri) | ((cand_pri == w_pri) & (cand_pos > w_pos))
                promote = leaving & beats & (cand_pri > float("-inf"))
                # the move (to the scratch slot when nothing is promoted, as the reference's masked write does)
                _move_slot(k_row, v_row, pos_row, pri_row, prior_row, src, tl.where(promote, w_idx, N), sk_n, sv_n,
                           o_d, m_d, o_dv, m_dv, HAS_PRIOR)
            if HAS_STATIC:
                _move_slot(k_row, v_row, pos_row, pri_row, prior_row, slot, tl.where(promote_s, s_idx, N), sk_n, sv_n,
                           o_d, m_d, o_dv, m_dv, HAS_PRIOR)
        # the new token into its slot (a padding step: the scratch slot); with a prior buffer its priority is its
        # prior, and its score starts at 0, no attention seen yet (`write_new_token`)
        dst = tl.where(real, slot, N)
        new_k = tl.load(nk_ptr + i_b64 * nk_b + i_h64 * nk_h + o_d, mask=m_d)
        new_v = tl.load(nv_ptr + i_b64 * nv_b + i_h64 * nv_h + o_dv, mask=m_dv)
        new_pri = tl.load(npri_ptr + i_b64 * nq_b + i_h64 * nq_h).to(tl.float32)
        tl.store(k_row + dst * sk_n + o_d, new_k.to(k_ptr.dtype.element_ty), mask=m_d)
        tl.store(v_row + dst * sv_n + o_dv, new_v.to(v_ptr.dtype.element_ty), mask=m_dv)
        tl.store(pos_row + dst, p)
        if HAS_PRIOR:
            tl.store(pri_row + dst, tl.zeros([], tl.float32))
            tl.store(prior_row + dst, new_pri)
        else:
            tl.store(pri_row + dst, new_pri)


def step_slots_kernel(
    buffers: tuple[Tensor, ...],
    key: Tensor,
    value: Tensor,
    p: Tensor,
    real: Tensor,
    pri_new: Tensor,
    sink: int,
    window: int,
    topk: int,
    static: int = 0,
    tova_first: bool = False,
    block_n: int = 1024,
) -> None:
    """`step_slots_reference` in one Triton launch (CUDA, or `TRITON_INTERPRET=1`); same arguments, and `block_n` the
    long-range slots a program reduces at a time (a power of two; the tests make it small to walk several blocks).

    A custom op (`kvpop::step_slots`), so that a compiled step (inductor, CUDA graphs, `generate`'s compile) takes
    it as one call that writes the buffers in place."""
    if not available(buffers[0]):
        raise RuntimeError(f"the Triton step kernel cannot run on {buffers[0].device} here: it needs `triton` and "
                           "CUDA, or TRITON_INTERPRET=1 on the CPU")
    _check_step(buffers, topk, static)
    if any(t.stride(-1) != 1 for t in (*buffers, key, value)):
        raise ValueError("step_slots_kernel needs every last dimension contiguous (stride 1)")
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two")
    keys, values, pos, pri = buffers[:4]
    prior = buffers[4] if len(buffers) > 4 else None
    _step_slots_op(keys, values, pos, pri, prior, key, value, p, real, pri_new, int(sink), int(window), int(topk),
                   int(static), bool(tova_first), int(block_n))


def _check_step(buffers: tuple[Tensor, ...], topk: int, static: int) -> None:
    if len(buffers) not in (4, 5):
        raise ValueError(f"a decode step takes 4 buffers (keys, values, pos, pri) or 5 (and the prior), got "
                         f"{len(buffers)}")
    if not 0 <= static <= topk:
        raise ValueError(f"static={static} must be in [0, topk={topk}] (the static pool's long-range slots)")
    if static and len(buffers) < 5:
        raise ValueError(f"a static pool (static={static}) is ranked by the prior buffer: pass 5 buffers")
    if buffers[2].dtype != torch.long or any(b.dtype != torch.float32 for b in buffers[3:]):
        raise ValueError(f"slot positions ({buffers[2].dtype}) must be int64 and priorities "
                         f"({', '.join(str(b.dtype) for b in buffers[3:])}) float32")


if triton is not None:

    @torch.library.custom_op("kvpop::step_slots", mutates_args=("keys", "values", "pos", "pri", "prior"))
    def _step_slots_op(keys: Tensor, values: Tensor, pos: Tensor, pri: Tensor, prior: Tensor | None, key: Tensor,
                       value: Tensor, p: Tensor, real: Tensor, pri_new: Tensor, sink: int, window: int, topk: int,
                       static: int, tova_first: bool, block_n: int) -> None:
        B, H, n, D = keys.shape
        if B * H == 0:
            return
        DV = values.shape[-1]
        # without a prior buffer the kernel never touches its pointer: `pri` stands in
        rank = pri if prior is None else prior
        step_slots_fwd_kernel[(B * H,)](
            keys, values, pos, pri, rank, key, value, p.contiguous(), real.contiguous(), pri_new,
            H, n - 1, D, DV, sink, window, static,
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            pos.stride(0), pos.stride(1), pri.stride(0), pri.stride(1), rank.stride(0), rank.stride(1),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), pri_new.stride(0), pri_new.stride(1),
            BLOCK_N=min(block_n, triton.next_power_of_2(max(topk, 1))), BLOCK_D=triton.next_power_of_2(D),
            BLOCK_DV=triton.next_power_of_2(DV), HAS_STATIC=static > 0, HAS_POOL=topk > static,
            HAS_PRIOR=prior is not None, TOVA_FIRST=tova_first,
        )

    @_step_slots_op.register_fake
    def _(keys, values, pos, pri, prior, key, value, p, real, pri_new, sink, window, topk, static, tova_first,
          block_n) -> None:
        return None


def step_slots(
    buffers: tuple[Tensor, ...],
    key: Tensor,
    value: Tensor,
    p: Tensor,
    real: Tensor,
    pri_new: Tensor,
    sink: int,
    window: int,
    topk: int,
    static: int = 0,
    tova_first: bool = False,
    backend: str = "auto",
) -> None:
    """One decode step's slot update (module docstring), every rule's: one pool or a cascade's two (`static`,
    `tova_first`), with or without the prior buffer. `backend`: "auto" (the kernel on CUDA; elsewhere
    `step_slots_torch` on contiguous buffers, else the reference), "torch", "triton", "reference"."""
    if backend not in ("auto", "torch", "triton", "reference"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'torch', 'triton' or 'reference'")
    _check_step(buffers, topk, static)
    args = (buffers, key, value, p, real, pri_new, sink, window, topk, static, tova_first)
    if backend == "auto":
        if buffers[0].is_cuda and available(buffers[0]) and all(t.stride(-1) == 1 for t in (*buffers, key, value)):
            backend = "triton"
        else:
            backend = "torch" if all(b.is_contiguous() for b in buffers) else "reference"
    if backend == "triton":
        step_slots_kernel(*args)
    elif backend == "torch":
        if not all(b.is_contiguous() for b in buffers):
            raise ValueError("step_slots_torch needs contiguous buffers (a cache's are)")
        step_slots_torch(*args)
    else:
        step_slots_reference(*args)


def write_slots_kernel(
    slots: tuple[Tensor, Tensor, Tensor, Tensor],
    cands: tuple[Tensor, Tensor, Tensor, Tensor],
    evict: Tensor,
    last: Tensor,
    sink: int,
    window: int,
    block_m: int = 128,
) -> None:
    """`write_slots_reference` in one Triton launch (CUDA, or `TRITON_INTERPRET=1`); same arguments.

    Every tensor's last dimension must be contiguous (the slots and candidates of a cache are); the others may be
    strided, as the cache's slot views (without their scratch slot) and a chunk's transposed keys are.
    """
    if not available(slots[0]):
        raise RuntimeError(f"the Triton slot kernel cannot run on {slots[0].device} here: it needs `triton` and CUDA, "
                           "or TRITON_INTERPRET=1 on the CPU")
    keys, values, pos, pri = slots
    ck, cv, cpos, cpri = cands
    B, H, N, D = keys.shape
    M, DV = cpos.shape[-1], values.shape[-1]
    if ck.dtype != keys.dtype or cv.dtype != values.dtype or cpos.dtype != torch.long or pri.dtype != torch.float32:
        raise ValueError(f"candidates ({ck.dtype}, {cv.dtype}, {cpos.dtype}) must match the slots' dtypes "
                         f"({keys.dtype}, {values.dtype}, int64, float32 priorities)")
    tensors = (keys, values, pos, pri, ck, cv, cpos, cpri, evict)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("write_slots_kernel needs every last dimension contiguous (stride 1)")
    if B * H == 0:
        return
    evict = evict.expand(B, H, M)
    _write_slots_kernel[(B * H,)](
        keys, values, pos, pri, ck, cv, cpos, cpri, evict, last.contiguous(),
        H, N, M, D, DV, sink, window,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        pos.stride(0), pos.stride(1), pri.stride(0), pri.stride(1),
        ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        cpos.stride(0), cpos.stride(1), cpri.stride(0), cpri.stride(1), evict.stride(0), evict.stride(1),
        BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(DV),
    )


def write_slots(
    slots: tuple[Tensor, Tensor, Tensor, Tensor],
    cands: tuple[Tensor, Tensor, Tensor, Tensor],
    evict: Tensor,
    last: Tensor,
    sink: int,
    window: int,
    backend: str = "auto",
) -> None:
    """Rewrite the slots after a chunk (module docstring). `backend`: "auto" (the kernel on CUDA), "torch", "triton"."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'torch' or 'triton'")
    # "auto" takes the kernel where it runs and its layout holds; "triton" lets the kernel say why it cannot
    auto = (backend == "auto" and slots[0].is_cuda and available(slots[0])
            and all(t.stride(-1) == 1 for t in (*slots, *cands, evict)))
    if backend == "triton" or auto:
        write_slots_kernel(slots, cands, evict, last, sink, window)
    else:
        write_slots_reference(slots, cands, evict, last, sink, window)


__all__ = ["new_token_slot", "retained_slot", "step_slots", "step_slots_kernel", "step_slots_reference", "step_slots_torch",
           "write_new_token", "write_slots", "write_slots_kernel", "write_slots_reference"]
