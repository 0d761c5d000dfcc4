"""The chunked rule's round as three Triton kernels: its evidence and output in one, its decision in two.

A round of the chunked rule (`chunked.py`, the reference beside this file) in PyTorch is about a hundred small
kernels: the masked softmax of the chunk's queries over their candidates, the column sums, the scores, two
rankings of two argsorts each and their gathers. On a GPU their number, not their work, sets the round's time
(0.85 ms per round and layer at the Qwen3-8B shape, replayed as a CUDA graph). Here:

- `round_evidence_fused`: one program per (batch row and KV head, query head of the group, tile of the chunk's
  queries) computes its queries' logits against every candidate twice, the online maximum and normaliser first,
  then the probabilities, their sum over the tile's queries per candidate (the evidence, [B, H, G, M]) and the
  attention output. Its floats are its own (the sums run in another order than `chunk_probs`'; 16-bit queries and
  keys meet on the tensor cores, the scale applied after, and the probabilities meet 16-bit values rounded to their
  dtype, as in flash attention), so against the reference it can differ only where two candidates' scores are
  within rounding of each other, and its output by the values' rounding.
- `chunk_decision_fused`: the decision of `chunked.chunk_decision` from the same scores, bit for bit, ties and empty
  candidates included. Both rankings order candidates by (rank, position, index), best first: the newer wins a
  tie of ranks, and only empty candidates (`-inf`, position -1) tie on both, where the lower index comes first
  (`chunked._order`'s two stable sorts). A candidate's place in that order is the number of candidates ahead of
  it, counted by comparing it with every other candidate: no sort, every place at once. The first launch ranks
  the pool (the pool's tokens and the chunk's, the same in every KV head), the second each head's static pool
  (its own tokens and the pool's losers). The losers enter the static ranking by index, not in the pool's order:
  that order breaks only ties of empty candidates, which are in index order either way.

Both executions of the rule call these through `chunked.round_evidence` and `chunked.decide_from_sums` (the
teacher-forced positions and the cache), so they see the same floats on one device. `available()` says whether a
tensor's device can run them (CUDA, or Triton's interpreter on the CPU, how the tests check them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.ops.triton_support import available as available
from kvpop.ops.triton_support import tl, triton

BLOCK_E = 32  # candidates a decision program places
BLOCK_C = 128  # candidates it compares them with at a time


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(int(n), 1) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _logits(q, k, scale, LOW: tl.constexpr):
        """The tile's logits in float32: 16-bit queries and keys on the tensor cores (exact products, float32 sums),
        scaled after; float32 ones (scaled before, as `chunk_probs` does) in float32 arithmetic, not TF32."""
        # one return after a static if/else: Triton's compiler also generates what follows a return inside a static
        # branch, so an early return would compile the float32 product with 16-bit queries
        if LOW:
            s = tl.dot(q, tl.trans(k)) * scale
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        return s

    @triton.jit
    def _evidence_kernel(q_ptr, k_ptr, v_ptr, held_ptr, cvalid_ptr, out_ptr, sums_ptr,
                         H, G, L, K, M, D, DV, n_tiles, scale, softcap,
                         HAS_SOFTCAP: tl.constexpr, LOW: tl.constexpr, HAS_V: tl.constexpr, BL: tl.constexpr,
                         BM: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
        bh = tl.program_id(0)  # b * H + h
        g = tl.program_id(1)
        lt = tl.program_id(2)
        b = bh // H
        h = bh % H
        qh = h * G + g
        rows = lt * BL + tl.arange(0, BL)
        row_in = rows < L
        row_valid = tl.load(cvalid_ptr + b * L + rows, mask=row_in, other=0) != 0
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        q_base = (b.to(tl.int64) * H * G + qh) * L * D
        q = tl.load(q_ptr + q_base + rows[:, None] * D + d[None, :], mask=row_in[:, None] & (d[None, :] < D),
                    other=0.0)
        if not LOW:
            q = q.to(tl.float32) * scale
        k_base = bh.to(tl.int64) * M * D
        v_base = bh.to(tl.int64) * M * DV
        m_i = tl.full([BL], float("-inf"), tl.float32)
        l_i = tl.zeros([BL], tl.float32)
        # pass 1: each query's maximum and normaliser over what it sees, online (while loops: Triton's
        # interpreter cannot `range` over a runtime scalar)
        m0 = 0
        while m0 < M:
            cols = m0 + tl.arange(0, BM)
            col_in = cols < M
            k = tl.load(k_ptr + k_base + cols[:, None] * D + d[None, :], mask=col_in[:, None] & (d[None, :] < D),
                        other=0.0)
            s = _logits(q, k, scale, LOW)
            if HAS_SOFTCAP:
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
            held = tl.load(held_ptr + bh.to(tl.int64) * K + cols, mask=col_in & (cols < K), other=0) != 0
            t = cols - K
            tok = tl.load(cvalid_ptr + b * L + t, mask=col_in & (cols >= K), other=0) != 0
            sees = row_valid[:, None] & ((held[None, :] & (cols[None, :] < K))
                                         | (tok[None, :] & (cols[None, :] >= K) & (t[None, :] <= rows[:, None])))
            s = tl.where(sees, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
            m0 += BM
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        # a padding query sees nothing: its probabilities are 0
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        acc = tl.zeros([BL, BDV], tl.float32)
        sums_base = ((bh.to(tl.int64) * G + g) * n_tiles + lt) * M
        # pass 2: the probabilities, their sum over the tile's queries per candidate, and the output
        m0 = 0
        while m0 < M:
            cols = m0 + tl.arange(0, BM)
            col_in = cols < M
            k = tl.load(k_ptr + k_base + cols[:, None] * D + d[None, :], mask=col_in[:, None] & (d[None, :] < D),
                        other=0.0)
            s = _logits(q, k, scale, LOW)
            if HAS_SOFTCAP:
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            held = tl.load(held_ptr + bh.to(tl.int64) * K + cols, mask=col_in & (cols < K), other=0) != 0
            t = cols - K
            tok = tl.load(cvalid_ptr + b * L + t, mask=col_in & (cols >= K), other=0) != 0
            sees = row_valid[:, None] & ((held[None, :] & (cols[None, :] < K))
                                         | (tok[None, :] & (cols[None, :] >= K) & (t[None, :] <= rows[:, None])))
            p = tl.where(sees, tl.exp(s - m_safe[:, None]) * inv[:, None], 0.0)
            tl.store(sums_ptr + sums_base + cols, tl.sum(p, axis=0), mask=col_in)
            if HAS_V:  # the decision alone (teacher-forced) reads no output
                v = tl.load(v_ptr + v_base + cols[:, None] * DV + dv[None, :],
                            mask=col_in[:, None] & (dv[None, :] < DV), other=0.0)
                if LOW:
                    acc += tl.dot(p.to(v.dtype), v)
                else:
                    acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m0 += BM
        if HAS_V:
            out_base = (b.to(tl.int64) * H * G + qh) * L * DV
            tl.store(out_ptr + out_base + rows[:, None] * DV + dv[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_in[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _ahead(r_e, p_e, c_e, rank_ptr, rank_base, pos_ptr, pos_base, taken_ptr, taken_base, lo, hi,
               UNTAKEN_ONLY: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr):
        """How many candidates in columns [lo, hi) rank ahead of each of the program's (ranks `r_e`, positions
        `p_e`, columns `c_e`): by (rank, position), best first, then the lower column; an empty candidate (position
        -1) ranks -inf. UNTAKEN_ONLY: only those the pool did not take (`taken` 0) count."""
        ahead = tl.zeros([BE], tl.int32)
        c0 = lo
        while c0 < hi:
            c = c0 + tl.arange(0, BC)
            c_in = c < hi
            p_c = tl.load(pos_ptr + pos_base + c, mask=c_in, other=-1)
            r_c = tl.load(rank_ptr + rank_base + c, mask=c_in, other=float("-inf"))
            r_c = tl.where(p_c >= 0, r_c, float("-inf"))
            if UNTAKEN_ONLY:
                c_in = c_in & (tl.load(taken_ptr + taken_base + c, mask=c_in, other=1) == 0)
            better = (r_c[None, :] > r_e[:, None]) | ((r_c[None, :] == r_e[:, None]) & (
                (p_c[None, :] > p_e[:, None]) | ((p_c[None, :] == p_e[:, None]) & (c[None, :] < c_e[:, None]))))
            ahead += tl.sum((better & c_in[None, :]).to(tl.int32), axis=1)
            c0 += BC
        return ahead

    @triton.jit
    def _pool_kernel(score_ptr, pos_ptr, keep_ptr, taken_ptr, H, M, S, POOL, BE: tl.constexpr, BC: tl.constexpr):
        """The pool's ranking of one batch row: its tokens and the chunk's (columns [S, M)), by the layer's score;
        the POOL best take the pool's slots in every head, in rank order, and are marked in `taken`."""
        b = tl.program_id(0)
        c_e = S + tl.program_id(1) * BE + tl.arange(0, BE)
        e_in = c_e < M
        score_base = b.to(tl.int64) * M
        pos_base = b.to(tl.int64) * H * M  # head 0's positions: the pool's tokens are the same in every head
        p_e = tl.load(pos_ptr + pos_base + c_e, mask=e_in, other=-1)
        r_e = tl.load(score_ptr + score_base + c_e, mask=e_in, other=float("-inf"))
        r_e = tl.where(p_e >= 0, r_e, float("-inf"))
        ahead = _ahead(r_e, p_e, c_e, score_ptr, score_base, pos_ptr, pos_base, taken_ptr, score_base, S, M,
                       False, BE, BC)
        kept = e_in & (ahead < POOL)
        tl.store(taken_ptr + score_base + c_e, kept.to(tl.int8), mask=e_in)
        h = 0
        while h < H:
            tl.store(keep_ptr + (b.to(tl.int64) * H + h) * (S + POOL) + S + ahead, c_e, mask=kept)
            h += 1

    @triton.jit
    def _static_kernel(prior_ptr, pos_ptr, taken_ptr, keep_ptr, evicted_ptr, H, M, S, POOL, L,
                       BE: tl.constexpr, BC: tl.constexpr):
        """One KV head's static ranking: its static slots (columns [0, S)) and what the pool did not take, by
        static priority; the S best take the static slots in rank order, the other L are evicted."""
        bh = tl.program_id(0)
        b = bh // H
        c_e = tl.program_id(1) * BE + tl.arange(0, BE)
        e_in = c_e < M
        base = bh.to(tl.int64) * M
        taken_base = b.to(tl.int64) * M
        p_e = tl.load(pos_ptr + base + c_e, mask=e_in, other=-1)
        r_e = tl.load(prior_ptr + base + c_e, mask=e_in, other=float("-inf"))
        r_e = tl.where(p_e >= 0, r_e, float("-inf"))
        mine = e_in & (tl.load(taken_ptr + taken_base + c_e, mask=e_in, other=1) == 0)
        ahead = _ahead(r_e, p_e, c_e, prior_ptr, base, pos_ptr, base, taken_ptr, taken_base, 0, M, True, BE, BC)
        tl.store(keep_ptr + bh.to(tl.int64) * (S + POOL) + ahead, c_e, mask=mine & (ahead < S))
        tl.store(evicted_ptr + bh.to(tl.int64) * L + (ahead - S), c_e, mask=mine & (ahead >= S))


