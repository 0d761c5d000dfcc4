"""The dynamic policies' prefill walk in Triton: a program per row of slots walks the positions.

Same decisions as `walk.dynamic_walk_torch` (the reference of this kernel), for every score but "prior": "max"
(TOVA) and "sum" (H2O) with a program per (batch, KV head); "mean" (TOVA averaged over all query
heads of the layer) with a program per batch row, since all KV heads of a row then hold the same
slots (the program averages the heads' probabilities); "cascade" (KVpop-cascade) with a program per
(batch, KV head), carrying each slot's static priority beside its score (two pools, `ops.dynamic.dynamic_walk`);
"cascade_mean" and "cascade_sum" (the layer-wide KVpop-cascades) with a program per batch row that holds every KV
head's slots as `[BH, BN]` blocks (`dynamic_walk_layer_fwd_kernel`): the score is the layer's head average (the
latest, or accumulated), so the program needs every head's probabilities, while each head keeps its own static pool.

The walk goes in blocks of `BLOCK_C` tokens. Per block, one batched GEMM (cuBLAS, float32) gives the
logits of the block's queries against its candidates: the slots as they are at the block's start
(column `n` = slot `n`) followed by the block's own tokens (column `N + j`). Then one launch walks
the block with the slots' positions, priorities and candidate columns in registers. Per token it
moves the token leaving the window (to the weakest long-range slot or out), inserts the new token,
reads the query's logits at its slots' columns (`G x N` floats from L2), and updates every priority
from the softmax over the occupied slots. After the block the slot keys are gathered from the
candidates for the next one.

Its floats are its own (a blocked GEMM and another softmax order than PyTorch's per-token matmul),
so it can differ from the torch walk where two priorities are within rounding of each other; exact
ties (equal keys, uniform attention) it resolves identically (newer token wins). Triton is optional:
`available()` says whether this path can run (CUDA, or Triton's interpreter on the CPU with
`TRITON_INTERPRET=1`, which is how the CPU tests check it).
"""

from __future__ import annotations

import torch
from torch import Tensor

# `available` (re-exported) says whether these kernels can run; without Triton, `triton` and `tl` are None and
# the torch walk serves them
from kvpop.ops.triton_support import available as available
from kvpop.ops.triton_support import tl, triton

SCORES = {"max": 0, "sum": 1, "mean": 2, "cascade": 3, "cascade_mean": 4, "cascade_sum": 5}
"""The scores this module implements: `dynamic_walk_fwd_kernel`'s `SCORE` constant (4 and 5:
`dynamic_walk_layer_fwd_kernel`)."""



BLOCK_C = 256
"""Tokens per launch: the logits of a block are `B x Hkv x G x BLOCK_C x (N + BLOCK_C)` float32."""


