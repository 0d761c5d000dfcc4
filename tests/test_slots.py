"""The slot rewrite after a chunk and a decode step's slot update (`ops/slots.py`): the Triton kernels against the
PyTorch references.

The reference is what `KVpopCache._chunk` ran before the kernel (and still runs off CUDA); the cache tests check it
against token-by-token decoding. Without CUDA the kernel runs under Triton's interpreter in a child process.
"""

import textwrap

import pytest
import torch

from helpers import run_triton_check
from kvpop.ops.slots import step_slots, write_slots

CHECK = textwrap.dedent(
    """
    import torch
    from kvpop.ops.slots import write_slots_kernel, write_slots_reference
    from kvpop.ops.topk import eviction_positions

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def case(B, H, sink, window, topk, prefix, C, D, DV, dtype, seed, ties=False, pad=True):
        # slots holding `prefix` earlier tokens (some empty), then a chunk of C tokens, left-padded in rows > 0
        g = torch.Generator().manual_seed(seed)
        N = sink + window + topk
        pos = torch.full((B, H, N), -1, dtype=torch.long)
        pri = torch.full((B, H, N), float("-inf"))
        seen = torch.zeros(B, dtype=torch.long)
        if prefix:
            # the prefix's survivors at random slots: positions below `prefix`, distinct per row
            for b in range(B):
                for h in range(H):
                    n = min(N, prefix)
                    pos[b, h, torch.randperm(N, generator=g)[:n]] = torch.randperm(prefix, generator=g)[:n]
            pri = torch.where(pos >= 0, torch.randn(B, H, N, generator=g), float("-inf"))
            seen[:] = prefix
        valid = torch.ones(B, C, dtype=torch.bool)
        if pad:
            for b in range(1, B):
                valid[b, : int(torch.randint(0, C, (1,), generator=g))] = False
        position = seen[:, None] + valid.long().cumsum(-1) - 1
        new_pos = torch.where(valid, position, -1)[:, None, :].expand(B, H, C)
        cpos = torch.cat([pos, new_pos], dim=2)
        cpri = torch.cat([pri, torch.randn(B, H, C, generator=g)], dim=2)
        if ties:
            cpri = torch.where(cpri > float("-inf"), cpri.round(), cpri)
        # a few -inf priorities among the new tokens (DMS's evict decision)
        cpri[..., -C:][torch.rand(B, H, C, generator=g) < 0.05] = float("-inf")
        ev = eviction_positions(cpri, cpos, cpos >= 0, sink, window, topk)
        last = seen + valid.sum(-1) - 1
        ck = torch.randn(B, H, N + C, D, generator=g).to(dtype)
        # values as a strided view (a transposed layout), keys contiguous
        cv = torch.randn(B, N + C, H, DV, generator=g).to(dtype).transpose(1, 2)
        cands = [t.to(device) for t in (ck, cv, cpos, cpri)]
        return cands, ev.to(device), last.to(device), N

    def slots_like(B, H, N, D, DV, dtype):
        # the cache's views: buffers with one scratch slot more, sliced; garbage in them beforehand
        bufs = (torch.randn(B, H, N + 1, D), torch.randn(B, H, N + 1, DV), torch.randint(0, 9, (B, H, N + 1)),
                torch.randn(B, H, N + 1))
        return [(b.to(dtype) if i < 2 else b).to(device) for i, b in enumerate(bufs)]

    # (B, H, sink, window, topk, prefix, C, D, DV, dtype, ties): fresh and filled caches, padding, a chunk shorter
    # than the window (empty slots), topk 0, sink 0, ties, bfloat16, tiles of the kernel cut mid-chunk
    CASES = [
        (2, 3, 4, 16, 24, 0, 300, 8, 8, torch.float32, False),
        (2, 2, 4, 16, 24, 60, 200, 8, 4, torch.bfloat16, True),
        (1, 2, 2, 64, 32, 0, 40, 16, 16, torch.float32, False),
        (3, 1, 0, 8, 16, 30, 129, 4, 4, torch.float32, True),
        (2, 2, 4, 32, 0, 10, 257, 8, 8, torch.float16, False),
        (1, 1, 1, 1, 1, 0, 5, 2, 2, torch.float32, False),
    ]
    emptied = 0
    for i, (B, H, sink, window, topk, prefix, C, D, DV, dtype, ties) in enumerate(CASES):
        cands, ev, last, N = case(B, H, sink, window, topk, prefix, C, D, DV, dtype, seed=i, ties=ties)
        want, got = slots_like(B, H, N, D, DV, dtype), [b.clone() for b in slots_like(B, H, N, D, DV, dtype)]
        before = [b.clone() for b in got]
        write_slots_reference([b[:, :, :N] for b in want], cands, ev, last, sink, window)
        write_slots_kernel([b[:, :, :N] for b in got], cands, ev, last, sink, window, block_m=64)
        for name, a, b, b0 in zip(("keys", "values", "pos", "pri"), want, got, before):
            assert a.dtype == b.dtype and torch.equal(a[:, :, :N], b[:, :, :N]), (i, name)
            # the scratch slot past the views is left as it was
            assert torch.equal(b[:, :, N:], b0[:, :, N:]), (i, name)
        emptied += int((got[2][:, :, :N] < 0).any())
    # the cases reach empty slots (a chunk shorter than the budget) as well as full ones
    assert 0 < emptied < len(CASES), emptied
    print("ok")
    """
)