def chunk_decision_fused(
    score: Tensor,  # [B, M]
    cand_pos: Tensor,  # [B, H, M]
    cand_prior: Tensor,  # [B, H, M]
    topk: int,
    pool: int,
) -> tuple[Tensor, Tensor]:
    """`chunked.chunk_decision` in two launches: the same (keep [B, H, K], evicted [B, H, L]), bit for bit."""
    B, H, M = cand_pos.shape
    K, S = topk, topk - pool
    L = M - K
    dev = cand_pos.device
    score = score.float().contiguous()
    pos = cand_pos.contiguous()
    prior = cand_prior.float().contiguous()
    keep = torch.empty(B, H, K, dtype=torch.long, device=dev)
    evicted = torch.empty(B, H, L, dtype=torch.long, device=dev)
    taken = torch.zeros(B, M, dtype=torch.int8, device=dev)
    if pool:
        _pool_kernel[(B, triton.cdiv(M - S, BLOCK_E))](score, pos, keep, taken, H, M, S, pool, BE=BLOCK_E,
                                                        BC=BLOCK_C)
    _static_kernel[(B * H, triton.cdiv(M, BLOCK_E))](prior, pos, taken, keep, evicted, H, M, S, pool, L,
                                                      BE=BLOCK_E, BC=BLOCK_C)
    return keep, evicted


