"""The dynamic policies' prefill walk by speculation: a block of decisions at once, verified, redone from a mismatch.

Same contract and decisions as `walk.dynamic_walk_torch` (its reference), for every score. The walk is
sequential because query `j`'s probabilities are normalised over the tokens held at `j`, which depend on
the decisions before `j`. But a block of `T` tokens (the slots held at its start plus its own tokens, `M =
N + T` candidate columns, as in `kernel.py`) needs only a few passes over its `[T, M]` logits:

1. speculate: every step's probabilities from one batched softmax over the held set as if the block
   evicted nothing (the slots at its start plus its tokens inserted so far, causal), hence every step's
   priorities ("max"/"mean" the last query's score, "sum" a cumulative sum over the steps);
2. select: step `j` evicts the weakest of its competitors (the token leaving the window and the
   long-range tokens) that no earlier step of the block evicted. The competitors a step can see are known
   in advance (the long-range tokens at the block start and the tokens that left the window up to `j`),
   so each step's are sorted once (`topk` of the `T` weakest: at most `j` of them are gone), and a light
   sequential pass takes each step's first one still held (a Triton program per row on CUDA, a Python
   loop on the host elsewhere), or, opt-in (`select="jacobi"`), every step takes it at once against the
   others' current choices, repeated to the fixed point that is the sequential answer (`_select_jacobi`);
3. verify: those evictions give the held set of every step, hence the exact normalisers, priorities and
   every step's decision, all steps at once. Where they agree the block is done (one host sync). At the
   first mismatch `m` the prefix before `m` is right, and the priorities just computed are exact up to
   step `m`; selecting again with them (step 2) keeps the prefix, gives step `m` its true decision and
   the steps after it a better speculation; then verify again. Each round fixes at least one more step,
   and the result is the fixed point `e = select(priorities(e))`, which the sequential walk's decisions
   are and no other sequence is (step `j`'s decision depends only on those before it).

Step `j`'s competition, as in `README.md`: the token `x` in the ring slot that `p` takes against the
long-range tokens; the weakest by (priority, position), empty slots `(-inf, -1)` first in slot order, a
`-inf` leaving token weakest of all (it never takes a slot). The lowest of these keys is evicted: `x`
itself, or the long-range token whose slot `x` then takes (an empty slot: nothing evicted). Keys are one
int64 per (step, column): the priority's bits made order-preserving in the high half, the column's rank
by (position, slot) in the low half, so exact ties resolve as the walk resolves them.

Its floats are its own (a blocked GEMM and batched softmax, a cumulative sum for "sum"), so against the
torch walk it can differ only where two priorities are within rounding of each other; exact ties (equal
keys, uniform attention) it resolves identically. Per block of `T` tokens everything is `[rows, T, M]`
at most (the logits `[B, Hkv, G, T, M]`); host syncs: one per verification round (one per block when the
speculation holds), plus, off CUDA, one per selection pass. `supported` says when it applies: empty slots
must carry `-inf` (as the cache makes them) and "mean" and "prior" need the heads' slots alike (as
`kernel.py`); `ops.dynamic.dynamic_walk` runs the torch walk otherwise. "prior" (KVpop-TOVA) is "mean" plus
each column's static prior, a per-column constant that moves with its token like its position.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvpop.ops.dynamic.kernel import available, tl, triton

BLOCK_T = {"cuda": 256, "cpu": 64}
"""Tokens per block by device: the logits of a block are `B x Hkv x G x T x (N + T)` float32. Longer blocks
pay fewer launches and syncs per token, shorter ones fewer verification rounds (mismatches grow with `T`);
on the CPU (2 threads, Hkv 2, G 4, D 64, N 512) 64 was fastest of 64, 128 and 256."""

_MAX = torch.iinfo(torch.long).max


def supported(slot_pos: Tensor, slot_pri: Tensor, score: str, slot_prior: Tensor | None = None) -> bool:
    """Whether the parallel walk takes these slots ([B, H, N]; `slot_prior` for "prior"); a few host syncs."""
    # an empty slot with a finite priority could win a comparison in the walk, which the candidates here leave out
    if not bool(((slot_pos >= 0) | (slot_pri == float("-inf"))).all()):
        return False
    if score in ("mean", "prior"):
        alike = [slot_pos, slot_pri] if slot_prior is None else [slot_pos, slot_pri, slot_prior]
        return all(torch.equal(t, t[:, :1].expand_as(t)) for t in alike)
    return True


def _order_keys(pri: Tensor, rank: Tensor) -> Tensor:
    """int64 keys ordered as (priority, rank): float32 `pri` [..., T, M], `rank` [..., M] in [0, 2^32)."""
    # +0.0 turns -0.0 into +0.0 (equal priorities, equal keys); flipping a negative float's other bits orders it
    bits = (pri + 0.0).view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.long() << 32) | rank[..., None, :]


_NEG_INF_KEY = int(_order_keys(torch.tensor([[float("-inf")]]), torch.zeros(1, dtype=torch.long)))
"""The key of a leaving token of priority -inf: below every other key (rank 0; other columns rank from 1)."""


def _priorities(
    logits: Tensor,  # [B, H, G, T, M]
    ins: Tensor,  # [B, Hd, M]
    rm: Tensor,  # [B, Hd, M]
    real: Tensor,  # [B, T]
    pri0: Tensor,  # [B, Hd, M]
    ins_pri: Tensor,  # [B, Hd, T]
    score: str,
    prior: Tensor | None = None,  # [B, Hd, M]
) -> tuple[Tensor, Tensor]:
    """Each column's priority at every step's decision, [B, Hd, T, M], and after the block, [B, Hd, M].

    Column `c` is inserted at step `ins[c]` (-1: before the block) and held at query `j` while `j < rm[c]`;
    `pri0` holds the priorities at the block's start (for "sum" 0 at the block's tokens, which start from
    their insertion priority `ins_pri` at their own step). The normalisers are over the held columns; a column
    inserted but no longer held gets the probability it would have under them (`exp(l - max) / sum`), so that
    its priority is a fair guess should a later round find it held after all. "prior": each column's static
    prior [B, Hd, M] is added to its "mean" score.
    """
    B, Hd, M = ins.shape
    T = logits.shape[3]
    N = M - T
    step = torch.arange(T, device=ins.device)[:, None]
    present = (ins[:, :, None, :] <= step)[:, :, None]  # [B, Hd, 1, T, M]
    held = present & (step < rm[:, :, None, :])[:, :, None]
    # a padded step's row may hold nothing (NaN below): it is never read
    top = logits.masked_fill(~held, float("-inf")).amax(dim=-1, keepdim=True)
    # capped: a column no longer held may exceed the held maximum
    ex = torch.exp((logits - top).clamp_(max=60.0))
    probs = ex / torch.where(held, ex, 0.0).sum(dim=-1, keepdim=True)
    if score == "max":
        new = probs.amax(dim=2)
    else:
        # added head by head, the same operation at every column: a reduction over a middle dimension may
        # take another path at the last columns (on the CPU) and break an exact tie by rounding
        heads = probs.unbind(2) if score == "sum" else probs.flatten(1, 2).unbind(1)
        new = heads[0]
        for h in heads[1:]:
            new = new + h
        if score in ("mean", "prior"):
            new = (new / len(heads))[:, None]
        if score == "prior":
            new = new + prior[:, :, None, :]
    update = present[:, :, 0] & real[:, None, :, None]
    if score == "sum":
        inc = torch.where(update, new, 0.0)
        # token i at its own step: its insertion priority plus its first probabilities, as the walk adds them
        own = inc[..., N:].diagonal(dim1=2, dim2=3)
        own.copy_(torch.where(real[:, None], ins_pri + own, own))
        run = torch.cat([pri0[:, :, None], inc], dim=2).cumsum(dim=2)
        return run[:, :, :T], run[:, :, T]
    # TOVA replaces: at step j every column has the last real query's score before j
    step = step[:, 0]
    last = torch.where(real, step, -1).cummax(dim=1).values  # [B, T]: the last real step <= j
    src = torch.cat([last.new_full((B, 1), -1), last], dim=1)  # [B, T + 1]: before step j, and after the block
    idx = src.clamp(min=0)[:, None, :, None].expand(B, Hd, T + 1, M)
    took = update.gather(2, idx) & (src >= 0)[:, None, :, None]
    out = torch.where(took, new.gather(2, idx), pri0[:, :, None])
    return out[:, :, :T], out[:, :, T]


@functools.cache
def _fused_priorities():
    """`_priorities` compiled: one graph per score and block shape, shapes made dynamic after a second one (a
    prefill has two: its full blocks and its last); past dynamo's recompile limit it runs eagerly."""
    return torch.compile(_priorities)


