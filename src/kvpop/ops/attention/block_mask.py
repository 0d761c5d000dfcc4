"""FlexAttention block masks for the retention rule, built at block granularity from positions.

`create_block_mask` evaluates the mask on all `Q x N` points (90-150 ms at 16k with 32 query heads
on an H200, against 5-7 ms for the attention itself); this builder took 0.9-1.5 ms there. The tile structure is known without that: each key `t` is
visible to query `q` exactly on an interval of query positions, `pos_t <= pos_q < alive_t`, so a
`(q block, kv block)` tile is empty or full by comparing a few per-block minima and maxima
(derivation: `README.md` beside this file). The builder works on `[Q / block, N / block]` tensors
only, stays on the device and needs no host sync. On CUDA its tables come from two Triton launches
(`block_mask_kernel.py`: the per-block statistics, then the eight ordered tables written directly),
bit for bit the torch form's (`tile_states` and a stable argsort per table, `backend="torch"`). The
1.06 ms above is the torch form's; the kernels took 0.18 ms (the torch form 1.21 ms in the same H200
run). `block_mask_reference` builds the same mask the slow way, for tests.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from kvpop.ops.topk.predicate import mask_from_eviction

_MIN = torch.iinfo(torch.int64).min
_MAX = torch.iinfo(torch.int64).max

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile states of `tile_states`: skipped, computed with `mask_mod`, computed without it."""


def alive_until(
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
) -> Tensor:
    """First query position at which each key is no longer visible; keys are visible on `[pos_t, alive_t)`.

    The rule's three cases fold into one bound: a sink never leaves (`NEVER`), any other key stays
    while it is in the window (`pos_q < pos_t + window`) or not yet evicted (`pos_q < evict_t`).

    Args:
        k_pos: int64 [B, N], key positions.
        k_valid: bool [B, N], False for padding.
        evict: int64 [B, Hkv, N], eviction positions (`NEVER` if never).
    Returns:
        int64 [B, Hkv, N]; the int64 minimum for invalid keys (visible to no query).
    """
    kp = k_pos[:, None, :]
    alive = torch.where(kp < sink, _MAX, torch.maximum(evict, kp + window))
    return torch.where(k_valid[:, None, :], alive, _MIN)


def retention_mask_mod(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    group: int,
):
    """A FlexAttention `mask_mod` for the rule, with the predicate folded into two comparisons.

    Query head `h` reads KV head `h // group`. Invalid queries get the int64 minimum as position
    (no key is at or before it), invalid keys an empty visibility interval, so the kernel loads
    three values per point instead of five.
    """
    q_eff = torch.where(q_valid, q_pos, _MIN)  # [B, Q]
    alive = alive_until(k_pos, k_valid, evict, sink, window)  # [B, Hkv, N]
    return _folded_mask_mod(q_eff, k_pos, alive, group)


