"""A decode step's attention in Triton, split over the slots (flash-decoding): the CUDA path of `decode_attention`.

One query per row attends a layer's `N` slots. SDPA runs that as one program per (row, head) walking all `N`
keys: at batch 1 with 8 KV heads that is 8 to 32 programs on a 132-SM GPU, and cuDNN's kernel took 42.6 us per
layer over 2048 slots on an H100, more than the dense model's 31 us over 4096 keys (`bench/profile_decode_step.py`,
2026-12-06). Here each (row, KV head) is cut into splits of `SPLIT` slots, one program each:

1. `decode_split_fwd_kernel`: the program loads its KV head's `G` queries once (padded to 16 rows for `tl.dot`),
   walks its split in blocks of `BLOCK_N` slots with an online softmax over the occupied ones, and writes its
   running maximum, sum and unnormalised output (float32);
2. `decode_combine_kernel`: one program per (row, query head) rescales the splits to a common maximum and divides.

The reference is `reference.masked_attention` (and `sdpa.decode_attention`, the path elsewhere): the same
probabilities up to float rounding, with the probabilities cast to the values' dtype before the second product,
as flash attention does. Triton's interpreter (3.6) gets bfloat16 `tl.dot` wrong, so off CUDA the blocks are
multiplied in float32 (`F32`): the CPU tests check the algorithm, the CUDA tests the bfloat16 products. A row with
no occupied slot (padding before a row's first token) gives zeros.
`available()` says when it can run: Triton on CUDA, or its interpreter on the CPU (`TRITON_INTERPRET=1`, the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

# `available` (re-exported) says whether these kernels can run; without Triton, `triton` and `tl` are None and
# SDPA serves them
from kvpop.ops.triton_support import available as available
from kvpop.ops.triton_support import tl, triton

SPLIT = 128
"""Slots per program: 2048 slots at batch 1 with 8 KV heads give 128 programs, about one per SM of an H100."""

BLOCK_N = 64
"""Slots per inner step of a program."""



if triton is not None:

    @triton.jit
    def decode_split_fwd_kernel(
        q_ptr, k_ptr, v_ptr, occ_ptr,  # q [B, Hkv, G, D]; k, v [B, Hkv, N, D]; occ [B, Hkv, N] bool
        m_ptr, l_ptr, acc_ptr,  # out, float32: [B * Hkv, S, BG] twice and [B * Hkv, S, BG, DV]
        s_ptr,  # out, float32 [B * Hkv, G, N]: the scaled logits, -inf on empty slots (WRITE_S only)
        sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h,
        Hkv, G, N, D, DV, n_splits, scale,
        SPLIT_N: tl.constexpr, BLOCK: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
        F32: tl.constexpr, PRECISION: tl.constexpr, FROM_POS: tl.constexpr, WRITE_S: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_s = tl.program_id(1)
        i_b = i_bh // Hkv
        i_h = i_bh % Hkv
        o_g = tl.arange(0, BG)
        o_d = tl.arange(0, BD)
        o_dv = tl.arange(0, BDV)
        b_q = tl.load(q_ptr + i_b.to(tl.int64) * sq_b + i_h * sq_h + o_g[:, None] * sq_g + o_d[None, :],
                      mask=(o_g[:, None] < G) & (o_d[None, :] < D), other=0.0)  # [BG, BD]
        if F32:
            b_q = b_q.to(tl.float32)
        p_k = k_ptr + i_b.to(tl.int64) * sk_b + i_h * sk_h
        p_v = v_ptr + i_b.to(tl.int64) * sv_b + i_h * sv_h
        p_occ = occ_ptr + i_b.to(tl.int64) * so_b + i_h * so_h
        b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BG], dtype=tl.float32)
        b_acc = tl.zeros([BG, BDV], dtype=tl.float32)
        for n0 in range(0, SPLIT_N, BLOCK):  # a static trip count: the split's first slot is added below
            o_n = i_s * SPLIT_N + n0 + tl.arange(0, BLOCK)
            in_n = o_n < N
            b_k = tl.load(p_k + o_n[:, None] * sk_n + o_d[None, :], mask=in_n[:, None] & (o_d[None, :] < D), other=0.0)
            b_v = tl.load(p_v + o_n[:, None] * sv_n + o_dv[None, :], mask=in_n[:, None] & (o_dv[None, :] < DV),
                          other=0.0)
            if FROM_POS:  # the slots' positions: a slot is occupied where its position is >= 0
                keep = tl.load(p_occ + o_n, mask=in_n, other=-1) >= 0  # [BLOCK]
            else:
                keep = tl.load(p_occ + o_n, mask=in_n, other=0) != 0
            if F32:
                b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale  # [BG, BLOCK] float32
            b_s = tl.where(keep[None, :], b_s, float("-inf"))
            if WRITE_S:
                # the dynamic policies' score reads them back (`decode_score`): [G, N] floats per (row, KV head),
                # a few percent of the keys' and values' bytes
                tl.store(s_ptr + (i_bh.to(tl.int64) * G + o_g[:, None]) * N + o_n[None, :], b_s,
                         mask=(o_g[:, None] < G) & in_n[None, :])
            m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
            # nothing occupied yet (m_new = -inf): every term is 0, never exp(-inf - -inf)
            seen = m_new > float("-inf")
            alpha = tl.where(seen, tl.exp(b_m - m_new), 1.0)
            b_p = tl.where(keep[None, :] & seen[:, None], tl.exp(b_s - m_new[:, None]), 0.0)
            b_l = b_l * alpha + tl.sum(b_p, axis=1)
            b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
            b_m = m_new
        base = i_bh.to(tl.int64) * n_splits + i_s
        tl.store(m_ptr + base * BG + o_g, b_m)
        tl.store(l_ptr + base * BG + o_g, b_l)
        tl.store(acc_ptr + (base * BG + o_g[:, None]) * BDV + o_dv[None, :], b_acc)

    @triton.jit
    def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, i_bh, i_g, G, DV, n_splits,
                 BS: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr):
        # (row, KV head, query head of its group): its splits' [BS] statistics and [BS, BDV] outputs
        o_s = tl.arange(0, BS)
        o_dv = tl.arange(0, BDV)
        in_s = o_s < n_splits
        row = (i_bh.to(tl.int64) * n_splits + o_s) * BG + i_g  # [BS]
        b_m = tl.load(m_ptr + row, mask=in_s, other=float("-inf"))
        b_l = tl.load(l_ptr + row, mask=in_s, other=0.0)
        b_acc = tl.load(acc_ptr + row[:, None] * BDV + o_dv[None, :], mask=in_s[:, None], other=0.0)  # [BS, BDV]
        top = tl.max(b_m, axis=0)
        # splits with nothing occupied weigh 0; so does everything in a row with no occupied slot (its output: 0)
        w = tl.where(b_m > float("-inf"), tl.exp(b_m - top), 0.0)
        total = tl.sum(w * b_l, axis=0)
        out = tl.sum(w[:, None] * b_acc, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + (i_bh.to(tl.int64) * G + i_g) * DV + o_dv, out.to(out_ptr.dtype.element_ty), mask=o_dv < DV)

    @triton.jit
    def decode_combine_kernel(
        m_ptr, l_ptr, acc_ptr, out_ptr,  # out [B * Hkv, G, DV] in the query's dtype
        G, DV, n_splits,
        BS: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr,
    ):
        # one program per (row, KV head, query head of its group)
        _combine(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0), tl.program_id(1), G, DV, n_splits, BS, BG, BDV)

    @triton.jit
    def _score_block(
        m_ptr, l_ptr, s_ptr, pos_ptr, pri_ptr, prior_ptr, real_ptr, i_b, i_u,
        Hkv, G, N, n_splits, sp_b, sp_h, sq_b, sq_h, sr_b, sr_h, decay,
        BS: tl.constexpr, BG: tl.constexpr, HP: tl.constexpr, GP: tl.constexpr, BLOCK_U: tl.constexpr,
        REDUCE: tl.constexpr, ACCUMULATE: tl.constexpr, ADD_PRIOR: tl.constexpr,
    ):
        # slots [i_u * BLOCK_U, + BLOCK_U) of row i_b, every KV head at once ([HP, GP, BLOCK_U] tiles: no loop, so
        # every load is in flight together): the step's probabilities from the logits and the splits' statistics
        # (the normaliser the combine computes), reduced as the score says, then each occupied slot's priority
        # rewritten (a padding step rewrites nothing)
        o_n = i_u * BLOCK_U + tl.arange(0, BLOCK_U)
        o_h = tl.arange(0, HP)
        o_g = tl.arange(0, GP)
        o_s = tl.arange(0, BS)
        in_n = o_n < N
        in_h = o_h < Hkv
        in_hg = in_h[:, None] & (o_g[None, :] < G)  # [HP, GP]
        i_b64 = i_b.to(tl.int64)
        bh = i_b64 * Hkv + o_h  # [HP]
        # the splits' statistics [HP, BS, GP]: each query head's maximum and sum over its occupied slots
        stat = ((bh[:, None] * n_splits + o_s[None, :]) * BG)[:, :, None] + o_g[None, None, :]
        m_stat = in_hg[:, None, :] & (o_s < n_splits)[None, :, None]
        b_m = tl.load(m_ptr + stat, mask=m_stat, other=float("-inf"))
        b_l = tl.load(l_ptr + stat, mask=m_stat, other=0.0)
        top = tl.max(b_m, axis=1)  # [HP, GP]
        w = tl.where(b_m > float("-inf"), tl.exp(b_m - top[:, None, :]), 0.0)
        total = tl.sum(w * b_l, axis=1)  # [HP, GP]
        p_s = s_ptr + ((bh[:, None] * G + o_g[None, :]) * N)[:, :, None] + o_n[None, None, :]
        b_s = tl.load(p_s, mask=in_hg[:, :, None] & in_n[None, None, :], other=float("-inf"))  # [HP, GP, BLOCK_U]
        # empty slots (and a head with none occupied) have probability 0
        b_p = tl.where(b_s > float("-inf"), tl.exp(b_s - top[:, :, None]) / total[:, :, None], 0.0)
        if REDUCE == 0:
            new = tl.max(b_p, axis=1)  # [HP, BLOCK_U]
        elif REDUCE == 1:
            new = tl.sum(b_p, axis=1)
        else:
            # the layer's head average, the same for every KV head; every slot sums its heads in the same order, so
            # equal probabilities give equal priorities (the rule's ties)
            mean = tl.sum(tl.sum(b_p, axis=1), axis=0) / (Hkv * G)  # [BLOCK_U]
            new = tl.zeros([HP, BLOCK_U], dtype=tl.float32) + mean[None, :]
        m_hn = in_h[:, None] & in_n[None, :]
        occupied = tl.load(pos_ptr + i_b64 * sp_b + (o_h * sp_h)[:, None] + o_n[None, :], mask=m_hn, other=-1) >= 0
        p_pri = pri_ptr + i_b64 * sq_b + (o_h * sq_h)[:, None] + o_n[None, :]
        if ACCUMULATE:
            # H2O's sum (decay 1, an exact product) or "cascade_sum"'s fading one
            new = tl.load(p_pri, mask=m_hn, other=0.0) * decay + new
        if ADD_PRIOR:
            new = new + tl.load(prior_ptr + i_b64 * sr_b + (o_h * sr_h)[:, None] + o_n[None, :], mask=m_hn, other=0.0)
        real = tl.load(real_ptr + i_b) != 0
        tl.store(p_pri, new, mask=m_hn & occupied & real)

    @triton.jit
    def decode_combine_score_kernel(
        m_ptr, l_ptr, acc_ptr, out_ptr, s_ptr, pos_ptr, pri_ptr, prior_ptr, real_ptr,
        Hkv, G, N, DV, n_splits, n_blocks, sp_b, sp_h, sq_b, sq_h, sr_b, sr_h, decay,
        BS: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr, HP: tl.constexpr, GP: tl.constexpr,
        BLOCK_U: tl.constexpr, REDUCE: tl.constexpr, ACCUMULATE: tl.constexpr, ADD_PRIOR: tl.constexpr,
    ):
        # one launch for both ends of the step: programs [0, B * Hq) combine the splits' outputs as
        # `decode_combine_kernel` does, the rest each update the priorities of a block of slots of one row
        i = tl.program_id(0)
        n_heads = tl.num_programs(0) - n_blocks
        if i < n_heads:
            _combine(m_ptr, l_ptr, acc_ptr, out_ptr, i // G, i % G, G, DV, n_splits, BS, BG, BDV)
        else:
            j = i - n_heads
            n_u = tl.cdiv(N, BLOCK_U)
            _score_block(m_ptr, l_ptr, s_ptr, pos_ptr, pri_ptr, prior_ptr, real_ptr, j // n_u, j % n_u, Hkv, G, N,
                         n_splits, sp_b, sp_h, sq_b, sq_h, sr_b, sr_h, decay, BS, BG, HP, GP, BLOCK_U, REDUCE,
                         ACCUMULATE, ADD_PRIOR)


def decode_attention_split(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, Dv]
    occupied: Tensor,  # [B, Hkv, N] bool, or the slots' int64 positions (occupied where >= 0)
    scale: float,
    split: int = SPLIT,
) -> Tensor:
    """`decode_attention` by splits of `split` slots (a multiple of `BLOCK_N`): out [B, Hq, 1, Dv].

    The occupancy may come as the slots' positions: the kernel compares them itself, where a `pos >= 0` beforehand
    would be one more launch per layer and step.

    Keys and values may be strided views (the cache's slot buffers without their scratch slot). A custom op, so
    that `torch.compile` (the fused decode step, the whole step under inductor) and CUDA graphs take it as one
    opaque call instead of tracing Triton."""
    if split % BLOCK_N:
        raise ValueError(f"split={split} must be a multiple of {BLOCK_N}")
    return _split_op(query, key, value, occupied, float(scale), int(split))


SCORE_FORMS: dict[str, tuple[int, bool, bool]] = {
    "max": (0, False, False),
    "cascade": (0, False, False),
    "sum": (1, True, False),
    "mean": (2, False, False),
    "cascade_mean": (2, False, False),
    "cascade_sum": (2, True, False),
    "prior": (2, False, True),
}
"""How `decode_attention_scored` turns a step's probabilities `P [B, Hkv, G, N]` into slot priorities, per score of
`ops.dynamic.score_update` (the reference): (reduction, adds the slot's priority times `decay`, adds the slot's
prior), the reduction 0 the max over a KV head's query heads, 1 their sum, 2 the mean over every query head of the
layer. A new score of one of these forms is one line here; any other score runs the reference (`cache.decode_step`)."""

SCORE_TILE = 4096
"""Elements of a priority-update program's `[KV heads, query heads per KV head, slots]` tile (powers of two): its
slots per program are what is left, at most 128 (the Qwen3-8B shape: 8 x 4 x 128)."""


def decode_attention_scored(
    query: Tensor,  # [B, Hq, 1, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, Dv]
    pos: Tensor,  # [B, Hkv, M >= N] int64, -1: an empty slot
    pri: Tensor,  # [B, Hkv, M] float32, updated in place
    prior: Tensor | None,  # [B, Hkv, M] float32, the slots' static priors (score "prior")
    real: Tensor,  # [B] bool, False: a padding step (no priority changes)
    scale: float,
    score: str,
    split: int = SPLIT,
    decay: float = 1.0,
) -> Tensor:
    """A dynamic policy's decode attention (`reference.scored_attention_reference`): the split attention over the
    occupied slots, and every occupied slot's priority rewritten from the step's probabilities as `score` says
    (`SCORE_FORMS`), in place. Out [B, Hq, 1, Dv].

    `pos`, `pri` and `prior` may hold columns past the `N` slots, which nothing reads or writes: a cache passes its
    buffers whole (the scratch slot last), so that a compiled step mutates its own input, in place, rather than a
    view of it that would be copied back.

    The split pass also writes its logits; one more launch combines the splits' outputs and, in other programs,
    turns the logits into probabilities with the combine's normaliser and updates the priorities: three launches,
    as many as the attention and the slot kernel of a one-pool rule take. Its probabilities are the reference's up to
    float rounding (the logits' product order differs); equal logits give equal priorities."""
    if split % BLOCK_N:
        raise ValueError(f"split={split} must be a multiple of {BLOCK_N}")
    if score not in SCORE_FORMS:
        raise ValueError(f"score={score!r} has no kernel form; known: {sorted(SCORE_FORMS)}")
    reduce, accumulate, add_prior = SCORE_FORMS[score]
    if add_prior and prior is None:
        raise ValueError(f"score={score!r} adds the slots' priors: pass prior")
    if pos.dtype != torch.int64 or pri.dtype != torch.float32:
        raise ValueError(f"pos ({pos.dtype}) must be int64 and pri ({pri.dtype}) float32")
    slots = (pos, pri, *(() if prior is None else (prior,)))
    if any(t.stride(-1) != 1 for t in slots):
        raise ValueError("decode_attention_scored needs pos, pri and prior contiguous in their last dimension")
    if any(t.shape[:2] != key.shape[:2] or t.shape[2] < key.shape[2] for t in slots):
        raise ValueError(f"pos, pri and prior ({', '.join(str(tuple(t.shape)) for t in slots)}) must cover the "
                         f"{key.shape[2]} slots of the keys {tuple(key.shape)}")
    return _scored_op(query, key, value, pos, pri, prior if add_prior else None, real, float(scale), int(split),
                      reduce, accumulate, float(decay))


def _split_pass(query: Tensor, key: Tensor, value: Tensor, occupied: Tensor, scale: float, split: int,
                logits: Tensor | None = None):
    """The split kernel's launch: its statistics `(m, l, acc)` and the launch constants `(n_splits, BG, BDV)`."""
    B, Hq, _, D = query.shape
    Hkv, N, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G, D)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    # the occupancy as it comes (bool, loaded as int1; or int64 positions): a conversion would be one more launch
    # per layer and step
    occ = occupied if occupied.stride(-1) == 1 else occupied.contiguous()
    if occ.dtype not in (torch.bool, torch.int64):
        raise ValueError(f"occupied must be bool or the slots' int64 positions, got {occ.dtype}")
    n_splits = triton.cdiv(N, split)
    # tl.dot needs at least 16 rows and 16 columns
    BG = max(16, triton.next_power_of_2(G))
    BD, BDV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    # wide heads (Gemma's 256) with 64-slot blocks in three pipeline stages need more shared memory than a Hopper
    # SM has: half the block and two stages there
    wide = max(BD, BDV) > 128
    block, stages = (BLOCK_N // 2, 2) if wide else (BLOCK_N, None)
    m = torch.empty(B * Hkv, n_splits, BG, dtype=torch.float32, device=query.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(B * Hkv, n_splits, BG, BDV, dtype=torch.float32, device=query.device)
    decode_split_fwd_kernel[(B * Hkv, n_splits)](
        q, key, value, occ, m, l_sum, acc, m if logits is None else logits,
        q.stride(0), q.stride(1), q.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), occ.stride(0), occ.stride(1),
        Hkv, G, N, D, Dv, n_splits, scale,
        SPLIT_N=split, BLOCK=block, BG=BG, BD=BD, BDV=BDV, F32=not query.is_cuda,
        FROM_POS=occ.dtype == torch.int64, WRITE_S=logits is not None,
        # float32 products stay float32 (not TF32's 10-bit mantissa): a float32 model decodes as SDPA does
        PRECISION="ieee" if query.dtype == torch.float32 or not query.is_cuda else "tf32", num_warps=4,
        **({} if stages is None else {"num_stages": stages}))
    return (m, l_sum, acc), (n_splits, BG, BDV)


@torch.library.custom_op("kvpop::decode_attention_split", mutates_args=())
def _split_op(query: Tensor, key: Tensor, value: Tensor, occupied: Tensor, scale: float, split: int) -> Tensor:
    B, Hq = query.shape[:2]
    Hkv, Dv = key.shape[1], value.shape[-1]
    G = Hq // Hkv
    (m, l_sum, acc), (n_splits, BG, BDV) = _split_pass(query, key, value, occupied, scale, split)
    out = torch.empty(B, Hq, 1, Dv, dtype=query.dtype, device=query.device)
    decode_combine_kernel[(B * Hkv, G)](
        m, l_sum, acc, out, G, Dv, n_splits,
        BS=triton.next_power_of_2(n_splits), BG=BG, BDV=BDV, num_warps=4)
    return out


@_split_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, occupied: Tensor, scale: float, split: int) -> Tensor:
    return query.new_empty(*query.shape[:3], value.shape[-1])


@torch.library.custom_op("kvpop::decode_attention_scored", mutates_args=("pri",))
def _scored_op(query: Tensor, key: Tensor, value: Tensor, pos: Tensor, pri: Tensor, prior: Tensor | None,
               real: Tensor, scale: float, split: int, reduce: int, accumulate: bool, decay: float) -> Tensor:
    B, Hq = query.shape[:2]
    Hkv, N, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    logits = torch.empty(B * Hkv, G, N, dtype=torch.float32, device=query.device)
    (m, l_sum, acc), (n_splits, BG, BDV) = _split_pass(query, key, value, pos, scale, split, logits)
    out = torch.empty(B, Hq, 1, Dv, dtype=query.dtype, device=query.device)
    HP, GP = triton.next_power_of_2(Hkv), triton.next_power_of_2(G)
    block_u = max(16, min(128, SCORE_TILE // (HP * GP)))
    n_blocks = B * triton.cdiv(N, block_u)
    # without a prior the kernel never reads its pointer: `pri` stands in
    rank = pri if prior is None else prior
    decode_combine_score_kernel[(B * Hq + n_blocks,)](
        m, l_sum, acc, out, logits, pos, pri, rank, real.contiguous(),
        Hkv, G, N, Dv, n_splits, n_blocks, pos.stride(0), pos.stride(1), pri.stride(0), pri.stride(1),
        rank.stride(0), rank.stride(1), decay,
        BS=triton.next_power_of_2(n_splits), BG=BG, BDV=BDV, HP=HP, GP=GP, BLOCK_U=block_u, REDUCE=reduce,
        ACCUMULATE=accumulate, ADD_PRIOR=prior is not None, num_warps=4)
    return out


@_scored_op.register_fake
def _(query, key, value, pos, pri, prior, real, scale, split, reduce, accumulate, decay) -> Tensor:
    return query.new_empty(*query.shape[:3], value.shape[-1])
