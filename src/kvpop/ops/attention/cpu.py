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
