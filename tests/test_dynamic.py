"""The dynamic policies' prefill walk (`ops/dynamic`) against today's path: the decode step, token by token.

The claim: a chunk prefilled through the walk leaves the cache's slots (keys, values, positions,
priorities) *bit for bit* as feeding the same tokens one at a time through `KVpopLayerCache`'s decode
step does, its eviction record is what that replay evicts, and its output equals the replay's up to
float rounding. Inputs include exact ties (duplicate and all-zero keys), odd sizes, the paper's splits
(sink 0 / window 1), left padding and several chunks in a row.
"""

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvpop
from helpers import assert_close, left_padded, run_triton_check
from kvpop.baselines import make_policy
from kvpop.cache import KVpopLayerCache
from kvpop.ops.attention import sparse_attention
from kvpop.ops.dynamic import (
    NEVER,
    SCORES,
    dynamic_eviction_positions,
    dynamic_walk,
    eviction_from_steps,
    score_update,
)

OUT_ATOL = 2e-5  # the chunk's attention output against the replay's per-step outputs, float32

POLICIES = {"tova": dict(policy="tova"), "tova-mean": dict(policy="tova", tova_head_average=True),
            "h2o": dict(policy="h2o")}
# (sink, window, topk): the defaults in small, the paper's TOVA (0, 1, B - 1) and H2O (0, B/2, B/2) splits,
# no long-range slots, a budget above the sequence
SPLITS = [(2, 3, 9), (0, 1, 7), (0, 5, 5), (3, 2, 0), (4, 30, 30)]


def _inputs(B, Hkv, G, S, D, ties: str | None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, S, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    if ties == "duplicates":
        # every third key repeats an earlier one, and queries repeat in pairs: exactly equal probabilities
        k[:, :, 2::3] = k[:, :, 0:1]
        k[:, :, 4::5] = k[:, :, 1:2]
        q[:, :, 1::2] = q[:, :, 0::2][:, :, : S // 2]
    elif ties == "zeros":
        # uniform attention: every priority ties, so age alone decides
        k.zero_()
    return q, k, v


def _layer_and_policy(sink, window, topk, Hkv, D, **policy):
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, **policy)
    return KVpopLayerCache(sink, window, topk), make_policy(cfg, Hkv, D)


def _replay(layer, policy, q, k, v, valid, scale):
    """Today's path: one `attend` per token (the decode step). Returns outputs [B, Hq, S, D], slots after each step."""
    outs, held = [], []
    for j in range(q.shape[2]):
        outs.append(layer.attend(q[:, :, j : j + 1], k[:, :, j : j + 1], v[:, :, j : j + 1], valid[:, j : j + 1],
                                 policy, scale))
        held.append(layer.pos.clone())
    return torch.cat(outs, 2), held


def _state(layer):
    return [t.clone() for t in (layer.keys, layer.values, layer.pos, layer.pri, layer.seen)]


def _assert_same_state(a, b, what):
    for name, x, y in zip(("keys", "values", "pos", "pri", "seen"), a, b):
        assert torch.equal(x, y), f"{what}: {name} differ"


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("sink,window,topk", SPLITS)
@pytest.mark.parametrize("ties", [None, "duplicates", "zeros"])
@torch.no_grad()
def test_one_chunk_equals_the_token_by_token_replay(name, sink, window, topk, ties):
    B, Hkv, G, S, D = 2, 2, 3, 41, 8
    q, k, v = _inputs(B, Hkv, G, S, D, ties)
    valid = torch.ones(B, S, dtype=torch.bool)
    scale = D**-0.5
    replay, policy = _layer_and_policy(sink, window, topk, Hkv, D, **POLICIES[name])
    want, held = _replay(replay, policy, q, k, v, valid, scale)
    fast, _ = _layer_and_policy(sink, window, topk, Hkv, D, **POLICIES[name])
    got = fast.attend(q, k, v, valid, policy, scale)
    _assert_same_state(_state(fast), _state(replay), f"{name} {sink}/{window}/{topk} {ties}")
    assert_close(got, want, OUT_ATOL, "chunk output")
    # the walk's eviction record is what the replay evicted: gone from the slots at that step, never back
    position = torch.arange(S)[None].expand(B, S)
    evict = dynamic_eviction_positions(q, k, position, valid, torch.zeros(B, Hkv, S), sink, window, topk, scale,
                                       policy.score)
    present = torch.stack(held, -1)[..., None, :] == torch.arange(S)[:, None]  # [B, H, N, token, step]
    present = present.any(2) | (torch.arange(S)[:, None] > torch.arange(S))  # not yet inserted counts as present
    gone = torch.where(present.all(-1), NEVER, (~present).long().argmax(-1))
    assert torch.equal(evict, gone)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("sink,window,topk", [(2, 3, 9), (0, 1, 7), (0, 4, 4), (1, 2, 0)])
@pytest.mark.parametrize("split", [(17, 30, 1, 1, 1, 13), (1, 5, 40, 1, 1, 15)], ids=str)
@torch.no_grad()
def test_chunks_and_decode_steps_with_left_padding(name, sink, window, topk, split):
    B, Hkv, G, D = 3, 2, 2, 16
    S = sum(split)
    q, k, v = _inputs(B, Hkv, G, S, D, "duplicates", seed=1)
    valid = left_padded(B, S, seed=2)
    scale = D**-0.5
    replay, policy = _layer_and_policy(sink, window, topk, Hkv, D, **POLICIES[name])
    want, _ = _replay(replay, policy, q, k, v, valid, scale)
    fast, _ = _layer_and_policy(sink, window, topk, Hkv, D, **POLICIES[name])
    outs, start = [], 0
    for n in split:
        sl = slice(start, start + n)
        outs.append(fast.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], valid[:, sl], policy, scale))
        start += n
    _assert_same_state(_state(fast), _state(replay), f"{name} {split}")
    got = torch.cat(outs, 2)
    real = valid[:, None, :, None].expand_as(got)
    assert_close(got[real], want[real], OUT_ATOL, "outputs at real tokens")


