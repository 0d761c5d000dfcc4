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
`write_slots` picks: the kernel on CUDA, where `generate`'s eager prefill is bound by its launches (twenty-first
and twenty-second sessions, docs/RESULTS.md), the reference elsewhere. Both write the same bytes: each slot's
fields are copied from one candidate or filled.
"""

from __future__ import annotations

import torch
from torch import Tensor

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


__all__ = ["retained_slot", "write_slots", "write_slots_kernel", "write_slots_reference"]
