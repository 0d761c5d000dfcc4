"""The chunked rule's round as Triton kernels (`ops/dynamic/chunked_kernel.py`), against its PyTorch form.

The claims: the decision kernels make `chunk_decision`'s decision bit for bit (the same slots in the same order, the
same evicted candidates), with ties of score and of static priority, empty slots, padding, protected (+inf) ranks,
no static pool and no pool; the evidence kernel gives `chunk_probs`' output and column sums to float rounding, with
grouped heads, head dims and chunks of any size, soft-capping and padding queries; and with the kernels on, the
cache makes the teacher-forced decisions (both executions call them). On a machine without CUDA the kernels run
under Triton's interpreter, in a subprocess.
"""

import pytest
import torch

from helpers import run_triton_check

triton = pytest.importorskip("triton")

_CANDIDATES = '''
import torch

dev = "cuda" if torch.cuda.is_available() else "cpu"

def candidates(B, H, K, P, L, gen, empty=0, pad=0, ties=False, protect=False):
    S = K - P
    pos = torch.full((B, H, K + L), -1, dtype=torch.long)
    for b in range(B):
        held = torch.randperm(1000, generator=gen)[:K].sort().values
        pos[b, :, S:K] = held[S:K]
        for h in range(H):
            pos[b, h, :S] = torch.randperm(1000, generator=gen)[:S] + 1000 * (h + 1)
        pos[b, :, K:] = torch.arange(5000, 5000 + L)
    if empty:
        pos[:, :, :empty] = -1
        pos[:, :, S:S + empty] = -1
    if pad:
        pos[:, :, K:K + pad] = -1
    score = torch.rand(B, K + L, generator=gen)
    prior = torch.randn(B, H, K + L, generator=gen)
    if ties:
        score = (score * 3).floor() / 3
        prior = (prior * 2).round() / 2
        prior[:, :, ::5] = float("-inf")
    if protect:
        prior[:, :, -3:] = float("inf")
    return score, pos, prior
'''


def test_the_decision_kernels_are_the_decision_bit_for_bit():
    run_triton_check(_CANDIDATES + '''
from kvpop.ops.dynamic.chunked import chunk_decision
from kvpop.ops.dynamic.chunked_kernel import chunk_decision_fused

gen = torch.Generator().manual_seed(0)
cases = 0
for K, P, L in [(6, 3, 4), (6, 6, 4), (6, 0, 3), (1, 1, 1), (9, 4, 1), (5, 2, 8), (40, 30, 33), (70, 0, 9),
                (3, 0, 40), (160, 120, 16)]:
    for ties in (False, True):
        for empty, pad in ((0, 0), (1, 0), (0, L - 1), (1, 1)):
            if empty >= max(K - P, 1) or empty > P or pad >= L:
                continue
            for protect in (False, True):
                score, pos, prior = candidates(2, 3, K, P, L, gen, empty, pad, ties, protect)
                want = chunk_decision(score, pos, prior, K, P)
                got = [t.cpu() for t in chunk_decision_fused(score.to(dev), pos.to(dev), prior.to(dev), K, P)]
                assert torch.equal(got[0], want[0]), ("keep", K, P, L, ties, empty, pad, protect)
                assert torch.equal(got[1], want[1]), ("evicted", K, P, L, ties, empty, pad, protect)
                cases += 1
assert cases > 80, cases
print("ok")
''', "decision kernels")


def test_the_evidence_kernel_is_the_chunk_attention():
    run_triton_check('''
import torch
from kvpop.ops.dynamic.chunked import chunk_attention, chunk_probs
from kvpop.ops.dynamic.chunked_kernel import round_evidence_fused

dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(1)
for B, H, G, K, L, D, Dv, softcap in [(2, 2, 2, 12, 5, 24, 16, None), (1, 1, 4, 40, 70, 32, 32, 30.0),
                                       (2, 3, 1, 7, 16, 8, 40, None), (1, 2, 3, 0 + 1, 3, 16, 16, 5.0)]:
    q = torch.randn(B, H * G, L, D, generator=gen)
    k = torch.randn(B, H, K + L, D, generator=gen)
    v = torch.randn(B, H, K + L, Dv, generator=gen)
    held = torch.rand(B, H, K, generator=gen) > 0.3
    chunk_valid = torch.ones(B, L, dtype=torch.bool)
    chunk_valid[-1, : L // 3] = False  # a left-padded row: its padding queries see nothing
    q, k, v, held, chunk_valid = (t.to(dev) for t in (q, k, v, held, chunk_valid))
    probs = chunk_probs(q, k, held, chunk_valid, 0.3, softcap)
    out, sums = round_evidence_fused(q, k, v, held, chunk_valid, 0.3, softcap)
    want_out = chunk_attention(probs, v)
    assert out.shape == want_out.shape and sums.shape == (B, H, G, K + L)
    assert torch.allclose(out, want_out, atol=2e-5), (out - want_out).abs().max()
    assert torch.allclose(sums, probs.sum(3), atol=2e-5), (sums - probs.sum(3)).abs().max()
    assert bool((sums[..., :K] == 0)[~held[:, :, None].expand(B, H, G, K)].all())  # an empty slot gets nothing
    none, sums2 = round_evidence_fused(q, k, None, held, chunk_valid, 0.3, softcap)
    assert none is None and torch.equal(sums2, sums)
print("ok")
''', "evidence kernel")


