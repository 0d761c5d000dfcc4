"""Sparse attention under the retention rule: the dense-mask reference, FlexAttention and the CPU kernels.

`sparse_attention` checks nothing expensive and picks the backend: FlexAttention on CUDA (block
mask built from the known structure; SDPA under the dense mask when key positions differ per head,
as a cache's slots do), on the CPU PyTorch's fused kernel over the keys each block of queries needs
(inference) or over each query tile's gathered keys (training: FlexAttention has no backward there),
and the explicit reference otherwise; `backends.py` runs a backend by name (the gathered tiles of `gather.py` call it
too). Fast backends are imported lazily and never import the reference.

Logit soft-capping (`softcap`, Gemma 2's `c * tanh(l / c)`): FlexAttention applies it in a `score_mod`; PyTorch's
fused CPU and SDPA kernels cannot, so a soft-capped call runs the explicit reference there (on the CPU inside the
gathered tiles when the rule evicts, so its memory stays `O(Q * (budget + tile))`), and the decode step runs
`attention_with_probs` instead of the split kernel.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from kvpop.ops.attention.reference import (
    attention_with_probs,
    masked_attention,
    scored_attention_reference,
    slot_probs,
    step_probs,
)

Backend = Literal["auto", "reference", "cpu", "cpu_blocks", "flex", "sdpa", "gather"]


def decode_attention(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    occupied: Tensor,  # [B, Hkv, N] bool, or the slots' int64 positions (occupied where >= 0)
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """A decode step's attention over its occupied slots: on CUDA split over the slots (`decode_kernel.py`, which
    reads the positions itself), elsewhere one SDPA call (`sdpa.decode_attention`); reference: `masked_attention`.
    With `softcap` (which neither fused kernel takes): `attention_with_probs`, the reference over the slots."""
    if softcap is not None:
        return attention_with_probs(query, key, value, occupied if occupied.dtype == torch.bool else occupied >= 0,
                                    scale, softcap)[0]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from kvpop.ops.attention import decode_kernel

        if decode_kernel.available(query):
            return decode_kernel.decode_attention_split(query, key, value, occupied, scale)
    from kvpop.ops.attention.sdpa import decode_attention as fused

    return fused(query, key, value, occupied if occupied.dtype == torch.bool else occupied >= 0, scale)


def decode_attention_scored(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    pos: Tensor,  # [B, Hkv, M >= N] int64, -1: an empty slot
    pri: Tensor,  # [B, Hkv, M] float32, updated in place
    prior: Tensor | None,  # [B, Hkv, M] float32, the slots' static priors
    real: Tensor,  # [B] bool
    scale: float,
    score: str,
    decay: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """A dynamic policy's decode attention, its priorities updated by `score` from the step's probabilities: on CUDA
    the split kernel with the update in its second launch (`decode_kernel.decode_attention_scored`) for the scores
    of `decode_kernel.SCORE_FORMS`; reference (and elsewhere, and with `softcap`, which the kernel does not take):
    `scored_attention_reference`. `pos`, `pri` and `prior` may run past the keys' `N` slots (a cache's buffers,
    scratch slot included): only `[0, N)` is used."""
    if softcap is None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from kvpop.ops.attention import decode_kernel

        if decode_kernel.available(query) and score in decode_kernel.SCORE_FORMS:
            return decode_kernel.decode_attention_scored(query, key, value, pos, pri, prior, real, scale, score,
                                                         decay=decay)
    N = key.shape[2]
    return scored_attention_reference(query, key, value, pos[..., :N], pri[..., :N],
                                      None if prior is None else prior[..., :N], real, scale, score, decay, softcap)


def sparse_attention(
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
    backend: Backend = "auto",
    topk: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention of each query over the keys the rule keeps for it (see `policy.mask_from_eviction`).

    Key positions are shared by the heads ([B, N]: a sequence) or per KV head ([B, Hkv, N]: a cache's
    slots followed by a chunk). Backends: "flex" (CUDA, shared positions), "sdpa" (CUDA, per-head
    positions: `scaled_dot_product_attention` under the dense mask), "cpu_blocks" (the CPU's fused
    kernel over the keys each block of queries needs; the CPU default when nothing needs a gradient),
    "cpu" (the fused kernel under the dense mask), "gather" (shared positions: each tile of queries over its own
    gathered keys, `gather.py`, the fused kernel inside on the CPU, FlexAttention on CUDA; the CPU's training
    default when the rule evicts), "reference". `topk`: the rule's top-k, which bounds the keys a gathered tile holds
    (a static shape on CUDA); None finds the bound with one host sync. `softcap`: the model's logit soft-capping
    `c * tanh(l / c)` (None: none), which "flex", "gather" and "reference" take ("auto" picks among them).

    Returns:
        out [B, Hq, Q, D] and, if asked, lse float32 [B, Hq, Q].
    """
    shared = k_pos.dim() == 2
    if softcap is not None:
        if backend == "auto":
            # the fused CPU and SDPA kernels take no score modification: FlexAttention, or the explicit logits (on
            # the CPU per gathered tile where the rule evicts, not over the whole sequence)
            backend = ("flex" if shared else "reference") if query.is_cuda else (
                "gather" if shared and sink + window < key.shape[-2] else "reference")
        if backend not in ("flex", "gather", "reference"):
            raise ValueError(f"backend={backend!r} takes no logit soft-capping (softcap={softcap}): use 'auto', "
                             "'flex', 'gather' or 'reference'")
    if backend == "auto":
        from kvpop.ops.attention.backends import auto_backend
        from kvpop.ops.attention.cpu import available

        B, Hq, Q, D = query.shape
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        backend = auto_backend(query.device.type, B, Hq, D, Q, sink, window, topk, shared, grad,
                               cpu_kernels=query.device.type == "cpu" and available(query))
    if backend == "gather":
        if not shared:
            raise ValueError("backend='gather' needs key positions shared by the heads ([B, N])")
        from kvpop.ops.attention.gather import gather_sparse_attention

        return gather_sparse_attention(query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, topk,
                                       scale, return_lse=return_lse, softcap=softcap)
    from kvpop.ops.attention.backends import run_backend

    return run_backend(backend, query, key, value, q_pos, q_valid, k_pos, k_valid, evict, sink, window, scale,
                       return_lse, softcap)


__all__ = [
    "attention_with_probs",
    "decode_attention",
    "decode_attention_scored",
    "masked_attention",
    "scored_attention_reference",
    "slot_probs",
    "sparse_attention",
    "step_probs",
]
