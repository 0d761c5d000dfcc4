"""Sparse attention over each query tile's gathered keys: the tile work of the rule's attention cut to its keys.

The training path's FlexAttention runs on the sequence's own layout, where the kept tokens are spread over the whole
history: nearly every causal tile holds some kept key, so it computes 60-100 % of the causal tiles for 23 % of the
pairs (`bench/train_attention_tiles.py`, docs/RESULTS.md, eighteenth session). Here each tile of `block` queries
first gathers the keys visible to any of its queries, then attends to those alone. Visibility is an interval
(`[pos_t, alive_t)`, `block_mask.alive_until`), so a tile's keys are the ones its first query holds (at most the
budget) plus the ones inserted within the tile: at most `sink + window + topk + block - 1`, whatever the sequence
length. The gathered problem is the same rule on other tensors (one batch entry per (row, KV head, query tile), the
query heads of the group as its heads), so it runs through `sparse_attention`'s own backends (FlexAttention, the
CPU's fused kernel, the reference), and autograd scatters the gradients back through the gather.

Exact: every query sees the same keys as under `sparse_attention` (`tests/test_attention_gather.py`, values and
gradients). Its cost is memory: the gathered keys and values are `ceil(Q / block) * U / N` times the layer's own
(about 17x at S = 16k, B = 2048). The CPU's training default (`sparse_attention` "auto" with gradients): 2.4-4.4x
faster than the whole-sequence mask per layer at S = 2048, a full distillation step 1.29x. Opt-in on CUDA
(`bench_train_attention.py --gather`), not yet timed there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
) -> tuple[Tensor, Tensor]:
    """Each query tile's visible keys, in position order: (indices [B, Hkv, T, width], used [B, Hkv, T, width]).

    `width` must hold the largest tile's keys (None: the largest tile's count); a tile with fewer pads with keys no
    query of it sees (`used` False). One host sync checks or finds the width.
    """
    alive = alive_until(k_pos, k_valid, evict, sink, window)  # [B, Hkv, N]
    seen = tile_sight(q_pos, q_valid, k_pos, alive, block)
    most = int(seen.sum(-1).amax())
    width = max(1, most) if width is None else width
    if most > width:
        raise ValueError(f"a query tile sees {most} keys, more than the width {width}: the query positions of a "
                         "tile must be consecutive (one document per row), or pass a larger width")
    # the visible keys first, each tile's in position order (a stable sort of the flags)
    idx = torch.sort(seen.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
    return idx, seen.gather(-1, idx)


def _attend(query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, scale, return_lse, backend):
    """The rule's attention on the gathered batch, by `sparse_attention`'s backends of those names (not imported
    from the package, which dispatches to this module)."""
    if backend == "flex":
        from kvpop.ops.attention.flex import flex_sparse_attention

        return flex_sparse_attention(query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, scale,
                                     return_lse=return_lse)
    from kvpop.ops.topk import mask_from_eviction

    mask = mask_from_eviction(q_pos, q_valid, k_pos[:, None], k_valid[:, None], evict, sink, window)
    if backend == "cpu":
        from kvpop.ops.attention.cpu import cpu_masked_attention

        return cpu_masked_attention(query, key, value, mask, scale, return_lse=return_lse)
    from kvpop.ops.attention.reference import masked_attention

    return masked_attention(query, key, value, mask, scale, return_lse=return_lse)


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
    block: int = 128,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """`sparse_attention` (shared key positions) computed tile by tile over each query tile's gathered keys.

    `topk` bounds the gathered width (`sink + window + topk + block - 1`: a static shape); None takes the largest
    tile's count instead. `backend` runs the gathered batch: "flex", "cpu" or "reference", as in `sparse_attention`. Returns out [B, Hq, Q, D] and, if asked, lse
    float32 [B, Hq, Q], as `sparse_attention`; "auto" is FlexAttention on CUDA, else the CPU's fused kernel.
    """
    from kvpop.ops.attention.cpu import available

    if backend == "auto":
        backend = "flex" if query.is_cuda else "cpu" if available(query) else "reference"
    if backend not in ("flex", "cpu", "reference"):
        raise ValueError(f"backend={backend!r}: the gathered tiles run through 'flex', 'cpu' or 'reference'")
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    G, T = Hq // Hkv, -(-Q // block)
    U = None if topk is None else min(N, sink + window + topk + block - 1)
    idx, used = tile_keys(q_pos, q_valid, k_pos, k_valid, evict, sink, window, U, block)
    U = idx.shape[-1]
    flat = idx.reshape(B, Hkv, T * U)
    R = B * Hkv * T  # one batch entry per (row, KV head, query tile), with the group's query heads as its heads

    def pick(t: Tensor) -> Tensor:  # [B, Hkv, N, ...] -> [R, U, ...]
        if t.dim() == 3:
            return t.gather(2, flat).reshape(R, U)
        return t.gather(2, flat[..., None].expand(-1, -1, -1, t.shape[-1])).reshape(R, U, t.shape[-1])

    kp = pick(k_pos[:, None].expand(B, Hkv, N))
    pad = T * block - Q
    q = F.pad(query, (0, 0, 0, pad)).view(B, Hkv, G, T, block, D).transpose(2, 3).reshape(R, G, block, D)
    qp = F.pad(q_pos, (0, pad)).view(B, 1, T, block).expand(B, Hkv, T, block).reshape(R, block)
    qv = F.pad(q_valid, (0, pad), value=False).view(B, 1, T, block).expand(B, Hkv, T, block).reshape(R, block)
    out, lse = _attend(q, pick(key)[:, None], pick(value)[:, None], qp, qv, kp, used.reshape(R, U),
                       pick(evict)[:, None], sink, window, scale, return_lse, backend)
    out = out.view(B, Hkv, T, G, block, D).transpose(2, 3).reshape(B, Hq, T * block, D)[:, :, :Q]
    if lse is not None:
        lse = lse.view(B, Hkv, T, G, block).transpose(2, 3).reshape(B, Hq, T * block)[:, :, :Q]
    return out, lse


__all__ = ["gather_sparse_attention", "tile_keys", "tile_sight"]
