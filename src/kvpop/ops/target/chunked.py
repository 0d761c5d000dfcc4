"""Log future attention mass on any device: a loop over chunks of queries, `O(chunk * S)` memory.

For each chunk of queries `d` the logits against every key they may reach are formed, shifted by the
queries' log-normalisers, and folded into a running log-sum-exp per (query head, key). No `[S, S]`
tensor is ever allocated. This is the CPU backend; on CUDA `flex.py` is faster.
"""

from __future__ import annotations

import torch
from torch import Tensor


def log_future_mass_chunked(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, Hkv, S, D]
    lse: Tensor,  # [B, Hq, S]
    window: int,
    scale: float,
    chunk: int = 256,
    softcap: float | None = None,
) -> Tensor:
    """`log sum_{d >= t + window} exp(l(d, t) - lse[d])` for every query head and key `t`.

    `l(d, t) = scale * q_d . k_t`, soft-capped to `c * tanh(l / c)` with `softcap = c` (None: not capped).

    Args:
        query: [B, Hq, S, D]; query head `hq` reads KV head `hq // G`.
        key: [B, Hkv, S, D].
        lse: [B, Hq, S], natural log.
        window: a query `d` counts for key `t` when `d >= t + window`.
        scale: logit scale.
        chunk: queries per step; the working set is about `B * Hq * chunk * S` float32 values.
    Returns:
        float32 [B, Hq, S]; `-inf` for keys no query reaches.
    """
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    k = key.float()
    lse = lse.float()
    # running log-sum-exp, laid out [.., t, g] so each chunk's reduction runs over the last axis
    acc = torch.full((B, Hkv, S, G), float("-inf"), device=query.device)
    # queries before `window` reach no key
    for d0 in range(window, S, chunk):
        d1 = min(d0 + chunk, S)
        C = d1 - d0
        # keys t <= d1 - 1 - window are the only ones this chunk reaches
        T = d1 - window
        q = (query[:, :, d0:d1].float() * scale).reshape(B, Hkv, G * C, D)
        # one matmul per KV head: the G query heads sharing it are stacked along the columns
        logits = torch.matmul(k[:, :, :T], q.transpose(-1, -2)).view(B, Hkv, T, G, C)
        if softcap is not None:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        logits.sub_(lse[:, :, d0:d1].reshape(B, Hkv, 1, G, C))
        # only keys t > d0 - window miss some of the chunk's queries; mask just that band
        t0 = max(0, d0 - window + 1)
        t = torch.arange(t0, T, device=query.device)
        d = torch.arange(d0, d1, device=query.device)
        too_early = d[None, :] < t[:, None] + window  # [T - t0, C]
        logits[:, :, t0:].masked_fill_(too_early[:, None, :], float("-inf"))
        # log-sum-exp over the chunk in place, so the chunk costs one [T, G * C] buffer
        top = logits.amax(dim=-1)
        # a key whose whole row is masked has top = -inf; shifting by 0 keeps it -inf instead of NaN
        top = torch.where(torch.isfinite(top), top, 0.0)
        part = logits.sub_(top[..., None]).exp_().sum(dim=-1).log_().add_(top)
        acc[:, :, :T] = torch.logaddexp(acc[:, :, :T], part)
    return acc.permute(0, 1, 3, 2).reshape(B, Hq, S)