if triton is not None:

    @triton.jit
    def _first_free(b_c, b_ev, o_k, BK: tl.constexpr):
        # the first entry of b_c [BK] that is a column (>= 0) not in b_ev [BT]: its index (BK: none) and column
        b_hit = tl.max((b_c[:, None] == b_ev[None, :]).to(tl.int32), axis=1)  # [BK]
        r = tl.min(tl.where((b_hit == 0) & (b_c >= 0), o_k, BK))
        return r, tl.sum(tl.where(o_k == r, b_c, 0))

    @triton.jit
    def dynamic_select_fwd_kernel(
        cand_ptr,  # [R, T - START, K] int32: each step's competitors from START on, weakest first (-1: none)
        decide_ptr,  # [R, T] int8: whether step j evicts
        ev_ptr,  # [R, T] int32, in (steps before START) and out: the column step j evicts (-1: none)
        skip_ptr,  # [R] int32 out: entries passed over because an earlier step of the block evicted them
        T, K, START,
        BT: tl.constexpr, BK: tl.constexpr,
    ):
        i_r = tl.program_id(0)
        o_t = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        p_ev = ev_ptr + i_r.to(tl.int64) * T
        p_dec = decide_ptr + i_r.to(tl.int64) * T
        p_cand = cand_ptr + i_r.to(tl.int64) * (T - START) * K
        # [BT] the columns evicted so far, by step: the known ones before START
        b_ev = tl.load(p_ev + o_t, mask=o_t < START, other=-1)
        n_skip = tl.zeros([], dtype=tl.int32)
        # each step's flag and first BK competitors are loaded one step ahead
        d_next = tl.load(p_dec + START) != 0
        b_next = tl.load(p_cand + o_k, mask=(o_k < K) & (o_k <= START), other=-1)  # [BK]
        j = START
        while j < T:
            d, b_c = d_next, b_next
            more = j + 1 < T
            d_next = tl.load(p_dec + j + 1, mask=more, other=0) != 0
            b_next = tl.load(p_cand + (j + 1 - START) * K + o_k, mask=more & (o_k < K) & (o_k <= j + 1), other=-1)
            # the first competitor no earlier step evicted, BK at a time; one exists within the first j + 1
            r, e = _first_free(b_c, b_ev, o_k, BK)
            e = tl.where(d & (r < BK), e, -1)
            n_skip += tl.where(d & (r < BK), r, 0)
            r0 = BK
            while d & (e < 0) & (r0 <= j):
                b_c = tl.load(p_cand + (j - START) * K + r0 + o_k, mask=(r0 + o_k < K) & (r0 + o_k <= j), other=-1)
                r, e = _first_free(b_c, b_ev, o_k, BK)
                e = tl.where(r < BK, e, -1)
                n_skip += tl.where(r < BK, r0 + r, 0)
                r0 += BK
            tl.store(p_ev + j, e)
            b_ev = tl.where(o_t == j, e, b_ev)
            j += 1
        tl.store(skip_ptr + i_r, n_skip)


