"""Running top-k in O(S log S), vectorised over batch, heads *and* the sequence.

The paper walks the queries one by one with a Fenwick tree; on a CPU that is a Python loop of `S`
steps. Here the same answers come from "k-th smallest value in a prefix" queries on a wavelet
matrix, answered for every prefix at once with `log S` gathers (derivation: `README.md` beside
this file). Everything stays on the device, with static shapes and no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NEVER = torch.iinfo(torch.int64).max
"""Eviction position of a token that is never evicted."""


def prefix_kth_smallest(values: Tensor, ends: Tensor, k: int | Tensor, bits: int) -> Tensor:
    """The `k`-th smallest of `values[n, :ends[n, j]]` for every row `n` and query `j`.

    Args:
        values: int64 [N, L], each in `[0, 2**bits)`.
        ends: int64 [N, Q], each in `[0, L]`: the prefix length of each query.
        k: >= 1, the order statistic (1 = smallest): an int, or an int64 0-dim tensor on `values`' device
            (left unchecked, which would sync with the host), as the compiled `train.loss.boundary_labels`
            passes it so that a new `k` does not recompile.
        bits: number of bits of the largest value.
    Returns:
        int64 [N, Q]; -1 where the prefix holds fewer than `k` values.
    """
    if isinstance(k, int) and k < 1:
        raise ValueError(f"k={k} must be >= 1")
    N, L = values.shape
    arange = torch.arange(L, device=values.device)
    levels = []
    cur = values
    # build: per bit (most significant first) a prefix count of zeros, then a stable partition
    for b in reversed(range(bits)):
        bit = (cur >> b) & 1
        zeros_before = F.pad(torch.cumsum(1 - bit, dim=-1), (1, 0))  # [N, L + 1]
        n_zero = zeros_before[:, -1:]
        dest = torch.where(bit == 0, zeros_before[:, :-1], n_zero + arange - zeros_before[:, :-1])
        cur = torch.empty_like(cur).scatter_(1, dest, cur)
        levels.append(zeros_before)

    # query: descend one level per bit, narrowing [lo, hi) to the side that holds the k-th value
    lo = torch.zeros_like(ends)
    hi = ends.clone()
    kk = torch.full_like(ends, k - 1) if isinstance(k, int) else (k - 1).expand_as(ends)
    result = torch.zeros_like(ends)
    for zeros_before, b in zip(levels, reversed(range(bits))):
        n_zero = zeros_before[:, -1:]
        z_lo = zeros_before.gather(1, lo)
        z_hi = zeros_before.gather(1, hi)
        nz = z_hi - z_lo
        go_zero = kk < nz
        result = result | ((~go_zero).long() << b)
        lo = torch.where(go_zero, z_lo, n_zero + lo - z_lo)
        hi = torch.where(go_zero, z_hi, n_zero + hi - z_hi)
        kk = torch.where(go_zero, kk, kk - nz)
    return torch.where(ends >= k, result, -1)


def _rank_order(priority: Tensor, position: Tensor, eligible: Tensor) -> Tensor:
    """Token indices sorted best first: higher priority, ties to the newer (larger) position.

    Non-eligible tokens are given `-inf`; where they interleave with eligible `-inf` tokens does not
    matter to the callers, which never count them.
    """
    by_pos = torch.argsort(position, dim=-1, descending=True, stable=True)
    pri = torch.where(eligible, priority, float("-inf")).gather(-1, by_pos)
    by_pri = torch.argsort(pri, dim=-1, descending=True, stable=True)
    return by_pos.gather(-1, by_pri)


def eviction_positions(
    priority: Tensor,  # [B, H, N]
    position: Tensor,  # [B, H, N] or broadcastable
    valid: Tensor,  # [B, H, N] or broadcastable
    sink: int,
    window: int,
    topk: int,
    ordered: bool = False,
    backend: str = "auto",
) -> Tensor:
    """Position of the first query at which each token is out of the cache (`NEVER` if it never is).

    Works on any set of tokens with distinct positions per (b, h) row - a whole sequence, or the
    cache's slots plus a new chunk - so that training, prefill and decoding share one rule. A token
    `t` with `position >= sink` leaves the protected window at query `pos_t + window`; it is then
    evicted once `topk` eligible tokens outrank it, i.e. at `pos_u + window` where `u` is the
    `topk`-th oldest token that beats it. A token of priority `-inf` never takes a long-range slot: it
    is evicted as it leaves the window (DMS's "evict" decision), and it displaces nobody.

    Args:
        priority: float32 [B, H, N], static priorities.
        position: int64 [B, H, N], positions within the sequence (distinct among valid tokens).
        valid: bool [B, H, N], False for padding and empty slots (their result is meaningless).
        sink, window, topk: the budget split of `docs/method.md` Sec. 1.
        ordered: the valid tokens are stored in increasing position order (a teacher-forced
            sequence, padding anywhere). The Triton kernels (`kernel.py`) need that order: without
            it they run on a copy of each row sorted by position (one sort, three gathers, a scatter).
        backend: "auto" (the two-level Triton kernel on CUDA, else the wavelet matrix), "wavelet",
            "triton" (the two-level kernel, `kernel.evictions_ordered`), "triton_unfused" (the same kernel
            with its masks, sort key and epilogue as separate PyTorch operations: the
            fusion's same-run baseline) or "triton_scan" (the one-level tile-scan kernel, `kernel.kth_beater`,
            kept for comparison); the Triton ones also run on CPU under `TRITON_INTERPRET=1`.
    Returns:
        int64 [B, H, N]; sinks and invalid tokens get `NEVER`.
    """
    B, H, N = priority.shape
    position = position.expand(B, H, N)
    valid = valid.expand(B, H, N)
    kernel = _use_kernel(priority, backend) and topk > 0
    if kernel and backend not in ("triton_scan", "triton_unfused"):
        # the two-level kernel with its small operations fused (`kernel.evictions_ordered`): the cutoffs and a
        # prefill in `generate` run eagerly on CUDA, bound by the host's launches
        from kvpop.ops.topk.kernel import evictions_ordered

        if ordered:
            return evictions_ordered(priority, position, valid, sink, window, topk, NEVER)
        # a cache's slots plus a chunk: the kernel on each row sorted by position, ranked tokens first (the kernel
        # reads the others' own positions only, wherever they sit), the answers scattered back
        ranked = valid & (position >= sink) & (priority > float("-inf"))
        by_pos = torch.argsort(torch.where(ranked, position, NEVER), dim=-1, stable=True)
        return torch.empty_like(by_pos).scatter_(-1, by_pos, evictions_ordered(
            priority.gather(-1, by_pos), position.gather(-1, by_pos), valid.gather(-1, by_pos), sink, window, topk,
            NEVER))
    eligible = valid & (position >= sink)
    # -inf tokens beat nobody, so leaving them out of the ranking changes no other token's eviction
    ranked = eligible & (priority > float("-inf"))
    if topk == 0:
        return torch.where(eligible, position + window, NEVER)
    if kernel:
        # the kernels as separate launches: the earlier tile scan ("triton_scan"), or the two-level kernel unfused
        tiled = backend == "triton_unfused"
        if ordered:
            evict = _eviction_ordered_unfused(priority, position, ranked, window, topk, tiled)
        else:
            by_pos = torch.argsort(torch.where(ranked, position, NEVER), dim=-1, stable=True)
            evict = torch.empty_like(by_pos).scatter_(-1, by_pos, _eviction_ordered_unfused(
                priority.gather(-1, by_pos), position.gather(-1, by_pos), ranked.gather(-1, by_pos), window, topk,
                tiled))
        return torch.where(eligible & ~ranked, position + window, evict)

    pri = priority.reshape(B * H, N)
    pos = position.reshape(B * H, N)
    elig = ranked.reshape(B * H, N)
    # index of each token in position order, so that wavelet values stay below N whatever the positions
    by_pos = torch.argsort(torch.where(elig, pos, NEVER), dim=-1, stable=True)
    pos_sorted = pos.gather(-1, by_pos)
    pos_index = torch.empty_like(by_pos).scatter_(-1, by_pos, torch.arange(N, device=pri.device).expand(B * H, N))

    order = _rank_order(pri, pos, elig)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=pri.device).expand(B * H, N))
    # walking the tokens best first, value = position index of each (N for tokens that never count)
    values = torch.where(elig, pos_index, N).gather(-1, order)
    kth = prefix_kth_smallest(values, rank, topk, bits=N.bit_length())
    found = (kth >= 0) & (kth < N)
    kth_pos = pos_sorted.gather(-1, kth.clamp(0, N - 1))
    evict = torch.where(found, torch.maximum(pos, kth_pos) + window, NEVER)
    evict = torch.where(elig, evict, NEVER).reshape(B, H, N)
    return torch.where(eligible & ~ranked, position + window, evict)


def _use_kernel(priority: Tensor, backend: str) -> bool:
    from kvpop.ops.topk import kernel

    if backend == "auto":
        return priority.is_cuda and kernel.available(priority)
    if backend == "wavelet":
        return False
    if backend not in ("triton", "triton_unfused", "triton_scan"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'wavelet', 'triton', 'triton_unfused' or 'triton_scan'")
    if not kernel.available(priority):
        raise RuntimeError(f"the Triton top-k kernel cannot run on {priority.device} here: it needs `triton` and "
                           "CUDA, or TRITON_INTERPRET=1 on the CPU")
    return True


def _eviction_ordered_unfused(priority: Tensor, position: Tensor, ranked: Tensor, window: int, topk: int,
                              tiled: bool) -> Tensor:
    """`eviction_positions` for tokens in position order: one sort, the tile-scan kernel (`kernel.kth_beater`) or
    (`tiled`) the two-level one (`kernel.kth_beater_tiled`), and the small operations around it one by one."""
    from kvpop.ops.topk.kernel import kth_beater, kth_beater_tiled

    B, H, N = priority.shape
    ranked = ranked.reshape(B * H, N)
    # best first, ties to the newer token: a stable descending sort of the row read back to front
    key = torch.where(ranked, priority.reshape(B * H, N).float(), float("-inf")).flip(-1)
    order = (N - 1) - torch.argsort(key, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=priority.device).expand(B * H, N))
    kth = kth_beater_tiled(rank, ranked, topk, order=order) if tiled else kth_beater(rank, ranked, topk)
    kth = kth.long()  # [B * H, N], -1 if fewer than k outrank the token
    pos = position.reshape(B * H, N)
    kth_pos = pos.gather(-1, kth.clamp(min=0))
    evict = torch.where((kth >= 0) & ranked, torch.maximum(pos, kth_pos) + window, NEVER)
    return evict.reshape(B, H, N)


def boundary_tokens(priority: Tensor, sink: int, window: int, topk: int | Tensor) -> Tensor:
    """For each query `q`, the weakest token of the top-k of `E(q - 1)` (`docs/method.md` Sec. 5's `t_bnd`).

    Args:
        priority: float32 [B, H, S] over a whole sequence (positions `0 .. S-1`).
        sink, window, topk: the budget split; `topk` an int, or an int64 0-dim tensor >= 1 on `priority`'s
            device (unchecked: see `prefix_kth_smallest`).
    Returns:
        int64 [B, H, S]; -1 where `q < sink + window + topk` (no boundary yet) or `topk == 0`.
    """
    B, H, S = priority.shape
    if S <= sink or (isinstance(topk, int) and topk == 0):
        return torch.full((B, H, S), -1, dtype=torch.long, device=priority.device)
    pos = torch.arange(S, device=priority.device).expand(B * H, S)
    elig = pos >= sink
    order = _rank_order(priority.reshape(B * H, S), pos, elig)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=priority.device).expand(B * H, S))
    # E(q - 1) = positions [sink, q - 1 - window]: a prefix of length q - window - sink of rank[:, sink:]
    q = torch.arange(S, device=priority.device)
    ends = (q - window - sink).clamp(0, S - sink).expand(B * H, S).contiguous()
    kth = prefix_kth_smallest(rank[:, sink:], ends, topk, bits=S.bit_length())
    tokens = order.gather(-1, kth.clamp(min=0))
    live = (kth >= 0) & (q >= sink + window + topk)
    return torch.where(live, tokens, -1).reshape(B, H, S)