DECODED_SLOTS = [(1, 1, 1, 1, 4, 0, 1, 0), (2, 3, 1, 37, 4, 1, 1, 5), (1, 2, 4, 100, 8, 0, 50, 50),
                 (2, 1, 2, 70, 8, 3, 7, 11)]
"""(B, Hkv, G, S, D, sink, window, topk) of the walks that start from slots decoding left."""


def _walk_args_from_decoded_slots(score, B, Hkv, G, S, D, sink, window, topk, neg_inf) -> tuple:
    """`dynamic_walk`'s arguments for a chunk into the slots a replay of random tokens left, some priorities -inf."""
    g = torch.Generator().manual_seed(S)
    q, k, _ = _inputs(B, Hkv, G, S, D, None, seed=S)
    N = sink + window + topk
    valid = left_padded(B, S, seed=3)
    seen = torch.randint(0, 2 * N, (B,), generator=g)
    position = seen[:, None] + valid.long().cumsum(-1) - 1
    # slots as decoding leaves them: fill a layer by a replay of `seen` random tokens first
    layer, policy = _layer_and_policy(sink, window, topk, Hkv, D, policy="h2o" if score == "sum" else "tova",
                                      tova_head_average=score == "mean")
    m = int(seen.max())
    pre_valid = torch.arange(m)[None] >= (m - seen)[:, None]
    if m:
        _replay(layer, policy, *_inputs(B, Hkv, G, m, D, None, seed=S + 1), pre_valid, D**-0.5)
    priority = torch.zeros(B, Hkv, S)
    if neg_inf:
        priority = torch.where(torch.rand(B, Hkv, S, generator=g) < 0.3, float("-inf"), priority)
    return q, k, layer.keys, layer.pos, layer.pri, position, valid, priority, sink, window, topk, D**-0.5, score


@pytest.mark.parametrize("score", ["max", "mean", "sum"])
@pytest.mark.parametrize("B,Hkv,G,S,D,sink,window,topk", DECODED_SLOTS)
@pytest.mark.parametrize("neg_inf", [False, True])
def test_torch_walk_equals_the_reference_walk(score, B, Hkv, G, S, D, sink, window, topk, neg_inf):
    # the op level, with arbitrary slots before the chunk and -inf priorities (never promoted)
    args = _walk_args_from_decoded_slots(score, B, Hkv, G, S, D, sink, window, topk, neg_inf)
    want = dynamic_walk(*args, backend="reference")
    got = dynamic_walk(*args, backend="torch")
    for a, b, what in zip(got, want, ("evicted", "pos", "pri")):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("B,Hkv,G,S,D,sink,window,topk", DECODED_SLOTS)
@pytest.mark.parametrize("ties", [False, True])
def test_torch_walk_equals_the_reference_walk_with_priors(B, Hkv, G, S, D, sink, window, topk, ties):
    # KVpop-TOVA (score "prior"): the slots' priors move with their tokens; a second chunk starts from the
    # slots, priorities and priors the first left. With ties: priors on a coarse grid and repeated keys
    g = torch.Generator().manual_seed(S + 7)
    q, k, _ = _inputs(B, Hkv, G, S, D, None, seed=S)
    if ties:
        k = k[:, :, torch.randint(0, min(4, S), (S,), generator=g)]
    N = sink + window + topk
    valid = left_padded(B, S, seed=3)
    position = valid.long().cumsum(-1) - 1
    prior = torch.rand(B, Hkv, S, generator=g) * 0.05
    if ties:
        prior = (prior * 80).round() / 80
    empty = torch.full((B, Hkv, N), float("-inf"))
    half = S // 2
    slots = (k.new_zeros(B, Hkv, N, D), position.new_full((B, Hkv, N), -1), empty)
    first = dynamic_walk(q[:, :, :half], k[:, :, :half], *slots, position[:, :half], valid[:, :half],
                         prior[..., :half], sink, window, topk, D**-0.5, "prior", backend="reference", slot_prior=empty)
    # the keys of the slots the first chunk left (kept tokens' keys, zeros elsewhere)
    src = first[1].clamp(min=0)[..., None].expand(-1, -1, -1, D)
    keys = torch.where((first[1] >= 0)[..., None], k.gather(2, src), 0.0)
    args = (q[:, :, half:], k[:, :, half:], keys, first[1], first[2], position[:, half:], valid[:, half:],
            prior[..., half:], sink, window, topk, D**-0.5, "prior")
    want = dynamic_walk(*args, backend="reference", slot_prior=first[3])
    got = dynamic_walk(*args, backend="torch", slot_prior=first[3])
    for a, b, what in zip(got, want, ("evicted", "pos", "pri", "prior")):
        assert torch.equal(a, b), what
    held = want[1][0] >= 0  # row 0 has no padding: a token's position is its index
    assert torch.equal(want[3][0][held], prior[0].gather(-1, want[1][0].clamp(min=0))[held])  # its token's prior