def test_kernel_writes_the_reference_slots():
    pytest.importorskip("triton", reason="the Triton kernels are optional (pip install triton)")
    run_triton_check(CHECK, "slots kernel check")


def test_write_slots_rejects_an_unknown_backend():
    t = torch.zeros(1, 1, 2, 2)
    p = torch.zeros(1, 1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="backend='tiled' must be"):
        write_slots((t, t, p, p.float()), (t, t, p, p.float()), p, torch.zeros(1, dtype=torch.long), 1, 1, "tiled")


def test_write_slots_names_why_the_kernel_cannot_run(monkeypatch):
    # the CPU without Triton's interpreter: backend="triton" says what it needs, "auto" takes the PyTorch form
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = torch.zeros(1, 1, 2, 2)
    p = torch.full((1, 1, 2), -1, dtype=torch.long)
    last = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="needs `triton` and CUDA"):
        write_slots((t, t, p, p.float()), (t, t, p, p.float()), p, last, 1, 1, "triton")
    pri = torch.zeros(1, 1, 2)
    write_slots((t, t, p.clone(), pri), (t, t, p, p.float()), p, last, 1, 1)
    assert torch.equal(pri, torch.full((1, 1, 2), float("-inf")))


STEP = textwrap.dedent(
    """
    import torch
    from kvpop.ops.slots import step_slots_kernel, step_slots_reference, step_slots_torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    NAMES = ("keys", "values", "pos", "pri", "prior")

    def run(B, H, sink, window, topk, steps, D, DV, dtype, seed, ties, block_n, static=0, tova_first=False, prior=False,
            compiled=False, impl=None):
        # both from empty buffers (garbage in the scratch slot), token by token: padding steps in rows > 0, tied and
        # -inf priorities (DMS's evict decision), keys and values given as strided views. With a prior buffer the
        # slots' priorities change between steps as a score update would change them (the same in both)
        g = torch.Generator().manual_seed(seed)
        n = sink + window + topk + 1
        bufs = [torch.zeros(B, H, n, D).to(dtype), torch.zeros(B, H, n, DV).to(dtype),
                torch.full((B, H, n), -1, dtype=torch.long), torch.full((B, H, n), float("-inf"))]
        if prior or static:
            bufs.append(torch.full((B, H, n), float("-inf")))
        bufs[0][:, :, -1] = 7.0
        want = [b.to(device) for b in bufs]
        got = [b.clone() for b in want]
        kernel = impl or step_slots_kernel
        if compiled:
            # the custom op inside a compiled function: it must write the caller's buffers in place
            kernel = torch.compile(kernel, fullgraph=True, backend="inductor")
        seen = torch.zeros(B, dtype=torch.long)
        moved = [0, 0]
        lo = sink + window
        for t in range(steps):
            real = torch.ones(B, dtype=torch.bool)
            real[1:] = torch.rand(B - 1, generator=g) > 0.2
            p = seen + real.long() - 1
            seen += real.long()
            pri = torch.randn(B, H, generator=g)
            if ties:
                pri = pri.round()
            pri[torch.rand(B, H, generator=g) < 0.1] = float("-inf")
            key = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)
            value = torch.randn(B, H, 1, DV, generator=g).to(dtype)
            args = [x.to(device) for x in (key, value, p, real, pri)]
            before = want[2].clone()
            step_slots_reference(want, *args, sink, window, topk, static, tova_first)
            if impl is None:
                kernel(got, *args, sink, window, topk, static, tova_first, block_n=block_n)
            else:
                kernel(got, *args, sink, window, topk, static, tova_first)
            for name, a, b in zip(NAMES, want, got):
                assert torch.equal(a, b), (B, H, sink, window, topk, static, tova_first, seed, t, name)
            changed = want[2][:, :, :-1] != before[:, :, :-1]
            moved[0] += int(changed[..., lo : lo + static].sum())
            moved[1] += int(changed[..., lo + static :].sum())
            if len(want) > 4:
                # a score update: new priorities for the occupied slots (rounded: ties), the scratch slot's kept
                new = torch.randn(B, H, n - 1, generator=g).to(device)
                new = new.round() if ties else new
                for bufs_ in (want, got):
                    bufs_[3][:, :, :-1] = torch.where(bufs_[2][:, :, :-1] >= 0, new, bufs_[3][:, :, :-1])
        return moved

    # (B, H, sink, window, topk, steps, D, DV, dtype, ties, block_n): several reduction blocks, topk 0, sink 0,
    # window 1 (TOVA's split), ties, bfloat16, a budget past the steps (empty long-range slots throughout)
    CASES = [
        (2, 3, 2, 4, 12, 60, 8, 8, torch.float32, True, 4),
        (3, 2, 0, 1, 9, 50, 4, 8, torch.bfloat16, False, 2),
        (1, 2, 4, 8, 0, 30, 8, 4, torch.float16, False, 16),
        (2, 1, 1, 3, 40, 70, 16, 16, torch.float32, True, 1024),
        (2, 2, 4, 16, 64, 30, 8, 8, torch.float32, False, 8),
    ]
    IMPL = globals().get("IMPL")
    moves = [sum(run(*c[:6], *c[6:9], seed=i, ties=c[9], block_n=c[10], impl=IMPL)) for i, c in enumerate(CASES)]
    # the rule promoted tokens where it could (long-range slots changed), and never where there were none
    assert all(m > 0 for m in moves[:2]) and moves[2] == 0 and moves[3] > 0, moves
    # the cascades: (sink, window, topk, static, tova_first), both pools, one of them empty, TOVA's split; and
    # KVpop-TOVA's prior buffer with one pool
    CASCADES = [
        (2, 3, 9, 4, False), (0, 1, 11, 3, True), (1, 2, 8, 8, False), (0, 1, 7, 7, True), (2, 2, 7, 0, True),
        (0, 1, 10, 0, False),
    ]
    for i, (sink, window, topk, static, tova_first) in enumerate(CASCADES):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        moved = run(2, 2, sink, window, topk, 32, 8, 4, dtype, seed=20 + i, ties=i != 5, block_n=(2, 4, 1024)[i % 3],
                    static=static, tova_first=tova_first, prior=True, impl=IMPL)
        # tokens went into every pool the rule has
        assert (moved[0] > 0) == (static > 0) and (moved[1] > 0) == (static < topk), (i, moved)
    run(2, 2, 2, 4, 12, 25, 8, 8, torch.float32, seed=9, ties=True, block_n=4, compiled=True, impl=IMPL)
    run(2, 2, 0, 1, 12, 25, 8, 8, torch.float32, seed=10, ties=True, block_n=4, static=5, tova_first=True, prior=True,
        compiled=True, impl=IMPL)
    print("ok")
    """
)


