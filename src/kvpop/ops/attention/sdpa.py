"""PyTorch's `scaled_dot_product_attention` under an explicit per-KV-head mask: the cache's chunk attention on CUDA.

A prefill chunk of `KVpopCache` attends its slots plus its own tokens under the rule's mask
(`[B, Hkv, Q, slots + Q]`; the slots' positions differ per head, so FlexAttention's shared-position
`mask_mod` does not apply). The reference materialises float32 logits for every query head; this folds
each KV head into the batch so its `G` query heads share one mask (broadcast, not repeated) and lets
SDPA pick its fused kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_masked_attention(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    mask: Tensor,  # [B, Hkv, Q, N] bool
    scale: float,
) -> Tensor:
    """Same output as `reference.masked_attention` (rows with no key give zeros): [B, Hq, Q, D]."""
    B, Hq, Q, D = query.shape
    Hkv, N, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    empty = ~mask.any(-1, keepdim=True)  # [B, Hkv, Q, 1]
    # an empty row (a padding query) gets one key so the kernel stays finite; its output is zeroed below
    allowed = (mask | (empty & (torch.arange(N, device=mask.device) == 0))).reshape(B * Hkv, 1, Q, N)
    out = F.scaled_dot_product_attention(
        query.reshape(B * Hkv, G, Q, D),
        key.reshape(B * Hkv, 1, N, D).expand(B * Hkv, G, N, D),
        value.reshape(B * Hkv, 1, N, Dv).expand(B * Hkv, G, N, Dv),
        attn_mask=allowed, scale=scale,
    )
    return out.reshape(B, Hq, Q, Dv).masked_fill(empty.repeat_interleave(G, 1), 0.0)


def decode_attention(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    occupied: Tensor,  # [B, Hkv, N] bool
    scale: float,
) -> Tensor:
    """One decode step's attention over the occupied slots, as one fused call: out [B, Hq, 1, D].

    The `G` query heads of a KV head act as `G` queries over its slots, so nothing is repeated. Same
    output as `reference.masked_attention` (a row with no occupied slot gives zeros) in a handful of
    operations instead of its ~35: the decode step runs once per layer and token.
    """
    B, Hq, _, D = query.shape
    Hkv = key.shape[1]
    out = F.scaled_dot_product_attention(query.reshape(B, Hkv, Hq // Hkv, D), key, value,
                                         attn_mask=occupied[:, :, None, :], scale=scale)
    if query.device.type != "cpu":
        # the CPU kernel gives zeros for a row with no allowed key (tested); elsewhere make sure of it
        out = torch.where(occupied.any(-1)[..., None, None], out, 0.0)
    return out.reshape(B, Hq, 1, value.shape[-1])