def test_priors_go_with_score_prior_only():
    q, k = torch.zeros(1, 2, 5, 4), torch.zeros(1, 1, 5, 4)
    slots = (torch.zeros(1, 1, 6, 4), torch.full((1, 1, 6), -1), torch.full((1, 1, 6), float("-inf")))
    pos, valid, pri = torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 1, 5)
    with pytest.raises(ValueError, match="priors"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "prior")
    with pytest.raises(ValueError, match="priors"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "mean", slot_prior=slots[2])
    with pytest.raises(ValueError, match="does not run score 'prior'"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "prior", backend="triton", slot_prior=slots[2])
    # the parallel walk takes priors only alike in every KV head (as "mean" takes slots)
    from kvpop.ops.dynamic.parallel import supported

    prior = torch.rand(1, 2, 6)
    assert supported(slots[1].expand(1, 2, 6), slots[2].expand(1, 2, 6), "prior", prior[:, :1].expand(1, 2, 6))
    assert not supported(slots[1].expand(1, 2, 6), slots[2].expand(1, 2, 6), "prior", prior)


@pytest.mark.parametrize("score", SCORES)
def test_equal_probabilities_give_equal_priorities(score):
    # the rule gives a tie of priorities to the newer token: slots whose probabilities are equal in every
    # head must get bit-equal priorities, at every width (a reduction over outer dims did not: widths 5,
    # 6, 33 at 8 x 4 heads)
    g = torch.Generator().manual_seed(0)
    for N in (*range(2, 70), 191, 255, 513):
        for B, H, G in ((1, 8, 4), (3, 9, 1), (2, 2, 3), (1, 4, 8)):
            column = torch.rand(B, H, G, 1, generator=g)
            probs = torch.cat([column.expand(B, H, G, N), column], dim=-1)[..., :N]  # a view, as a slice can be
            priority = torch.rand(B, H, 1, generator=g).expand(B, H, N)
            prior = torch.rand(B, H, 1, generator=g).expand(B, H, N) if score == "prior" else None
            new = score_update(score, priority, probs, None, prior)
            assert torch.equal(new, new[..., :1].expand_as(new)), (score, N, B, H, G)


def test_eviction_from_steps():
    evicted = torch.tensor([[[-1, 3, -1, 0, 5]]])
    position = torch.tensor([[10, 11, 12, 13, 14]])
    cand = torch.tensor([[[0, 1, 3, 5, 7, -1]]])
    assert eviction_from_steps(evicted, position, cand).tolist() == [[[13, NEVER, 11, 14, NEVER, NEVER]]]


def test_bad_inputs_are_refused():
    q, k = torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8)
    slots = (torch.zeros(1, 2, 6, 8), torch.full((1, 2, 6), -1), torch.zeros(1, 2, 6))
    pos, valid, pri = torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="sink \\+ window \\+ topk"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 2, 1.0, "max")
    with pytest.raises(ValueError, match="score="):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "median")
    with pytest.raises(ValueError, match="backend="):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "max", backend="cuda")
    with pytest.raises(ValueError, match="multiple"):
        dynamic_walk(torch.zeros(1, 3, 5, 8), k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "max")
    with pytest.raises(ValueError, match="score="):
        score_update("median", pri, torch.zeros(1, 2, 1, 5), torch.ones(1, 2, 5, dtype=torch.bool))


@torch.no_grad()
def test_teacher_forced_sparse_attention_equals_the_replay():
    # the teacher-forced path (attention.py): eviction positions, then FlexAttention / the CPU kernel
    B, Hkv, G, S, D = 2, 2, 2, 50, 8
    q, k, v = _inputs(B, Hkv, G, S, D, "duplicates", seed=4)
    valid = left_padded(B, S, seed=5)
    position = valid.long().cumsum(-1) - 1
    layer, policy = _layer_and_policy(0, 1, 9, Hkv, D, policy="tova", tova_head_average=True)
    want, _ = _replay(layer, policy, q, k, v, valid, D**-0.5)
    evict = dynamic_eviction_positions(q, k, position, valid, torch.zeros(B, Hkv, S), 0, 1, 9, D**-0.5, "mean")
    got, _ = sparse_attention(q, k, v, position, valid, position, valid, evict, 0, 1, D**-0.5)
    real = valid[:, None, :, None].expand_as(got)
    assert_close(got[real], want[real], OUT_ATOL, "teacher-forced")


# --- the Triton walk (ops/dynamic/kernel.py): under Triton's interpreter on the CPU, natively on CUDA ---

