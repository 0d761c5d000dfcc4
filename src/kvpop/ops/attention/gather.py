"""Sparse attention over each query tile's gathered keys: the tile work of the rule's attention cut to its keys.

The training path's FlexAttention runs on the sequence's own layout, where the kept tokens are spread over the whole
history: nearly every causal tile holds some kept key, so it computes 60-100 % of the causal tiles for 23 % of the
pairs (`bench/train_attention_tiles.py`, docs/training.md). Here each tile of `block` queries
first gathers the keys visible to any of its queries, then attends to those alone. Visibility is an interval
(`[pos_t, alive_t)`, `block_mask.alive_until`), so a tile's keys are the ones its first query holds (at most the
budget) plus the ones inserted within the tile: at most `sink + window + topk + block - 1`, whatever the sequence
length. The gathered problem is the same rule on other tensors (one batch entry per (row, KV head, query tile), the
query heads of the group as its heads), so it runs through `sparse_attention`'s own backends (`backends.py`:
FlexAttention, the CPU's fused kernel, the reference), and autograd scatters the gradients back through the gather.

Exact: every query sees the same keys as under `sparse_attention` (`tests/test_attention_gather.py`, values and
gradients). Its cost is memory: the gathered keys and values are `ceil(Q / block) * U / N` times the layer's own
(about 5x at S = 16k, B = 2048 with CUDA's tiles of 512). Timed (docs/training.md): the CPU's training default (`sparse_attention` "auto" with gradients), 2.4-4.4x faster than the
whole-sequence mask per layer at S = 2048, a full distillation step 1.29x; on an H100 at the Qwen3-4B shape, S = 16k,
B = 2048, forward + backward 11.9 ms against FlexAttention's 40.1 ms over the sequence (dense SDPA: 14.3 ms), yet a
SmolLM2 distillation step (S = 8192) was slower with it, bound by the host: on CUDA "auto" takes it where the work
it saves pays for its launches (`backends.auto_backend`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpop.ops.attention.backends import run_backend
from kvpop.ops.attention.block_mask import _MAX, _MIN, _block_reduce, alive_until


def tile_sight(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    alive: Tensor,  # [B, Hkv, N]: `alive_until`
    block: int,
) -> Tensor:
    """Which keys some query of each tile of `block` queries sees: bool [B, Hkv, ceil(Q / block), N].

    A key is visible on `[pos_t, alive_t)`, so some query of the tile sees it iff it is at or before the tile's last
    valid query and alive past its first (`tile_states`' per-block statistics, per key instead of per key block).
    """
    q_lo = _block_reduce(torch.where(q_valid, q_pos, _MAX), block, _MAX, "min")  # [B, T]: all-padding tiles see none
    q_hi = _block_reduce(torch.where(q_valid, q_pos, _MIN), block, _MIN, "max")
    return (k_pos[:, None, None, :] <= q_hi[:, None, :, None]) & (alive[:, :, None, :] > q_lo[:, None, :, None])


def tile_keys(
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    width: int | None,
    block: int,
    alive: Tensor | None = None,  # [B, Hkv, N]: `alive_until`, if the caller has it
) -> tuple[Tensor, Tensor]:
    """Each query tile's visible keys, in position order: (indices [B, Hkv, T, width], used [B, Hkv, T, width]).

    `width` must hold the largest tile's keys (None: the largest tile's count, one host sync); a tile with fewer pads
    with its last key index, which it does not use (`used` False). A given width is checked: on the CPU with an error,
    on CUDA by a device-side assert (a host sync per layer cost the training step more than the gathering saved).
    """
    if alive is None:
        alive = alive_until(k_pos, k_valid, evict, sink, window)  # [B, Hkv, N]
    seen = tile_sight(q_pos, q_valid, k_pos, alive, block)  # [B, Hkv, T, N]
    count = seen.sum(-1)
    wrong = ("a query tile sees more keys than the width {}: the query positions of a tile must be consecutive "
             "(one document per row), or pass a larger width")
    if width is None:
        width = max(1, int(count.amax()))
    elif seen.is_cuda:
        torch._assert_async(count.amax() <= width, wrong.format(width))
    elif int(count.amax()) > width:
        raise ValueError(wrong.format(width) + f" (it sees {int(count.amax())})")
    # no sort of every tile's N flags: the r-th visible key (position order) is where the running count of visible
    # keys first reaches r + 1, a binary search per output column (deterministic; a scatter would not be)
    running = seen.cumsum(-1, dtype=torch.int32)
    want = torch.arange(1, width + 1, dtype=torch.int32, device=seen.device).expand(*seen.shape[:-1], width)
    idx = torch.searchsorted(running, want.contiguous()).clamp_(max=seen.shape[-1] - 1)
    return idx, want <= count[..., None]


class GatheredTiles(NamedTuple):
    """The gathered problem: one batch entry per (row, KV head, query tile), the group's query heads as its heads;
    the rule's inputs for `sparse_attention` with shared key positions, and the layout to scatter the output back."""

    query: Tensor  # [R, G, block, D]
    key: Tensor  # [R, 1, U, D]
    value: Tensor  # [R, 1, U, D]
    q_pos: Tensor  # [R, block]
    q_valid: Tensor  # [R, block]
    k_pos: Tensor  # [R, U]
    k_valid: Tensor  # [R, U]: the slots a tile uses
    evict: Tensor  # [R, 1, U]
    layout: tuple[int, int, int, int, int]  # B, Hkv, G, T, Q