if triton is not None:

    @triton.jit
    def _leaving_and_weakest(lpos_a, lpri_a, lcol_a, wpri_a, wpos_a, widx_a,
                             lpos_b, lpri_b, lcol_b, wpri_b, wpos_b, widx_b):
        # the leaving token's fields: one lane at most holds them, the others zeros, so a sum extracts them;
        # the weakest long-range slot: lowest priority, then oldest position, then lowest index
        b_first = (wpri_b < wpri_a) | ((wpri_b == wpri_a) & ((wpos_b < wpos_a) | ((wpos_b == wpos_a) & (widx_b < widx_a))))
        return (lpos_a + lpos_b, lpri_a + lpri_b, lcol_a + lcol_b, tl.where(b_first, wpri_b, wpri_a),
                tl.where(b_first, wpos_b, wpos_a), tl.where(b_first, widx_b, widx_a))

    @triton.jit
    def _weakest_static(rank_a, pos_a, idx_a, pri_a, col_a, rank_b, pos_b, idx_b, pri_b, col_b):
        # KVpop-cascade's static pool: the weakest slot by (rank, position, index), with its priority and column
        b_first = (rank_b < rank_a) | ((rank_b == rank_a) & ((pos_b < pos_a) | ((pos_b == pos_a) & (idx_b < idx_a))))
        return (tl.where(b_first, rank_b, rank_a), tl.where(b_first, pos_b, pos_a), tl.where(b_first, idx_b, idx_a),
                tl.where(b_first, pri_b, pri_a), tl.where(b_first, col_b, col_a))

    @triton.jit
    def dynamic_walk_fwd_kernel(
        l_ptr,  # [B, H, G, CB, N + CB] float32: the block's logits over its candidates
        pos_ptr,  # [B, H, N] int64, in and out
        pri_ptr,  # [B, H, N] float32, in and out
        col_ptr,  # [B, H, N] int64, out: each slot's candidate column after the block
        position_ptr,  # [B, C] int64, the block's tokens
        valid_ptr,  # [B, C] int8
        new_pri_ptr,  # [B, H, C] float32
        ev_ptr,  # [B, H, C] int64, out
        rank_ptr,  # [B, H, N] float32, in and out: the slots' static priorities (SCORE 3, cascade; else unused)
        C, CB, H, N, SINK, WINDOW, TOPK, STATIC,
        G: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, SCORE: tl.constexpr, NH: tl.constexpr,
    ):
        # the row of slots this program walks: (batch, KV head), or with SCORE 2 (mean) the batch row's
        # first head, whose slots every head of the row shares; NH heads' probabilities are read.
        # Per token: one tuple reduction finds the leaving token and the weakest long-range slot together,
        # and the softmax takes a max and a sum per head; the next token's scalars load meanwhile.
        if SCORE == 2:
            i_b = tl.program_id(0)
            i_bh = i_b * H
        else:
            i_bh = tl.program_id(0)
            i_b = i_bh // H
        o_n = tl.arange(0, BN)
        o_g = tl.arange(0, BG)
        m_n = o_n < N
        m_g = o_g < G
        M = N + CB
        p_pos = pos_ptr + i_bh.to(tl.int64) * N + o_n
        p_pri = pri_ptr + i_bh.to(tl.int64) * N + o_n
        b_pos = tl.load(p_pos, mask=m_n, other=-1)
        b_pri = tl.load(p_pri, mask=m_n, other=float("-inf"))
        b_col = o_n.to(tl.int64)
        # the pool ranked by the score: every long-range slot, or (cascade) those after the static pool
        top = m_n & (o_n >= SINK + WINDOW + STATIC)
        if SCORE == 3:
            p_rank = rank_ptr + i_bh.to(tl.int64) * N + o_n
            b_rank = tl.load(p_rank, mask=m_n, other=float("-inf"))
            stat = m_n & (o_n >= SINK + WINDOW) & (o_n < SINK + WINDOW + STATIC)
        p_position = position_ptr + i_b.to(tl.int64) * C
        p_valid = valid_ptr + i_b.to(tl.int64) * C
        p_new = new_pri_ptr + i_bh.to(tl.int64) * C
        p = tl.load(p_position)
        real = tl.load(p_valid) != 0
        new_pri = tl.load(p_new)
        j = 0
        while j < C:
            more = j + 1 < C
            p_next = tl.load(p_position + j + 1, mask=more, other=0)
            real_next = tl.load(p_valid + j + 1, mask=more, other=0) != 0
            new_pri_next = tl.load(p_new + j + 1, mask=more, other=0.0)
            slot = tl.where(p < SINK, tl.maximum(p, 0), SINK + tl.maximum(p - SINK, 0) % WINDOW)
            at = o_n == slot
            leave_pos, leave_pri, leave_col, weakest_pri, weakest_pos, widx = tl.reduce(
                (tl.where(at, b_pos, 0), tl.where(at, b_pri, 0.0), tl.where(at, b_col, 0),
                 tl.where(top, b_pri, float("inf")), tl.where(top, b_pos, 1 << 62), tl.where(top, o_n, BN)),
                0, _leaving_and_weakest)
            leaving = real & (p >= SINK + WINDOW)
            if SCORE == 3:
                # KVpop-cascade: the leaving token meets the static pool's weakest by static priority (it is the
                # newest: it wins ties); the loser meets the score pool's weakest by (priority, position)
                leave_rank = tl.sum(tl.where(at, b_rank, 0.0), axis=0)
                s_rank, s_pos, s_idx, s_pri, s_col = tl.reduce(
                    (tl.where(stat, b_rank, float("inf")), tl.where(stat, b_pos, 1 << 62), tl.where(stat, o_n, BN),
                     tl.where(stat, b_pri, 0.0), tl.where(stat, b_col, 0)), 0, _weakest_static)
                promote_s = leaving & (STATIC > 0) & (leave_rank >= s_rank) & (leave_rank > float("-inf"))
                y_pos = tl.where(promote_s, s_pos, leave_pos)
                y_pri = tl.where(promote_s, s_pri, leave_pri)
                y_col = tl.where(promote_s, s_col, leave_col)
                y_rank = tl.where(promote_s, s_rank, leave_rank)
                beats = (y_pri > weakest_pri) | ((y_pri == weakest_pri) & (y_pos > weakest_pos))
                promote = leaving & (TOPK > STATIC) & beats & (y_pri > float("-inf"))
                gone = tl.where(promote, weakest_pos, y_pos)
                tl.store(ev_ptr + i_bh.to(tl.int64) * C + j, tl.where(leaving, gone, -1))
                moved = promote & (o_n == widx)
                b_pos = tl.where(moved, y_pos, b_pos)
                b_pri = tl.where(moved, y_pri, b_pri)
                b_col = tl.where(moved, y_col, b_col)
                b_rank = tl.where(moved, y_rank, b_rank)
                taken = promote_s & (o_n == s_idx)
                b_pos = tl.where(taken, leave_pos, b_pos)
                b_pri = tl.where(taken, leave_pri, b_pri)
                b_col = tl.where(taken, leave_col, b_col)
                b_rank = tl.where(taken, leave_rank, b_rank)
                b_rank = tl.where(real & at, new_pri, b_rank)  # a new token's static priority is its priority
            else:
                promote = leaving & (TOPK > 0) & (leave_pri >= weakest_pri) & (leave_pri > float("-inf"))
                gone = tl.where(promote, weakest_pos, leave_pos)
                tl.store(ev_ptr + i_bh.to(tl.int64) * C + j, tl.where(leaving, gone, -1))
                moved = promote & (o_n == widx)
                b_pos = tl.where(moved, leave_pos, b_pos)
                b_pri = tl.where(moved, leave_pri, b_pri)
                b_col = tl.where(moved, leave_col, b_col)
            here = real & at
            b_pos = tl.where(here, p, b_pos)
            if SCORE == 3:
                # a score beside a static priority starts at 0 (`ops.dynamic.score`); the step overwrites it
                b_pri = tl.where(here, 0.0, b_pri)
            else:
                b_pri = tl.where(here, new_pri, b_pri)
            b_col = tl.where(here, N + j, b_col)
            occupied = m_n & (b_pos >= 0)
            b_acc = tl.zeros([BN], dtype=tl.float32)
            for h in tl.static_range(NH):
                p_l = l_ptr + (((i_bh + h).to(tl.int64) * G + o_g[:, None]) * CB + j) * M + b_col[None, :]
                m_l = m_g[:, None] & occupied[None, :]
                b_s = tl.load(p_l, mask=m_l, other=float("-inf"))  # [BG, BN]
                b_m = tl.max(b_s, axis=1)
                b_e = tl.exp(b_s - b_m[:, None])
                b_p = b_e / tl.sum(b_e, axis=1)[:, None]
                if SCORE == 0 or SCORE == 3:
                    b_acc = tl.max(tl.where(m_g[:, None], b_p, float("-inf")), axis=0)
                else:
                    b_acc += tl.sum(tl.where(m_l, b_p, 0.0), axis=0)
            if SCORE == 0 or SCORE == 3:
                b_new_pri = b_acc
            elif SCORE == 1:
                b_new_pri = b_pri + b_acc
            else:
                b_new_pri = b_acc / (NH * G)
            b_pri = tl.where(real & occupied, b_new_pri, b_pri)
            p, real, new_pri = p_next, real_next, new_pri_next
            j += 1
        tl.store(p_pos, b_pos, mask=m_n)
        tl.store(p_pri, b_pri, mask=m_n)
        tl.store(col_ptr + i_bh.to(tl.int64) * N + o_n, b_col, mask=m_n)
        if SCORE == 3:
            tl.store(p_rank, b_rank, mask=m_n)

    @triton.jit
    def _leaving_and_weakest_carried(lpos_a, lpri_a, lcol_a, lrank_a, wpri_a, wpos_a, widx_a, wcol_a, wrank_a,
                                     lpos_b, lpri_b, lcol_b, lrank_b, wpri_b, wpos_b, widx_b, wcol_b, wrank_b):
        # as `_leaving_and_weakest`, with the static priority of both and the weakest slot's column: the layer-wide
        # cascade moves the weakest on to the static pool when the leaving token displaces it
        b_first = (wpri_b < wpri_a) | ((wpri_b == wpri_a) & ((wpos_b < wpos_a) | ((wpos_b == wpos_a) & (widx_b < widx_a))))
        return (lpos_a + lpos_b, lpri_a + lpri_b, lcol_a + lcol_b, lrank_a + lrank_b, tl.where(b_first, wpri_b, wpri_a),
                tl.where(b_first, wpos_b, wpos_a), tl.where(b_first, widx_b, widx_a), tl.where(b_first, wcol_b, wcol_a),
                tl.where(b_first, wrank_b, wrank_a))

    @triton.jit
    def _weakest(rank_a, pos_a, idx_a, rank_b, pos_b, idx_b):
        # the weakest slot by (rank, position, index)
        b_first = (rank_b < rank_a) | ((rank_b == rank_a) & ((pos_b < pos_a) | ((pos_b == pos_a) & (idx_b < idx_a))))
        return tl.where(b_first, rank_b, rank_a), tl.where(b_first, pos_b, pos_a), tl.where(b_first, idx_b, idx_a)

    @triton.jit
    def dynamic_walk_layer_fwd_kernel(
        l_ptr,  # [B, H, G, CB, N + CB] float32: the block's logits over its candidates
        pos_ptr,  # [B, H, N] int64, in and out
        pri_ptr,  # [B, H, N] float32, in and out
        col_ptr,  # [B, H, N] int64, out: each slot's candidate column after the block
        rank_ptr,  # [B, H, N] float32, in and out: the slots' static priorities
        position_ptr,  # [B, C] int64, the block's tokens
        valid_ptr,  # [B, C] int8
        new_pri_ptr,  # [B, H, C] float32
        ev_ptr,  # [B, H, C] int64, out
        C, CB, H, N, SINK, WINDOW, STATIC, POOL, DECAY,
        G: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr,
    ):
        # the layer-wide cascades ("cascade_mean"; with ACC "cascade_sum", whose score accumulates: `DECAY x` the last
        # plus the step's), a program per batch row: every step's priorities average the probabilities of all H * G
        # query heads, so one program holds all the row's KV heads, a head per row of
        # the [BH, BN] blocks. The sinks, the window and the TOVA pool hold the same tokens in every head, but the
        # static pools do not (their priorities are per head), so every head walks its own slots: the per-head
        # decisions are then the torch walk's without assuming the heads agree. Positions and columns are int32
        # in registers (half the registers of int64; positions stay far below 2^31), and the loop needs no
        # loop-long [BH, BN] masks: registers are what limits this kernel (a block has H times the slots of
        # `dynamic_walk_fwd_kernel`'s)
        i_b = tl.program_id(0)
        o_h = tl.arange(0, BH)
        o_n = tl.arange(0, BN)
        m_h = o_h < H
        m_n = o_n < N
        M = N + CB
        # rows past the last head (BH > H) walk a copy of the last head, unstored and left out of the head sum
        o_bh = i_b.to(tl.int64) * H + tl.minimum(o_h, H - 1)
        p_pos = pos_ptr + o_bh[:, None] * N + o_n[None, :]
        p_pri = pri_ptr + o_bh[:, None] * N + o_n[None, :]
        p_rank = rank_ptr + o_bh[:, None] * N + o_n[None, :]
        # columns past the last slot stay empty: pos -1 keeps them out of the softmax
        b_pos = tl.load(p_pos, mask=m_n[None, :], other=-1).to(tl.int32)  # [BH, BN]
        b_pri = tl.load(p_pri, mask=m_n[None, :], other=float("-inf"))  # [BH, BN]
        b_rank = tl.load(p_rank, mask=m_n[None, :], other=float("-inf"))  # [BH, BN]
        b_col = tl.zeros([BH, BN], dtype=tl.int32) + o_n[None, :]  # [BH, BN]
        # the static pool `[SINK + WINDOW, +STATIC)` ranked by `rank`, then the TOVA pool ranked by `pri`
        stat = ((o_n >= SINK + WINDOW) & (o_n < SINK + WINDOW + STATIC))[None, :]
        top = ((o_n >= SINK + WINDOW + STATIC) & m_n)[None, :]
        LAST: tl.constexpr = 2147483647
        p_position = position_ptr + i_b.to(tl.int64) * C
        p_valid = valid_ptr + i_b.to(tl.int64) * C
        p_new = new_pri_ptr + o_bh * C
        p = tl.load(p_position).to(tl.int32)
        real = tl.load(p_valid) != 0
        new_pri = tl.load(p_new)  # [BH]
        j = 0
        while j < C:
            more = j + 1 < C
            p_next = tl.load(p_position + j + 1, mask=more, other=0).to(tl.int32)
            real_next = tl.load(p_valid + j + 1, mask=more, other=0) != 0
            new_pri_next = tl.load(p_new + j + 1, mask=more, other=0.0)
            slot = tl.where(p < SINK, tl.maximum(p, 0), SINK + tl.maximum(p - SINK, 0) % WINDOW)
            at = (o_n == slot)[None, :]
            b_idx = tl.broadcast_to(o_n[None, :], (BH, BN))
            # [BH] each: the leaving token (one lane per head holds it) and the TOVA pool's weakest slot
            leave_pos, leave_pri, leave_col, leave_rank, w_pri, w_pos, w_idx, w_col, w_rank = tl.reduce(
                (tl.where(at, b_pos, 0), tl.where(at, b_pri, 0.0), tl.where(at, b_col, 0), tl.where(at, b_rank, 0.0),
                 tl.where(top, b_pri, float("inf")), tl.where(top, b_pos, LAST), tl.where(top, b_idx, BN),
                 tl.where(top, b_col, 0), tl.where(top, b_rank, 0.0)),
                1, _leaving_and_weakest_carried)
            s_rank, s_pos, s_idx = tl.reduce(
                (tl.where(stat, b_rank, float("inf")), tl.where(stat, b_pos, LAST), tl.where(stat, b_idx, BN)),
                1, _weakest)
            leaving = real & (p >= SINK + WINDOW)
            # the leaving token meets the TOVA pool's weakest first (it is the newest: it wins ties); the loser
            # meets the static pool's weakest by (static priority, position), since it may be the older
            promote_t = leaving & (POOL > 0) & (leave_pri >= w_pri) & (leave_pri > float("-inf"))
            c_pos = tl.where(promote_t, w_pos, leave_pos)
            c_pri = tl.where(promote_t, w_pri, leave_pri)
            c_col = tl.where(promote_t, w_col, leave_col)
            c_rank = tl.where(promote_t, w_rank, leave_rank)
            beats = (c_rank > s_rank) | ((c_rank == s_rank) & (c_pos > s_pos))
            promote_s = leaving & (STATIC > 0) & beats & (c_rank > float("-inf"))
            gone = tl.where(promote_s, s_pos, c_pos)
            tl.store(ev_ptr + o_bh * C + j, tl.where(leaving, gone, -1).to(tl.int64), mask=m_h)
            # the three moves touch disjoint slots (static pool, TOVA pool, sink or window), so their order is free
            into_s = promote_s[:, None] & (o_n[None, :] == s_idx[:, None])
            b_pos = tl.where(into_s, c_pos[:, None], b_pos)
            b_pri = tl.where(into_s, c_pri[:, None], b_pri)
            b_col = tl.where(into_s, c_col[:, None], b_col)
            b_rank = tl.where(into_s, c_rank[:, None], b_rank)
            into_t = promote_t[:, None] & (o_n[None, :] == w_idx[:, None])
            b_pos = tl.where(into_t, leave_pos[:, None], b_pos)
            b_pri = tl.where(into_t, leave_pri[:, None], b_pri)
            b_col = tl.where(into_t, leave_col[:, None], b_col)
            b_rank = tl.where(into_t, leave_rank[:, None], b_rank)
            # a new token's static priority is its priority at insertion, its score starts at 0 (`ops.dynamic.score`)
            here = real & at
            b_pos = tl.where(here, p, b_pos)
            b_pri = tl.where(here, 0.0, b_pri)
            b_col = tl.where(here, N + j, b_col)
            b_rank = tl.where(here, new_pri[:, None], b_rank)
            occupied = b_pos >= 0
            # each query head's softmax over its KV head's occupied slots (0 on the others: a real token occupies
            # a slot in every head), summed over the heads per slot index (the same adds for every slot, so equal
            # probabilities give equal priorities); without a real token the sums are unused
            b_acc = tl.zeros([BN], dtype=tl.float32)
            for g in tl.static_range(G):
                p_l = l_ptr + ((o_bh[:, None] * G + g) * CB + j) * M + b_col
                b_s = tl.load(p_l, mask=occupied, other=float("-inf"))  # [BH, BN]
                b_m = tl.max(b_s, axis=1)
                b_e = tl.exp(b_s - b_m[:, None])
                b_p = b_e / tl.sum(b_e, axis=1)[:, None]
                b_acc += tl.sum(tl.where(m_h[:, None], b_p, 0.0), axis=0)
            if ACC:
                b_pri = tl.where(real & occupied, b_pri * DECAY + (b_acc / (H * G))[None, :], b_pri)
            else:
                b_pri = tl.where(real & occupied, (b_acc / (H * G))[None, :], b_pri)
            p, real, new_pri = p_next, real_next, new_pri_next
            j += 1
        m_hn = m_h[:, None] & m_n[None, :]
        tl.store(p_pos, b_pos.to(tl.int64), mask=m_hn)
        tl.store(p_pri, b_pri, mask=m_hn)
        tl.store(col_ptr + o_bh[:, None] * N + o_n[None, :], b_col.to(tl.int64), mask=m_hn)
        tl.store(p_rank, b_rank, mask=m_hn)