def _folded_mask_mod(q_eff: Tensor, k_pos: Tensor, alive: Tensor, group: int):
    """`retention_mask_mod` from its folded inputs (q_eff [B, Q], k_pos [B, N], alive [B, Hkv, N])."""

    def mask_mod(b, h, q_idx, kv_idx):
        qp = q_eff[b, q_idx]
        return (k_pos[b, kv_idx] <= qp) & (qp < alive[b, h // group, kv_idx])

    return mask_mod


def _block_reduce(x: Tensor, block: int, fill: int, reduce: str) -> Tensor:
    """`amin`/`amax` of the last dim over blocks of `block` entries, padding the tail with `fill`."""
    pad = -x.shape[-1] % block
    if pad:
        # not F.pad: its float fill value would round the int64 extremes
        x = torch.cat([x, x.new_full((*x.shape[:-1], pad), fill)], dim=-1)
    x = x.reshape(*x.shape[:-1], -1, block)
    return x.amin(-1) if reduce == "min" else x.amax(-1)


def tile_states(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    block_size: int = 128,
) -> Tensor:
    """Classify every `(q block, kv block)` tile as `EMPTY`, `PARTIAL` or `FULL`, per KV head.

    Sound for any positions and padding: an `EMPTY` tile holds no visible pair and a `FULL` tile
    only visible pairs (ragged edge tiles are never `FULL`). For contiguous positions the empty set
    is exact below the diagonal: a tile there is empty iff all its keys are gone by the first query.

    Returns:
        int8 [B, Hkv, ceil(Q / block), ceil(N / block)].
    """
    bs = block_size
    # per q block: range of the valid query positions; an all-padding block gets an empty range
    q_lo = _block_reduce(torch.where(q_valid, q_pos, _MAX), bs, _MAX, "min")  # [B, Qb]
    q_hi = _block_reduce(torch.where(q_valid, q_pos, _MIN), bs, _MIN, "max")  # [B, Qb]
    q_all = _block_reduce(q_valid.to(torch.int8), bs, 0, "min").bool()  # [B, Qb]
    # per kv block: range of the valid key positions and of their visibility ends
    k_lo = _block_reduce(torch.where(k_valid, k_pos, _MAX), bs, _MAX, "min")  # [B, Nb]
    k_hi = _block_reduce(torch.where(k_valid, k_pos, _MIN), bs, _MIN, "max")  # [B, Nb]
    alive = alive_until(k_pos, k_valid, evict, sink, window)  # [B, Hkv, N]
    # invalid and padded keys have alive = int64 min: they make a block's a_lo minimal (never full)
    a_lo = _block_reduce(alive, bs, _MIN, "min")  # [B, Hkv, Nb]
    a_hi = _block_reduce(alive, bs, _MIN, "max")  # [B, Hkv, Nb]

    q_lo, q_hi, q_all = q_lo[:, None, :, None], q_hi[:, None, :, None], q_all[:, None, :, None]
    k_lo, k_hi = k_lo[:, None, None, :], k_hi[:, None, None, :]
    a_lo, a_hi = a_lo[:, :, None, :], a_hi[:, :, None, :]
    # some key at or before the last query, and some key still alive at the first query
    nonempty = (k_lo <= q_hi) & (a_hi > q_lo)  # [B, Hkv, Qb, Nb]
    # every key at or before the first query, and every key alive past the last query
    full = q_all & (k_hi <= q_lo) & (q_hi < a_lo)  # [B, Hkv, Qb, Nb]
    return nonempty.to(torch.int8) + full.to(torch.int8)


def _ordered(tiles: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """BlockMask's (num_blocks, indices) form of bool [B, Hkv, R, C] tiles, repeated to the query heads."""
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    # flex indexes the block mask by query head; the KV head's rows serve its `group` query heads
    return num.repeat_interleave(group, dim=1), idx.repeat_interleave(group, dim=1)


def _tables(q_pos, q_valid, k_pos, k_valid, evict, sink, window, group, block_size) -> tuple[Tensor, ...]:
    """The eight (num_blocks, indices) tables of a BlockMask: partial and full, kv-side and q-side."""
    states = tile_states(q_pos, q_valid, k_pos, k_valid, evict, sink, window, block_size)
    partial, full = states == PARTIAL, states == FULL  # [B, Hkv, Qb, Nb]
    return (
        *_ordered(partial, group),
        *_ordered(full, group),
        *_ordered(partial.transpose(-2, -1), group),
        *_ordered(full.transpose(-2, -1), group),
    )


def sparse_block_mask(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    num_q_heads: int,
    block_size: int = 128,
    backend: str = "auto",
) -> BlockMask:
    """The FlexAttention `BlockMask` of the retention rule, without evaluating the `Q x N` points.

    One mask serves all heads of a layer call: tiles are classified and ordered per KV head and
    repeated to the `num_q_heads` query heads (query head `h` reads KV head `h // G`). The
    transposed (q-side) tables that the backward pass reads are ordered here too, from the same
    tiles, rather than left to `BlockMask.from_kv_blocks` (which rebuilds them from the indices,
    2.2 ms of the 3.7 ms this took at 16k on an H200).

    Args:
        q_pos: int64 [B, Q], query positions; q_valid: bool [B, Q].
        k_pos: int64 [B, N], key positions; k_valid: bool [B, N].
        evict: int64 [B, Hkv, N], eviction positions of the keys (`NEVER` if never).
        sink, window: the budget split of `docs/method.md` Sec. 1.
        num_q_heads: `Hq`, a multiple of `Hkv`.
        backend: "auto" (the Triton kernels on CUDA, else torch), "torch" (`tile_states` and a
            stable argsort per table), or "triton" (`block_mask_kernel.py`: the statistics in one
            launch, the eight ordered tables in a second; also on CPU under `TRITON_INTERPRET=1`).
            Both give the same tables, bit for bit.
    Returns:
        BlockMask of shape [B, Hq, Q, N] with `retention_mask_mod` deciding partial tiles.
    """
    B, Hkv, N = evict.shape
    Q = q_pos.shape[-1]
    if num_q_heads % Hkv:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of the {Hkv} KV heads")
    G = num_q_heads // Hkv
    if _use_kernel(evict, backend):
        from kvpop.ops.attention.block_mask_kernel import block_tables

        tables, q_eff, alive = block_tables(q_pos, q_valid, k_pos, k_valid, evict, sink, window, G, block_size)
        mask_mod = _folded_mask_mod(q_eff, k_pos, alive, G)
    else:
        tables = _tables(q_pos, q_valid, k_pos, k_valid, evict, sink, window, G, block_size)
        mask_mod = retention_mask_mod(q_pos, q_valid, k_pos, k_valid, evict, sink, window, G)
    kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx = tables
    return BlockMask(
        seq_lengths=(Q, N),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
    )


def _use_kernel(evict: Tensor, backend: str) -> bool:
    from kvpop.ops.attention import block_mask_kernel

    if backend == "auto":
        return evict.is_cuda and block_mask_kernel.available(evict)
    if backend == "torch":
        return False
    if backend != "triton":
        raise ValueError(f"backend={backend!r} must be 'auto', 'torch' or 'triton'")
    if not block_mask_kernel.available(evict):
        raise RuntimeError(f"the Triton block-mask kernels cannot run on {evict.device} here: they need `triton` and "
                           "CUDA, or TRITON_INTERPRET=1 on the CPU")
    return True


def block_mask_reference(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    num_q_heads: int,
    block_size: int = 128,
) -> BlockMask:
    """`sparse_block_mask` the slow way: `create_block_mask` over every point of the predicate itself.

    Same arguments and result shape as `sparse_block_mask`; its tiles are exact (a tile is full iff
    every point is visible, partial iff some is). For tests only: it costs `O(Q * N)` per head.
    """
    Hkv = evict.shape[1]
    G = num_q_heads // Hkv
    dense = mask_from_eviction(q_pos, q_valid, k_pos[:, None], k_valid[:, None], evict, sink, window)

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, h // G, q_idx, kv_idx]

    B, Q, N = q_pos.shape[0], q_pos.shape[-1], k_pos.shape[-1]
    return create_block_mask(mask_mod, B, num_q_heads, Q, N, device=q_pos.device, BLOCK_SIZE=block_size)


__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "alive_until",
    "block_mask_reference",
    "retention_mask_mod",
    "sparse_block_mask",
    "tile_states",
]
