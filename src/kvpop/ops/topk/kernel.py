"""The running top-k as Triton kernels: the `k`-th oldest token that outranks each token, on the GPU.

Same answer as `wavelet.eviction_positions` for a teacher-forced sequence (tokens stored in
position order), by a different parallel formulation (derivation in `README.md` beside this file):

    e[t] = max(pos_t, P_k(t)) + w,   P_k(t) = position of the k-th oldest token u with rank_u < rank_t

`kth_beater_tiled`: a program owns `block_r` tokens of consecutive rank; a table built by a first
launch gives, per block of ranks and position tile, how many better-ranked tokens lie in tiles
`<= j`, so the tile where a token's count reaches `k` is found with one compare per (token, tile),
and only that tile is scanned token by token. O(S^1.5) compares per row. `evictions_ordered` (the
CUDA default of `eviction_positions`) runs the same two kernels with the small operations around
them fused in: from priorities to eviction positions in four launches and one sort.

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
    def _token_of_rank(order_ptr, base, o_r, m_r, S, SORTED: tl.constexpr):
        # the token of each rank: `order` itself, or (SORTED) from the stable descending argsort of the row read back
        # to front (`evictions_ordered`), and the rank table written by `_tile_count_kernel`
        if SORTED:
            return (S - 1 - tl.load(order_ptr + base + o_r, mask=m_r, other=S - 1)).to(tl.int32)
        else:
            return tl.load(order_ptr + base + o_r, mask=m_r, other=0)

    @triton.jit
    def _rank_keys_kernel(pri_ptr, pos_ptr, valid_ptr, key_ptr, ranked_ptr, elig_ptr, H, S, SINK,
                          s_pb, s_ph, s_ob, s_oh, s_vb, s_vh,
                          BLOCK: tl.constexpr):
        # `evictions_ordered`'s first launch: per token whether it is eligible (valid, past the sinks) and ranked
        # (eligible with a priority above -inf), and the sort key of the row read back to front (-inf: unranked)
        i_t, i_row = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_row // H).to(tl.int64), (i_row % H).to(tl.int64)
        o_t = i_t * BLOCK + tl.arange(0, BLOCK)
        m_t = o_t < S
        pri = tl.load(pri_ptr + i_b * s_pb + i_h * s_ph + o_t, mask=m_t, other=float("-inf"))
        pos = tl.load(pos_ptr + i_b * s_ob + i_h * s_oh + o_t, mask=m_t, other=0)
        valid = tl.load(valid_ptr + i_b * s_vb + i_h * s_vh + o_t, mask=m_t, other=0) != 0
        elig = valid & (pos >= SINK)
        ranked = elig & (pri > float("-inf"))
        base = i_row.to(tl.int64) * S
        tl.store(key_ptr + base + (S - 1 - o_t), tl.where(ranked, pri, float("-inf")), mask=m_t)
        tl.store(ranked_ptr + base + o_t, ranked.to(tl.int8), mask=m_t)
        tl.store(elig_ptr + base + o_t, elig.to(tl.int8), mask=m_t)

    @triton.jit
    def _tile_count_kernel(order_ptr, ranked_ptr, cnt_ptr, rank_ptr, S, n_tiles,
                           BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_J: tl.constexpr,
                           FAR: tl.constexpr, SORTED: tl.constexpr):
        # cnt[row, b, j] = #{ranked tokens of rank block b whose position tile is <= j}; SORTED: `order_ptr` holds
        # the argsort (`_token_of_rank`), and each token's rank goes to `rank_ptr`
        i_b, i_row = tl.program_id(0), tl.program_id(1)
        base = i_row.to(tl.int64) * S
        o_r = i_b * BLOCK_R + tl.arange(0, BLOCK_R)
        m_r = o_r < S
        b_tok = _token_of_rank(order_ptr, base, o_r, m_r, S, SORTED)
        if SORTED:
            tl.store(rank_ptr + base + b_tok, o_r, mask=m_r)
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
                                 pos_ptr, elig_ptr, H, s_ob, s_oh, WINDOW, NEVER,
                                 BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_J: tl.constexpr,
                                 BLOCK_E: tl.constexpr, FAR: tl.constexpr, SORTED: tl.constexpr):
        # one program: the BLOCK_R tokens of ranks [b * BLOCK_R, (b + 1) * BLOCK_R) of one row. SORTED
        # (`evictions_ordered`): `order_ptr` holds the argsort (`_token_of_rank`), `before_ptr` the inclusive
        # cumulative counts (block b reads b - 1's), and `out_ptr` gets each token's eviction position
        i_b, i_row = tl.program_id(0), tl.program_id(1)
        base = i_row.to(tl.int64) * S
        o_r = i_b * BLOCK_R + tl.arange(0, BLOCK_R)  # each token's rank
        m_r = o_r < S
        b_tok = _token_of_rank(order_ptr, base, o_r, m_r, S, SORTED)
        b_ok = m_r & (tl.load(ranked_ptr + base + b_tok, mask=m_r, other=0) != 0)
        b_tile = tl.where(b_ok, b_tok // BLOCK_U, FAR)  # [BR]
        # a token of rank < k can never be outranked k times
        todo = b_ok & (o_r >= topk)
        if SORTED:
            # inclusive counts: the ranks before block b are block b - 1's (none before block 0)
            p_before = before_ptr + (i_row.to(tl.int64) * tl.num_programs(0) + i_b - 1) * n_tiles
            has_before = i_b > 0
        else:
            p_before = before_ptr + (i_row.to(tl.int64) * tl.num_programs(0) + i_b) * n_tiles
            has_before = i_b >= 0

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
            b_before = tl.load(p_before + o_j, mask=m_j & has_before, other=0)  # [BJ]
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
        if SORTED:
            # e = max(pos_t, pos of the k-th beater) + w; an eligible unranked token leaves with the window
            p_row = pos_ptr + (i_row // H).to(tl.int64) * s_ob + (i_row % H).to(tl.int64) * s_oh
            b_pos = tl.load(p_row + b_tok, mask=m_r, other=0)
            k_pos = tl.load(p_row + kth, mask=m_r & (kth < FAR), other=0)
            b_elig = tl.load(elig_ptr + base + b_tok, mask=m_r, other=0) != 0
            evict = tl.where(b_ok & (kth < FAR), tl.maximum(b_pos, k_pos) + WINDOW, NEVER)
            evict = tl.where(b_elig & ~b_ok, b_pos + WINDOW, evict)
            tl.store(out_ptr + base + b_tok, evict, mask=m_r)
        else:
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
    _tile_count_kernel[(n_blocks, R)](order, ranked, cnt, rank, S, n_tiles, SORTED=False, **consts)
    # before[row, b, j]: ranked tokens of rank < b * block_r in position tiles <= j
    before = torch.cumsum(cnt, dim=1, dtype=torch.int32) - cnt
    # 128 ranks a program with 4 warps: the fastest of 54 tile choices at S = 16384 on an H100 (0.088 ms against
    # 0.118 for 64 ranks with 8 warps; `bench/bench_train_attention.py --sweep`, docs/training.md)
    # pos_ptr, elig_ptr, H, s_ob, s_oh, WINDOW, NEVER: read only by `evictions_ordered`'s launch (SORTED)
    _kth_beater_tiled_kernel[(n_blocks, R)](order, rank, ranked, before, out, S, n_tiles, topk,
                                            out, ranked, 1, 0, 0, 0, 0,
                                            BLOCK_E=min(block_e, block_u), num_warps=num_warps, SORTED=False, **consts)
    return out


def evictions_ordered(
    priority: Tensor,  # [B, H, S]
    position: Tensor,  # [B, H, S], may be expanded
    valid: Tensor,  # [B, H, S] bool, may be expanded
    sink: int,
    window: int,
    topk: int,
    never: int,
    block_r: int = 128,
    block_u: int | None = None,
    block_j: int = 32,
    block_e: int = 64,
    num_warps: int = 4,
) -> Tensor:
    """`wavelet.eviction_positions` for tokens in position order, in four launches and one sort.

    The path `kth_beater_tiled` takes with the small operations around it fused: a first launch writes each
    token's eligibility, rank membership and sort key (`_rank_keys_kernel`); one stable argsort ranks every row;
    the tile counts also invert the permutation (each token's rank); a cumulative sum; and the two-level kernel
    writes eviction positions directly (`e = max(pos_t, P_k(t)) + w`, an eligible unranked token's `pos_t + w`,
    `never` otherwise) where `kth_beater_tiled` leaves `P_k`'s token to a dozen more operations. On CUDA those
    operations were most of the cutoffs' time, which is bound by the host's launches (docs/training.md).

    Args:
        priority: float32 [B, H, S]; position: int64 [B, H, S]; valid: bool [B, H, S]; expanded views are read
            as they are (a last dimension that is not contiguous is copied).
        sink, window, topk: the budget split, `topk >= 1`.
        never: the value of a token that is never evicted (`wavelet.NEVER`).
    Returns:
        int64 [B, H, S].
    """
    if triton is None:
        raise RuntimeError("the Triton top-k kernel needs `triton` (pip install triton)")
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1 for the kernel (topk 0 needs no ranking)")
    B, H, S = priority.shape
    position, valid = position.expand(B, H, S), valid.expand(B, H, S)
    if priority.dtype != torch.float32:
        priority = priority.float()
    priority, position, valid = (t if t.stride(-1) == 1 else t.contiguous() for t in (priority, position, valid))
    R, dev = B * H, priority.device
    out = torch.empty(B, H, S, dtype=torch.long, device=dev)
    if R * S == 0:
        return out
    block_u = _tile_size(S) if block_u is None else block_u
    key = torch.empty(R, S, dtype=torch.float32, device=dev)
    ranked = torch.empty(R, S, dtype=torch.int8, device=dev)
    elig = torch.empty(R, S, dtype=torch.int8, device=dev)
    _rank_keys_kernel[(triton.cdiv(S, 1024), R)](priority, position, valid, key, ranked, elig, H, S, sink,
                                                 priority.stride(0), priority.stride(1), position.stride(0),
                                                 position.stride(1), valid.stride(0), valid.stride(1), BLOCK=1024)
    # best first, ties to the newer token: the stable descending sort of the row read back to front
    by_key = torch.argsort(key, dim=-1, descending=True, stable=True)
    n_blocks, n_tiles = triton.cdiv(S, block_r), triton.cdiv(S, block_u)
    consts = dict(BLOCK_R=block_r, BLOCK_U=block_u, BLOCK_J=block_j, FAR=_FAR, SORTED=True)
    rank = torch.empty(R, S, dtype=torch.int32, device=dev)
    cnt = torch.empty(R, n_blocks, n_tiles, dtype=torch.int32, device=dev)
    _tile_count_kernel[(n_blocks, R)](by_key, ranked, cnt, rank, S, n_tiles, **consts)
    # inclusive: block b reads block b - 1's row, the ranked tokens of rank < b * block_r in position tiles <= j
    cnt = torch.cumsum(cnt, dim=1, dtype=torch.int32)
    _kth_beater_tiled_kernel[(n_blocks, R)](by_key, rank, ranked, cnt, out, S, n_tiles, topk,
                                            position, elig, H, position.stride(0), position.stride(1), window, never,
                                            BLOCK_E=min(block_e, block_u), num_warps=num_warps, **consts)
    return out
