"""Window evidence on any device: a loop over chunks of queries, each against its band of keys.

A chunk of `C` consecutive queries reaches only the `C + w - 1` local entries of its bands (and the
sinks), so its logits are one `[C, C + w - 1]` matmul per KV head; nothing of size `S x S` is ever
formed. Memory about `B * Hq * C * (C + w + E)` float32 values per chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor


def window_evidence_chunked(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    key_valid: Tensor,  # [B, N]
    query_valid: Tensor,  # [B, Q]
    query_pos: Tensor,  # [B, Q]
    sink_key: Tensor,  # [B, Hkv, E, D]
    sink_pos: Tensor,  # [B, E]
    window: int,
    scale: float,
    chunk: int = 128,
) -> tuple[Tensor, Tensor]:
    """Same contract as `window_evidence_reference` (float32 throughout).

    Returns:
        stats float32 [B, Hkv, N, 3, G] and reached bool [B, N].
    """
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    G, E = Hq // Hkv, sink_key.shape[2]
    dev = query.device
    k_all, sk = key.float(), sink_key.float()
    # [B, Hkv, 3, G, N]: sum, max, latest
    stats = torch.zeros(B, Hkv, 3, G, N, device=dev)
    reached = torch.zeros(B, N, dtype=torch.bool, device=dev)
    for j0 in range(0, Q, chunk):
        j1 = min(j0 + chunk, Q)
        C = j1 - j0
        a0, a1 = N - Q + j0, N - Q + j1  # the chunk's local indices
        k0 = max(0, a0 - window + 1)
        K = a1 - k0
        q = (query[:, :, j0:j1].float() * scale).reshape(B, Hkv, G * C, D)
        local = torch.matmul(q, k_all[:, :, k0:a1].transpose(-1, -2)).view(B, Hkv, G, C, K)
        fixed = torch.matmul(q, sk.transpose(-1, -2)).view(B, Hkv, G, C, E) if E else None
        a = torch.arange(a0, a1, device=dev)
        i = torch.arange(k0, a1, device=dev)
        band = (i[None, :] <= a[:, None]) & (i[None, :] > a[:, None] - window)  # [C, K]
        band = band & key_valid[:, None, k0:a1] & query_valid[:, j0:j1, None]  # [B, C, K]
        sinks = (sink_pos[:, None, :] >= 0) & (sink_pos[:, None, :] <= query_pos[:, j0:j1, None])  # [B, C, E]
        # the normaliser of each query over its always-retained keys (sinks and window), in place:
        # p = exp(l - top) / sum exp(l - top), 0 off the band
        local.masked_fill_(~band[:, None, None], -torch.inf)
        top = local.amax(-1)  # [B, Hkv, G, C]
        if E:
            fixed.masked_fill_(~sinks[:, None, None], -torch.inf)
            top = torch.maximum(top, fixed.amax(-1))
        # an invalid query has no key at all (-inf): shift it by 0, its probabilities are 0 anyway
        top = torch.where(torch.isfinite(top), top, 0.0)[..., None]
        p = local.sub_(top).exp_()
        z = p.sum(-1, keepdim=True)
        if E:
            z = z + fixed.sub_(top).exp_().sum(-1, keepdim=True)
        p.div_(z.clamp(min=torch.finfo(torch.float32).tiny))  # [B, Hkv, G, C, K]
        stats[:, :, 0, :, k0:a1] += p.sum(-2)
        stats[:, :, 1, :, k0:a1] = torch.maximum(stats[:, :, 1, :, k0:a1], p.amax(-2))
        latest = torch.where(band, torch.arange(C, device=dev)[None, :, None], -1).amax(1)  # [B, K]
        hit = latest >= 0
        last = p.gather(-2, latest.clamp(min=0)[:, None, None, None, :].expand(B, Hkv, G, 1, K))[..., 0, :]
        stats[:, :, 2, :, k0:a1] = torch.where(hit[:, None, None], last, stats[:, :, 2, :, k0:a1])
        reached[:, k0:a1] |= hit
    return stats.permute(0, 1, 4, 2, 3).contiguous(), reached
