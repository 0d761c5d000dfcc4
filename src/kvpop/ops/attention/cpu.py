"""CPU backend: PyTorch's fused CPU flash-attention kernel with the rule's mask, returning the LSE.

`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu` takes an additive float mask, has a
backward, and returns the per-row log-sum-exp that training needs, at about a third of the time
and memory of the reference's explicit softmax. It is an internal op, so `available()` checks it
and `sparse_attention` falls back to the reference when it is missing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
BLOCK = 64
"""Queries per block of `cpu_block_sparse_attention`."""
_PAD = 1 / 8
"""Padding to one key count that a batch of blocks may add to their work before it is split."""
_BATCH = 512
"""Queries per batch of blocks at most: its gathered keys and mask stay in cache and their memory is reused."""
_INDEX = 1 << 24
"""Elements (blocks x batch x KV heads x keys) of the per-key index work done at once: 16M, about 200 MB."""


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
    Each block gathers those keys per (batch, KV head), the ones every query of the block sees first
    (their mask is a constant 0, not evaluated), then the ones only some see, padded to the largest
    count and the padding masked. Blocks of similar counts go through the fused kernel as one batch
    (`README.md`): `O(Q * (budget + block))` work, a mask evaluated only where it varies, and no causal
    half computed in vain. Same contract as `cpu_masked_attention` over `mask_from_eviction`'s mask
    (rows with no key give zeros and `lse = -inf`); one host sync per group of blocks whose index work fits
    `_INDEX` (one group up to a few thousand tokens).
    """
    B, Hq, Q, D = query.shape
    Hkv, N, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    dev = query.device
    if k_pos.dim() == 2:
        k_pos, k_valid = k_pos[:, None], k_valid[:, None]
    kp = k_pos.expand(B, Hkv, N)
    valid = k_valid.expand(B, Hkv, N)
    alive = torch.where(kp < sink, _MAX, torch.maximum(evict, kp + window))
    alive = torch.where(valid, alive, _MIN)  # [B, Hkv, N]; invalid keys: never visible
    nb = -(-Q // block)
    Qp = nb * block
    q_eff = torch.where(q_valid, q_pos, _MIN)  # [B, Q]; invalid queries see nothing
    q_eff = F.pad(q_eff, (0, Qp - Q), value=_MIN).view(B, nb, block).transpose(0, 1)  # [nb, B, bq]
    # queries that see no key (padding): as a valid key has `alive_t >= pos_t`, query `q` sees
    # `#{pos_t <= q} - #{alive_t <= q}` keys, two searches in the sorted bounds
    k_lo = torch.sort(torch.where(valid, kp, _MAX), dim=-1).values
    k_hi = torch.sort(torch.where(valid, alive, _MAX), dim=-1).values
    qq = q_eff.permute(1, 0, 2).reshape(B, 1, Qp).expand(B, Hkv, Qp).contiguous()
    seen = torch.searchsorted(k_lo, qq, right=True) - torch.searchsorted(k_hi, qq, right=True)
    empty = (seen == 0).view(B, Hkv, nb, block).permute(2, 0, 1, 3)  # [nb, B, Hkv, bq]

    # queries and outputs as [nb, B, Hkv, G, bq, D]: a batch of blocks is one leading dimension
    qb = query if Qp == Q else F.pad(query, (0, 0, 0, Qp - Q))
    qb = qb.view(B, Hkv, G, nb, block, D).permute(3, 0, 1, 2, 4, 5)
    out = query.new_empty(B, Qp, Hq, Dv)  # the caller's [B, Q, Hq, D] layout: its reshape copies nothing
    out_b = out.view(B, nb, block, Hkv, G, Dv).permute(1, 0, 3, 4, 2, 5)
    lse = torch.empty(B, Hq, Qp, dtype=torch.float32, device=dev) if return_lse else None
    lse_b = lse.view(B, Hkv, G, nb, block).permute(3, 0, 1, 2, 4) if return_lse else None
    zero, ninf = query.new_zeros(()), query.new_full((), float("-inf"))
    k_rows, v_rows = key.reshape(B * Hkv * N, D), value.reshape(B * Hkv * N, Dv)
    kp_rows, alive_rows = kp.reshape(-1), alive.reshape(-1)
    rows0 = torch.arange(0, B * Hkv * N, N, device=dev).view(1, B, Hkv, 1)
    # the per-key index work of a group of blocks is [blocks, B, Hkv, N]: groups bound it to `_INDEX` elements
    # (all blocks at once for a few thousand tokens; a long prompt would otherwise hold `Q / block x N` of it)
    step = max(1, _INDEX // (B * Hkv * N))
    for g0 in range(0, nb, step):
        g1 = min(nb, g0 + step)
        qe = q_eff[g0:g1]
        q_hi = qe.amax(-1)[..., None, None]  # [g, B, 1, 1]
        q_lo = torch.where(qe > _MIN, qe, _MAX).amin(-1)[..., None, None]
        # per (block, batch, KV head, key): seen by every valid query of the block, by some, by none
        some = (kp <= q_hi) & (alive > q_lo)  # [g, B, Hkv, N]
        every = some & (kp <= q_lo) & (alive > q_hi)
        n_some = some.sum(-1)  # [g, B, Hkv]
        # the group's one host sync: per block the largest count, the smallest constant-mask count, any empty row
        counts = torch.stack([n_some.flatten(1).amax(-1), every.sum(-1).flatten(1).amin(-1),
                              empty[g0:g1].flatten(1).any(-1).long()])
        n_max, n_full, has_empty = counts.tolist()
        # keys of each class in their order (a stable sort): the constant-mask ones first, the padding last;
        # as rows of the flattened keys, which `index_select` copies whole
        order = torch.sort(some.to(torch.int8) + every.to(torch.int8), dim=-1, descending=True, stable=True).indices
        order = order + rows0
        for a0, a1 in _batches(n_max, max(_BATCH // block, 1)):  # a0, a1 in the group; b0, b1 of all blocks
            b0, b1 = g0 + a0, g0 + a1
            n, M, full = a1 - a0, max(max(n_max[a0:a1]), 1), min(n_full[a0:a1])
            idx = order[a0:a1, ..., :M].reshape(-1)
            kb, vb = k_rows.index_select(0, idx), v_rows.index_select(0, idx)
            shape = (n, B, Hkv, 1, M)
            kpb = kp_rows.index_select(0, idx).view(shape)[..., full:]
            # past each row's count the padding, seen by nobody
            pad = torch.arange(full, M, device=dev) >= n_some[a0:a1, ..., None, None]
            ab = alive_rows.index_select(0, idx).view(shape)[..., full:].masked_fill(pad, _MIN)
            qv = q_eff[b0:b1, :, None, :, None]  # [n, B, 1, bq, 1]
            # the constant-mask keys (seen by every query of the batch) are 0; only the rest is evaluated
            bias = torch.empty(n, B, Hkv, block, M, dtype=query.dtype, device=dev)
            bias[..., :full] = 0.0
            torch.where((kpb <= qv) & (qv < ab), zero, ninf, out=bias[..., full:])
            e = empty[b0:b1] if any(has_empty[a0:a1]) else None
            if e is not None:
                # an empty row (a padding query) gets one key so the kernel stays finite; its output is zeroed below
                bias[..., 0].masked_fill_(e, 0.0)
            o, lb = _OP(
                qb[b0:b1].reshape(n * B * Hkv, G, block, D),
                kb.view(n * B * Hkv, 1, M, D).expand(-1, G, M, D),
                vb.view(n * B * Hkv, 1, M, Dv).expand(-1, G, M, Dv),
                0.0, False, attn_mask=bias.view(n * B * Hkv, 1, block, M), scale=scale,
            )
            o, lb = o.view(n, B, Hkv, G, block, Dv), lb.view(n, B, Hkv, G, block).float()
            if e is not None:
                e = e[:, :, :, None, :]  # [n, B, Hkv, 1, bq]
                o, lb = o.masked_fill(e[..., None], 0.0), lb.masked_fill(e, float("-inf"))
            out_b[b0:b1] = o
            if return_lse:
                lse_b[b0:b1] = lb
    return out[:, :Q].transpose(1, 2), (lse[..., :Q] if return_lse else None)


def _batches(counts: list[int], most: int) -> list[tuple[int, int]]:
    """Runs of at most `most` consecutive blocks `[b0, b1)`, split where padding to the largest count would add `_PAD`."""
    runs, b0 = [], 0
    for b in range(1, len(counts) + 1):
        if (b == len(counts) or b - b0 == most
                or max(counts[b0 : b + 1]) * (b + 1 - b0) > (1 + _PAD) * sum(counts[b0 : b + 1])):
            runs.append((b0, b))
            b0 = b
    return runs
