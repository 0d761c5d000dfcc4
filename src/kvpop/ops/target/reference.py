"""The future-attention target straight from its definition (`docs/method.md` Sec. 4): dense, float64, tests only.

It materialises the `[S, S]` matrix of probabilities `p(d -> t)` per query head, so keep `S` to a few
hundred. It sums masses in linear space (no log-sum-exp tricks), so it shares no numerics with the
fast backends it checks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def future_attention_target_reference(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, Hkv, S, D]
    lse: Tensor,  # [B, Hq, S]
    window: int,
    scale: float,
    eps: float = 1e-6,
    agg: str = "max",
    count_norm: bool = True,
    softcap: float | None = None,
) -> Tensor:
    """Future attention mass each key receives from the queries at least `window` steps later.

    Args:
        query: [B, Hq, S, D]; query head `hq` reads KV head `hq // G`.
        key: [B, Hkv, S, D].
        lse: [B, Hq, S], the student's own log-normaliser of each query (natural log).
        window, scale, eps, agg, count_norm, softcap: as in `kvpop.ops.target.future_attention_target`.
    Returns:
        float32 [B, Hkv, S].
    """
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    q = query.double().reshape(B, Hkv, G, S, D)
    logits = torch.einsum("bhgdx,bhtx->bhgdt", q, key.double()) * scale  # [B, Hkv, G, S(d), S(t)]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    p = torch.exp(logits - lse.double().reshape(B, Hkv, G, S, 1))
    pos = torch.arange(S, device=query.device)
    future = pos[:, None] >= pos[None, :] + window  # [d, t]
    mass = torch.where(future, p, 0.0).sum(dim=-2)  # [B, Hkv, G, S(t)]
    if count_norm:
        n = (S - window - pos).clamp(min=1).double()
        per_head = torch.log(eps + mass / n)
        out = per_head.amax(dim=2) if agg == "max" else per_head.mean(dim=2)
    else:
        pooled = mass.amax(dim=2) if agg == "max" else mass.mean(dim=2)
        out = torch.log(eps + pooled)
    return out.float()


def future_block_mask_reference(seq_len: int, window: int, block_size: int = 128, device: str = "cpu"):
    """The transposed pass's block mask evaluated point by point with `create_block_mask` (tests only).

    Rows are keys `t`, columns queries `d`; a point is on when `d >= t + window`.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, t, d):
        return d >= t + window

    return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device, BLOCK_SIZE=block_size)
