"""`sparse_block_mask`'s tables in two Triton launches, for the GPU (the torch form is `block_mask.py`).

The first launch reduces the per-block statistics of `tile_states` (and writes the mask_mod's folded
inputs, the queries' effective positions and the keys' `alive_until`); the second classifies the
tiles of one q-block row (or one kv-block column) per program and writes BlockMask's ordered
`(num_blocks, indices)` tables directly, for every query head of the KV head. The order is
`_ordered`'s, bit for bit: the present blocks in increasing index, then the absent ones in
increasing index - where the torch form pays a stable argsort per table.

Triton is optional: `available()` says whether this path can run (CUDA, or `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
from torch import Tensor

# `available` (re-exported) says whether these kernels can run; without Triton, `triton` and `tl` are None and
# the torch form serves them
from kvpop.ops.triton_support import available as available
from kvpop.ops.triton_support import tl, triton

_MIN = torch.iinfo(torch.int64).min
_MAX = torch.iinfo(torch.int64).max



if triton is not None:

    @triton.jit
    def _block_stats_kernel(q_pos_ptr, q_valid_ptr, k_pos_ptr, k_valid_ptr, evict_ptr,
                            q_eff_ptr, alive_ptr, q_lo_ptr, q_hi_ptr, q_all_ptr, k_lo_ptr, k_hi_ptr,
                            a_lo_ptr, a_hi_ptr, Q, N, Qb, Nb, Hkv, sink, window, bs, MIN, MAX,
                            BLOCK: tl.constexpr):
        # program (block i, batch b): statistics of q block i and of kv block i (each if it exists)
        i_blk, i_b = tl.program_id(0), tl.program_id(1)
        o = tl.arange(0, BLOCK)
        # the block's own entries; a ragged tail counts as padding, as `_block_reduce` pads it
        o_t = i_blk * bs + o
        m_blk = o < bs
        if i_blk < Qb:
            m_q = m_blk & (o_t < Q)
            p_q = i_b.to(tl.int64) * Q + o_t
            b_qp = tl.load(q_pos_ptr + p_q, mask=m_q, other=0)
            b_qv = m_q & (tl.load(q_valid_ptr + p_q, mask=m_q, other=0) != 0)
            tl.store(q_eff_ptr + p_q, tl.where(b_qv, b_qp, MIN), mask=m_q)
            p_s = i_b * Qb + i_blk
            tl.store(q_lo_ptr + p_s, tl.min(tl.where(b_qv, b_qp, MAX), axis=0))
            tl.store(q_hi_ptr + p_s, tl.max(tl.where(b_qv, b_qp, MIN), axis=0))
            tl.store(q_all_ptr + p_s, tl.min(tl.where(m_blk, b_qv.to(tl.int8), 1), axis=0))
        if i_blk < Nb:
            m_k = m_blk & (o_t < N)
            p_k = i_b.to(tl.int64) * N + o_t
            b_kp = tl.load(k_pos_ptr + p_k, mask=m_k, other=0)
            b_kv = m_k & (tl.load(k_valid_ptr + p_k, mask=m_k, other=0) != 0)
            p_s = i_b * Nb + i_blk
            tl.store(k_lo_ptr + p_s, tl.min(tl.where(b_kv, b_kp, MAX), axis=0))
            tl.store(k_hi_ptr + p_s, tl.max(tl.where(b_kv, b_kp, MIN), axis=0))
            h = 0
            # a while loop: Triton's interpreter cannot `range` over a runtime scalar
            while h < Hkv:
                p_e = (i_b * Hkv + h).to(tl.int64) * N + o_t
                b_ev = tl.load(evict_ptr + p_e, mask=m_k, other=0)
                # `alive_until`: a sink never leaves, another key at max(evict, pos + window)
                b_a = tl.where(b_kp < sink, MAX, tl.maximum(b_ev, b_kp + window))
                b_a = tl.where(b_kv, b_a, MIN)  # [BLOCK]
                tl.store(alive_ptr + p_e, b_a, mask=m_k)
                p_a = (i_b * Hkv + h) * Nb + i_blk
                # lanes past `bs` (BLOCK is a power of two) are no part of the block; its ragged tail is
                tl.store(a_lo_ptr + p_a, tl.min(tl.where(m_blk, b_a, MAX), axis=0))
                tl.store(a_hi_ptr + p_a, tl.max(b_a, axis=0))
                h += 1

    @triton.jit
    def _ordered_store(present, o, n_valid, num_ptr, idx_ptr, G, head_stride, idx_stride):
        # `_ordered`: present blocks first in increasing index, then the absent ones in increasing index
        b_p = present.to(tl.int32)
        incl = tl.cumsum(b_p, axis=0)
        num = tl.sum(b_p, axis=0)
        dest = tl.where(present, incl - 1, num + o - incl)
        # flex indexes the block mask by query head: the G query heads of a KV head get copies
        g = 0
        while g < G:
            tl.store(num_ptr + g * head_stride, num)
            tl.store(idx_ptr + g * idx_stride + dest, o, mask=o < n_valid)
            g += 1

    @triton.jit
    def _state(q_lo, q_hi, q_all, k_lo, k_hi, a_lo, a_hi):
        # `tile_states`, term for term: EMPTY 0, PARTIAL 1, FULL 2
        nonempty = (k_lo <= q_hi) & (a_hi > q_lo)
        full = q_all & (k_hi <= q_lo) & (q_hi < a_lo)
        return nonempty.to(tl.int32) + full.to(tl.int32)

    @triton.jit
    def _block_tables_kernel(q_lo_ptr, q_hi_ptr, q_all_ptr, k_lo_ptr, k_hi_ptr, a_lo_ptr, a_hi_ptr,
                             kv_num_ptr, kv_idx_ptr, fkv_num_ptr, fkv_idx_ptr,
                             q_num_ptr, q_idx_ptr, fq_num_ptr, fq_idx_ptr,
                             Qb, Nb, Hkv, G, BLOCK: tl.constexpr):
        # program (line, b * Hkv + h): line < Qb is the kv-side row of q block `line`, the rest the
        # q-side column of kv block `line - Qb`; both write their tables for the G query heads of h
        i_l, i_bh = tl.program_id(0), tl.program_id(1)
        i_b = i_bh // Hkv
        o = tl.arange(0, BLOCK)
        hq0 = (i_bh * G).to(tl.int64)  # b * Hq + h * G: the first query head of this KV head
        if i_l < Qb:
            m = o < Nb
            state = _state(
                tl.load(q_lo_ptr + i_b * Qb + i_l), tl.load(q_hi_ptr + i_b * Qb + i_l),
                tl.load(q_all_ptr + i_b * Qb + i_l) != 0,
                tl.load(k_lo_ptr + i_b * Nb + o, mask=m, other=0), tl.load(k_hi_ptr + i_b * Nb + o, mask=m, other=0),
                tl.load(a_lo_ptr + i_bh * Nb + o, mask=m, other=0), tl.load(a_hi_ptr + i_bh * Nb + o, mask=m, other=0),
            )  # [BLOCK]
            p_num = hq0 * Qb + i_l
            p_idx = p_num * Nb
            _ordered_store(m & (state == 1), o, Nb, kv_num_ptr + p_num, kv_idx_ptr + p_idx, G, Qb, Qb * Nb)
            _ordered_store(m & (state == 2), o, Nb, fkv_num_ptr + p_num, fkv_idx_ptr + p_idx, G, Qb, Qb * Nb)
        else:
            j = i_l - Qb
            m = o < Qb
            state = _state(
                tl.load(q_lo_ptr + i_b * Qb + o, mask=m, other=0), tl.load(q_hi_ptr + i_b * Qb + o, mask=m, other=0),
                tl.load(q_all_ptr + i_b * Qb + o, mask=m, other=0) != 0,
                tl.load(k_lo_ptr + i_b * Nb + j), tl.load(k_hi_ptr + i_b * Nb + j),
                tl.load(a_lo_ptr + i_bh * Nb + j), tl.load(a_hi_ptr + i_bh * Nb + j),
            )  # [BLOCK]
            p_num = hq0 * Nb + j
            p_idx = p_num * Qb
            _ordered_store(m & (state == 1), o, Qb, q_num_ptr + p_num, q_idx_ptr + p_idx, G, Nb, Nb * Qb)
            _ordered_store(m & (state == 2), o, Qb, fq_num_ptr + p_num, fq_idx_ptr + p_idx, G, Nb, Nb * Qb)


def block_tables(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    group: int,
    block_size: int,
) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
    """`block_mask._tables` in two launches, plus the mask_mod's inputs.

    Args:
        q_pos: int64 [B, Q]; q_valid: bool [B, Q]; k_pos: int64 [B, N]; k_valid: bool [B, N].
        evict: int64 [B, Hkv, N], eviction positions (`NEVER` if never).
        group: query heads per KV head.
    Returns:
        the eight tables (kv-side partial num/indices, full num/indices, then the q-side ones), each
        int32 [B, Hkv * group, rows(, cols)]; q_eff int64 [B, Q] (padding queries at the int64 minimum)
        and `alive_until` int64 [B, Hkv, N].
    """
    if triton is None:
        raise RuntimeError("the Triton block-mask kernels need `triton` (pip install triton)")
    B, Hkv, N = evict.shape
    Q = q_pos.shape[-1]
    if block_size < 1 or group < 1:
        raise ValueError(f"block_size={block_size} and group={group} must be >= 1")
    if B * Hkv * Q * N == 0:
        raise ValueError(f"empty block mask: B={B}, Hkv={Hkv}, Q={Q}, N={N}")
    dev = evict.device
    q_pos = q_pos.to(torch.int64).expand(B, Q).contiguous()
    q_valid = q_valid.to(torch.int8).expand(B, Q).contiguous()
    k_pos = k_pos.to(torch.int64).expand(B, N).contiguous()
    k_valid = k_valid.to(torch.int8).expand(B, N).contiguous()
    evict = evict.to(torch.int64).contiguous()
    Qb, Nb = triton.cdiv(Q, block_size), triton.cdiv(N, block_size)
    i64 = dict(dtype=torch.int64, device=dev)
    q_eff, alive = torch.empty(B, Q, **i64), torch.empty(B, Hkv, N, **i64)
    q_lo, q_hi, q_all = torch.empty(B, Qb, **i64), torch.empty(B, Qb, **i64), torch.empty(B, Qb, dtype=torch.int8, device=dev)
    k_lo, k_hi = torch.empty(B, Nb, **i64), torch.empty(B, Nb, **i64)
    a_lo, a_hi = torch.empty(B, Hkv, Nb, **i64), torch.empty(B, Hkv, Nb, **i64)
    _block_stats_kernel[(max(Qb, Nb), B)](
        q_pos, q_valid, k_pos, k_valid, evict, q_eff, alive, q_lo, q_hi, q_all, k_lo, k_hi, a_lo, a_hi,
        Q, N, Qb, Nb, Hkv, sink, window, block_size, _MIN, _MAX, BLOCK=triton.next_power_of_2(block_size),
    )
    Hq = Hkv * group
    i32 = dict(dtype=torch.int32, device=dev)
    kv_num, fkv_num = torch.empty(B, Hq, Qb, **i32), torch.empty(B, Hq, Qb, **i32)
    kv_idx, fkv_idx = torch.empty(B, Hq, Qb, Nb, **i32), torch.empty(B, Hq, Qb, Nb, **i32)
    q_num, fq_num = torch.empty(B, Hq, Nb, **i32), torch.empty(B, Hq, Nb, **i32)
    q_idx, fq_idx = torch.empty(B, Hq, Nb, Qb, **i32), torch.empty(B, Hq, Nb, Qb, **i32)
    _block_tables_kernel[(Qb + Nb, B * Hkv)](
        q_lo, q_hi, q_all, k_lo, k_hi, a_lo, a_hi, kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx,
        Qb, Nb, Hkv, group, BLOCK=triton.next_power_of_2(max(Qb, Nb)),
    )
    return (kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx), q_eff, alive
