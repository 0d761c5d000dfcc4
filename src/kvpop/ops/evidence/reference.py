"""Window evidence straight from its definition (`README.md`): dense, float64, tests only.

It forms every query's logits against every local entry and every sink, so keep sizes to a few
hundred. Masses are summed in linear space, so it shares no numerics with the chunked form it checks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def window_evidence_reference(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    key_valid: Tensor,  # [B, N]
    query_valid: Tensor,  # [B, Q]
    query_pos: Tensor,  # [B, Q]
    sink_key: Tensor,  # [B, Hkv, E, D]
    sink_pos: Tensor,  # [B, E]
    window: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Per local entry: sum, max and latest of the window-normalised attention its window's queries give it.

    Args: as `kvpop.ops.evidence.window_evidence`.
    Returns:
        stats float32 [B, Hkv, N, 3, G] and reached bool [B, N].
    """
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    G = Hq // Hkv
    q = query.double().reshape(B, Hkv, G, Q, D)
    a = torch.arange(N - Q, N, device=query.device)  # the queries' local indices
    i = torch.arange(N, device=query.device)
    band = (i[None, :] <= a[:, None]) & (i[None, :] > a[:, None] - window)  # [Q, N]
    band = band & key_valid[:, None, :] & query_valid[:, :, None]  # [B, Q, N]
    sinks = (sink_pos[:, None, :] >= 0) & (sink_pos[:, None, :] <= query_pos[:, :, None])  # [B, Q, E]
    local = torch.einsum("bhgqd,bhnd->bhgqn", q, key.double()) * scale
    fixed = torch.einsum("bhgqd,bhed->bhgqe", q, sink_key.double()) * scale
    # the normaliser: the always-retained keys of each query, sinks and window
    norm = torch.exp(torch.where(band[:, None, None], local, -torch.inf)).sum(-1)
    norm = norm + torch.exp(torch.where(sinks[:, None, None], fixed, -torch.inf)).sum(-1)
    p = torch.where(band[:, None, None], torch.exp(local) / norm.clamp(min=1e-300)[..., None], 0.0)  # [B,Hkv,G,Q,N]
    total = p.sum(-2)
    peak = p.amax(-2)
    # the latest query of each entry's band
    j = torch.arange(Q, device=query.device)
    latest = torch.where(band, j[None, :, None], -1).amax(1)  # [B, N]
    reached = latest >= 0
    last = p.gather(-2, latest.clamp(min=0)[:, None, None, None, :].expand(B, Hkv, G, 1, N))[..., 0, :]
    last = torch.where(reached[:, None, None], last, 0.0)
    stats = torch.stack([total, peak, last], dim=2)  # [B, Hkv, 3, G, N]
    return stats.permute(0, 1, 4, 2, 3).float(), reached
