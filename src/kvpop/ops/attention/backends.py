"""`sparse_attention`'s backends by name, on the sequence as given: the one dispatch that the package and the gathered
tiles (`gather.py`, which runs the same rule on its own batch) both call, so neither keeps a copy of the other's."""

from __future__ import annotations

from torch import Tensor

BACKENDS = ("reference", "cpu", "cpu_blocks", "flex", "sdpa")

GATHER_TILE_CUDA = 512
"""The gathered tiles' queries on CUDA (`gather.BLOCK["cuda"]`), which the CUDA rule of `auto_backend` counts."""

GATHER_MIN_WORK = 5e10
"""The CUDA rule of `auto_backend`: the gathered tiles train when `batch x query heads x head dim x S x (S / 2 -
(budget + tile))` reaches this. The product is the causal attention work (in multiply-adds per pass, up to a
constant) that gathering saves against FlexAttention over the whole sequence, which computes nearly every causal
tile because the kept keys are scattered (docs/training.md: 60-100 % of the tiles for 23 % of the pairs); the gathered
tiles compute `budget + tile` keys per query. What they cost in return is host time per layer: about 60 more launches
and a sort, which a step bound by its launches pays in full. Measured on an H100 (docs/training.md): at SmolLM2's
shape, S = 8192, B = 1024 (product 1.2e10) a distillation step was 1.05-1.4x slower with them; at the Qwen3-4B
shape, S = 16k, B = 2048 (3.8e11) one layer's forward + backward was 3.4x faster (11.9 against 40.1 ms). The
threshold sits between, where the saved work (about 14 x the product in flops forward and backward, at a few hundred
TFLOP/s) equals about two milliseconds of host time per layer."""


def auto_backend(
    device: str,
    batch: int,
    q_heads: int,
    head_dim: int,
    length: int,
    sink: int,
    window: int,
    topk: int | None,
    shared: bool,
    grad: bool,
    cpu_kernels: bool = True,
) -> str:
    """`sparse_attention`'s backend for "auto", by where it runs, the shapes and the budget (a name, or "gather").

    - CUDA, key positions per head (a cache's slots): "sdpa" under the dense mask (FlexAttention needs shared ones);
    - CUDA, training (`grad`) with a known `topk` and enough work to save (`GATHER_MIN_WORK`): "gather", each query
      tile over its own keys; otherwise "flex", FlexAttention over the whole sequence, which keeps a small model's
      step, bound by its launches, at its fewest (and evaluation, unmeasured with the tiles end to end, as it was);
    - the CPU with its fused kernels (`cpu.available`): training "gather" when the rule evicts (2.4-4.4x less time
      than the whole-sequence mask at S = 2048, B = 512 / 256) unless the rule keeps everything (the dense teacher:
      a tile would gather its whole prefix), else "cpu"; inference "cpu_blocks";
    - elsewhere "reference".

    Args:
        device: "cuda" or "cpu" (any other type runs the reference).
        batch, q_heads, head_dim, length: the query's `[B, Hq, Q, D]` sizes (Q = S teacher-forced).
        sink, window, topk: the rule; `topk` None when the caller does not know the bound (the gathered tiles would
            then find it with a host sync).
        shared: key positions shared by the heads ([B, N]).
        grad: a gradient flows through the attention (training).
        cpu_kernels: the CPU's fused kernels are there.
    """
    if device == "cuda":
        if not shared:
            return "sdpa"
        if grad and topk is not None:
            saved = batch * q_heads * head_dim * length * (length / 2 - (sink + window + topk + GATHER_TILE_CUDA))
            if saved >= GATHER_MIN_WORK:
                return "gather"
        return "flex"
    if device == "cpu" and cpu_kernels:
        if grad:
            return "gather" if shared and sink + window < length else "cpu"
        return "cpu_blocks"
    return "reference"


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


__all__ = ["BACKENDS", "GATHER_MIN_WORK", "GATHER_TILE_CUDA", "auto_backend", "run_backend"]
