"""Prefill of the dynamic policies (TOVA, H2O): the eviction walk, one launch per layer where it can be.

A dynamic policy re-ranks its slots after every token, so its decisions are sequential. But a token
that leaves the cache never returns (the token leaving the window either takes the weakest long-range
slot or is dropped; a replaced slot's token is gone), so a prefill is fully described by *which token
each step evicts*: the walk below computes only those decisions (and the final slots), and the
chunk's attention output is then one sparse-attention call under the resulting eviction times, the
same call the static policies make (`ops/attention`).

`dynamic_walk` picks the backend: `reference` (the decode step, token by token), `torch` (the same
loop with a fraction of its operations, vectorised over batch and heads; the CPU default), `triton`
(one program per (batch, KV head), or per batch row for the layer-wide scores, that walks all positions with the
slot state on chip; the CUDA default for "max", "sum" and the cascades) or `parallel` (a block of decisions speculated at once, verified at once,
redone from the first mismatch; `parallel.py`; the CUDA default for "mean"). Every backend makes the decode step's decisions; the torch walk computes the very same
floats as the decode step (`step_probs`, `score_update`), so its slots equal a token-by-token replay
bit for bit. The derivation is in `README.md` beside this file.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from kvpop.ops.dynamic.score import CASCADES, LAYER_CASCADES, SCORES, Score, score_update
from kvpop.ops.topk import NEVER

Backend = Literal["auto", "reference", "torch", "triton", "parallel"]


def dynamic_walk(
    query: Tensor,  # [B, Hq, C, D]
    key: Tensor,  # [B, H, C, D]
    slot_keys: Tensor,  # [B, H, N, D]
    slot_pos: Tensor,  # [B, H, N]
    slot_pri: Tensor,  # [B, H, N]
    position: Tensor,  # [B, C]
    valid: Tensor,  # [B, C]
    priority: Tensor,  # [B, H, C]
    sink: int,
    window: int,
    topk: int,
    scale: float,
    score: Score,
    backend: Backend = "auto",
    slot_prior: Tensor | None = None,  # [B, H, N]
    pool: int | None = None,
    decay: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Insert `C` tokens into the slots of a dynamic policy, deciding each step's eviction.

    Slot layout as in `KVpopCache` (`[0, s)` sinks, `[s, s + w)` the window ring, `[s + w, N)` the
    long-range slots; `pos = -1` and `pri = -inf` mark an empty slot). Query `j` sees the slots after
    token `j` is inserted; its probabilities update the priorities (`score_update`) before step `j + 1`.

    Args:
        query: [B, Hq, C, D], the chunk's queries; `Hq` a multiple of `H`.
        key: [B, H, C, D], the chunk's keys as cached.
        slot_keys, slot_pos, slot_pri: the slots before the chunk: keys [B, H, N, D], positions
            int64 [B, H, N], priorities float32 [B, H, N].
        position: int64 [B, C], each token's position (real tokens counted per row); valid: bool [B, C].
        priority: float32 [B, H, C], each token's priority at insertion.
        sink, window, topk: the budget split, `N = sink + window + topk`.
        scale: the attention logit scale.
        score: how probabilities become priorities, one of `SCORES` ("max", "mean": TOVA; "sum": H2O;
            "prior": KVpop-TOVA, which needs `slot_prior`).
        backend: "auto" (on CUDA with Triton: "parallel" for "mean" and "prior", else "triton", the cascades
            included; else torch),
            "reference", "torch", "triton" or "parallel" (the torch walk where `parallel.supported` refuses the
            slots). The Triton walk does not carry priors: it refuses "prior".
        slot_prior: float32 [B, H, N], the slots' static priors ("prior" and the cascades only; a new token's prior
            is its `priority`).
        pool: the cascades only (KVpop-cascade, `KVpopConfig.tova_pool`), in [0, topk]: the last `pool` long-range
            slots form the pool ranked by the score, the first `topk - pool` the static pool ranked by
            `slot_prior`. "cascade" (TOVA's per-KV-head max): the token leaving the window meets the static pool's
            weakest (by prior; it wins ties, being the newest); whichever loses meets the score pool's weakest (by
            priority, ties to the newer position), and the loser of that is evicted. "cascade_mean" (the layer's
            head average, one ranking for every KV head): the other way round, so that the score pool holds the
            same tokens in every head: the leaving token meets the score pool's weakest first (it wins ties), and
            whichever loses meets the static pool's weakest by (prior, position). "cascade_sum" decides as
            "cascade_mean", its pool ranked by the accumulated attention. None for every other score.
        decay: "cascade_sum" only, in [0, 1]: each step's score is `decay x` the last plus the step's head-averaged
            attention (1: H2O's accumulated attention; 0: TOVA's latest, "cascade_mean"'s decisions).
        softcap: the model's logit soft-capping (Gemma 2), applied to the logits the probabilities come from, as the
            decode step does. The Triton and parallel walks do not take it: "auto" runs the torch walk then.
    Returns:
        evicted: int64 [B, H, C], the position of the token step `j` evicted (-1: none);
        pos, pri: the slots' positions and priorities after the chunk, [B, H, N];
        prior: the slots' priors after the chunk, [B, H, N] (None without `slot_prior`).
    """
    B, Hq, C, D = query.shape
    H, N = key.shape[1], slot_pos.shape[-1]
    if key.shape[:3] != (B, H, C) or Hq % H:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be [B, Hq, C, D] and "
                         "[B, H, C, D] with Hq a multiple of H")
    if N != sink + window + topk or slot_keys.shape[:3] != (B, H, N) or slot_pri.shape != (B, H, N):
        raise ValueError(f"slots (keys {tuple(slot_keys.shape)}, pos {tuple(slot_pos.shape)}, pri "
                         f"{tuple(slot_pri.shape)}) must hold sink + window + topk = {sink + window + topk} "
                         f"entries for batch {B} and {H} KV heads")
    if position.shape != (B, C) or valid.shape != (B, C) or priority.shape != (B, H, C):
        raise ValueError(f"position {tuple(position.shape)}, valid {tuple(valid.shape)} and priority "
                         f"{tuple(priority.shape)} must be [B, C], [B, C] and [B, H, C] = [{B}, {H}, {C}]")
    if window < 1 or sink < 0 or topk < 0:
        raise ValueError(f"sink={sink}, window={window}, topk={topk}: need sink >= 0, window >= 1, topk >= 0")
    if score not in SCORES:
        raise ValueError(f"score={score!r} must be one of {SCORES}")
    if (score in ("prior", *CASCADES)) != (slot_prior is not None):
        raise ValueError(f"score={score!r} and slot_prior: the slots' priors are given with scores 'prior' and "
                         f"{', '.join(map(repr, CASCADES))} only")
    if slot_prior is not None and slot_prior.shape != (B, H, N):
        raise ValueError(f"slot_prior {tuple(slot_prior.shape)} must be [B, H, N] = [{B}, {H}, {N}]")
    if (score in CASCADES) != (pool is not None):
        raise ValueError(f"score={score!r} and pool={pool!r}: the pool size is given with scores "
                         f"{', '.join(map(repr, CASCADES))} only")
    if pool is not None and not (isinstance(pool, int) and 0 <= pool <= topk):
        raise ValueError(f"pool={pool!r} must be an integer in [0, topk={topk}]")
    if decay != 1.0 and not (score == "cascade_sum" and 0.0 <= decay <= 1.0):
        raise ValueError(f"decay={decay!r}: score 'cascade_sum' takes a decay in [0, 1]; the other scores none")
    args = (query, key, slot_keys, slot_pos, slot_pri, position, valid, priority, sink, window, topk, scale, score)
    if softcap is not None:
        if backend not in ("auto", "torch", "reference"):
            raise ValueError(f"backend={backend!r} takes no logit soft-capping (softcap={softcap}): use 'auto', "
                             "'torch' or 'reference'")
        if backend == "reference":
            from kvpop.ops.dynamic.reference import dynamic_walk_reference

            return dynamic_walk_reference(*args, slot_prior, pool, decay, softcap=softcap)
        from kvpop.ops.dynamic.walk import dynamic_walk_torch

        return dynamic_walk_torch(*args, slot_prior, pool, decay, softcap=softcap)
    if score in CASCADES:
        # two pools per step: the parallel walk does not implement it; the kernel does (the CUDA default)
        if backend == "parallel":
            raise ValueError(f"backend={backend!r} does not run score {score!r}: use 'auto', 'triton', 'torch' or "
                             "'reference'")
        if backend == "auto":
            from kvpop.ops.dynamic.kernel import available

            backend = "triton" if query.is_cuda and available(query) else "torch"
        if backend == "reference":
            from kvpop.ops.dynamic.reference import dynamic_walk_reference

            return dynamic_walk_reference(*args, slot_prior, pool, decay)
        if backend == "triton":
            from kvpop.ops.dynamic.kernel import dynamic_walk_triton

            return dynamic_walk_triton(*args, slot_prior=slot_prior, pool=pool, decay=decay)
        from kvpop.ops.dynamic.walk import dynamic_walk_torch

        return dynamic_walk_torch(*args, slot_prior, pool, decay)
    if score == "prior" and backend == "triton":
        raise ValueError(f"backend={backend!r} does not run score 'prior' (its kernel carries no priors): use "
                         "'auto', 'parallel', 'torch' or 'reference'")
    if backend == "auto":
        backend = "torch"
        if query.is_cuda:
            from kvpop.ops.dynamic.kernel import available

            # measured on an H200 at the Qwen3-8B shape (docs/speed.md): the parallel walk
            # is faster for the head average (paper TOVA: 20 vs 26 us/token), the kernel for the rest (6.5
            # vs 16-28); the CPU keeps the torch walk, whose floats are the decode step's bit for bit
            # KVpop-TOVA's "prior" is the head average plus a per-token constant: the same walk
            backend = ("parallel" if score in ("mean", "prior") else "triton") if available(query) else "torch"
    if backend == "reference":
        from kvpop.ops.dynamic.reference import dynamic_walk_reference

        return dynamic_walk_reference(*args, slot_prior)
    if backend == "parallel":
        from kvpop.ops.dynamic.parallel import dynamic_walk_parallel, supported

        if supported(slot_pos, slot_pri, score, slot_prior):
            return dynamic_walk_parallel(*args, slot_prior=slot_prior)
        backend = "torch"
    if backend == "torch":
        from kvpop.ops.dynamic.walk import dynamic_walk_torch

        return dynamic_walk_torch(*args, slot_prior)
    if backend == "triton":
        from kvpop.ops.dynamic.kernel import dynamic_walk_triton

        return dynamic_walk_triton(*args)
    raise ValueError(f"backend={backend!r} must be one of 'auto', 'reference', 'torch', 'triton', 'parallel'")


