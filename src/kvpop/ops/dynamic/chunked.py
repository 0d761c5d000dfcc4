"""The chunked TOVA pool (an extension): the dynamic rules' decisions once every `C` tokens, not after each one.

The per-token rules (TOVA, the layer-wide KVpop-cascade) decide after every query, so their prefill is a sequential
walk over the prompt (`README.md` beside this file). The chunked rule decides after every `C`-th step, from the
`C` queries of the chunk that just ended, all at once:

- while a chunk is read, nothing is evicted: query `q` sees the `K` long-range slots held at the chunk's start and
  the chunk's tokens up to itself, so the cache holds at most `K + C` tokens;
- a candidate's chunk score is its attention probability averaged over the layer's query heads and over the
  chunk's queries that see it (each normalised over what that query sees): every one of them for a held token,
  the queries from its own on for a token of the chunk. With `C = 1` that is TOVA's head-averaged latest attention;
- the pool (the last `pool` slots, the same tokens in every KV head) keeps the `pool` best of its tokens and the
  chunk's by (score, position): the newer wins a tie;
- each KV head's static pool (the first `K - pool` slots) keeps the `K - pool` best of its own tokens and the pool's
  losers by (static priority, position); the rest are evicted, invisible from the next chunk's first query on.

H2O's chunked rule (`protect`) ranks by accumulated attention instead: each candidate carries its score (the
static priority's place, `cand_prior`), to which a chunk adds its probability summed over the chunk's queries and
the query heads of its KV head; the `protect` newest tokens (H2O's window less the ring) stay, and each KV head keeps
the best of the others by (score, position) in the remaining slots (no pool: H2O ranks per head).

With `pool = K` it is TOVA's rule (head average, no sinks), chunked. With `C = 1` each makes its per-token rule's
decisions exactly: the cascade's (the leaving token meets the pool first, whichever loses meets the static pool) and
H2O's (with `protect = window - 1`). The decisions of a chunk are parallel: one GEMM of its queries against its candidates, a softmax and two sorts, so a
prefill of `S` tokens takes `S / C` sequential rounds instead of `S`.

Chunks are counted in steps of the batch (padding steps count): every row decides after the same step.
`chunked_eviction_positions` is the teacher-forced execution (the eviction position of every token of a sequence,
for `ops.attention.sparse_attention`), `cache.ChunkedLayerCache` the prefill and decode one (the same decision on the
same tensors); `chunk_decision_reference` is the rule stated slot by slot in Python, the reference the tests compare
with. In a `KVpopConfig` the chunk's ring is the window (`with_decision_chunk`: `window = C`, `topk = budget - C`).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from kvpop.ops.dynamic import chunked_kernel as _kernels
from kvpop.ops.topk import NEVER


def chunk_probs(
    query: Tensor,  # [B, Hq, L, D]
    cand_keys: Tensor,  # [B, H, M, D], the held slots (K) then the chunk's tokens (L)
    held: Tensor,  # [B, H, K] bool: the slot holds a token
    chunk_valid: Tensor,  # [B, L] bool
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """Each chunk query's attention probabilities over the candidates it sees: float32 [B, H, G, L, M] (query head
    `h * G + g` reads KV head `h`); a padding query's row is 0.

    Every query is normalised over what it sees: the held slots of its KV head and the chunk's valid tokens up to
    itself. These are the chunk's attention weights as well as the decision's evidence (`chunk_scores`)."""
    B, Hq, L, D = query.shape
    H, M = cand_keys.shape[1], cand_keys.shape[2]
    G = Hq // H
    logits = torch.matmul(query.reshape(B, H, G * L, D).float() * scale, cand_keys.float().transpose(-1, -2))
    logits = logits.view(B, H, G, L, M)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    # what each query sees as an additive mask (0 or -inf), built from its small factors: the held slots of its KV
    # head, the chunk's valid tokens up to itself, nothing for a padding query (its row is 0 after the softmax's
    # NaN). Adding it is bit for bit a masked fill, and far faster on the CPU than filling through a broadcast mask
    i = torch.arange(L, device=query.device)
    causal = i[None, :] <= i[:, None]  # [L (query), L (token)]
    row = torch.log(chunk_valid.float())  # [B, L]: 0, or -inf for a padding query
    held_bias = torch.log(held.float())[:, :, None, :] + row[:, None, :, None]  # [B, H, L, K]
    chunk_bias = torch.log((causal[None] & chunk_valid[:, None, :]).float()) + row[:, :, None]  # [B, L, L]
    bias = torch.cat([held_bias, chunk_bias[:, None].expand(B, H, L, L)], dim=-1)  # [B, H, L, M]
    probs = torch.softmax(logits.add_(bias[:, :, None]), dim=-1)
    return probs.nan_to_num_(0.0)


def scores_from_probs(probs: Tensor, chunk_valid: Tensor) -> Tensor:
    """`chunk_scores` from `chunk_probs`' weights: each candidate's probability averaged over the query heads and
    the valid queries that see it. float32 [B, M]."""
    return scores_from_sums(probs.sum(3), chunk_valid)


def scores_from_sums(sums: Tensor, chunk_valid: Tensor) -> Tensor:
    """`chunk_scores` from each candidate's probability summed over the chunk's queries per query head (`sums`,
    float32 [B, H, G, M]: `chunk_probs(...).sum(3)`, or `round_evidence`'s). float32 [B, M]."""
    B, H, G, M = sums.shape
    L = chunk_valid.shape[-1]
    K = M - L
    # over the heads in one order for every column (with one query, the per-token rules' head average to the bit)
    total = sums.permute(0, 3, 1, 2).reshape(B, M, H * G).sum(-1)  # [B, M]
    q_valid = chunk_valid.sum(-1, keepdim=True)  # [B, 1]
    # a chunk token t is seen by the valid queries from t on
    after = torch.flip(torch.cumsum(torch.flip(chunk_valid.long(), [-1]), -1), [-1])  # [B, L]
    count = torch.cat([q_valid.expand(B, K), torch.where(chunk_valid, after, 0)], dim=-1).float()
    return torch.where(count > 0, total / (H * G * count.clamp(min=1)), 0.0)


def chunk_scores(
    query: Tensor,  # [B, Hq, L, D]
    cand_keys: Tensor,  # [B, H, M, D], the held slots (K) then the chunk's tokens (L)
    held: Tensor,  # [B, H, K] bool: the slot holds a token
    chunk_valid: Tensor,  # [B, L] bool
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """Each candidate's chunk score: its probability averaged over the layer's query heads and the valid queries
    of the chunk that see it. float32 [B, M]; 0 where no valid query sees it.

    The floats are the same in every execution (the teacher-forced walk, the cache and the reference): each calls
    `chunk_probs` and `scores_from_probs` on the same tensors."""
    return scores_from_probs(chunk_probs(query, cand_keys, held, chunk_valid, scale, softcap), chunk_valid)


def accumulated_from_sums(sums: Tensor) -> Tensor:
    """H2O's evidence from a chunk: each candidate's probability summed over the chunk's queries (`sums`, float32
    [B, H, G, M]; a padding query adds 0) and over the query heads of its KV head, float32 [B, H, M]. The heads are
    summed as the per-token rule sums them (`ops.dynamic.score.score_update`, score "sum"), so one query adds the
    same floats."""
    return sums.transpose(2, 3).contiguous().sum(-1)


FUSED = True
"""Whether a round runs as the Triton kernels of `chunked_kernel.py` where they can run (CUDA; Triton's interpreter
on the CPU); False runs the PyTorch form everywhere (the reference the kernels are tested against)."""


_KERNELS_RUN: dict[tuple[str, int | None], bool] = {}
"""Per device: whether the kernels compiled and ran on a small round (`_fused`)."""


def _fused(t: Tensor) -> bool:
    """Whether a round on `t`'s device runs as the Triton kernels. The first time a device asks, a small round
    tries them: one that cannot compile or launch there (a card they were never tried on) leaves that device's
    rounds to PyTorch from its first round on, so both executions decide alike."""
    if not (FUSED and _kernels.available(t)):
        return False
    device = (t.device.type, t.device.index)
    if device not in _KERNELS_RUN:
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return True  # a user's own capture: no trial inside it (it would be captured too)
        _KERNELS_RUN[device] = _kernels_run(t.device)
    return _KERNELS_RUN[device]


def _kernels_run(device: torch.device) -> bool:
    try:
        q = torch.ones(1, 1, 2, 16, device=device)
        keys = torch.ones(1, 1, 4, 16, device=device)
        held = torch.ones(1, 1, 2, dtype=torch.bool, device=device)
        _, sums = _kernels.round_evidence_fused(q, keys, keys, held, held[:, 0], 0.25)
        pos = torch.arange(4, device=device).expand(1, 1, 4).contiguous()
        _kernels.chunk_decision_fused(sums[:, 0, 0], pos, sums[:, :, 0], 2, 1)
        return True
    except Exception as err:  # noqa: BLE001 - whatever stops them here: the PyTorch form instead
        warnings.warn(f"kvpop: the chunked rule's fused round cannot run on {device} ({err}); its rounds run in "
                      "PyTorch", RuntimeWarning, stacklevel=4)
        return False


def round_evidence(
    query: Tensor,  # [B, Hq, L, D]
    cand_keys: Tensor,  # [B, H, M, D]
    cand_values: Tensor | None,  # [B, H, M, Dv]
    held: Tensor,  # [B, H, K] bool
    chunk_valid: Tensor,  # [B, L] bool
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor | None, Tensor]:
    """What a round reads from the chunk's attention: its output [B, Hq, L, Dv] (None without values) and each
    candidate's probability summed over the chunk's queries, float32 [B, H, G, M]. In PyTorch from `chunk_probs`;
    on CUDA one Triton launch (`chunked_kernel.round_evidence_fused`), its own floats."""
    if _fused(query):
        return _kernels.round_evidence_fused(query, cand_keys, cand_values, held, chunk_valid, scale, softcap)
    probs = chunk_probs(query, cand_keys, held, chunk_valid, scale, softcap)
    out = chunk_attention(probs, cand_values) if cand_values is not None else None
    return out, probs.sum(3)


def protected_rank(score: Tensor, cand_pos: Tensor, protect: int) -> Tensor:
    """H2O's rank of the candidates [B, H, M]: `+inf` for the `protect` newest tokens (its window, kept whatever they
    scored), the accumulated score for the others. Positions count real tokens, so the newest are those within
    `protect` of the newest candidate (the same tokens in every head: the chunk's, and the newest held ones)."""
    newest = cand_pos.amax(-1, keepdim=True)
    recent = (cand_pos >= 0) & (cand_pos > newest - protect)
    return torch.where(recent, float("inf"), score)


def decide_from_sums(
    sums: Tensor,  # [B, H, G, M], each candidate's probability summed over the chunk's queries
    cand_pos: Tensor,  # [B, H, K + L], -1: no token
    cand_prior: Tensor,  # [B, H, K + L]
    topk: int,
    pool: int,
    protect: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One decision from the chunk's evidence (`round_evidence`): (keep, evicted) as `chunk_decision` gives them,
    and each candidate's carried value after the chunk: its static priority unchanged (TOVA's and the cascade's
    rules), or with `protect` (H2O's) its accumulated score with the chunk's attention added. Every execution
    decides through this."""
    decision = chunk_decision
    if _fused(sums):
        decision = _kernels.chunk_decision_fused
    if protect is None:
        chunk_valid = cand_pos[:, 0, topk:] >= 0  # the chunk's tokens are the same in every head
        keep, evicted = decision(scores_from_sums(sums, chunk_valid), cand_pos, cand_prior, topk, pool)
        return keep, evicted, cand_prior
    score = cand_prior + accumulated_from_sums(sums)
    rank = protected_rank(score, cand_pos, protect)
    # no pool: every KV head ranks its own candidates (the pool's score argument goes unread with pool 0)
    keep, evicted = decision(score[:, 0], cand_pos, rank, topk, 0)
    return keep, evicted, score


def chunk_attention(probs: Tensor, cand_values: Tensor) -> Tensor:
    """The chunk's attention output from `chunk_probs`' weights: [B, Hq, L, Dv] in the values' dtype. A whole chunk's
    prefill computes its weights once for its output and its decision (`cache.ChunkedLayerCache`); the reference is
    `ops.attention.sparse_attention` over the same visible set."""
    B, H, G, L, M = probs.shape
    out = torch.matmul(probs.reshape(B, H, G * L, M), cand_values.float())  # [B, H, G * L, Dv]
    return out.view(B, H * G, L, -1).to(cand_values.dtype)


def _order(rank: Tensor, pos: Tensor) -> Tensor:
    """Indices along the last dim, best first: by rank, then by position (the newer first); empty (-inf, -1) last."""
    by_pos = pos.argsort(dim=-1, descending=True, stable=True)
    by_rank = rank.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True)
    return by_pos.gather(-1, by_rank)


def chunk_decision(
    score: Tensor,  # [B, M]
    cand_pos: Tensor,  # [B, H, M], -1: no token
    cand_prior: Tensor,  # [B, H, M]
    topk: int,
    pool: int,
) -> tuple[Tensor, Tensor]:
    """Which candidates the long-range slots keep after a chunk (module docstring).

    Candidates are the `K = topk` slots (the static pool `[0, K - pool)`, then the pool) followed by the chunk's
    `L` tokens. The pool's slots hold the same tokens in every KV head.

    Returns:
        keep: int64 [B, H, K], the candidate each new slot holds (static pool first, then the pool; the pool's
            entries are the same in every head);
        evicted: int64 [B, H, L], the candidates evicted (empty candidates among them are no token).
    """
    B, H, M = cand_pos.shape
    K = topk
    S = K - pool
    # the pool: its tokens and the chunk's, one ranking for the layer (head 0's positions: the same in every head)
    pool_cols = torch.arange(S, M, device=score.device)
    p_pos = cand_pos[:, 0, S:]
    p_score = torch.where(p_pos >= 0, score[:, S:], float("-inf"))
    p_order = pool_cols[_order(p_score, p_pos)]  # [B, pool + L]
    pool_keep, losers = p_order[:, :pool], p_order[:, pool:]
    # each head's static pool: its tokens and the pool's losers, by (static priority, position)
    s_cols = torch.cat([torch.arange(S, device=score.device).expand(B, S), losers], dim=-1)[:, None].expand(B, H, -1)
    s_pos = cand_pos.gather(-1, s_cols)
    s_rank = torch.where(s_pos >= 0, cand_prior.gather(-1, s_cols), float("-inf"))
    s_order = s_cols.gather(-1, _order(s_rank, s_pos))  # [B, H, S + L]
    keep = torch.cat([s_order[..., :S], pool_keep[:, None].expand(B, H, pool)], dim=-1)
    return keep, s_order[..., S:]


def chunk_round(
    query: Tensor,  # [B, Hq, L, D], the chunk's queries
    cand_keys: Tensor,  # [B, H, K + L, D], the long-range slots, then the chunk's tokens
    cand_pos: Tensor,  # [B, H, K + L], -1: no token
    cand_prior: Tensor,  # [B, H, K + L]
    topk: int,
    pool: int,
    scale: float,
    softcap: float | None = None,
    protect: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One decision after a chunk (`round_evidence`, then `decide_from_sums`): what every execution calls, so that they
    hand the same tensors to the same floats. Returns (keep, evicted, the candidates' carried values after it)."""
    held = cand_pos[:, :, :topk] >= 0
    chunk_valid = cand_pos[:, 0, topk:] >= 0  # the chunk's tokens are the same in every head
    _, sums = round_evidence(query, cand_keys, None, held, chunk_valid, scale, softcap)
    return decide_from_sums(sums, cand_pos, cand_prior, topk, pool, protect)


def chunked_eviction_positions(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, H, S, D]
    position: Tensor,  # [B, S]
    valid: Tensor,  # [B, S]
    prior: Tensor,  # [B, H, S]
    topk: int,
    pool: int,
    chunk: int,
    scale: float,
    softcap: float | None = None,
    protect: int | None = None,
) -> Tensor:
    """Teacher-forced: the eviction position of every token of a sequence under the chunked rule.

    A token evicted after the chunk ending at step `c` is invisible from the first real query after `c` on. With
    these, `ops.attention.sparse_attention` (sink 0, window 1, top-k `topk + chunk - 1`) gives the attention output.

    Args:
        prior: float32, each token's static priority (the static pool's rank; any values where `pool = topk`).
        topk: `K`, the long-range slots kept after each decision; pool: the slots ranked by the chunk score, in
            [0, topk]; chunk: `C >= 1`.
        protect: H2O's chunked rule: the newest tokens kept at each decision, in [0, topk); `prior` is then each
            token's starting score (H2O's: 0) and `pool` must be 0. None: TOVA's and the cascade's rules.
    Returns:
        int64 [B, H, S], `NEVER` for tokens never evicted (and for padding).
    """
    B, Hq, S_len, D = query.shape
    H = key.shape[1]
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk={chunk!r} must be an integer >= 1")
    if not (isinstance(topk, int) and topk >= 1 and isinstance(pool, int) and 0 <= pool <= topk):
        raise ValueError(f"topk={topk!r}, pool={pool!r}: need topk >= 1 and 0 <= pool <= topk")
    if protect is not None and not (isinstance(protect, int) and 0 <= protect < topk and pool == 0):
        raise ValueError(f"protect={protect!r} (H2O's chunked rule) must be an integer in [0, topk = {topk}) with "
                         f"pool 0, got pool {pool}")
    dev = key.device
    evict = torch.full((B, H, S_len + 1), NEVER, dtype=torch.long, device=dev)  # a scratch column last
    # the first real position after each step: when a decision after that step takes effect
    big = torch.iinfo(torch.long).max
    real_pos = torch.where(valid, position, big)
    next_pos = torch.flip(torch.cummin(torch.flip(real_pos, [-1]), -1).values, [-1])  # [B, S]: min over cols >= c
    slot_keys = key.new_zeros(B, H, topk, D)
    slot_col = torch.full((B, H, topk), -1, dtype=torch.long, device=dev)
    slot_pos = torch.full((B, H, topk), -1, dtype=torch.long, device=dev)
    slot_prior = torch.full((B, H, topk), float("-inf"), device=dev)
    for c0 in range(0, S_len - chunk + 1, chunk):
        c1 = c0 + chunk
        if c1 >= S_len:
            break  # no query after the last chunk: its decision changes no visibility
        cols = torch.arange(c0, c1, device=dev)
        cv = valid[:, c0:c1]
        cand_keys = torch.cat([slot_keys, key[:, :, c0:c1]], dim=2)
        cand_col = torch.cat([slot_col, torch.where(cv, cols, -1)[:, None].expand(B, H, chunk)], dim=2)
        cand_pos = torch.cat([slot_pos, torch.where(cv, position[:, c0:c1], -1)[:, None].expand(B, H, chunk)], dim=2)
        cand_prior = torch.cat([slot_prior, prior[:, :, c0:c1].float()], dim=2)
        keep, out, carried = chunk_round(query[:, :, c0:c1], cand_keys, cand_pos, cand_prior, topk, pool, scale,
                                         softcap, protect)
        # the evicted tokens: invisible from the first real query after this chunk
        out_col = cand_col.gather(-1, out)
        when = next_pos[:, c1][:, None, None].expand_as(out_col)
        # no token (an empty candidate) writes the scratch column
        evict.scatter_(2, torch.where(out_col >= 0, out_col, S_len), when)
        slot_keys = cand_keys.gather(2, keep[..., None].expand(-1, -1, -1, D))
        slot_col, slot_pos, slot_prior = (t.gather(-1, keep) for t in (cand_col, cand_pos, carried))
    return torch.where(valid[:, None], evict[..., :S_len], NEVER)


def chunk_decision_reference(score, cand_pos, cand_prior, topk: int, pool: int) -> list[list[set[int]]]:
    """The decision of one chunk stated slot by slot in Python (the reference of `chunk_decision`): per row and KV
    head, the set of candidate indices evicted (real tokens only).

    The pool's tokens and the chunk's compete by (score, position); the `pool` best stay. Each head's static tokens
    and the pool's losers compete by (static priority, position); the `topk - pool` best stay; the rest go."""
    B, H, M = cand_pos.shape
    S = topk - pool
    out = []
    for b in range(B):
        rows = []
        pool_cands = [m for m in range(S, M) if int(cand_pos[b, 0, m]) >= 0]
        ranked = sorted(pool_cands, key=lambda m: (float(score[b, m]), int(cand_pos[b, 0, m])), reverse=True)
        losers = ranked[pool:]
        for h in range(H):
            static = [m for m in range(S) if int(cand_pos[b, h, m]) >= 0] + losers
            kept = sorted(static, key=lambda m: (float(cand_prior[b, h, m]), int(cand_pos[b, h, m])), reverse=True)
            rows.append(set(kept[S:]))
        out.append(rows)
    return out