def round_evidence_fused(
    query: Tensor,  # [B, Hq, L, D]
    cand_keys: Tensor,  # [B, H, M, D]
    cand_values: Tensor | None,  # [B, H, M, Dv]
    held: Tensor,  # [B, H, K] bool
    chunk_valid: Tensor,  # [B, L] bool
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor | None, Tensor]:
    """`chunked.round_evidence` in one launch: (the chunk's attention output [B, Hq, L, Dv] in the values' dtype, or
    None without values; each candidate's probability summed over the chunk's queries, float32 [B, H, G, M])."""
    B, Hq, L, D = query.shape
    H, M = cand_keys.shape[1], cand_keys.shape[2]
    G, K = Hq // H, held.shape[-1]
    has_v = cand_values is not None
    values = cand_values if has_v else cand_keys  # unread without values (HAS_V): a pointer of the right kind
    DV = values.shape[-1] if has_v else 1
    BD, BDV = _pow2(D), _pow2(DV)
    # small query tiles: at batch 1 the programs are (KV head, query head, tile), and a chunk of 64 tokens in tiles of
    # 16 gives an 8B-shape layer 128 of them
    BL = 16 if L <= 64 or max(BD, BDV) > 128 else 32
    BM = 32 if max(BD, BDV) > 128 else 64
    low = query.dtype in (torch.bfloat16, torch.float16) and cand_keys.dtype == query.dtype and \
        values.dtype == query.dtype
    n_tiles = triton.cdiv(L, BL)
    out = torch.empty(B, Hq, L, DV, dtype=values.dtype, device=query.device) if has_v else query.new_empty(0)
    sums = torch.empty(B, H, G, n_tiles, M, dtype=torch.float32, device=query.device)
    _evidence_kernel[(B * H, G, n_tiles)](
        query.contiguous(), cand_keys.contiguous(), values.contiguous(), held.to(torch.int8).contiguous(),
        chunk_valid.to(torch.int8).contiguous(), out, sums, H, G, L, K, M, D, DV, n_tiles, float(scale),
        float(softcap) if softcap is not None else 1.0, HAS_SOFTCAP=softcap is not None, LOW=low, HAS_V=has_v, BL=BL, BM=BM,
        BD=BD, BDV=BDV, num_warps=4)
    return (out if has_v else None), (sums[:, :, :, 0] if n_tiles == 1 else sums.sum(3))
