"""Attention under an explicit boolean mask, with its log-sum-exp: the reference (and CPU) backend.

GQA is handled by viewing the `Hq` query heads as `[Hkv, G]`, so keys, values and the per-KV-head
mask are never repeated. Logits and the softmax are computed in float32. A model that soft-caps its
logits (Gemma 2: `c * tanh(l / c)` of the scaled logits, before the mask) passes `softcap`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.ops.dynamic.score import score_update


def soft_cap(logits: Tensor, softcap: float | None) -> Tensor:
    """The model's logit soft-capping `c * tanh(l / c)` of scaled logits, in Hugging Face's order of operations;
    `softcap=None`: the logits unchanged."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def masked_attention(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    mask: Tensor,  # [B, Hkv, Q, N] bool
    scale: float,
    return_lse: bool = False,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Softmax attention of each query over the keys its mask row allows.

    Args:
        query: [B, Hq, Q, D]; query head `hq` reads KV head `hq // G`.
        key, value: [B, Hkv, N, D].
        mask: bool [B, Hkv, Q, N]; every row a real query uses must allow at least one key.
        scale: logit scale (usually `D ** -0.5`).
        softcap: the logit soft-capping (`soft_cap`), None for none.
    Returns:
        out [B, Hq, Q, D] in the query's dtype, and lse float32 [B, Hq, Q] (natural log) or None.
        Rows with no allowed key give zeros and `lse = -inf`.
    """
    B, Hq, Q, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G, Q, D).float()
    logits = soft_cap(torch.einsum("bhgqd,bhnd->bhgqn", q, key.float()) * scale, softcap)
    logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G, Q]
    # a row with no key (padding) would give NaN; it is zeroed instead
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bhgqn,bhnd->bhgqd", probs, value.float()).to(query.dtype)
    out = out.reshape(B, Hq, Q, D)
    return out, (lse.reshape(B, Hq, Q) if return_lse else None)


def slot_probs(
    query: Tensor,  # [B, Hkv, G, D]
    key: Tensor,  # [B, Hkv, N, D]
    occupied: Tensor | None,  # [B, Hkv, N] bool
    softcap: float | None = None,
) -> Tensor:
    """Softmax of `query . key` (soft-capped by `softcap`) over `N` slots; `query` float32 and already scaled;
    `occupied=None`: all slots.

    The one computation the dynamic policies (TOVA, H2O) rank by: the decode step (`step_probs`) and
    the prefill walk (`ops/dynamic/walk.py`) both call it on the same slot layout, so their decisions
    agree bit for bit. Leaving out an all-True `occupied` changes no bit.

    Returns:
        float32 [B, Hkv, G, N], 0 on empty slots.
    """
    B, H, G, D = query.shape
    # `torch.matmul`'s batched product, called on the views it would make (the same kernel, the same bits) without
    # its shape handling, which costs a one-query step on the CPU a quarter of the product's time
    logits = torch.bmm(query.reshape(B * H, G, D), key.float().reshape(B * H, -1, D).transpose(1, 2))
    logits = soft_cap(logits.view(B, H, G, -1), softcap)
    if occupied is not None:
        logits = logits.masked_fill(~occupied[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def step_probs(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    occupied: Tensor,  # [B, Hkv, N] bool
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """The attention probabilities of one query per row over `N` slots, float32 [B, Hkv, G, N] (`slot_probs`)."""
    B, Hq, _, D = query.shape
    Hkv = key.shape[1]
    return slot_probs(query.reshape(B, Hkv, Hq // Hkv, D).float() * scale, key, occupied, softcap)


def attention_with_probs(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    occupied: Tensor,  # [B, Hkv, N] bool
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One decode step that also returns the attention probabilities (for TOVA / H2O; the soft-capped decode step).

    Returns:
        out [B, Hq, 1, D] and probs float32 [B, Hkv, G, N] (0 on empty slots).
    """
    B, Hq, _, D = query.shape
    probs = step_probs(query, key, occupied, scale, softcap)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, value.float()).to(query.dtype)
    return out.reshape(B, Hq, 1, D), probs


def scored_attention_reference(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    pos: Tensor,  # [B, Hkv, N] int64, -1: an empty slot
    pri: Tensor,  # [B, Hkv, N] float32, updated in place
    prior: Tensor | None,  # [B, Hkv, N] float32, the slots' static priors
    real: Tensor,  # [B] bool
    scale: float,
    score: str,
    decay: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """A dynamic policy's decode attention: the step's attention over the occupied slots (soft-capped by `softcap`),
    then every occupied slot's priority rewritten from its probabilities by `score` (`ops.dynamic.score_update`, with
    `decay` for "cascade_sum"), in place for the real rows.

    Returns:
        out [B, Hq, 1, D].
    """
    occupied = pos >= 0
    out, probs = attention_with_probs(query, key, value, occupied, scale, softcap)
    updated = score_update(score, pri, probs, occupied, prior, decay)
    pri.copy_(torch.where(real[:, None, None], updated, pri))
    return out
