"""The Triton running top-k (`ops/topk/kernel.py`: the two-level kernel and the tile scan) against the references.

On a machine without CUDA the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which
must be set before Triton compiles anything, so those checks run in a child process.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernel is optional (pip install triton)")

CHECK = textwrap.dedent(
    """
    import torch
    from hypothesis import given, settings, strategies as st
    from kvpop.ops.topk import NEVER, eviction_positions, eviction_times_from_mask, retention_mask_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def priorities(g, shape, ties, neg_inf):
        pri = torch.randint(0, 3, shape, generator=g).float() if ties else torch.randn(shape, generator=g)
        if neg_inf:  # DMS's "evict" decision: never takes a long-range slot, outranks nobody
            pri = torch.where(torch.rand(shape, generator=g) < 0.2, float("-inf"), pri)
        return pri

    @settings(max_examples=MAX_EXAMPLES, deadline=None)
    @given(S=st.integers(1, 300), sink=st.integers(0, 5), window=st.integers(1, 20), topk=st.integers(1, 60),
           ties=st.booleans(), neg_inf=st.booleans(), seed=st.integers(0, 2**16))
    def dense_reference(S, sink, window, topk, ties, neg_inf, seed):
        g = torch.Generator().manual_seed(seed)
        pri = priorities(g, (2, 2, S), ties, neg_inf)
        expected = eviction_times_from_mask(retention_mask_reference(pri, sink, window, topk), sink, window)
        pos = torch.arange(S, device=device)
        ones = torch.ones(S, dtype=torch.bool, device=device)
        got = eviction_positions(pri.to(device), pos, ones, sink, window, topk, ordered=True, backend="triton")
        assert torch.equal(got.clamp(max=S).cpu(), expected), (S, sink, window, topk, ties, neg_inf, seed)

    @settings(max_examples=MAX_EXAMPLES, deadline=None)
    @given(S=st.integers(1, 400), sink=st.integers(0, 5), window=st.integers(1, 20), topk=st.integers(1, 200),
           ties=st.booleans(), seed=st.integers(0, 2**16))
    def padded_wavelet(S, sink, window, topk, ties, seed):
        g = torch.Generator().manual_seed(seed)
        pri = priorities(g, (2, 3, S), ties, False).to(device)
        valid = (torch.rand(2, 1, S, generator=g) > 0.25).to(device)
        position = torch.cumsum(valid.long(), -1) - 1  # padding anywhere, as the training path has it
        a = eviction_positions(pri, position, valid, sink, window, topk, backend="wavelet")
        b = eviction_positions(pri, position, valid, sink, window, topk, ordered=True, backend="triton")
        m = valid.expand_as(a)
        assert torch.equal(a[m], b[m]), (S, sink, window, topk, ties, seed)

    @settings(max_examples=MAX_EXAMPLES, deadline=None)
    @given(S=st.integers(1, 300), sink=st.integers(0, 5), window=st.integers(1, 20), topk=st.integers(1, 200),
           ties=st.booleans(), neg_inf=st.booleans(), seed=st.integers(0, 2**16))
    def unordered_wavelet(S, sink, window, topk, ties, neg_inf, seed):
        # a cache's slots plus a chunk: positions in any order per (row, head), gaps, empty slots anywhere
        g = torch.Generator().manual_seed(seed)
        pri = priorities(g, (2, 3, S), ties, neg_inf)
        position = torch.stack([torch.randperm(2 * S, generator=g)[:S] for _ in range(6)]).reshape(2, 3, S)
        valid = torch.rand(2, 3, S, generator=g) > 0.2
        pri, position, valid = pri.to(device), position.to(device), valid.to(device)
        a = eviction_positions(pri, position, valid, sink, window, topk, backend="wavelet")
        for backend in ("triton", "triton_unfused", "triton_scan"):
            b = eviction_positions(pri, position, valid, sink, window, topk, backend=backend)
            assert torch.equal(a[valid], b[valid]), (S, sink, window, topk, ties, neg_inf, seed, backend)

    dense_reference()
    padded_wavelet()
    unordered_wavelet()
    print("ok")
    """
)


def _run_check(max_examples: int) -> None:
    _run(CHECK.replace("MAX_EXAMPLES", str(max_examples)))


def test_kernel_equals_reference_and_wavelet():
    _run_check(max_examples=400 if torch.cuda.is_available() else 40)


TILED = textwrap.dedent(
    """
    import torch
    from kvpop.ops.topk.kernel import kth_beater, kth_beater_tiled

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    # (S, topk, ties, share of unranked tokens): tiny rows, k at and past the ends, S off the tile sizes
    for S, topk, ties, unranked in [(1, 1, False, 0.0), (2, 1, True, 0.0), (17, 3, True, 0.3), (63, 5, False, 0.3),
                                    (100, 34, True, 0.0), (100, 99, False, 0.0), (57, 60, True, 0.2)]:
        pri = torch.randint(0, 3, (2, S), generator=g).float() if ties else torch.randn(2, S, generator=g)
        ranked = torch.rand(2, S, generator=g) >= unranked
        # ranks as the training path makes them: best first, ties to the newer token, unranked last
        key = torch.where(ranked, pri, float("-inf")).flip(-1)
        order = (S - 1) - torch.argsort(key, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(S).expand(2, S)).int().to(device)
        ranked = ranked.to(device)
        expected = kth_beater(rank, ranked, topk)
        # small tiles walk every loop of the kernel: several rank blocks, tile chunks and scan steps
        for blocks in ({}, dict(block_r=8, block_u=4, block_j=2, block_e=2), dict(block_r=16, block_u=8, block_j=4)):
            got = kth_beater_tiled(rank, ranked, topk, **blocks)
            assert torch.equal(got, expected), (S, topk, ties, unranked, blocks)
    print("ok")
    """
)


def _run(code: str) -> None:
    if torch.cuda.is_available():
        exec(compile(code, "<kernel check>", "exec"), {})
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def test_tiled_kernel_equals_scan_kernel():
    # the two-level kernel against the tile scan it replaces, on the same ranks (ties, unranked tokens)
    _run(TILED)


def test_kernel_backend_errors():
    from kvpop.ops.topk import eviction_positions

    pri = torch.randn(1, 1, 8)
    pos, ones = torch.arange(8), torch.ones(8, dtype=torch.bool)
    with pytest.raises(ValueError, match="backend='bogus'"):
        eviction_positions(pri, pos, ones, 1, 2, 3, ordered=True, backend="bogus")
    from kvpop.ops.topk.kernel import kth_beater_tiled

    rank = torch.arange(8, dtype=torch.int32)[None]
    with pytest.raises(ValueError, match="block_u=3"):
        kth_beater_tiled(rank, torch.ones_like(rank, dtype=torch.bool), 2, block_u=3)
    with pytest.raises(ValueError, match="topk=0"):
        kth_beater_tiled(rank, torch.ones_like(rank, dtype=torch.bool), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_is_the_cuda_default_at_long_length():
    from kvpop.ops.topk import eviction_positions

    g = torch.Generator().manual_seed(0)
    pri = torch.randn(1, 8, 16384, generator=g).cuda()
    pos = torch.arange(16384, device="cuda")
    ones = torch.ones(16384, dtype=torch.bool, device="cuda")
    auto = eviction_positions(pri, pos, ones, 4, 256, 1788, ordered=True)
    wave = eviction_positions(pri, pos, ones, 4, 256, 1788, backend="wavelet")
    scan = eviction_positions(pri, pos, ones, 4, 256, 1788, ordered=True, backend="triton_scan")
    assert torch.equal(auto, wave) and torch.equal(scan, wave)