def eviction_from_steps(
    evicted: Tensor,  # [B, H, C]
    position: Tensor,  # [B, C]
    cand_pos: Tensor,  # [B, H, M]
) -> Tensor:
    """Eviction positions of candidate tokens from the walk's per-step record (`dynamic_walk`).

    A token evicted at step `j` is invisible from query position `position[j]` on (`NEVER` if it
    survives the chunk): the `evict` argument of `ops.topk.mask_from_eviction` and `sparse_attention`.

    Args:
        evicted: int64 [B, H, C], the position each step evicted, -1 for none; each position at most once.
        position: int64 [B, C], the query position of each step.
        cand_pos: int64 [B, H, M], the candidates' positions (-1: no token).
    Returns:
        int64 [B, H, M].
    """
    B, H, C = evicted.shape
    if C == 0:
        return torch.full_like(cand_pos, NEVER)
    vals, order = evicted.sort(dim=-1)
    i = torch.searchsorted(vals, cand_pos.contiguous()).clamp(max=C - 1)
    hit = (vals.gather(-1, i) == cand_pos) & (cand_pos >= 0)
    step = order.gather(-1, i)
    when = position[:, None, :].expand(B, H, C).gather(-1, step)
    return torch.where(hit, when, NEVER)


def dynamic_eviction_positions(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, H, S, D]
    position: Tensor,  # [B, S]
    valid: Tensor,  # [B, S]
    priority: Tensor,  # [B, H, S]
    sink: int,
    window: int,
    topk: int,
    scale: float,
    score: Score,
    backend: Backend = "auto",
    pool: int | None = None,
    decay: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """Teacher-forced: the eviction position of every token of a sequence under a dynamic policy.

    The walk over an empty cache (`dynamic_walk`); with these, `ops.attention.sparse_attention` gives
    the sequence's attention output as decoding it token by token would.

    Returns:
        int64 [B, H, S], `NEVER` for tokens never evicted (and for padding).
    """
    B, H, S, D = key.shape
    N = sink + window + topk
    empty = torch.full((B, H, N), float("-inf"), device=key.device)
    evicted = dynamic_walk(
        query, key, key.new_zeros(B, H, N, D), position.new_full((B, H, N), -1), empty, position, valid, priority,
        sink, window, topk, scale, score, backend, slot_prior=empty if score in ("prior", *CASCADES) else None,
        pool=pool, decay=decay, softcap=softcap,
    )[0]
    return eviction_from_steps(evicted, position, torch.where(valid, position, -1)[:, None, :].expand(B, H, S))


def candidate_index(slot_pos: Tensor, cand_pos: Tensor) -> Tensor:
    """For each slot, the index of the candidate holding its token (0 for an empty slot).

    Args:
        slot_pos: int64 [B, H, N], positions after the walk (-1: empty).
        cand_pos: int64 [B, H, M], the candidates' positions, unique among those >= 0.
    Returns:
        int64 [B, H, N].
    """
    vals, order = cand_pos.sort(dim=-1)
    i = torch.searchsorted(vals, slot_pos.contiguous()).clamp(max=cand_pos.shape[-1] - 1)
    return torch.where(slot_pos >= 0, order.gather(-1, i), 0)


__all__ = [
    "CASCADES",
    "LAYER_CASCADES",
    "NEVER",
    "SCORES",
    "Score",
    "candidate_index",
    "dynamic_eviction_positions",
    "dynamic_walk",
    "eviction_from_steps",
    "score_update",
]
