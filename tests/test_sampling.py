"""`kvpop.sampling`: the hash against integer arithmetic, noise that depends on (seed, step, token) only,
and Gumbel-max draws distributed as softmax(logits / T)."""

from __future__ import annotations

import math

import pytest
import torch

from kvpop.sampling import gumbel_sample, hash_uniform, next_tokens, splitmix64

MASK64 = (1 << 64) - 1
# a statistical bound that a correct sampler misses with probability ~1e-9 (chi-square, 5 degrees of freedom)
CHI2_BOUND_5DOF = 50.0


def splitmix64_reference(x: int) -> int:
    """splitmix64 on Python's unbounded integers, reduced modulo 2**64 at each step (the published algorithm)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_splitmix64_is_the_published_algorithm():
    # the first output of splitmix64 seeded with 0 (as in Vigna's reference implementation)
    assert int(splitmix64(torch.tensor([0]))) & MASK64 == 0xE220A8397B1DCDAF
    g = torch.Generator().manual_seed(0)
    xs = [0, 1, -1, 2**63 - 1, -(2**63), 123456789] + torch.randint(-(2**63), 2**63 - 1, (200,), generator=g).tolist()
    got = [v & MASK64 for v in splitmix64(torch.tensor(xs)).tolist()]
    assert got == [splitmix64_reference(x & MASK64) for x in xs]


def test_uniforms_depend_on_seed_step_and_token_only():
    seeds = torch.tensor([3, 17, 3, 2**40 + 5])
    u = hash_uniform(seeds, 7, 1000)
    assert u.dtype == torch.float64 and u.shape == (4, 1000)
    assert (u > 0).all() and (u < 1).all()
    # equal seeds, equal rows; a row alone is the row in the batch; a longer vocabulary extends it
    assert torch.equal(u[0], u[2])
    assert torch.equal(hash_uniform(seeds[1:2], 7, 1000)[0], u[1])
    assert torch.equal(hash_uniform(seeds, 7, 1500)[:, :1000], u)
    # another step or seed: other numbers
    assert not torch.isclose(hash_uniform(seeds, 8, 1000), u).any(-1).all()
    assert (hash_uniform(seeds + 1, 7, 1000) != u).float().mean() > 0.99
    # roughly uniform: mean 1/2, variance 1/12 (over 4000 numbers, several standard errors of slack)
    flat = u.flatten()
    assert abs(flat.mean().item() - 0.5) < 0.02 and abs(flat.var().item() - 1 / 12) < 0.01


def test_neighbouring_seeds_and_steps_are_uncorrelated():
    seeds = torch.arange(20000)
    a = hash_uniform(seeds, 0, 2)
    b = hash_uniform(seeds + 1, 0, 2)
    c = hash_uniform(seeds, 1, 2)
    for x, y in ((a[:, 0], b[:, 0]), (a[:, 0], c[:, 0]), (a[:, 0], a[:, 1])):
        r = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
        # standard error of r is 1/sqrt(20000) ~ 0.007
        assert abs(r) < 0.04, r


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * probs
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_gumbel_draws_follow_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -0.3])
    probs = (logits.double() / temperature).softmax(-1)
    n = 40000
    # across seeds at one step, and across steps of one seed: both must be draws of softmax(logits / T)
    by_seed = gumbel_sample(logits.expand(n, -1), torch.arange(n), 0, temperature)
    by_step = torch.stack([gumbel_sample(logits[None], torch.tensor([11]), t, temperature)[0] for t in range(4000)])
    for draws, count in ((by_seed, n), (by_step, 4000)):
        counts = torch.bincount(draws, minlength=len(logits)).double()
        assert counts.sum() == count
        chi2 = _chi2(counts, probs)
        assert chi2 < CHI2_BOUND_5DOF, f"chi2 {chi2:.1f}; frequencies {(counts / count).tolist()} vs {probs.tolist()}"


def test_sampling_is_deterministic_and_batch_independent():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(0))
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    first = gumbel_sample(logits, seeds, 3, 0.7)
    assert torch.equal(first, gumbel_sample(logits, seeds, 3, 0.7))
    # each row alone, and the rows in another order, draw the same tokens
    alone = torch.cat([gumbel_sample(logits[r : r + 1], seeds[r : r + 1], 3, 0.7) for r in range(6)])
    assert torch.equal(alone, first)
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    assert torch.equal(gumbel_sample(logits[perm], seeds[perm], 3, 0.7), first[perm])
    # other seeds draw other tokens (flat logits: 500 near-equal choices)
    flat = torch.zeros(6, 500)
    assert (gumbel_sample(flat, seeds, 3, 0.7) != gumbel_sample(flat, seeds + 100, 3, 0.7)).sum() >= 4


def test_next_tokens_greedy_and_errors():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert next_tokens(logits, None, 0, 0.0).tolist() == [1, 0]
    # a very low temperature is greedy too
    assert next_tokens(logits, torch.tensor([1, 2]), 5, 1e-3).tolist() == [1, 0]
    with pytest.raises(ValueError, match="seed"):
        next_tokens(logits, None, 0, 0.7)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_sample(logits, torch.tensor([1, 2]), 0, 0.0)
    # the extreme uniforms (0.5 and 2**52 - 0.5, over 2**52) give finite Gumbel noise
    extremes = torch.tensor([0.5, 2.0**52 - 0.5], dtype=torch.float64) * 2.0**-52
    assert all(math.isfinite(g) for g in (-torch.log(-torch.log(extremes))).tolist())
