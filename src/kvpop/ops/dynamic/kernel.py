"""The dynamic policies' prefill walk as one Triton launch per layer: a program per (batch, KV head).

Same decisions as `walk.dynamic_walk_torch` (the reference of this kernel), for the scores "max"
(TOVA) and "sum" (H2O); "mean" (TOVA averaged over the layer's heads) couples the heads of a row and
stays on the torch walk. A program walks every position of its row: the slots' positions and
priorities live in registers, the slots' keys in a working copy in global memory (L2-resident: a few
MB per layer); per token it moves the token leaving the window (to the weakest long-range slot or
out), inserts the new token, and recomputes every slot's priority from the query's probabilities
(`tl.dot` in IEEE float32, a softmax over the occupied slots, then max or sum over the query heads).

Its floats are its own (the dot products and the softmax sum in another order than cuBLAS and
PyTorch), so it can differ from the torch walk where two priorities are within rounding of each
other; exact ties (equal keys, uniform attention) it resolves identically (newer token wins).
Triton is optional: `available()` says whether this path can run (CUDA, or Triton's interpreter on
the CPU with `TRITON_INTERPRET=1`, which is how the CPU tests check it).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton; the torch walk serves them
    triton = None

SCORES = {"max": 0, "sum": 1}
"""The scores this kernel implements, as its `SCORE` constant."""


def available(t: Tensor) -> bool:
    """Whether the kernel can run on `t`'s device: Triton on CUDA, or Triton's interpreter on CPU."""
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def dynamic_walk_fwd_kernel(
        q_ptr,  # [B, H, C, G, D] float32, scaled
        k_ptr,  # [B, H, C, D] float32, the chunk's keys
        ks_ptr,  # [B, H, N, D] float32, the slots' keys (a working copy, updated)
        pos_ptr,  # [B, H, N] int64, in and out
        pri_ptr,  # [B, H, N] float32, in and out
        position_ptr,  # [B, C] int64
        valid_ptr,  # [B, C] int8
        new_pri_ptr,  # [B, H, C] float32
        ev_ptr,  # [B, H, C] int64, out
        C, H, N, SINK, WINDOW, TOPK,
        G: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, SCORE: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_b = i_bh // H
        o_n = tl.arange(0, BN)
        o_d = tl.arange(0, D)
        o_g = tl.arange(0, BG)
        m_n = o_n < N
        m_g = o_g < G
        p_pos = pos_ptr + i_bh.to(tl.int64) * N + o_n
        p_pri = pri_ptr + i_bh.to(tl.int64) * N + o_n
        p_ks = ks_ptr + i_bh.to(tl.int64) * N * D
        b_pos = tl.load(p_pos, mask=m_n, other=-1)  # [BN]
        b_pri = tl.load(p_pri, mask=m_n, other=float("-inf"))  # [BN]
        top = m_n & (o_n >= SINK + WINDOW)  # [BN] the long-range slots
        j = 0
        # a while loop: Triton's interpreter cannot `range` over a runtime bound
        while j < C:
            p = tl.load(position_ptr + i_b.to(tl.int64) * C + j)
            real = tl.load(valid_ptr + i_b.to(tl.int64) * C + j) != 0
            slot = tl.where(p < SINK, tl.maximum(p, 0), SINK + tl.maximum(p - SINK, 0) % WINDOW)
            at = o_n == slot
            leave_pos = tl.sum(tl.where(at, b_pos, 0))
            leave_pri = tl.sum(tl.where(at, b_pri, 0.0))
            leaving = real & (p >= SINK + WINDOW)
            # the weakest long-range slot: lowest priority, then oldest, then first; empty slots (-inf, -1) first
            weakest_pri = tl.min(tl.where(top, b_pri, float("inf")))
            ties = top & (b_pri == weakest_pri)
            weakest_pos = tl.min(tl.where(ties, b_pos, 1 << 62))
            widx = tl.min(tl.where(ties & (b_pos == weakest_pos), o_n, BN))
            # the leaving token is newer than every long-range token: it wins ties; a -inf token never enters
            promote = leaving & (TOPK > 0) & (leave_pri >= weakest_pri) & (leave_pri > float("-inf"))
            gone = tl.where(promote, weakest_pos, leave_pos)
            tl.store(ev_ptr + i_bh.to(tl.int64) * C + j, tl.where(leaving, gone, -1))
            # move the leaving token's key to the weakest slot (before its own slot is overwritten)
            b_row = tl.load(p_ks + slot * D + o_d)  # [D]
            tl.debug_barrier()
            tl.store(p_ks + widx * D + o_d, b_row, mask=promote & (o_d < D))
            moved = promote & (o_n == widx)
            b_pos = tl.where(moved, leave_pos, b_pos)
            b_pri = tl.where(moved, leave_pri, b_pri)
            # the new token takes its sink or window-ring slot
            tl.debug_barrier()
            b_new = tl.load(k_ptr + (i_bh.to(tl.int64) * C + j) * D + o_d)
            tl.store(p_ks + slot * D + o_d, b_new, mask=real & (o_d < D))
            here = real & at
            b_pos = tl.where(here, p, b_pos)
            b_pri = tl.where(here, tl.load(new_pri_ptr + i_bh.to(tl.int64) * C + j), b_pri)
            tl.debug_barrier()
            # the query's probabilities over the occupied slots
            occupied = m_n & (b_pos >= 0)
            b_k = tl.load(p_ks + o_n[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)  # [BN, D]
            b_q = tl.load(q_ptr + ((i_bh.to(tl.int64) * C + j) * G + o_g[:, None]) * D + o_d[None, :],
                          mask=m_g[:, None], other=0.0)  # [BG, D]
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BG, BN]
            b_s = tl.where(occupied[None, :], b_s, float("-inf"))
            b_m = tl.max(b_s, axis=1)  # [BG]
            b_e = tl.exp(b_s - b_m[:, None])
            b_p = b_e / tl.sum(b_e, axis=1)[:, None]
            if SCORE == 0:
                b_new_pri = tl.max(tl.where(m_g[:, None], b_p, float("-inf")), axis=0)
            else:
                b_new_pri = b_pri + tl.sum(tl.where(m_g[:, None], b_p, 0.0), axis=0)
            b_pri = tl.where(real & occupied, b_new_pri, b_pri)
            j += 1
        tl.store(p_pos, b_pos, mask=m_n)
        tl.store(p_pri, b_pri, mask=m_n)


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
) -> tuple[Tensor, Tensor, Tensor]:
    """See `ops.dynamic.dynamic_walk` (scores "max" and "sum")."""
    if triton is None:
        raise RuntimeError("the Triton walk needs `triton` (pip install triton)")
    if score not in SCORES:
        raise ValueError(f"score={score!r}: the Triton walk implements {tuple(SCORES)}; use backend='torch'")
    B, Hq, C, D = query.shape
    H, N = key.shape[1], slot_pos.shape[-1]
    G = Hq // H
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D}: the Triton walk needs a power of two >= 16; use backend='torch'")
    q = (query.reshape(B, H, G, C, D).float() * scale).transpose(2, 3).contiguous()  # [B, H, C, G, D]
    ks = slot_keys.float().contiguous().clone()
    pos = slot_pos.to(torch.int64).contiguous().clone()
    pri = slot_pri.float().contiguous().clone()
    ev = torch.full((B, H, C), -1, dtype=torch.int64, device=key.device)
    if B * H * C == 0:
        return ev, pos, pri
    grid = (B * H,)
    dynamic_walk_fwd_kernel[grid](
        q, key.float().contiguous(), ks, pos, pri, position.to(torch.int64).contiguous(),
        valid.to(torch.int8).contiguous(), priority.float().contiguous(), ev,
        C, H, N, sink, window, topk,
        G=G, D=D, BG=max(16, triton.next_power_of_2(G)), BN=max(16, triton.next_power_of_2(N)),
        SCORE=SCORES[score],
    )
    return ev, pos, pri
