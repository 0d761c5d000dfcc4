"""Sparse attention under the retention rule: the dense-mask reference and FlexAttention.

`sparse_attention` checks nothing expensive and picks the backend: FlexAttention on CUDA (block
mask built from the known structure), PyTorch's fused CPU kernel with the dense mask on CPU
(FlexAttention has no backward there), and the explicit reference otherwise. Fast backends are
imported lazily and never import the reference.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from kvpop.ops.attention.reference import attention_with_probs, masked_attention, slot_probs, step_probs

Backend = Literal["auto", "reference", "cpu", "flex"]
MaskBackend = Literal["auto", "reference", "cpu", "sdpa"]


def attention_under_mask(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    mask: Tensor,  # [B, Hkv, Q, N] bool
    scale: float,
    backend: MaskBackend = "auto",
) -> Tensor:
    """`reference.masked_attention`'s output, fast: the attention of a `KVpopCache` prefill chunk.

    Backends: "cpu" (PyTorch's fused CPU kernel; the default there), "sdpa" (`scaled_dot_product_attention`;
    the default on CUDA), "reference". Rows with no allowed key give zeros.

    Returns:
        out [B, Hq, Q, D].
    """
    if backend == "auto":
        from kvpop.ops.attention.cpu import available

        backend = "cpu" if available(query) else ("sdpa" if query.is_cuda else "reference")
    if backend == "cpu":
        from kvpop.ops.attention.cpu import cpu_masked_attention

        return cpu_masked_attention(query, key, value, mask, scale)[0]
    if backend == "sdpa":
        from kvpop.ops.attention.sdpa import sdpa_masked_attention

        return sdpa_masked_attention(query, key, value, mask, scale)
    if backend != "reference":
        raise ValueError(f"backend={backend!r} must be one of 'auto', 'reference', 'cpu', 'sdpa'")
    return masked_attention(query, key, value, mask, scale)[0]


def sparse_attention(
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
    scale: float,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Attention of each query over the keys the rule keeps for it (see `policy.mask_from_eviction`).

    Returns:
        out [B, Hq, Q, D] and, if asked, lse float32 [B, Hq, Q].
    """
    if backend == "auto":
        from kvpop.ops.attention.cpu import available

        backend = "flex" if query.is_cuda else ("cpu" if available(query) else "reference")
    if backend == "flex":
        from kvpop.ops.attention.flex import flex_sparse_attention

        return flex_sparse_attention(
            query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, scale, return_lse=return_lse
        )
    if backend not in ("reference", "cpu"):
        raise ValueError(f"backend={backend!r} must be one of 'auto', 'reference', 'cpu', 'flex'")
    from kvpop.ops.topk import mask_from_eviction

    mask = mask_from_eviction(q_pos, q_valid, k_pos[:, None], k_valid[:, None], evict, sink, window)
    if backend == "cpu":
        from kvpop.ops.attention.cpu import cpu_masked_attention

        return cpu_masked_attention(query, key, value, mask, scale, return_lse=return_lse)
    return masked_attention(query, key, value, mask, scale, return_lse=return_lse)


__all__ = ["attention_under_mask", "attention_with_probs", "masked_attention", "slot_probs", "sparse_attention", "step_probs"]
