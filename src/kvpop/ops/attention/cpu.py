"""CPU backend: PyTorch's fused CPU flash-attention kernel with the rule's mask, returning the LSE.

`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu` takes an additive float mask, has a
backward, and returns the per-row log-sum-exp that training needs, at about a third of the time
and memory of the reference's explicit softmax. It is an internal op, so `available()` checks it
and `sparse_attention` falls back to the reference when it is missing.
"""

from __future__ import annotations

import torch
from torch import Tensor

_OP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available(query: Tensor) -> bool:
    return _OP is not None and query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)


def cpu_masked_attention(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    mask: Tensor,  # [B, Hkv, Q, N] bool
    scale: float,
    return_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as `reference.masked_attention` (rows with no key give zeros and `lse = -inf`)."""
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    G = Hq // Hkv
    empty = ~mask.any(-1, keepdim=True)  # [B, Hkv, Q, 1]
    # an empty row (a padding query) gets one key so the kernel stays finite; its output is zeroed below
    allowed = mask | (empty & (torch.arange(N, device=mask.device) == 0))
    # fold each KV head into the batch: its G query heads then share one [Q, N] mask (broadcast over
    # heads) and the keys/values are expanded, not copied, so nothing is repeated G times
    bias = torch.where(allowed, 0.0, float("-inf")).to(query.dtype).reshape(B * Hkv, 1, Q, N)
    out, lse = _OP(
        query.reshape(B * Hkv, G, Q, D),
        key.reshape(B * Hkv, 1, N, D).expand(B * Hkv, G, N, D),
        value.reshape(B * Hkv, 1, N, value.shape[-1]).expand(B * Hkv, G, N, value.shape[-1]),
        0.0, False, attn_mask=bias, scale=scale,
    )
    empty_q = empty[..., 0].repeat_interleave(G, 1)  # [B, Hq, Q]
    out = out.reshape(B, Hq, Q, -1).masked_fill(empty_q[..., None], 0.0)
    if not return_lse:
        return out, None
    return out, lse.reshape(B, Hq, Q).float().masked_fill(empty_q, float("-inf"))


_MIN = torch.iinfo(torch.int64).min
_MAX = torch.iinfo(torch.int64).max
BLOCK = 256
"""Queries per block of `cpu_block_sparse_attention`."""


def cpu_block_sparse_attention(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N] or [B, Hkv, N]
    k_valid: Tensor,  # [B, N] or [B, Hkv, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    scale: float,
    return_lse: bool = False,
    block: int = BLOCK,
) -> tuple[Tensor, Tensor | None]:
    """`sparse_attention` on the CPU without the `Q x N` mask: per block of queries, only the keys alive in it.

    Key `t` is visible to query `q` on `pos_t <= pos_q < alive_t` (`block_mask.alive_until`), so a block
    of queries sees at most the `budget` keys retained at its first query plus the block's own tokens.
    Each block gathers those keys per (batch, KV head) - padded to the largest count, the padding
    masked - and runs the fused kernel over them: `O(Q * (budget + block))` work and mask instead of
    `O(Q * N)`, and no causal half computed in vain. Same contract as `cpu_masked_attention` over
    `mask_from_eviction`'s mask (rows with no key give zeros and `lse = -inf`); one host sync per block.
    """
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    if k_pos.dim() == 2:
        k_pos, k_valid = k_pos[:, None], k_valid[:, None]
    kp = k_pos.expand(B, Hkv, N)
    alive = torch.where(kp < sink, _MAX, torch.maximum(evict, kp + window))
    alive = torch.where(k_valid.expand(B, Hkv, N), alive, _MIN)  # [B, Hkv, N]; invalid keys: never visible
    q_eff = torch.where(q_valid, q_pos, _MIN)  # [B, Q]; invalid queries see nothing
    outs, lses = [], []
    for i in range(0, Q, block):
        qb = q_eff[:, i : i + block]  # [B, bq]
        q_hi = qb.amax(-1)[:, None, None]
        q_lo = torch.where(qb > _MIN, qb, _MAX).amin(-1)[:, None, None]
        needed = (kp <= q_hi) & (alive > q_lo)  # [B, Hkv, N]: visible to some query of the block
        M = max(int(needed.sum(-1).amax()), 1)
        # the needed keys first, in their order; the padding after them stays masked
        idx = torch.sort(needed.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :M]
        kb = key.gather(2, idx[..., None].expand(-1, -1, -1, D))
        vb = value.gather(2, idx[..., None].expand(-1, -1, -1, value.shape[-1]))
        kpb, ab, nb = kp.gather(2, idx), alive.gather(2, idx), needed.gather(2, idx)
        qv = qb[:, None, :, None]
        mask = (kpb[:, :, None, :] <= qv) & (qv < ab[:, :, None, :]) & nb[:, :, None, :]  # [B, Hkv, bq, M]
        out, lse = cpu_masked_attention(query[:, :, i : i + block], kb, vb, mask, scale, return_lse)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=2)
    return out, (torch.cat(lses, dim=2) if return_lse else None)