def dynamic_walk_triton(
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
    score: str,
    block: int = BLOCK_C,
    num_warps: int | None = None,
    slot_prior: Tensor | None = None,  # [B, H, N], the cascades only
    pool: int | None = None,  # the cascades only
    decay: float = 1.0,  # "cascade_sum" only
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """See `ops.dynamic.dynamic_walk`; `num_warps` overrides the launch's (for `bench/bench_walk.py`).

    The cascades ("cascade", "cascade_mean", "cascade_sum": KVpop-cascade) take the slots' static priorities `slot_prior` and the
    score pool's size `pool`, and return the priors after the chunk as a fourth result (None for the other scores)."""
    if triton is None:
        raise RuntimeError("the Triton walk needs `triton` (pip install triton)")
    if score not in SCORES:
        raise ValueError(f"score={score!r} must be one of {tuple(SCORES)}")
    layer = score in ("cascade_mean", "cascade_sum")
    cascade = score == "cascade" or layer
    if cascade != (slot_prior is not None and pool is not None):
        raise ValueError(f"score={score!r}: the slots' priors and the pool size go with scores 'cascade', "
                         "'cascade_mean' and 'cascade_sum' only")
    mean = score == "mean"
    if mean and not (torch.equal(slot_pos, slot_pos[:, :1].expand_as(slot_pos))
                     and torch.equal(slot_pri, slot_pri[:, :1].expand_as(slot_pri))):
        raise ValueError("score='mean' ranks alike in every KV head, but these slots differ between heads; "
                         "use backend='torch'")
    B, Hq, C, D = query.shape
    H, N = key.shape[1], slot_pos.shape[-1]
    G = Hq // H
    q = query.reshape(B, H, G, C, D).float() * scale
    keys = slot_keys.float()
    pos = slot_pos.to(torch.int64).contiguous().clone()
    pri = slot_pri.float().contiguous().clone()
    col = torch.empty_like(pos)
    # the slots' static priorities (the cascades), in and out; another score's kernel never reads it
    rank = slot_prior.float().contiguous().clone() if cascade else pri
    static = topk - pool if cascade else 0
    ev = torch.full((B, H, C), -1, dtype=torch.int64, device=key.device)
    position = position.to(torch.int64)
    valid = valid.to(torch.int8)
    priority = priority.float()
    BN = triton.next_power_of_2(max(N, 1))
    warps = num_warps or (4 if BN <= 512 else (8 if BN <= 1024 else 16))
    BH = triton.next_power_of_2(H)
    if layer:
        # a program holds BH x BN slots, 16 of each state block per thread (measured on an H200: 16 warps the
        # fastest at 8192 slots, SmolLM2's 3 heads at N = 2048 and the 8B shape's 8 at 1024; 32 at 8 x 2048)
        warps = num_warps or min(32, max(4, BH * BN // 512))
    NH = H if mean else 1
    for c0 in range(0, C, block):
        cb = min(block, C - c0)
        cand = torch.cat([keys, key[:, :, c0 : c0 + cb].float()], dim=2)  # [B, H, N + cb, D]
        # [B, H, G, cb, N + cb]
        logits = torch.matmul(q[:, :, :, c0 : c0 + cb], cand[:, :, None].transpose(-1, -2)).contiguous()
        evb = torch.empty(B, H, cb, dtype=torch.int64, device=key.device)
        tokens = (position[:, c0 : c0 + cb].contiguous(), valid[:, c0 : c0 + cb].contiguous(),
                  priority[:, :, c0 : c0 + cb].contiguous())
        if layer:
            dynamic_walk_layer_fwd_kernel[(B,)](
                logits, pos, pri, col, rank, *tokens, evb, cb, cb, H, N, sink, window, static, pool, float(decay),
                G=G, BH=BH, BN=BN, ACC=score == "cascade_sum", num_warps=warps)
        else:
            dynamic_walk_fwd_kernel[(B,) if mean else (B * H,)](
                logits, pos, pri, col, *tokens, evb, rank, cb, cb, H, N, sink, window, topk, static,
                G=G, BG=triton.next_power_of_2(G), BN=BN, SCORE=SCORES[score], NH=NH, num_warps=warps)
        if mean:
            # the program walked each row's first head; the others hold the same slots
            for t in (pos, pri, col, evb):
                t[:, 1:] = t[:, :1]
        ev[:, :, c0 : c0 + cb] = evb
        # the slots' keys for the next block; an empty slot's key is never read (its logit is masked)
        keys = cand.gather(2, col[..., None].expand(-1, -1, -1, D))
    return ev, pos, pri, (rank if cascade else None)