SELECTS = ("kernel", "jacobi")
"""How a round selects: "kernel" step by step (a Triton program per row on CUDA, a Python loop elsewhere), "jacobi"
every step at once, repeatedly (`_select_jacobi`)."""

JACOBI_ITERS = 4
"""Passes of the "jacobi" selection on CUDA before one host sync asks whether the last changed nothing (then the
choices are exact; else the steps go one by one). Off CUDA it passes until nothing changes. On the CPU at the 8B
shape's heads and blocks of 256 (2048 tokens, B = 512), from `_select`'s guesses, "mean" settled in 1-3 passes and
"sum" in 1-12 (2026-12-06)."""


def _select(
    key: Tensor,  # [B, Hd, T, M] int64
    enter: Tensor,  # [B, Hd, M]
    decide: Tensor,  # [B, Hd, T]
    stats: dict | None,
    start: int = 0,
    known: Tensor | None = None,  # [B, Hd, T]
    how: str = "kernel",
    empty: Tensor | None = None,  # [B, Hd]
) -> Tensor:
    """Each step's eviction under these keys from step `start` on, the steps before it keeping their `known`
    evictions: [B, Hd, T] columns (`M`: none). `how`: one of `SELECTS`; "jacobi" starts from a guess (`empty`:
    the empty long-range slots at the block's start)."""
    B, Hd, T, M = key.shape
    R = B * Hd
    if known is None:
        known = torch.full((B, Hd, T), M, dtype=torch.long, device=key.device)
    step = torch.arange(start, T, device=key.device)
    # step j sees the long-range columns and the leaving tokens up to j; at most j of them are gone before it
    val, cand = torch.where(enter[:, :, None, :] <= step[:, None], key[:, :, start:], _MAX).topk(
        T, dim=-1, largest=False)
    cand = cand.masked_fill(val == _MAX, -1).reshape(R, T - start, T)
    dec = decide.reshape(R, T)
    known = known.reshape(R, T)
    if how == "jacobi":
        if start > 0:
            # a redone round: the last round's choices from `start` on are a near guess (its keys differ a little)
            guess = known[:, start:]
        else:
            # a block that fills empty slots: they are every step's weakest competitors, in slot order, so the
            # d-th deciding step takes the d-th while there are any (`empty` [B, Hd] of them)
            taken = dec.long().cumsum(-1) - dec.long()  # [R, T] deciding steps before each
            fill = taken < (0 if empty is None else empty.reshape(R, 1))
            guess = torch.where(fill, cand.gather(2, taken.clamp(max=T - 1)[..., None])[..., 0], cand[..., 0])
        ev, skips, settled = _select_jacobi(cand, dec, known, start, M, JACOBI_ITERS if key.is_cuda else None,
                                            guess)
        # a long chain (a block filling empty slots: every step wants the next one) needs a pass per step: then
        # the steps one by one (one host sync here, beside the round's own)
        if bool(settled):
            if stats is not None:
                stats["skips"] = stats.get("skips", 0) + int(skips)
                stats["jacobi"] = stats.get("jacobi", 0) + 1
            return ev.reshape(B, Hd, T)
        if stats is not None:
            stats["jacobi_unsettled"] = stats.get("jacobi_unsettled", 0) + 1
    if available(key):
        ev = torch.where(known < M, known, -1).int()
        skips = torch.empty(R, dtype=torch.int32, device=key.device)
        dynamic_select_fwd_kernel[(R,)](
            cand.int().contiguous(), dec.to(torch.int8).contiguous(), ev, skips, T, T, start,
            BT=triton.next_power_of_2(T), BK=32, num_warps=4)
        ev = torch.where(ev >= 0, ev.long(), M)
        # counted only when asked: `int` waits for the GPU, and the round already syncs once for its mismatch
        skips = int(skips.sum()) if stats is not None else 0
    else:
        ev, skips = _select_host(cand, dec, known, start, M)
    if stats is not None:
        stats["skips"] = stats.get("skips", 0) + skips
    return ev.reshape(B, Hd, T)


