"""The running top-k as Triton kernels: the `k`-th oldest token that outranks each token, on the GPU.

Same answer as `wavelet.eviction_positions` for a teacher-forced sequence (tokens stored in
position order), by a different parallel formulation (derivation in `README.md` beside this file):

    e[t] = max(pos_t, P_k(t)) + w,   P_k(t) = position of the k-th oldest token u with rank_u < rank_t

`kth_beater_tiled` (the default): a program owns `block_r` tokens of consecutive rank; a table
built by a first launch gives, per block of ranks and position tile, how many better-ranked tokens
lie in tiles `<= j`, so the tile where a token's count reaches `k` is found with one compare per
(token, tile), and only that tile is scanned token by token. O(S^1.5) compares per row.

`kth_beater` (backend "triton_scan", kept for comparison): one program owns a block of `BLOCK_T`
tokens of one (batch, KV head) row and walks the row oldest first in tiles of `BLOCK_U`, counting
for each of its tokens how many outrank it; the tile in which a token's count reaches `k` gives
`P_k(t)` by an in-tile prefix sum. O(S^2 / 2) compares per row in the worst case, and in practice.

Triton is optional: `available()` says whether this path can run. With `TRITON_INTERPRET=1` it
runs on CPU tensors (slowly), which is how the CPU test suite checks it against the reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# `available` (re-exported) says whether these kernels can run; without Triton, `triton` and `tl` are None and
# the wavelet form serves them
from kvpop.ops.triton_support import available as available
from kvpop.ops.triton_support import tl, triton

BLOCK_T = 32
BLOCK_U = 128
_FAR = 1 << 30  # larger than any token index



if triton is not None:

    @triton.jit
    def _kth_beater_kernel(rank_ptr, ranked_ptr, out_ptr, S, topk,
                           BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr, FAR: tl.constexpr):
        row = tl.program_id(1)
        base = row.to(tl.int64) * S
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_in = t < S
        r_t = tl.load(rank_ptr + base + t, mask=t_in, other=-1)  # rank -1: outranked by nobody
        todo = (tl.load(ranked_ptr + base + t, mask=t_in, other=0) != 0) & (r_t >= topk)
        count = tl.zeros([BLOCK_T], dtype=tl.int32)
        kth = tl.full([BLOCK_T], FAR, dtype=tl.int32)
        u0 = 0
        # a token of rank < k can never be outranked k times: `todo` starts without it
        while (u0 < S) & (tl.max(todo.to(tl.int32), axis=0) > 0):
            u = u0 + tl.arange(0, BLOCK_U)
            u_in = u < S
            r_u = tl.load(rank_ptr + base + u, mask=u_in, other=S)
            ok_u = tl.load(ranked_ptr + base + u, mask=u_in, other=0) != 0
            beats = (r_u[None, :] < r_t[:, None]) & ok_u[None, :]  # [BLOCK_T, BLOCK_U]
            in_tile = tl.sum(beats.to(tl.int32), axis=1)
            # the count passes k exactly once per token; only the tile where it does needs the prefix
            # sum that finds P_k(t) (most tiles skip it)
            crossing = todo & (count + in_tile >= topk)
            if tl.max(crossing.to(tl.int32), axis=0) > 0:
                running = tl.cumsum(beats.to(tl.int32), axis=1) + count[:, None]
                hit = beats & (running == topk) & crossing[:, None]
                kth = tl.minimum(kth, tl.min(tl.where(hit, u[None, :], FAR), axis=1))
            count += in_tile
            todo = todo & (count < topk)
            u0 += BLOCK_U
        tl.store(out_ptr + base + t, tl.where(kth < FAR, kth, -1), mask=t_in)

    @triton.jit
    def _tile_count_kernel(order_ptr, ranked_ptr, cnt_ptr, S, n_tiles,
                           BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_J: tl.constexpr,
                           FAR: tl.constexpr):
        # cnt[row, b, j] = #{ranked tokens of rank block b whose position tile is <= j}
        i_b, i_row = tl.program_id(0), tl.program_id(1)
        base = i_row.to(tl.int64) * S
        o_r = i_b * BLOCK_R + tl.arange(0, BLOCK_R)
        m_r = o_r < S
        b_tok = tl.load(order_ptr + base + o_r, mask=m_r, other=0)
        b_ok = m_r & (tl.load(ranked_ptr + base + b_tok, mask=m_r, other=0) != 0)
        # an unranked token lies in no tile, so it never counts as outranking anyone
        b_tile = tl.where(b_ok, b_tok // BLOCK_U, FAR)  # [BR]
        p_cnt = cnt_ptr + (i_row.to(tl.int64) * tl.num_programs(0) + i_b) * n_tiles
        j0 = 0
        while j0 < n_tiles:
            o_j = j0 + tl.arange(0, BLOCK_J)
            b_le = (b_tile[:, None] <= o_j[None, :]).to(tl.int32)  # [BR, BJ]
            tl.store(p_cnt + o_j, tl.sum(b_le, axis=0), mask=o_j < n_tiles)
            j0 += BLOCK_J

    @triton.jit
    def _kth_beater_tiled_kernel(order_ptr, rank_ptr, ranked_ptr, before_ptr, out_ptr, S, n_tiles, topk,
                                 BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_J: tl.constexpr,
                                 BLOCK_E: tl.constexpr, FAR: tl.constexpr):
        # one program: the BLOCK_R tokens of ranks [b * BLOCK_R, (b + 1) * BLOCK_R) of one row
        i_b, i_row = tl.program_id(0), tl.program_id(1)
        base = i_row.to(tl.int64) * S
        o_r = i_b * BLOCK_R + tl.arange(0, BLOCK_R)  # each token's rank
        m_r = o_r < S
        b_tok = tl.load(order_ptr + base + o_r, mask=m_r, other=0)
        b_ok = m_r & (tl.load(ranked_ptr + base + b_tok, mask=m_r, other=0) != 0)
        b_tile = tl.where(b_ok, b_tok // BLOCK_U, FAR)  # [BR]
        # a token of rank < k can never be outranked k times
        todo = b_ok & (o_r >= topk)
        p_before = before_ptr + (i_row.to(tl.int64) * tl.num_programs(0) + i_b) * n_tiles

        # level 1, whole position tiles: beaters of rank < b * BLOCK_R come from the table, the
        # block's own better-ranked tokens from an exclusive prefix count over the block
        n_below = tl.zeros([BLOCK_R], dtype=tl.int32)  # tiles before the one where the count reaches k
        c_below = tl.zeros([BLOCK_R], dtype=tl.int32)  # beaters in those tiles
        crossed = tl.zeros([BLOCK_R], dtype=tl.int32)
        open_ = todo
        j0 = 0
        while (j0 < n_tiles) & (tl.max(open_.to(tl.int32), axis=0) > 0):
            o_j = j0 + tl.arange(0, BLOCK_J)
            m_j = o_j < n_tiles
            b_before = tl.load(p_before + o_j, mask=m_j, other=0)  # [BJ]
            b_le = (b_tile[:, None] <= o_j[None, :]).to(tl.int32)  # [BR, BJ]
            b_count = b_before[None, :] + tl.cumsum(b_le, axis=0) - b_le  # [BR, BJ] beaters in tiles <= j
            below = m_j[None, :] & (b_count < topk)
            # the count grows with j, so the tiles below k come first and the last of them holds c_below
            n_below += tl.sum(below.to(tl.int32), axis=1)
            c_below = tl.maximum(c_below, tl.max(tl.where(below, b_count, 0), axis=1))
            crossed = tl.maximum(crossed, tl.max((m_j[None, :] & (b_count >= topk)).to(tl.int32), axis=1))
            open_ = todo & (crossed == 0)
            j0 += BLOCK_J

        # level 2, the crossing tile token by token: the (k - c_below)-th beater in it is P_k(t)
        hit_tile = todo & (crossed > 0)
        u0 = n_below * BLOCK_U  # [BR]
        seen = c_below
        kth = tl.full([BLOCK_R], FAR, dtype=tl.int32)
        for e0 in tl.static_range(0, BLOCK_U, BLOCK_E):
            u = u0[:, None] + e0 + tl.arange(0, BLOCK_E)[None, :]  # [BR, BE]
            m_u = hit_tile[:, None] & (u < S)
            r_u = tl.load(rank_ptr + base + u, mask=m_u, other=S)
            ok_u = tl.load(ranked_ptr + base + u, mask=m_u, other=0) != 0
            beat = (ok_u & (r_u < o_r[:, None])).to(tl.int32)  # [BR, BE]
            running = tl.cumsum(beat, axis=1) + seen[:, None]
            kth = tl.minimum(kth, tl.min(tl.where((beat > 0) & (running == topk), u, FAR), axis=1))
            seen += tl.sum(beat, axis=1)
        tl.store(out_ptr + base + b_tok, tl.where(kth < FAR, kth, -1), mask=m_r)


def kth_beater(rank: Tensor, ranked: Tensor, topk: int) -> Tensor:
    """Index of the `topk`-th oldest ranked token that outranks each token, or -1.

    Args:
        rank: int32 [R, S], each row a permutation of `0..S-1`, 0 = best; tokens in position order.
        ranked: bool [R, S], tokens that take part (outrank others) at all.
        topk: >= 1.
    Returns:
        int32 [R, S].
    """
    if triton is None:
        raise RuntimeError("the Triton top-k kernel needs `triton` (pip install triton)")
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1 for the kernel (topk 0 needs no ranking)")
    R, S = rank.shape
    rank = rank.to(torch.int32).contiguous()
    ranked = ranked.to(torch.int8).contiguous()
    out = torch.empty(R, S, dtype=torch.int32, device=rank.device)
    if R * S == 0:
        return out
    grid = (triton.cdiv(S, BLOCK_T), R)
    _kth_beater_kernel[grid](rank, ranked, out, S, topk, BLOCK_T=BLOCK_T, BLOCK_U=BLOCK_U, FAR=_FAR)
    return out


def _tile_size(S: int) -> int:
    """Position tile of the two-level kernel: about sqrt(S), which balances its two levels."""
    return min(256, max(16, triton.next_power_of_2(math.isqrt(max(S - 1, 1)) + 1)))


def kth_beater_tiled(
    rank: Tensor,
    ranked: Tensor,
    topk: int,
    order: Tensor | None = None,
    block_r: int = 128,
    block_u: int | None = None,
    block_j: int = 32,
    block_e: int = 64,
    num_warps: int = 4,
) -> Tensor:
    """`kth_beater` in O(S^1.5) per row: whole position tiles are counted from a table, one tile is scanned.

    Same arguments and result as `kth_beater`. A program owns `block_r` tokens of consecutive rank.
    The beaters of token `t` are the tokens of rank `< rank_t`; a table built by a first launch counts,
    per block of ranks and per position tile of `block_u`, how many of them lie in tiles `<= j`, so
    the program finds the tile where the count reaches `k` with one compare per (token, tile), and
    then scans that single tile token by token (derivation: `README.md` beside this file).

    Args:
        rank: int32 [R, S], each row a permutation of `0..S-1`, 0 = best; tokens in position order.
        ranked: bool [R, S], tokens that take part (outrank others) at all.
        topk: >= 1.
        order: int32 [R, S], the inverse permutation of `rank` (token of each rank), if at hand.
        block_r, block_u, block_j, block_e: powers of two; tile sizes (small ones let tests walk
            every loop). `block_u` defaults to about `sqrt(S)`.
        num_warps: of the second launch (`bench/bench_train_attention.py --sweep` times the choices).
    Returns:
        int32 [R, S].
    """
    if triton is None:
        raise RuntimeError("the Triton top-k kernel needs `triton` (pip install triton)")
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1 for the kernel (topk 0 needs no ranking)")
    if rank.dim() != 2 or ranked.shape != rank.shape:
        raise ValueError(f"rank {tuple(rank.shape)} and ranked {tuple(ranked.shape)} must be the same [R, S]")
    R, S = rank.shape
    block_u = _tile_size(S) if block_u is None else block_u
    for name, v in (("block_r", block_r), ("block_u", block_u), ("block_j", block_j), ("block_e", block_e)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two")
    rank = rank.to(torch.int32).contiguous()
    ranked = ranked.to(torch.int8).contiguous()
    out = torch.empty(R, S, dtype=torch.int32, device=rank.device)
    if R * S == 0:
        return out
    if order is None:
        arange = torch.arange(S, dtype=torch.int32, device=rank.device).expand(R, S)
        order = torch.empty_like(rank).scatter_(-1, rank.long(), arange)
    order = order.to(torch.int32).contiguous()
    n_blocks, n_tiles = triton.cdiv(S, block_r), triton.cdiv(S, block_u)
    consts = dict(BLOCK_R=block_r, BLOCK_U=block_u, BLOCK_J=block_j, FAR=_FAR)
    cnt = torch.empty(R, n_blocks, n_tiles, dtype=torch.int32, device=rank.device)
    _tile_count_kernel[(n_blocks, R)](order, ranked, cnt, S, n_tiles, **consts)
    # before[row, b, j]: ranked tokens of rank < b * block_r in position tiles <= j
    before = torch.cumsum(cnt, dim=1, dtype=torch.int32) - cnt
    # 128 ranks a program with 4 warps: the fastest of 54 tile choices at S = 16384 on an H100 (0.088 ms against
    # 0.118 for the earlier 64 ranks with 8 warps; `bench_train_attention.py --sweep`, RESULTS, seventeenth session)
    _kth_beater_tiled_kernel[(n_blocks, R)](order, rank, ranked, before, out, S, n_tiles, topk,
                                            BLOCK_E=min(block_e, block_u), num_warps=num_warps, **consts)
    return out
