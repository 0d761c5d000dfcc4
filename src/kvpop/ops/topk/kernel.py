"""The running top-k as a Triton kernel: the `k`-th oldest token that outranks each token, on the GPU.

Same answer as `wavelet.eviction_positions` for a teacher-forced sequence (tokens stored in
position order), by a different parallel formulation (derivation in `README.md` beside this file):

    e[t] = max(pos_t, P_k(t)) + w,   P_k(t) = position of the k-th oldest token u with rank_u < rank_t

One program owns a block of `BLOCK_T` tokens of one (batch, KV head) row and walks the row's tokens
oldest first in tiles of `BLOCK_U`, counting for each of its tokens how many outrank it; the tile in
which a token's count reaches `k` gives `P_k(t)` by an in-tile prefix sum. A program stops as soon
as every token of its block has found its `k`-th outranking token. Work is O(S^2 / 2) comparisons
per row in the worst case (a high-priority token is never evicted and scans the whole row), but
they are integer compares in registers, parallel over batch, heads *and* token blocks - where the
paper's Fenwick walk is a chain of S dependent steps per row, and the wavelet form is ~log S
rounds of small launches each.

Triton is optional: `available()` says whether this path can run. With `TRITON_INTERPRET=1` it
runs on CPU tensors (slowly), which is how the CPU test suite checks it against the reference.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs have no Triton; the wavelet form serves them
    triton = None

BLOCK_T = 32
BLOCK_U = 128
_FAR = 1 << 30  # larger than any token index


def available(t: Tensor) -> bool:
    """Whether the kernel can run on `t`'s device: Triton on CUDA, or Triton's interpreter on CPU."""
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


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
