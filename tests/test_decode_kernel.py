"""The split decode attention (`ops/attention/decode_kernel.py`) against the reference, and where it is used.

Without CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`), which must be set before Triton
compiles anything, so those checks run in a child process (as in `test_topk_kernel.py`).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from kvpop.ops.attention.decode_kernel import decode_attention_split
    from kvpop.ops.attention.reference import masked_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    # (B, Hq, Hkv, N, D, split): SmolLM2's 9 / 3 heads of 64, Qwen3's 32 / 8 of 128, N off the splits and blocks,
    # one split, several, a last split that is mostly past N; Gemma 3's 4 / 1 heads of 256 (half-size blocks)
    for B, Hq, Hkv, N, D, split in [(2, 9, 3, 200, 64, 128), (1, 32, 8, 257, 128, 128), (3, 4, 4, 64, 16, 64),
                                    (2, 6, 2, 1, 32, 64), (1, 8, 2, 130, 64, 64), (2, 4, 1, 150, 256, 64)]:
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(B, Hq, 1, D, generator=g)
            # the cache's layout: slot buffers with a scratch slot last, attended without it (a strided view)
            kbuf, vbuf = torch.randn(B, Hkv, N + 1, D, generator=g), torch.randn(B, Hkv, N + 1, D, generator=g)
            occupied = torch.rand(B, Hkv, N, generator=g) < 0.7
            occupied[0, 0] = False  # a row with no slot yet: zeros
            if N > 70:
                occupied[-1, -1] = False
                occupied[-1, -1, 65:70] = True  # everything in one block of one split
            q, kbuf, vbuf, occupied = (t.to(device) for t in (q, kbuf, vbuf, occupied))
            q, kbuf, vbuf = q.to(dtype), kbuf.to(dtype), vbuf.to(dtype)
            k, v = kbuf[:, :, :N], vbuf[:, :, :N]
            scale = D ** -0.5
            want, _ = masked_attention(q, k, v, occupied[:, :, None, :], scale)
            # the occupancy as a strided view too (every other column of a wider mask)
            wide = torch.stack([occupied, ~occupied], dim=-1).flatten(-2)
            assert torch.equal(decode_attention_split(q, k, v, wide[..., ::2], scale, split=split),
                               decode_attention_split(q, k, v, occupied, scale, split=split))
            got = decode_attention_split(q, k, v, occupied, scale, split=split)
            # the occupancy as the slots' positions (-1: empty), as the cache's decode step passes it
            pos = torch.where(occupied, torch.arange(N, device=device), -1)
            assert torch.equal(decode_attention_split(q, k, v, pos, scale, split=split), got)
            G = Hq // Hkv
            assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
            assert torch.isfinite(got).all()
            assert (got[0, :G] == 0).all()
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            err = (got.float() - want.float()).abs().max().item()
            assert err < tol, (B, Hq, Hkv, N, D, split, dtype, err)
    # a custom op: a compiled step (the fused decode step, the whole step under inductor) takes it as one call
    step = torch.compile(decode_attention_split, backend="aot_eager", fullgraph=True)
    assert torch.equal(step(q, k, v, occupied, scale, split=split), got)
    print("ok")
    """
)