BLOCK = {"cuda": 512, "cpu": 128}
"""Queries per gathered tile by device. A tile gathers up to `budget + block - 1` keys, so the copies of K and V are
`(budget + block) / block` times the keys' own; longer tiles copy less and give FlexAttention longer problems, at a
little more compute. On an H100 (S = 16k, B = 2048) forward + backward took 15.3 / 13.5 / 12.7 ms at tiles of
256 / 512 / 1024, and 39.4 ms at 64 (docs/training.md; 512 keeps the memory lower at smaller
budgets, not measured); the CPU's fused kernel was timed at 128."""


def gather_tiles(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    topk: int | None,
    block: int,
) -> GatheredTiles:
    """Each tile of `block` queries with the keys it sees (`tile_keys`), as one batch entry of the same rule."""
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    G, T = Hq // Hkv, -(-Q // block)
    U = None if topk is None else min(N, sink + window + topk + block - 1)
    alive = alive_until(k_pos, k_valid, evict, sink, window)  # [B, Hkv, N]
    idx, used = tile_keys(q_pos, q_valid, k_pos, k_valid, evict, sink, window, U, block, alive)
    U = idx.shape[-1]
    # Order each tile's keys so that FlexAttention's tiles come out full or empty, not partial: the keys older than
    # the tile by when they stop being visible (latest first), then the tile's own keys in position order (already
    # last). A query at `p` sees an older key iff its `alive_until` is past `p`: a prefix of that order, shorter as
    # `p` grows; the tile's own keys it sees causally. So only the blocks holding the keys evicted during a query
    # block, and the diagonal, are partial; in position order nearly every block was.
    alive = alive.gather(-1, idx.flatten(2)).view_as(idx)
    first = _block_reduce(torch.where(q_valid, q_pos, _MAX), block, _MAX, "min")  # [B, T]
    older = used & (k_pos.gather(-1, idx.flatten(1)).view_as(idx) < first[:, None, :, None])
    order = torch.sort(torch.where(older, -alive, _MAX), dim=-1, stable=True).indices
    idx, used = idx.gather(-1, order), used.gather(-1, order)
    R = B * Hkv * T
    # whole rows by `index_select` on the flattened (row, head, key) axis: one index per key, not per element as a
    # `gather` over D would read, and its backward is `index_add_` (deterministic under torch's deterministic mode)
    rows = (idx + torch.arange(B * Hkv, device=idx.device).view(B, Hkv, 1, 1) * N).reshape(-1)

    def pick(t: Tensor) -> Tensor:  # [B, Hkv, N, ...] -> [R, U, ...]
        return t.reshape(B * Hkv * N, *t.shape[3:]).index_select(0, rows).view(R, U, *t.shape[3:])

    pad = T * block - Q
    return GatheredTiles(
        query=F.pad(query, (0, 0, 0, pad)).view(B, Hkv, G, T, block, D).transpose(2, 3).reshape(R, G, block, D),
        key=pick(key)[:, None],
        value=pick(value)[:, None],
        q_pos=F.pad(q_pos, (0, pad)).view(B, 1, T, block).expand(B, Hkv, T, block).reshape(R, block),
        q_valid=F.pad(q_valid, (0, pad), value=False).view(B, 1, T, block).expand(B, Hkv, T, block).reshape(R, block),
        k_pos=pick(k_pos[:, None].expand(B, Hkv, N)),
        k_valid=used.reshape(R, U),
        evict=pick(evict)[:, None],
        layout=(B, Hkv, G, T, Q),
    )


def scatter_tiles(out: Tensor, lse: Tensor | None, layout: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    """The gathered batch's output (`[R, G, block, D]`, lse `[R, G, block]`) back in `[B, Hq, Q, D]` order."""
    B, Hkv, G, T, Q = layout
    block, D = out.shape[-2], out.shape[-1]
    out = out.view(B, Hkv, T, G, block, D).transpose(2, 3).reshape(B, Hkv * G, T * block, D)[:, :, :Q]
    if lse is not None:
        lse = lse.view(B, Hkv, T, G, block).transpose(2, 3).reshape(B, Hkv * G, T * block)[:, :, :Q]
    return out, lse


def gather_sparse_attention(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    topk: int | None,
    scale: float,
    return_lse: bool = False,
    block: int | None = None,
    backend: str = "auto",
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`sparse_attention` (shared key positions) computed tile by tile over each query tile's gathered keys.

    `topk` bounds the gathered width (`sink + window + topk + block - 1`: a static shape); None takes the largest
    tile's count instead. `block`: queries per tile (None: `BLOCK` of the device). `backend` runs the gathered batch:
    "flex", "cpu" or "reference", as in `sparse_attention`; "auto" is FlexAttention on CUDA, else the CPU's fused
    kernel. `softcap`: the logit soft-capping, which the fused CPU kernel cannot take ("auto" then runs the gathered
    batch through "reference" off CUDA). Returns out [B, Hq, Q, D] and, if asked, lse float32 [B, Hq, Q], as
    `sparse_attention`.
    """
    from kvpop.ops.attention.cpu import available

    if backend == "auto":
        backend = "flex" if query.is_cuda else "cpu" if available(query) and softcap is None else "reference"
    if backend not in ("flex", "cpu", "reference"):
        raise ValueError(f"backend={backend!r}: the gathered tiles run through 'flex', 'cpu' or 'reference'")
    block = BLOCK["cuda" if query.is_cuda else "cpu"] if block is None else block
    if block < 1:
        raise ValueError(f"block={block}: a query tile holds at least one query")
    g = gather_tiles(query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, topk, block)
    out, lse = run_backend(backend, *g[:-1], sink, window, scale, return_lse, softcap)
    return scatter_tiles(out, lse, g.layout)


__all__ = ["BLOCK", "GatheredTiles", "gather_sparse_attention", "gather_tiles", "scatter_tiles", "tile_keys",
           "tile_sight"]
