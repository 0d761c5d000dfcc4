"""`sparse_attention`'s backends by name, on the sequence as given: the one dispatch that the package and the gathered
tiles (`gather.py`, which runs the same rule on its own batch) both call, so neither keeps a copy of the other's."""

from __future__ import annotations

from torch import Tensor

BACKENDS = ("reference", "cpu", "cpu_blocks", "flex", "sdpa")


def run_backend(
    backend: str,
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
    return_lse: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The rule's attention by one of `BACKENDS` (see `sparse_attention`); returns out and lse (or None).

    `softcap` (the logit soft-capping): "flex" and "reference" take it; the fused "cpu", "cpu_blocks" and "sdpa"
    kernels cannot, and refuse it."""
    shared = k_pos.dim() == 2
    if softcap is not None and backend not in ("flex", "reference"):
        raise ValueError(f"backend={backend!r} takes no logit soft-capping (softcap={softcap}): use 'flex' or "
                         "'reference'")
    if backend == "flex":
        if not shared:
            raise ValueError("backend='flex' needs key positions shared by the heads ([B, N]); use 'sdpa'")
        from kvpop.ops.attention.flex import flex_sparse_attention

        return flex_sparse_attention(
            query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, scale, return_lse=return_lse,
            softcap=softcap,
        )
    if backend == "cpu_blocks":
        from kvpop.ops.attention.cpu import cpu_block_sparse_attention

        return cpu_block_sparse_attention(
            query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, scale, return_lse=return_lse
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of 'auto', 'reference', 'cpu', 'cpu_blocks', 'flex', 'sdpa', "
                         "'gather'")
    from kvpop.ops.topk import mask_from_eviction

    if shared:
        k_pos, k_valid = k_pos[:, None], k_valid[:, None]
    mask = mask_from_eviction(q_pos, q_valid, k_pos, k_valid, evict, sink, window)
    if backend == "cpu":
        from kvpop.ops.attention.cpu import cpu_masked_attention

        return cpu_masked_attention(query, key, value, mask, scale, return_lse=return_lse)
    if backend == "sdpa":
        if return_lse:
            raise ValueError("backend='sdpa' returns no lse; use 'flex' or 'reference'")
        from kvpop.ops.attention.sdpa import sdpa_masked_attention

        return sdpa_masked_attention(query, key, value, mask, scale), None
    from kvpop.ops.attention.reference import masked_attention  # lazily: the fast backends never load it

    return masked_attention(query, key, value, mask, scale, return_lse=return_lse, softcap=softcap)


__all__ = ["BACKENDS", "run_backend"]