TRITON_CHECK = textwrap.dedent(
    """
    import torch
    from kvpop.ops.dynamic import dynamic_walk

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def case(B, H, G, C, D, s, w, k, score, ties, pad, seed):
        g = torch.Generator().manual_seed(seed)
        q, key = torch.randn(B, H * G, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
        if ties == "duplicates":
            key[:, :, 2::3] = key[:, :, 0:1]
        elif ties == "zeros":
            key.zero_()
        valid = torch.ones(B, C, dtype=torch.bool)
        if pad:
            valid[-1, : C // 4] = False
        # slots before the chunk: a first walk over an empty cache, then this chunk from where it left off
        N = s + w + k
        slots = (torch.zeros(B, H, N, D), torch.full((B, H, N), -1), torch.full((B, H, N), float("-inf")))
        position = valid.long().cumsum(-1) - 1
        half = C // 2
        first = dynamic_walk(q[:, :, :half], key[:, :, :half], *slots, position[:, :half], valid[:, :half],
                             torch.zeros(B, H, half), s, w, k, D**-0.5, score, backend="torch")
        keys = torch.zeros(B, H, N, D)  # the slot keys are not the walk's business; any values do for the check
        args = [t.to(device) for t in (q[:, :, half:], key[:, :, half:], keys, first[1], first[2], position[:, half:],
                                       valid[:, half:], torch.zeros(B, H, C - half))]
        want = dynamic_walk(*args, s, w, k, D**-0.5, score, backend="torch")
        got = dynamic_walk(*args, s, w, k, D**-0.5, score, backend="triton")
        what = (B, H, G, C, D, s, w, k, score, ties, pad, seed)
        # several launches: blocks of 8 tokens
        from kvpop.ops.dynamic.kernel import dynamic_walk_triton
        blocks = dynamic_walk_triton(*args, s, w, k, D**-0.5, score, block=8)
        assert torch.equal(blocks[0], got[0]) and torch.equal(blocks[1], got[1]), what
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), what
        # slots left empty (a padded row fills fewer) hold -inf in both: compare where they are finite
        held = want[2].isfinite()
        assert torch.equal(got[2].isfinite(), held), what
        assert (got[2] - want[2])[held].abs().max() <= 1e-5 * max(1.0, float(want[2][held].abs().max())), what

    for i, (B, H, G, C, D, s, w, k) in enumerate(SHAPES):
        for score in ("max", "sum", "mean"):
            case(B, H, G, C, D, s, w, k, score, (None, "duplicates", "zeros")[i % 3], pad=i % 2 == 1, seed=i)
    print("ok")
    """
)


def _run_triton_check(shapes) -> None:
    run_triton_check(TRITON_CHECK.replace("SHAPES", repr(shapes)), "<triton walk check>")