def test_with_the_kernels_the_cache_makes_the_teacher_forced_decisions():
    run_triton_check('''
import torch
from kvpop.cache import ChunkedLayerCache
from kvpop.ops.attention import sparse_attention
from kvpop.ops.dynamic import chunked
from kvpop.ops.dynamic.chunked import chunked_eviction_positions

dev = "cuda" if torch.cuda.is_available() else "cpu"
assert chunked._fused(torch.zeros(1, device=dev))  # the kernels run here (on CUDA, or the interpreter)


class Policy:
    def __init__(self, chunk, prior):
        self.chunk, self.prior_all, self.offset = chunk, prior, 0

    def scorer_key(self, key, rope):
        return key

    def priority(self, key, value, position):
        n = key.shape[2]
        out = self.prior_all[:, :, self.offset : self.offset + n]
        self.offset += n
        return out


S = 29
gen = torch.Generator().manual_seed(3)
for K, P, C, protect in [(6, 4, 4, None), (8, 8, 5, None), (5, 0, 7, None), (8, 0, 3, 4)]:
    q = torch.randn(2, 4, S, 8, generator=gen)
    k = torch.randn(2, 2, S, 8, generator=gen)
    k[:, :, 5:9] = k[:, :, 4:5]  # duplicated keys: tied probabilities
    v = torch.randn(2, 2, S, 8, generator=gen)
    prior = torch.zeros(2, 2, S) if protect is not None else torch.randn(2, 2, S, generator=gen)
    pos = torch.arange(S).expand(2, S).contiguous()
    valid = torch.ones(2, S, dtype=torch.bool)
    q, k, v, prior, pos, valid = (t.to(dev) for t in (q, k, v, prior, pos, valid))
    evict = chunked_eviction_positions(q, k, pos, valid, prior, K, P, C, 0.4, protect=protect)
    want, _ = sparse_attention(q, k, v, pos, valid, pos, valid, evict, 0, 1, 0.4, backend="reference")
    for cuts in ([0, S], [0, 3, 4, 11, 12, 20, S]):
        cache = ChunkedLayerCache(K, C, None if P == K else P, protect)
        policy = Policy(C, prior)
        outs = []
        for a, b in zip(cuts, cuts[1:]):
            outs.append(cache.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], valid[:, a:b], policy, 0.4))
            held = [sorted(int(p) for p in cache.pos[bb, h] if p >= 0) for bb in range(2) for h in range(2)]
            t = torch.arange(b, device=dev)
            visible = [sorted(int(x) for x in t[(evict[bb, h, :b] > b - 1) if b == S else (evict[bb, h, :b] > b)])
                       for bb in range(2) for h in range(2)]
            assert held == visible, (K, P, C, protect, a, b)
        assert torch.allclose(torch.cat(outs, dim=2), want, atol=2e-5), (K, P, C, protect)
print("ok")
''', "fused rounds in the cache")


@pytest.mark.parametrize("dtype", [
    "float16",
    pytest.param("bfloat16", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="Triton's interpreter has no bfloat16 arithmetic")),
])
def test_the_evidence_kernel_in_16_bits(dtype):
    # 16-bit queries and keys meet on the tensor cores (the scale after the product), the probabilities meet the
    # values in their dtype: the column sums stay within float rounding, the output within the dtype's
    run_triton_check(f'''
import torch
from kvpop.ops.dynamic.chunked import chunk_attention, chunk_probs
from kvpop.ops.dynamic.chunked_kernel import round_evidence_fused

dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(2)
B, H, G, K, L, D = 1, 2, 2, 20, 9, 32
q, k, v = (torch.randn(*shape, generator=gen).to(dev, torch.{dtype}) for shape in
           ((B, H * G, L, D), (B, H, K + L, D), (B, H, K + L, D)))
held = (torch.rand(B, H, K, generator=gen) > 0.2).to(dev)
chunk_valid = torch.ones(B, L, dtype=torch.bool, device=dev)
probs = chunk_probs(q, k, held, chunk_valid, 0.25)
out, sums = round_evidence_fused(q, k, v, held, chunk_valid, 0.25)
assert out.dtype == torch.{dtype}
assert torch.allclose(sums, probs.sum(3), atol=1e-4), (sums - probs.sum(3)).abs().max()
want = chunk_attention(probs, v).float()
assert torch.allclose(out.float(), want, atol=3e-2, rtol=2e-2), (out.float() - want).abs().max()
print("ok")
''', "evidence kernel, 16 bits")


def test_a_device_where_the_kernels_fail_runs_the_pytorch_round(monkeypatch):
    # a card the kernels cannot compile for: the trial round fails once, with a warning, and every round on that
    # device (both executions) is the PyTorch one from the first on
    from kvpop.ops.dynamic import chunked

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this card")

    monkeypatch.setattr(chunked._kernels, "available", lambda t: True)
    monkeypatch.setattr(chunked._kernels, "round_evidence_fused", broken)
    monkeypatch.setattr(chunked, "_KERNELS_RUN", {})
    t = torch.zeros(1)
    with pytest.warns(RuntimeWarning, match="no kernel for this card"):
        assert not chunked._fused(t)
    assert not chunked._fused(t)  # decided once per device
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 7, 8)
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5, 6]]])
    keep, evicted, _ = chunked.chunk_round(q, k, pos, torch.randn(1, 1, 7), 4, 2, 0.3)
    assert keep.shape == (1, 1, 4) and evicted.shape == (1, 1, 3)
