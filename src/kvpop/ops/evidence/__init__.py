"""Window evidence: the attention a token receives from the queries of its own window (`docs/method.md` Sec. 8).

For local entry `i` (a key) and query head `(h, g)`, the queries `d` of its window are those with
`i <= d <= i + w - 1`; each gives it the *window-normalised* probability

    p~(d -> i) = exp(l(d, i) - Lambda_d),    Lambda_d = logsumexp over the sinks and the window of d

(the keys every query keeps whatever the ranking decides; `README.md` says why not the full sparse
normaliser). Per entry the op returns the sum, the max and the latest of `p~` over its window's
queries seen so far, which is what the evidence scorer reads when the token leaves the window.

- `window_evidence`: any local sequence (a whole sequence in training; window ring + chunk in the
  cache's prefill); `backend="reference"` (dense float64, tests) or `"chunked"` (any device);
- `sequence_evidence`: a teacher-forced sequence with padding anywhere (compacted by position);
- `window_probs`: one decode step over the cache's sink and window slots.

Everything runs without autograd and in float32, also under autocast: the evidence is a scorer input,
detached like every scorer input.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

BACKENDS = ("auto", "reference", "chunked")


def window_evidence(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    key_valid: Tensor,  # [B, N]
    query_valid: Tensor,  # [B, Q]
    query_pos: Tensor,  # [B, Q]
    sink_key: Tensor,  # [B, Hkv, E, D]
    sink_pos: Tensor,  # [B, E]
    window: int,
    scale: float,
    backend: Literal["auto", "reference", "chunked"] = "auto",
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum, max and latest window-normalised attention each local entry gets from the given queries.

    The local entries are consecutive positions (entry `i` at position `offset + i`, the offset per row
    left to the caller); the queries are the last `Q` of them, query `j` being entry `N - Q + j`.
    Query `j` gives entry `i` evidence when `N - Q + j - w < i <= N - Q + j` (entry `i` is in its window)
    and both are valid; its normaliser runs over those same entries plus the sinks at positions
    `<= query_pos[j]`. Entries at sink positions belong in `sink_key`, not in `key_valid`, so that
    nothing is counted twice.

    Args:
        query: [B, Hq, Q, D], query head `hq` reads KV head `hq // G`.
        key: [B, Hkv, N, D], `N >= Q`.
        key_valid: bool [B, N], the entry is a real token past the sinks.
        query_valid: bool [B, Q].
        query_pos: int64 [B, Q], the queries' positions (decides which sinks they see).
        sink_key: [B, Hkv, E, D], the sinks (`E` may be 0).
        sink_pos: int64 [B, E], -1 for an absent sink.
        window: `w >= 1`.
        scale: logit scale.
        backend: "auto" (= "chunked"), "chunked", or "reference" (dense float64, tests only).
        chunk: queries per step of the chunked backend; None: `max(window, 128)`. A chunk's logits are
            `[chunk, chunk + w - 1]` of which a band of `w` per row is used, so chunks near `w` waste
            little, and far fewer than `w` pay the loop's per-step cost.
    Returns:
        stats float32 [B, Hkv, N, 3, G]: sum, max and latest `p~` (0 where no query reached the
        entry), and reached bool [B, N]: some query gave the entry evidence.
    """
    chunk = max(window, 128) if chunk is None else chunk
    _check(query, key, key_valid, query_valid, query_pos, sink_key, sink_pos, window, backend, chunk)
    args = (query, key, key_valid.bool(), query_valid.bool(), query_pos, sink_key, sink_pos, window, scale)
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):
        if backend == "reference":
            from kvpop.ops.evidence.reference import window_evidence_reference

            return window_evidence_reference(*args)
        from kvpop.ops.evidence.chunked import window_evidence_chunked

        return window_evidence_chunked(*args, chunk=chunk)


def sequence_evidence(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, Hkv, S, D]
    position: Tensor,  # [B, S]
    valid: Tensor,  # [B, S]
    sink: int,
    window: int,
    scale: float,
    backend: Literal["auto", "reference", "chunked"] = "auto",
    chunk: int | None = None,
) -> Tensor:
    """The evidence of every token of teacher-forced sequences, from all the queries of its window.

    Padding may sit anywhere: positions count real tokens (`position = cumsum(valid) - 1`), so the
    real tokens are first gathered in position order, where a window is a band of consecutive entries.
    A token whose window runs past the sequence's end gets what its window had by then.

    Returns:
        float32 [B, Hkv, S, 3, G] (padding and sinks: zeros).
    """
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    dev = query.device
    # compact index = position for real tokens; padding goes to a dump column S
    dest = torch.where(valid, position, S)  # [B, S]
    q = query.new_zeros(B, Hq, S + 1, D).scatter_(2, dest[:, None, :, None].expand(B, Hq, S, D), query)[:, :, :S]
    k = key.new_zeros(B, Hkv, S + 1, D).scatter_(2, dest[:, None, :, None].expand(B, Hkv, S, D), key)[:, :, :S]
    n = valid.sum(-1, keepdim=True)  # [B, 1]
    pos = torch.arange(S, device=dev).expand(B, S)
    real = pos < n
    e = min(sink, S)
    sink_pos = torch.where(real[:, :e], pos[:, :e], -1)
    stats, _ = window_evidence(q, k, real & (pos >= sink), real, pos, k[:, :, :e], sink_pos, window, scale,
                               backend=backend, chunk=chunk)
    # back to the input's order; padding and sinks get zeros
    src = torch.where(valid, position, 0)[:, None, :, None, None].expand(-1, Hkv, -1, *stats.shape[-2:])
    out = stats.gather(2, src)
    return torch.where((valid & (position >= sink))[:, None, :, None, None], out, 0.0)


def window_probs(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, n, D]
    occupied: Tensor,  # [B, Hkv, n]
    scale: float,
) -> Tensor:
    """One decode query's attention over the always-retained slots (sinks and window), normalised over them.

    Returns:
        float32 [B, Hkv, G, n], 0 on empty slots.
    """
    B, Hq, _, D = query.shape
    Hkv = key.shape[1]
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):
        q = (query.float() * scale).reshape(B, Hkv, Hq // Hkv, D)
        logits = torch.matmul(q, key.float().transpose(-1, -2)).masked_fill(~occupied[:, :, None], -torch.inf)
        # the chunked backend's arithmetic: exp(l - max) / sum
        top = logits.amax(-1, keepdim=True)
        p = torch.exp(logits - torch.where(torch.isfinite(top), top, 0.0))
        return p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


def _check(query, key, key_valid, query_valid, query_pos, sink_key, sink_pos, window, backend, chunk) -> None:
    if query.dim() != 4 or key.dim() != 4 or sink_key.dim() != 4:
        raise ValueError(f"query, key and sink_key must be [B, H, L, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(sink_key.shape)}")
    B, Hq, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key heads ({Hkv})")
    if key.shape[0] != B or key.shape[3] != D or sink_key.shape[:2] != key.shape[:2] or sink_key.shape[3] != D:
        raise ValueError(f"key {tuple(key.shape)} and sink_key {tuple(sink_key.shape)} must match query "
                         f"{tuple(query.shape)} in batch, heads and head dim")
    if N < Q:
        raise ValueError(f"the queries are the last Q = {Q} of the N = {N} local entries: need N >= Q")
    for name, t, shape in (("key_valid", key_valid, (B, N)), ("query_valid", query_valid, (B, Q)),
                           ("query_pos", query_pos, (B, Q)), ("sink_pos", sink_pos, (B, sink_key.shape[2]))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")


__all__ = ["BACKENDS", "sequence_evidence", "window_evidence", "window_probs"]