def test_triton_walk_makes_the_torch_walks_decisions():
    pytest.importorskip("triton", reason="the Triton walk is optional (pip install triton)")
    # (B, H, G, C, D, sink, window, topk): odd lengths, the paper's splits, no long-range slots, GQA groups
    # the sixth (padded) leaves slots of its last row empty
    _run_triton_check([(1, 2, 2, 31, 16, 2, 3, 5), (2, 2, 3, 40, 12, 0, 1, 7), (2, 1, 4, 37, 16, 0, 4, 4),
                       (1, 2, 1, 25, 8, 2, 3, 0), (1, 1, 2, 9, 8, 1, 2, 3), (2, 1, 2, 12, 8, 0, 4, 8)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_walk_at_size_on_cuda():
    pytest.importorskip("triton")
    _run_triton_check([(1, 8, 4, 2048, 128, 4, 256, 1788), (4, 8, 4, 1024, 128, 0, 512, 512),
                       (1, 3, 3, 2048, 64, 0, 1, 511)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("score", ["mean", "prior"])
def test_parallel_walk_at_size_on_cuda(score):
    # TOVA's head average and KVpop-TOVA at the Qwen3-8B shape's heads, the CUDA default ("auto") against the torch
    # walk on the same device: the same decisions, slots and priors
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, G, C, D, s, w, k = 1, 8, 4, 2048, 128, 0, 1, 511
    q = torch.randn(B, H * G, C, D, device="cuda", generator=g)
    key = torch.randn(B, H, C, D, device="cuda", generator=g)
    N = s + w + k
    empty = torch.full((B, H, N), float("-inf"), device="cuda")
    prior = (torch.rand(B, 1, C, device="cuda", generator=g) * 0.01).expand(B, H, C)
    args = (q, key, torch.zeros(B, H, N, D, device="cuda"), torch.full((B, H, N), -1, device="cuda"), empty,
            torch.arange(C, device="cuda").expand(B, C), torch.ones(B, C, dtype=torch.bool, device="cuda"),
            prior if score == "prior" else torch.zeros(B, H, C, device="cuda"), s, w, k, D**-0.5, score)
    slot_prior = empty if score == "prior" else None
    got = dynamic_walk(*args, slot_prior=slot_prior)
    want = dynamic_walk(*args, backend="torch", slot_prior=slot_prior)
    _assert_same_walk(got, want, f"cuda {score}")
    assert score != "prior" or torch.equal(got[3], want[3])


def test_triton_walk_refuses_what_it_does_not_implement():
    pytest.importorskip("triton")
    from kvpop.ops.dynamic.kernel import dynamic_walk_triton

    q, k = torch.zeros(1, 2, 3, 16), torch.zeros(1, 1, 3, 16)
    slots = (torch.zeros(1, 1, 6, 16), torch.full((1, 1, 6), -1), torch.zeros(1, 1, 6))
    rest = (torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 1, 3), 1, 2, 3, 0.25)
    with pytest.raises(ValueError, match="differ between heads"):
        dynamic_walk_triton(q, torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 6, 16), torch.tensor([[[0] * 6, [1] * 6]]),
                            torch.zeros(1, 2, 6), *rest, "mean")
    with pytest.raises(ValueError, match="score="):
        dynamic_walk_triton(q, k, *slots, *rest, "median")


# --- the parallel walk (ops/dynamic/parallel.py): speculated, verified, redone from a mismatch ---


def _chunk_after_a_first(B, H, G, C, D, s, w, k, score, ties, pad, seed, prior=None):
    """Inputs of `dynamic_walk` for the second half of a sequence, after the torch walk took the first half.

    `prior` [B, H, C] (score "prior"): the tokens' priors, the insertion priorities; then the slots' priors
    after the first half come back too, `(args, slot_prior)`."""
    g = torch.Generator().manual_seed(seed)
    q, key = torch.randn(B, H * G, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    if ties == "duplicates":
        key[:, :, 2::3] = key[:, :, 0:1]
        q[:, :, 1::2] = q[:, :, 0::2][:, :, : C // 2]
    elif ties == "zeros":
        key.zero_()
    valid = left_padded(B, C, seed) if pad else torch.ones(B, C, dtype=torch.bool)
    N = s + w + k
    slots = (torch.zeros(B, H, N, D), torch.full((B, H, N), -1), torch.full((B, H, N), float("-inf")))
    position = (valid.long().cumsum(-1) - 1).clamp(min=0)
    half = C // 2
    priority = torch.zeros(B, H, C) if prior is None else prior
    first = dynamic_walk(q[:, :, :half], key[:, :, :half], *slots, position[:, :half], valid[:, :half],
                         priority[..., :half], s, w, k, D**-0.5, score, backend="torch",
                         slot_prior=None if prior is None else slots[2])
    # the slots' keys: each held position's key
    held = (first[1][..., None] == position[:, None, None, :half]) & valid[:, None, None, :half]
    keys = key[:, :, :half].gather(2, held.float().argmax(-1)[..., None].expand(B, H, N, D))
    args = (q[:, :, half:], key[:, :, half:], keys, first[1], first[2], position[:, half:], valid[:, half:],
            priority[..., half:], s, w, k, D**-0.5, score)
    return args if prior is None else (args, first[3])


def _assert_same_walk(got, want, what):
    """Evictions and slot positions equal; priorities equal up to float rounding (-inf where the walk's are)."""
    assert torch.equal(got[0], want[0]), f"{what}: evictions differ at {(got[0] != want[0]).nonzero()[:3].tolist()}"
    assert torch.equal(got[1], want[1]), f"{what}: slot positions differ"
    finite = want[2].isfinite()
    assert torch.equal(got[2].isfinite(), finite), f"{what}: -inf priorities differ"
    err = (got[2] - want[2])[finite].abs()
    bound = PRI_RTOL * max(1.0, float(want[2][finite].abs().max())) if finite.any() else 0.0
    assert err.numel() == 0 or float(err.max()) <= bound, f"{what}: priorities max err {err.max():.3g} mean {err.mean():.3g}"


PRI_RTOL = 1e-5  # the parallel walk's priorities against the torch walk's, relative to the largest, float32

# (B, H, G, C, D, sink, window, topk): odd lengths, the paper's splits, no long-range slots, GQA groups 1..4,
# batch > 1, and a budget above the chunk; duplicate keys only at small N: the walk's mean over the query heads
# (`probs.mean(dim=(1, 2))`) is, on the CPU, not the same float operation at every column for some N (33, 35, ...),
# so there the walk may break an exact tie by rounding
PARALLEL_SHAPES = [
    ((1, 2, 2, 31, 16, 2, 3, 5), "duplicates"), ((2, 2, 3, 40, 12, 0, 1, 7), "zeros"),
    ((2, 1, 4, 37, 16, 0, 4, 4), None), ((1, 2, 1, 25, 8, 2, 3, 0), "duplicates"), ((1, 1, 2, 9, 8, 1, 2, 3), "zeros"),
    ((2, 1, 2, 12, 8, 0, 4, 8), None), ((3, 2, 4, 160, 8, 0, 1, 23), "duplicates"), ((2, 3, 1, 150, 8, 2, 9, 20), None),
    ((1, 2, 4, 300, 16, 0, 1, 63), None), ((2, 2, 2, 200, 8, 0, 30, 30), "zeros"), ((1, 1, 3, 90, 8, 0, 50, 50), None),
]


@pytest.mark.parametrize("score", ["max", "mean", "sum"])
@pytest.mark.parametrize("case", range(len(PARALLEL_SHAPES)))
@pytest.mark.parametrize("pad", [False, True])
def test_parallel_walk_makes_the_torch_walks_decisions(score, case, pad):
    from kvpop.ops.dynamic.parallel import dynamic_walk_parallel

    shape, ties = PARALLEL_SHAPES[case]
    args = _chunk_after_a_first(*shape, score, ties, pad, seed=case)
    want = dynamic_walk(*args, backend="torch")
    # one block for the chunk, and blocks of 8 tokens (many verification rounds, slots carried between blocks)
    _assert_same_walk(dynamic_walk(*args, backend="parallel"), want, f"{shape} {ties} {score}")
    _assert_same_walk(dynamic_walk_parallel(*args, block=8), want, f"{shape} {ties} {score} block 8")


@pytest.mark.parametrize("case", range(len(PARALLEL_SHAPES)))
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("grid", [False, True])
def test_parallel_walk_makes_the_torch_walks_decisions_with_priors(case, pad, grid):
    # KVpop-TOVA (score "prior"): the head average plus each token's prior, one prior per token for every KV
    # head; the second half starts from the slots and priors the torch walk left. `grid`: priors on a coarse
    # grid, so that exact ties of priority occur where the probabilities tie (duplicate or zero keys)
    from kvpop.ops.dynamic.parallel import dynamic_walk_parallel

    (B, H, G, C, D, s, w, k), ties = PARALLEL_SHAPES[case]
    g = torch.Generator().manual_seed(case + 100)
    prior = (torch.rand(B, 1, C, generator=g) * 0.1).expand(B, H, C)
    if grid:
        prior = (prior * 20).round() / 20
    args, slot_prior = _chunk_after_a_first(B, H, G, C, D, s, w, k, "prior", ties, pad, seed=case, prior=prior)
    want = dynamic_walk(*args, backend="torch", slot_prior=slot_prior)
    what = f"{(B, H, G, C, D, s, w, k)} {ties} prior"
    for fast in (dynamic_walk(*args, backend="parallel", slot_prior=slot_prior),
                 dynamic_walk_parallel(*args, block=8, slot_prior=slot_prior)):
        _assert_same_walk(fast, want, what)
        assert torch.equal(fast[3], want[3]), f"{what}: slot priors differ"


@pytest.mark.parametrize("score", ["max", "mean", "sum", "prior"])
def test_parallel_walk_with_fused_priorities_makes_the_same_decisions(score):
    # `fused=True` compiles the priorities with inductor (one graph per block shape): the torch walk's decisions,
    # ties included, from one block and from blocks of 8 (mismatches and redone rounds)
    from kvpop.ops.dynamic.parallel import dynamic_walk_parallel

    for case in (0, 1, 6, 8):  # duplicate keys, zero keys, and two longer chunks with redone rounds
        (B, H, G, C, D, s, w, k), ties = PARALLEL_SHAPES[case]
        prior = (torch.rand(B, 1, C, generator=torch.Generator().manual_seed(case)) * 0.1).expand(B, H, C)
        got = _chunk_after_a_first(B, H, G, C, D, s, w, k, score, ties, True, seed=case,
                                   prior=prior if score == "prior" else None)
        args, slot_prior = got if score == "prior" else (got, None)
        want = dynamic_walk(*args, backend="torch", slot_prior=slot_prior)
        for block in (None, 8):
            fused = dynamic_walk_parallel(*args, block=block, slot_prior=slot_prior, fused=True)
            _assert_same_walk(fused, want, f"case {case} {score} fused, block {block}")


@pytest.mark.parametrize("score", ["max", "mean", "sum"])
@pytest.mark.parametrize("B,Hkv,G,S,D,sink,window,topk", DECODED_SLOTS)
@pytest.mark.parametrize("neg_inf", [False, True])
def test_parallel_walk_from_decoded_slots(score, B, Hkv, G, S, D, sink, window, topk, neg_inf):
    # as test_torch_walk_equals_the_reference_walk: slots that decoding left, some priorities -inf
    from kvpop.ops.dynamic.parallel import dynamic_walk_parallel

    args = _walk_args_from_decoded_slots(score, B, Hkv, G, S, D, sink, window, topk, neg_inf)
    _assert_same_walk(dynamic_walk_parallel(*args, block=16), dynamic_walk(*args, backend="torch"), "decoded slots")


@pytest.mark.parametrize("score", ["max", "mean", "sum", "prior"])
@pytest.mark.parametrize("iters", [None, 1, 4])
def test_parallel_walk_with_jacobi_selection_makes_the_same_decisions(score, iters, monkeypatch):
    # select="jacobi": every step's choice at once, repeated; None passes until nothing changes (the CPU), 1 and 4
    # a fixed count as on CUDA (unsettled, the steps go one by one), on every shape, ties (duplicate, zero keys)
    # and padding, one block and blocks of 8
    from kvpop.ops.dynamic import parallel

    monkeypatch.setattr(parallel, "JACOBI_ITERS", iters)
    if iters is not None:  # the fixed count is CUDA's: taken here for every device
        monkeypatch.setattr(parallel, "_select_jacobi", functools.partial(_jacobi_fixed, parallel._select_jacobi, iters))
    seen = {"jacobi": 0, "jacobi_unsettled": 0}
    for case in range(len(PARALLEL_SHAPES)):
        (B, H, G, C, D, s, w, k), ties = PARALLEL_SHAPES[case]
        prior = (torch.rand(B, 1, C, generator=torch.Generator().manual_seed(case)) * 0.1).expand(B, H, C)
        got = _chunk_after_a_first(B, H, G, C, D, s, w, k, score, ties, case % 2 == 1, seed=case,
                                   prior=prior if score == "prior" else None)
        args, slot_prior = got if score == "prior" else (got, None)
        want = dynamic_walk(*args, backend="torch", slot_prior=slot_prior)
        for block in (None, 8):
            stats = {}
            fast = parallel.dynamic_walk_parallel(*args, block=block, slot_prior=slot_prior, select="jacobi",
                                                  stats=stats)
            _assert_same_walk(fast, want, f"case {case} {score} jacobi {iters}, block {block}")
            for name in ("jacobi", "jacobi_unsettled"):
                seen[name] += stats.get(name, 0)
            if slot_prior is not None:
                assert torch.equal(fast[3], want[3]), f"case {case}: slot priors differ"
    # both ways out were taken: settled passes, and (a fixed count) steps one by one where they did not settle
    assert (seen["jacobi"] > 0 or iters == 1) and (iters is None) == (seen["jacobi_unsettled"] == 0), seen


def _jacobi_fixed(select, iters, cand, dec, known, start, M, _iters, guess=None):
    return select(cand, dec, known, start, M, iters, guess)


def test_jacobi_selection_is_the_sequential_selection():
    # the selection alone, on random competitor lists with many collisions (every step's weakest among few
    # columns): passes until nothing changes give the host loop's choices and skips; one pass gets step `start` right
    from kvpop.ops.dynamic.parallel import _select_host, _select_jacobi

    g = torch.Generator().manual_seed(0)
    for R, T, M, start in [(3, 17, 17, 0), (2, 40, 45, 5), (4, 64, 70, 63), (1, 1, 3, 0), (2, 30, 30, 2)]:
        S = T - start
        # step j (its index in the block) has j + 1 .. T distinct competitors of M columns, weakest first, -1 after
        # them; a shared order plus a little noise per step makes steps want the same columns (skips)
        base = torch.rand(R, M, generator=g)
        cand = torch.full((R, S, T), -1, dtype=torch.long)
        for r in range(R):
            for i, j in enumerate(range(start, T)):
                n = int(torch.randint(j + 1, T + 1, (1,), generator=g))
                cand[r, i, :n] = (base[r] + 0.3 * torch.rand(M, generator=g)).argsort()[:n]
        dec = torch.rand(R, T, generator=g) < 0.8
        known = torch.full((R, T), M, dtype=torch.long)
        # the steps before `start` evicted distinct columns
        for r in range(R):
            picks = torch.randperm(M, generator=g)[:start]
            known[r, :start] = torch.where(dec[r, :start], picks, M)
        want, want_skips = _select_host(cand, dec, known, start, M)
        got, skips, settled = _select_jacobi(cand, dec, known, start, M, None)
        assert torch.equal(got, want) and int(skips) == want_skips and bool(settled), (R, T, M, start)
        assert T < 17 or want_skips > 0  # the collisions the passes must resolve
        one, _, settled = _select_jacobi(cand, dec, known, start, M, 1)
        assert torch.equal(one[:, : start + 1], want[:, : start + 1])
        # a fixed count says whether its last pass changed nothing: then it is the answer
        assert not bool(settled) or torch.equal(one, want)
        many, _, settled = _select_jacobi(cand, dec, known, start, M, T - start + 1)
        assert bool(settled) and torch.equal(many, want)
        # from any first choices: here every step's last competitor, and the answer itself (settles in one pass)
        last = cand.gather(2, ((cand >= 0).sum(-1, keepdim=True) - 1))[..., 0]
        for guess in (last, want[:, start:]):
            got, _, settled = _select_jacobi(cand, dec, known, start, M, None, guess)
            assert bool(settled) and torch.equal(got, want)
        _, _, settled = _select_jacobi(cand, dec, known, start, M, 1, want[:, start:])
        assert bool(settled)


def test_parallel_walk_redoes_blocks_from_a_mismatch():
    # small slots and long blocks: in-block evictions move the normalisers enough to flip some speculated decisions
    from kvpop.ops.dynamic.parallel import dynamic_walk_parallel

    args = _chunk_after_a_first(1, 2, 4, 300, 16, 0, 1, 31, "max", None, False, seed=7)
    stats = {}
    _assert_same_walk(dynamic_walk_parallel(*args, stats=stats), dynamic_walk(*args, backend="torch"), "mismatches")
    assert stats["mismatch_rows"] > 0 and stats["rounds"] > stats["blocks"], stats
    assert stats["decisions"] == 150 * 2 and stats["skips"] > 0, stats


def test_parallel_walk_falls_back_where_it_does_not_apply():
    from kvpop.ops.dynamic.parallel import supported

    args = list(_chunk_after_a_first(1, 2, 2, 40, 8, 1, 2, 5, "mean", None, False, seed=1))
    assert supported(args[3], args[4], "mean")
    # "mean" with heads whose slots differ; an empty slot with a finite priority
    args[4] = args[4].clone()
    args[4][0, 1, -1] += 1.0
    assert not supported(args[3], args[4], "mean")
    for bad in (args, [*args[:4], args[4].masked_fill(args[3] < 0, 0.0), *args[5:]]):
        assert torch.equal(dynamic_walk(*bad, backend="parallel")[0], dynamic_walk(*bad, backend="torch")[0])
    pos = torch.tensor([[[3, -1, 5]]])
    assert not supported(pos, torch.tensor([[[0.5, 0.0, 0.2]]]), "max")
    assert supported(pos, torch.tensor([[[0.5, float("-inf"), 0.2]]]), "max")


PARALLEL_TRITON_CHECK = textwrap.dedent(
    """
    import torch
    import kvpop.ops.dynamic.parallel as par
    from kvpop.ops.dynamic import dynamic_walk
    from kvpop.ops.dynamic.parallel import _select, _select_host, dynamic_walk_parallel

    # the selection kernel against the host loop: random keys, few columns, long blocks (many skips, chunks of 32);
    # on the GPU the kernel itself, else Triton's interpreter on the CPU
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for B, Hd, T, M, start in [(2, 3, 70, 90, 0), (1, 2, 64, 64 + 9, 17), (1, 1, 1, 5, 0)]:
        key = torch.randint(0, 40, (B, Hd, T, M), generator=g) * M + torch.arange(M)
        enter = torch.randint(-1, T, (B, Hd, M), generator=g)
        decide = torch.rand(B, Hd, T, generator=g) < 0.8
        enter[..., :T] = torch.where(decide, torch.arange(T), enter[..., :T])
        key, enter, decide = key.to(dev), enter.to(dev), decide.to(dev)
        known = torch.full((B, Hd, T), M, device=dev)
        host = par._select_host
        par._select_host = None  # the kernel must serve
        if start:
            known = _select(key, enter, decide, None)
        stats = {}
        got = _select(key, enter, decide, stats, start, known)
        par._select_host = host
        want = torch.where(decide, _select_host(*[t.reshape(B * Hd, *t.shape[2:]) for t in (
            torch.where(enter[:, :, None, :] <= torch.arange(start, T, device=dev)[:, None], key[:, :, start:], par._MAX)
            .topk(T, dim=-1, largest=False)[1], decide, known)], start, M)[0].reshape(B, Hd, T), M)
        assert torch.equal(torch.where(decide, got, M), want), (B, Hd, T, M, start)
    # one order at every step: step j passes over the j columns taken before it (chunks of 32 entries)
    T, M = 100, 120
    key, enter = torch.arange(M, device=dev).expand(1, 1, T, M), torch.full((1, 1, M), -1, device=dev)
    decide = torch.ones(1, 1, T, dtype=torch.bool, device=dev)
    stats = {}
    assert torch.equal(_select(key, enter, decide, stats)[0, 0], torch.arange(T, device=dev))
    assert stats["skips"] == T * (T - 1) // 2, stats
    # and the walk with it, in blocks of 8
    g = torch.Generator().manual_seed(1)
    B, H, G, C, D = 2, 2, 2, 40, 8
    q, key = torch.randn(B, H * G, C, D, generator=g).to(dev), torch.randn(B, H, C, D, generator=g).to(dev)
    slots = (torch.zeros(B, H, 9, D, device=dev), torch.full((B, H, 9), -1, device=dev),
             torch.full((B, H, 9), float("-inf"), device=dev))
    # KVpop-TOVA's priors, alike in every head
    prior = (torch.rand(B, 1, C, generator=g).expand(B, H, C) * 0.1).to(dev)
    for score in ("max", "sum", "mean", "prior"):
        pri = prior if score == "prior" else torch.zeros(B, H, C, device=dev)
        slot_prior = slots[2] if score == "prior" else None
        args = (q, key, *slots, torch.arange(C, device=dev).expand(B, C), torch.ones(B, C, dtype=torch.bool, device=dev),
                pri, 1, 2, 6, D**-0.5, score)
        got = dynamic_walk_parallel(*args, block=8, slot_prior=slot_prior)
        want = dynamic_walk(*args, backend="torch", slot_prior=slot_prior)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), score
        assert score != "prior" or torch.equal(got[3], want[3]), score
    print("ok")
    """
)


def test_parallel_selection_kernel():
    pytest.importorskip("triton", reason="the selection kernel is optional (pip install triton)")
    code = PARALLEL_TRITON_CHECK
    if torch.cuda.is_available():
        exec(compile(code, "<parallel selection check>", "exec"), {})
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


@pytest.mark.parametrize("score", ["max", "mean", "sum"])
@pytest.mark.parametrize("B,Hkv,G,S,D,sink,window,topk", DECODED_SLOTS[1:])
def test_soft_capped_walks_rank_by_the_capped_probabilities(score, B, Hkv, G, S, D, sink, window, topk):
    # Gemma 2's logit soft-capping: the torch walk makes the reference walk's (the decode step's) decisions from the
    # capped logits, which rank otherwise than the plain ones; the walks that cannot take the cap refuse it
    args = _walk_args_from_decoded_slots(score, B, Hkv, G, S, D, sink, window, topk, False)
    want = dynamic_walk(*args, backend="reference", softcap=0.5)
    for backend in ("torch", "auto"):
        got = dynamic_walk(*args, backend=backend, softcap=0.5)
        for a, b, what in zip(got, want, ("evicted", "pos", "pri")):
            assert torch.equal(a, b), f"{backend}: {what}"
    assert not torch.equal(dynamic_walk(*args, backend="reference")[2], want[2])
    for backend in ("triton", "parallel"):
        with pytest.raises(ValueError, match=f"backend='{backend}' takes no logit soft-capping"):
            dynamic_walk(*args, backend=backend, softcap=0.5)