SCORED = textwrap.dedent(
    """
    import torch
    from kvpop.ops.attention.decode_kernel import SCORE_FORMS, decode_attention_scored
    from kvpop.ops.attention.reference import scored_attention_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    PRI_TOL = 2e-5
    # (B, Hq, Hkv, N, D, split): SmolLM2's and Qwen3's heads, N off the splits and the update's blocks, one split
    # and several, a padding row; Gemma 3's heads of 256
    for B, Hq, Hkv, N, D, split in [(2, 9, 3, 200, 64, 128), (1, 32, 8, 257, 128, 64), (3, 4, 4, 64, 16, 64),
                                    (1, 4, 1, 100, 256, 64)]:
        # every score in float32 and bfloat16 across the shapes
        for i, score in enumerate(sorted(SCORE_FORMS)):
            dtype = (torch.float32, torch.bfloat16)[(i + N) % 2]
            q = torch.randn(B, Hq, 1, D, generator=g)
            # the cache's layout: buffers with a scratch slot, attended without it
            kbuf, vbuf = torch.randn(B, Hkv, N + 1, D, generator=g), torch.randn(B, Hkv, N + 1, D, generator=g)
            # ties: slots 1 and 2 hold the same key in every head (equal probabilities)
            kbuf[:, :, 2] = kbuf[:, :, 1]
            pos = torch.arange(N + 1).expand(B, Hkv, N + 1).clone()
            pos[torch.rand(B, Hkv, N + 1, generator=g) < 0.3] = -1
            pos[..., 1:3] = torch.tensor([5, 6])
            real = torch.ones(B, dtype=torch.bool)
            if B > 1:
                # a padding step changes no priority; in its row one KV head has no slot yet (left padding)
                real[-1] = False
                pos[-1, 0] = -1
            pri = torch.where(pos >= 0, torch.randn(B, Hkv, N + 1, generator=g), float("-inf"))
            prior = torch.randn(B, Hkv, N + 1, generator=g)
            q, kbuf, vbuf, pos, pri, prior, real = (t.to(device) for t in (q, kbuf, vbuf, pos, pri, prior, real))
            q, kbuf, vbuf = q.to(dtype), kbuf.to(dtype), vbuf.to(dtype)
            k, v = kbuf[:, :, :N], vbuf[:, :, :N]
            want_pri, got_pri = pri.clone(), pri.clone()
            # poisoned scratch slot: nothing may read or write it
            got_pri[..., N] = float("nan")
            scale = D ** -0.5
            # "cascade_sum" fades its accumulated score (H2O's "sum" keeps it whole)
            decay = 0.9 if score == "cascade_sum" else 1.0
            want = scored_attention_reference(q, k, v, pos[..., :N], want_pri[..., :N], prior[..., :N], real, scale,
                                              score, decay)
            # the buffers whole, as a cache passes them: the scratch slot is not the kernel's to touch
            got = decode_attention_scored(q, k, v, pos, got_pri, prior, real, scale, score, split=split, decay=decay)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            G = Hq // Hkv
            if B > 1:
                # the head with no slot: the reference's softmax over nothing is NaN, the kernel gives zeros
                assert (got[-1, :G] == 0).all() and torch.isnan(want[-1, :G]).all()
                got[-1, :G], want[-1, :G] = 0, 0
            err = (got.float() - want.float()).abs().max().item()
            assert got.shape == want.shape and got.dtype == dtype and err < tol, (score, dtype, err)
            assert torch.isnan(got_pri[..., N]).all()
            a, b = want_pri[..., :N], got_pri[..., :N]
            # the same slots updated (empty slots and padding rows keep their priority, -inf included)
            assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
            fin = torch.isfinite(a)
            perr = (a[fin] - b[fin]).abs().max().item()
            assert perr < PRI_TOL, (B, Hq, Hkv, N, score, dtype, perr)
            if not real[-1]:
                assert torch.equal(b[-1], pri[-1, :, :N]), score
            # equal probabilities, equal priorities (the rule's ties), where the slots' history is equal too
            if SCORE_FORMS[score][1] is False and SCORE_FORMS[score][2] is False:
                tie = (pos[:, :, 1] >= 0) & real[:, None]
                assert torch.equal(b[:, :, 1][tie], b[:, :, 2][tie]), score
    # a custom op that writes `pri` in place: a compiled step takes it as one call
    step = torch.compile(decode_attention_scored, backend="aot_eager", fullgraph=True)
    again = pri.clone()
    out = step(q, k, v, pos, again, prior, real, scale, score, split=split, decay=decay)
    assert torch.equal(out, got) and torch.equal(again[..., :N], got_pri[..., :N])
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


def test_split_decode_attention_matches_reference():
    _run(CHECK)


def test_split_rejects_a_split_off_the_block():
    from kvpop.ops.attention.decode_kernel import decode_attention_split

    q, k = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_attention_split(q, k, k, torch.ones(1, 2, 8, dtype=torch.bool), 1.0, split=100)


def test_scored_decode_attention_matches_reference():
    _run(SCORED)


def test_scored_attention_refuses_a_score_without_a_form():
    from kvpop.ops.attention.decode_kernel import decode_attention_scored

    q, k = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 8, 16)
    pos, pri = torch.zeros(1, 2, 8, dtype=torch.long), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="score='median' has no kernel form"):
        decode_attention_scored(q, k, k, pos, pri, None, torch.ones(1, dtype=torch.bool), 1.0, "median")
    with pytest.raises(ValueError, match="adds the slots' priors"):
        decode_attention_scored(q, k, k, pos, pri, None, torch.ones(1, dtype=torch.bool), 1.0, "prior")
    with pytest.raises(ValueError, match="must cover the 8 slots"):
        decode_attention_scored(q, k, k, pos[..., :7], pri[..., :7], None, torch.ones(1, dtype=torch.bool), 1.0, "max")


def test_every_score_has_a_kernel_form():
    # a dynamic policy's decode step runs the kernel only for the scores it has a form for (the others take the
    # reference's path, slower on CUDA): a new score of `ops.dynamic.score_update` adds its line to SCORE_FORMS
    from kvpop.ops.attention.decode_kernel import SCORE_FORMS
    from kvpop.ops.dynamic import SCORES

    assert set(SCORES) <= set(SCORE_FORMS), sorted(set(SCORES) - set(SCORE_FORMS))
