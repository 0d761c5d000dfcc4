"""The retention rule: the O(S log S) form against the dense definition, ties and edges included."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpop
from kvpop.ops.topk import (
    NEVER,
    eviction_positions,
    eviction_times_from_mask,
    prefix_kth_smallest,
    retention_mask_reference,
)
from kvpop.policy import mask_from_eviction, static_priority


def _priorities(seed: int, shape, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many exact ties, resolved to the newer token
        return torch.randint(0, 3, shape, generator=g).float()
    return torch.randn(shape, generator=g)


@settings(max_examples=150, deadline=None)
@given(
    S=st.integers(1, 70),
    sink=st.integers(0, 6),
    window=st.integers(1, 12),
    topk=st.integers(0, 15),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_eviction_times_match_dense_reference(S, sink, window, topk, ties, seed):
    pri = _priorities(seed, (2, 3, S), ties)
    mask = kvpop.retention_mask(pri, sink, window, topk)
    e = kvpop.eviction_times(pri, sink, window, topk)
    assert torch.equal(e, eviction_times_from_mask(mask, sink, window))
    # the mask rebuilt from eviction times is the reference mask, entry for entry
    pos = torch.arange(S).expand(2, S)
    ones = torch.ones(2, S, dtype=torch.bool)
    rebuilt = mask_from_eviction(pos, ones, pos[:, None], ones[:, None], torch.where(e >= S, NEVER, e), sink, window)
    assert torch.equal(rebuilt, mask)
    # never more than the budget, and a sequence within the budget is attended densely
    assert mask.sum(-1).max() <= sink + window + topk
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    short = min(S, sink + window + topk)
    assert torch.equal(mask[..., :short, :short], causal[:short, :short].expand(2, 3, short, short))


def test_reference_semantics_by_hand():
    # s=1, w=2, k=1 over 6 tokens; priorities make token 2 the best eligible one
    pri = torch.tensor([[[0.0, 1.0, 5.0, 0.5, 0.2, 0.1]]])
    m = kvpop.retention_mask(pri, sink=1, window=2, topk=1)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],  # q=2: E={} ; window {1, 2}
            [1, 1, 1, 1, 0, 0],  # q=3: E={1}: top-1 keeps 1; window {2, 3}
            [1, 0, 1, 1, 1, 0],  # q=4: E={1, 2}: 2 beats 1, so 1 is evicted
            [1, 0, 1, 0, 1, 1],  # q=5: E={1, 2, 3}: 3 (0.5) loses to 2
        ]
    )
    assert torch.equal(m, expected)
    assert kvpop.eviction_times(pri, 1, 2, 1)[0, 0].tolist() == [6, 4, 6, 5, 6, 6]


def test_ties_go_to_the_newer_token():
    pri = torch.zeros(1, 1, 8)
    # all equal: the running top-1 always holds the newest eligible token
    m = kvpop.retention_mask(pri, sink=0, window=1, topk=1)[0, 0]
    for q in range(1, 8):
        assert m[q, q - 1] and not m[q, : q - 1].any()
    assert torch.equal(kvpop.eviction_times(pri, 0, 1, 1), eviction_times_from_mask(m[None, None], 0, 1))


@pytest.mark.parametrize("sink,window,topk", [(0, 1, 0), (0, 1, 3), (3, 1, 0), (4, 16, 0), (0, 50, 50)])
def test_edges(sink, window, topk):
    pri = _priorities(1, (1, 2, 40), ties=False)
    mask = retention_mask_reference(pri, sink, window, topk)
    assert torch.equal(kvpop.eviction_times(pri, sink, window, topk), eviction_times_from_mask(mask, sink, window))


def test_general_positions_and_padding_match_contiguous():
    # the same sequence with padding scattered in front and gaps in the slots gives the same eviction positions
    S, sink, window, topk = 50, 2, 4, 6
    pri = _priorities(3, (1, 2, S), ties=True)
    e = eviction_positions(pri, torch.arange(S), torch.ones(S, dtype=torch.bool), sink, window, topk)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(0))
    pad = 7
    pri_p = torch.cat([torch.randn(1, 2, pad), pri[..., perm]], -1)
    pos_p = torch.cat([torch.full((pad,), -1), perm])
    valid_p = pos_p >= 0
    e_p = eviction_positions(pri_p, pos_p, valid_p, sink, window, topk)
    assert torch.equal(e_p[..., pad:], e[..., perm])
    assert (e_p[..., :pad] == NEVER).all()


@pytest.mark.parametrize("L,k", [(1, 1), (17, 3), (64, 64), (100, 7)])
def test_prefix_kth_smallest(L, k):
    g = torch.Generator().manual_seed(L)
    values = torch.randint(0, 50, (3, L), generator=g)
    ends = torch.randint(0, L + 1, (3, 20), generator=g)
    got = prefix_kth_smallest(values, ends, k, bits=6)
    for n in range(3):
        for j in range(20):
            prefix = values[n, : ends[n, j]].sort().values
            want = prefix[k - 1].item() if len(prefix) >= k else -1
            assert got[n, j].item() == want


def test_static_priority_ranks_like_the_effective_score():
    # r(t, q) = r[t] + (floor(q/n) - floor(t/n)) log(gamma): for every q, ordering by r(t, q) == ordering by pi
    S, n = 300, 16
    r = torch.randn(1, 2, S)
    log_gamma = torch.log(torch.tensor([0.9, 0.5]))
    pi = static_priority(r, torch.arange(S)[None], log_gamma, n)
    t = torch.arange(S)
    for q in (0, 15, 16, 200, 299):
        eff = r + ((q // n) - torch.div(t, n, rounding_mode="floor")).float() * log_gamma[None, :, None]
        assert torch.allclose(eff - pi, (q // n) * log_gamma[None, :, None].expand_as(pi), atol=1e-5)


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(2, 5), 1, 1, 1), r"\[B, H, S\]"),
        ((torch.zeros(1, 1, 5, dtype=torch.long), 1, 1, 1), "float"),
        ((torch.tensor([[[0.0, float("nan")]]]), 1, 1, 1), "NaN"),
        ((torch.zeros(1, 1, 5), -1, 1, 1), "sink=-1"),
        ((torch.zeros(1, 1, 5), 0, 0, 1), "window=0"),
        ((torch.zeros(1, 1, 5), 0, 1, -2), "topk=-2"),
    ],
)
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        kvpop.eviction_times(*args)
    with pytest.raises(ValueError, match=match):
        kvpop.retention_mask(*args)