def _select_jacobi(cand: Tensor, dec: Tensor, known: Tensor, start: int, M: int,
                   iters: int | None, guess: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`_select`'s choices for all steps at once: (evictions [R, T], entries skipped and whether the last pass
    changed nothing, 0-dim tensors).

    Step `j` evicts the first of its competitors `cand[:, j - start]` (weakest first, -1 after them) that no step
    before it evicted. Given every step's current choice, one pass makes each step's choice again against the
    steps before it, all steps in parallel: what a step evicted is known by the first step that evicts it (a
    `scatter_reduce` over the columns), so a competitor is gone for step `j` iff that step is below `j`. The exact
    choices are this pass's fixed point, and pass `p` makes at least the first `p` steps from `start` exact (step
    `j` depends only on the steps before it), so passes repeat until nothing changes (`iters` None) or `iters`
    times; at `iters >= 1` step `start` is always exact, which is all a round needs to progress. Any first
    choices will do (`guess` [R, T - start], else each step's weakest competitor); a near one saves passes."""
    R, T = dec.shape
    S = T - start
    steps = torch.arange(T, device=dec.device)
    at_step = steps[start:, None]  # [S, 1]
    real = cand >= 0
    col = cand.clamp(min=0)
    decided = dec[:, start:]
    ev = torch.where(decided, cand[..., 0] if guess is None else guess, M)
    first = torch.zeros(R, S, dtype=torch.long, device=dec.device)
    settled = torch.zeros((), dtype=torch.bool, device=dec.device)  # no pass, nothing shown
    for _ in range(S + 1 if iters is None else iters):
        whole = torch.cat([known[:, :start], ev], dim=1)  # [R, T]
        when = torch.full((R, M + 1), T, dtype=torch.long, device=dec.device).scatter_reduce_(
            1, whole, steps.expand(R, T), "amin")
        free = real & ~(when.gather(1, col.reshape(R, -1)).reshape(R, S, -1) < at_step)
        # the first free competitor: one exists (step j has at least j + 1 and at most j are gone)
        first = free.int().argmax(dim=-1)
        new = torch.where(decided, cand.gather(2, first[..., None])[..., 0], M)
        settled = torch.equal(new, ev) if iters is None else (new == ev).all()
        ev = new
        if iters is None and settled:
            break
    skips = torch.where(decided, first, 0).sum()
    return torch.cat([known[:, :start], ev], dim=1), skips, torch.as_tensor(settled, device=dec.device)


def _select_host(cand: Tensor, dec: Tensor, known: Tensor, start: int, M: int) -> tuple[Tensor, int]:
    """`_select`'s sequential pass on the host, in Python (a few hundred ns a step)."""
    R, T = dec.shape
    out, skips = [], 0
    for cands, decs, row in zip(cand.tolist(), dec.tolist(), known[:, :start].tolist()):
        gone = set(row)
        for j, d in enumerate(decs[start:], start):
            e = M
            if d:
                # the list holds at least j + 1 competitors (-1 after them) and at most j are gone
                for e in cands[j - start]:
                    if e not in gone:
                        break
                    skips += 1
                gone.add(e)
            row.append(e)
        out.append(row)
    return torch.tensor(out, device=dec.device), skips


def _block(
    logits: Tensor,  # [B, H, G, T, M]
    cand_pos: Tensor,  # [B, Hd, M]
    pri_state: Tensor,  # [B, Hd, N]
    position: Tensor,  # [B, T]
    real: Tensor,  # [B, T]
    slot: Tensor,  # [B, T]
    ins_pri: Tensor,  # [B, Hd, T]
    sink: int,
    window: int,
    topk: int,
    score: str,
    stats: dict | None,
    prior_state: Tensor | None = None,  # [B, Hd, N]
    priorities=None,
    select: str = "kernel",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One block: (evicted positions [B, Hd, T], slot positions and priorities after it [B, Hd, N], and the
    candidate column each slot then holds [B, Hd, N]). "prior": `prior_state` holds the slots' priors; a
    block token's prior is its insertion priority `ins_pri`. `priorities`: `_priorities` or its compiled form.
    `select`: how each round selects (`SELECTS`)."""
    _priorities_ = priorities or _priorities
    B, H, G, T, M = logits.shape
    Hd, N = cand_pos.shape[1], M - T
    dev = logits.device
    never = T
    step = torch.arange(T, device=dev)
    steps = step.expand(B, Hd, T)
    cols = torch.arange(M + 1, device=dev)
    # the column in the slot that step j's token takes: the block's last earlier real token there, else the slot's
    same = real[:, None, :] & (slot[:, None, :] == slot[:, :, None]) & (step[None, :] < step[:, None])  # [B, T, T]
    last = torch.where(same, step, -1).amax(-1)
    x = torch.where(last >= 0, N + last, slot)[:, None].expand(B, Hd, T)  # [B, Hd, T]
    held_x = cand_pos.gather(2, x) >= 0
    leaving = (real & (position >= sink + window))[:, None]
    decide = leaving & held_x  # [B, Hd, T]
    # a token in a sink or ring slot that a non-leaving token takes is dropped without a decision
    overwrite = real[:, None] & ~leaving & held_x
    ins = torch.cat([torch.where(cand_pos[..., :N] >= 0, -1, never),
                     torch.where(real, step, never)[:, None].expand(B, Hd, T)], dim=2)  # [B, Hd, M]
    rm0 = torch.full((B, Hd, M + 1), never, device=dev).scatter_(2, torch.where(overwrite, x, M), steps)[..., :M]
    rm0 = rm0.contiguous()  # as `removal` gives its minimum: one layout, one compiled graph when fused
    if score == "sum":
        pri0 = torch.cat([pri_state, pri_state.new_zeros(B, Hd, T)], dim=2)
    else:
        pri0 = torch.cat([pri_state, pri_state.new_full((B, Hd, T), float("-inf"))], dim=2)
    prior = None if prior_state is None else torch.cat([prior_state, ins_pri], dim=2)  # [B, Hd, M]

    def removal(ev: Tensor) -> tuple[Tensor, Tensor]:  # the step each column is evicted at, and its removal step
        # the first step that evicts it: no selection names a column twice (a "jacobi" one returns only when
        # settled), but should one, the verification sees the column gone from that first step on and redoes the
        # later one as a mismatch
        at = torch.full((B, Hd, M + 1), never, device=dev).scatter_reduce_(2, ev, steps, "amin")[..., :M]
        return at, torch.minimum(rm0, at)

    if topk == 0:
        ev = torch.where(decide, x, M)
        _, final = _priorities_(logits, ins, removal(ev)[1], real, pri0, ins_pri, score, prior)
        enter = torch.full_like(ins, never)
    else:
        # competitors: the long-range columns at the start, and each leaving token from its step on
        enter = torch.full((B, Hd, M + 1), never, device=dev)
        enter[..., sink + window : N] = -1
        enter = enter.scatter_(2, torch.where(decide, x, M), steps)[..., :M]
        # ties go to the older token, empty slots (position -1) first in slot order; rank 0 is kept for -inf
        order = (cand_pos * (M + 1) + cols[:M]).argsort(dim=-1)
        rank = torch.empty_like(order).scatter_(2, order, cols[1:].expand_as(order))
        xi = x[..., None]

        def keys(pri: Tensor) -> Tensor:
            key = _order_keys(pri, rank)
            # a leaving token of priority -inf never takes a slot: its key goes below every other
            lost = decide & (pri.gather(3, xi)[..., 0] == float("-inf"))
            return key.scatter_(3, xi, torch.where(lost[..., None], _NEG_INF_KEY, key.gather(3, xi)))

        # speculation: priorities as if the block evicted nothing
        pri, _ = _priorities_(logits, ins, rm0, real, pri0, ins_pri, score, prior)
        empty = (cand_pos[..., sink + window : N] < 0).sum(-1) if select == "jacobi" else None
        ev = torch.where(decide, _select(keys(pri), enter, decide, stats, how=select, empty=empty), M)
        rounds = 0
        while True:
            # verification: the priorities under the held sets these evictions give, every step's decision
            at, rm = removal(ev)
            pri, final = _priorities_(logits, ins, rm, real, pri0, ins_pri, score, prior)
            key = keys(pri)
            competing = (enter[:, :, None, :] <= step[:, None]) & (at[:, :, None, :] >= step[:, None])
            wrong = decide & (torch.where(competing, key, _MAX).argmin(dim=-1) != ev)
            first = torch.where(wrong, step, T).amin(dim=-1)  # [B, Hd]
            rounds += 1
            m = int(first.amin())
            if m == T:
                break
            if stats is not None:
                stats["mismatch_rows"] = stats.get("mismatch_rows", 0) + int((first < T).sum())
                stats.setdefault("first_mismatch", []).extend(first[first < T].tolist())
            # the steps before m are right and these priorities exact up to m: select again from m
            ev = torch.where(decide, _select(key, enter, decide, stats, m, ev, how=select), M)
        if stats is not None:
            stats["rounds"] = stats.get("rounds", 0) + rounds
            stats["blocks"] = stats.get("blocks", 0) + 1
    if stats is not None:
        stats["decisions"] = stats.get("decisions", 0) + int(decide.sum())

    # the slots after the block: a promoted leaving token takes the slot of the token it evicted
    promoted = decide & (ev != x)
    parent = cols.expand(B, Hd, M + 1).clone()
    parent.scatter_(2, torch.where(promoted, x, M), torch.where(promoted, ev, M))
    for _ in range(T.bit_length() + 1):
        parent = parent.gather(2, parent)
    _, rm = removal(ev)
    kept = (ins <= T - 1) & (rm >= never) & (enter <= T - 1)  # held long-range columns after the block
    newest = torch.full((B, N + 1), -1, dtype=torch.long, device=dev).scatter_reduce(
        1, torch.where(real, slot, N), step.expand(B, T), "amax")[:, None, :N]
    col = torch.cat([torch.where(newest >= 0, N + newest, cols[:N]).expand(B, Hd, N),
                     torch.full((B, Hd, 1), N, device=dev)], dim=2)
    col = col.scatter_(2, torch.where(kept, parent[..., :M], N), cols[:M].expand(B, Hd, M))[..., :N]
    evicted = torch.where(decide, cand_pos.gather(2, ev.clamp(max=M - 1)), -1)
    return evicted, cand_pos.gather(2, col), final.gather(2, col), col


def dynamic_walk_parallel(
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
    score: str,
    block: int | None = None,
    stats: dict | None = None,
    slot_prior: Tensor | None = None,  # [B, H, N]
    fused: bool = False,
    select: str = "kernel",
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """See `ops.dynamic.dynamic_walk` (its four outputs); the slots must pass `supported`. `block`: tokens per
    block (`BLOCK_T` by device). `stats`, if given, counts per call (with a few host syncs more): blocks with long-range
    slots, their verification rounds, rows with a mismatch (and the step of each first mismatch), decisions,
    and skips (competitors passed over because an earlier step of their block evicted them). `fused`: the
    priorities' dozen elementwise passes over `[B, H, G, T, M]` compiled into few kernels by inductor (opt-in,
    for the bench: its floats are inductor's, so it is held to the same contract as this walk's own, not to
    its bits). `select`: "kernel" (the default: one step after another) or "jacobi" (every step at once, a few
    passes; opt-in until timed on a GPU), the same decisions (`SELECTS`)."""
    if select not in SELECTS:
        raise ValueError(f"select={select!r} must be one of {', '.join(SELECTS)}")
    B, Hq, C, D = query.shape
    H, N = key.shape[1], slot_pos.shape[-1]
    G = Hq // H
    # "mean" and "prior" rank alike in every KV head: one row of decisions per batch row
    Hd = 1 if score in ("mean", "prior") else H
    q = query.reshape(B, H, G, C, D).float() * scale
    keys = slot_keys.float()
    pos = slot_pos[:, :Hd].long()
    pri = slot_pri[:, :Hd].float()
    prior = None if slot_prior is None else slot_prior[:, :Hd].float()
    position = position.long()
    slot = torch.where(position < sink, position.clamp(min=0), sink + (position - sink).clamp(min=0) % window)
    ev = torch.full((B, Hd, C), -1, dtype=torch.long, device=key.device)
    block = block or BLOCK_T["cuda" if key.is_cuda else "cpu"]
    for c0 in range(0, C, block):
        blk = slice(c0, min(C, c0 + block))
        T = blk.stop - c0
        cand = torch.cat([keys, key[:, :, blk].float()], dim=2)  # [B, H, M, D]
        logits = torch.matmul(q[:, :, :, blk], cand[:, :, None].transpose(-1, -2))  # [B, H, G, T, M]
        cand_pos = torch.cat([pos, torch.where(valid[:, blk], position[:, blk], -1)[:, None].expand(B, Hd, T)], 2)
        ins_pri = priority[:, :Hd, blk].float()
        ev[:, :, blk], pos, pri, col = _block(
            logits, cand_pos, pri, position[:, blk], valid[:, blk], slot[:, blk], ins_pri,
            sink, window, topk, score, stats, prior, _fused_priorities() if fused else None, select)
        if prior is not None:  # each slot's prior is its token's
            prior = torch.cat([prior, ins_pri], dim=2).gather(2, col)
        keys = cand.gather(2, col.expand(B, H, N)[..., None].expand(B, H, N, D))
    out = (ev.expand(B, H, C).contiguous(), pos.expand(B, H, N).contiguous(), pri.expand(B, H, N).contiguous())
    return (*out, None if prior is None else prior.expand(B, H, N).contiguous())
