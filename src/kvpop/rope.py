"""Keys before RoPE: undo the rotation the model gave each cached key (`KVpopConfig.scorer_keys="pre_rope"`).

A cached key carries its position's rotation, so a scorer reading it sees the position mixed into
the content. Hugging Face models rotate with `k' = k cos + rotate_half(k) sin`, the (cos, sin) the
attention module receives as `position_embeddings` ([B, S, D], the same for every head). Per
frequency this is a 2-d rotation scaled by `a = sqrt(cos^2 + sin^2)` (1 for plain RoPE, the
attention scaling of YaRN-style variants), so the inverse is

    k = (k' cos - rotate_half(k') sin) / (cos^2 + sin^2).

Qwen3 and Gemma 3 normalise keys before RoPE (QK-norm), so this gives the normalised key, which is what
the scorer wants. A model with a RoPE base per layer kind (Gemma 3: 1e6 in the full-attention layers,
1e4 in the sliding-window ones) hands each attention module its own (cos, sin); the retrofit passes on
that layer's, so each layer undoes its own rotation.
Computed in float32; the same elementwise ops on the same inputs in training, prefill and decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(key: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    """The keys before RoPE, float32.

    Args:
        key: [B, H, N, D] as cached (rotated).
        rope: the (cos, sin) that rotated them, each [B, N, D] (or broadcastable to it).
    Returns:
        float32 [B, H, N, D].
    """
    if rope is None:
        raise ValueError("scorer_keys='pre_rope' needs the model's rotary embeddings (cos, sin), which this "
                         "attention call did not receive: the model must pass position_embeddings to its attention")
    cos, sin = (t.float().unsqueeze(-3) for t in rope)  # [B, 1, N, D]
    k = key.float()
    return (k * cos - rotate_half(k) * sin) / (cos * cos + sin * sin)