def test_step_kernel_updates_the_slots_as_the_reference():
    pytest.importorskip("triton", reason="the Triton kernels are optional (pip install triton)")
    run_triton_check(STEP, "step kernel check")


def test_step_in_fewer_operations_updates_the_slots_as_the_reference():
    # the CPU's path (`step_slots_torch`): the same cases, in this process (the compiled runs through inductor too)
    from kvpop.ops.slots import step_slots_torch

    exec(compile(STEP, "torch step check", "exec"), {"IMPL": step_slots_torch})


def test_step_slots_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = torch.zeros(1, 1, 3, 2)
    pos, pri = torch.full((1, 1, 3), -1, dtype=torch.long), torch.zeros(1, 1, 3)
    new = torch.ones(1, 1, 1, 2)
    args = (new, new, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), torch.zeros(1, 1), 1, 1, 0)
    with pytest.raises(ValueError, match="backend='fused' must be"):
        step_slots((t, t, pos, pri), *args, backend="fused")
    with pytest.raises(ValueError, match="takes 4 buffers"):
        step_slots((t, t, pos), *args)
    with pytest.raises(ValueError, match=r"static=2 must be in \[0, topk=1\]"):
        step_slots((t, t, pos, pri, pri.clone()), *args[:-1], 1, static=2)
    with pytest.raises(ValueError, match="ranked by the prior buffer"):
        step_slots((t, t, pos, pri), *args[:-1], 1, static=1)
    with pytest.raises(RuntimeError, match="needs `triton` and CUDA"):
        step_slots((t, t, pos, pri), *args, backend="triton")
    # "auto" off CUDA: the PyTorch form; the token goes to slot 0 with its position and priority
    step_slots((t, t, pos, pri), *args)
    assert pos[0, 0, 0] == 0 and pri[0, 0, 0] == 0 and torch.equal(t[0, 0, 0], new[0, 0, 0])
