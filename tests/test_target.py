"""Tests of the future-attention target (`kvpop.ops.target`) against its dense float64 reference.

Run: `python -m pytest tests/test_target.py -q` (GPU cases need CUDA and are marked `gpu`).
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvpop.ops.target import future_attention_target
from kvpop.ops.target.flex import future_block_mask
from kvpop.ops.target.reference import future_attention_target_reference, future_block_mask_reference

# absolute, in log space, i.e. a relative error of the mass
ATOL_F32 = 2e-4
# bf16 inputs are compared with the reference on the same (rounded) inputs: the kernel multiplies
# bf16 exactly and accumulates in float32, so only float32 rounding differs (measured 1e-6 on an H200)
ATOL_BF16 = 5e-4
# peak resident-memory growth allowed for the chunked backend at S = 8192 (an S x S float32 is 268 MB)
MEM_LIMIT_MB = 100

CUDA = torch.cuda.is_available()

# (B, Hq, Hkv, S, D): odd lengths, GQA groups of 1, 3 and 4
SHAPES = [(1, 2, 2, 63, 16), (2, 6, 2, 200, 32), (1, 4, 1, 257, 8)]


def make_inputs(B, Hq, Hkv, S, D, seed=0, sharpness=1.0, dtype=torch.float32, device="cpu"):
    """Random queries and keys and a realistic lse: the dense causal log-normaliser of the same logits.

    `sharpness` scales the queries, so attention ranges from flat to peaked.
    """
    g = torch.Generator().manual_seed(seed)
    query = (torch.randn(B, Hq, S, D, generator=g) * sharpness).to(dtype)
    key = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    G = Hq // Hkv
    q = query.double().reshape(B, Hkv, G, S, D)
    logits = torch.einsum("bhgsx,bhtx->bhgst", q, key.double()) * D**-0.5
    pos = torch.arange(S)
    logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1).reshape(B, Hq, S).float()
    return query.to(device), key.to(device), lse.to(device)


def perturb(lse, seed=1, amount=2.0):
    """An lse a sparse attention could have returned: off the dense one by up to `amount` either way."""
    g = torch.Generator().manual_seed(seed)
    return lse + (torch.rand(lse.shape, generator=g) * 2 - 1).to(lse.device) * amount


def reference(query, key, lse, window, **kw):
    D = query.shape[-1]
    return future_attention_target_reference(query.cpu(), key.cpu(), lse.cpu(), window, D**-0.5, **kw)


@functools.cache
def cached_case(shape, window, agg, count_norm):
    # both backends are checked against one reference computation
    query, key, lse = make_inputs(*shape)
    return query, key, lse, reference(query, key, lse, window, agg=agg, count_norm=count_norm)


def assert_close(out, ref, atol, what=""):
    out, ref = out.float().cpu(), ref.float().cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out - ref).abs()
    assert err.max() <= atol, f"{what}: max err {err.max():.3g}, mean err {err.mean():.3g} (atol {atol:g})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("agg", ["max", "mean"])
@pytest.mark.parametrize("count_norm", [True, False])
@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_backends_match_reference(shape, window, agg, count_norm, backend):
    query, key, lse, ref = cached_case(shape, window, agg, count_norm)
    out = future_attention_target(query, key, lse, window, agg=agg, count_norm=count_norm, backend=backend, chunk=37)
    assert_close(out, ref, ATOL_F32, f"{backend} {shape} w={window} {agg} count_norm={count_norm}")


@pytest.mark.parametrize("backend", ["chunked", "flex"])
@pytest.mark.parametrize("sharpness", [0.3, 4.0])
def test_uses_the_given_lse(backend, sharpness):
    query, key, lse = make_inputs(2, 6, 2, 200, 32, sharpness=sharpness)
    other = perturb(lse)
    ref = reference(query, key, other, 5)
    out = future_attention_target(query, key, other, 5, backend=backend, chunk=64)
    assert_close(out, ref, ATOL_F32, f"{backend} perturbed lse, sharpness {sharpness}")
    # the perturbation must show: a backend that recomputed the dense lse would fail here
    assert (out - reference(query, key, lse, 5)).abs().max() > 0.1


@pytest.mark.parametrize("chunk", [3, 64, 199, 10_000])
def test_chunk_sizes(chunk):
    query, key, lse = make_inputs(1, 4, 2, 200, 16, seed=3)
    lse = perturb(lse)
    for agg in ("max", "mean"):
        ref = reference(query, key, lse, 3, agg=agg)
        out = future_attention_target(query, key, lse, 3, agg=agg, backend="chunked", chunk=chunk)
        assert_close(out, ref, ATOL_F32, f"chunk {chunk} {agg}")


@pytest.mark.parametrize("backend", ["reference", "chunked", "flex"])
@pytest.mark.parametrize("count_norm", [True, False])
def test_window_at_least_length_gives_log_eps(backend, count_norm):
    S = 63
    query, key, lse = make_inputs(1, 4, 2, S, 16)
    for window in (S, S + 10):
        out = future_attention_target(query, key, lse, window, eps=1e-4, count_norm=count_norm, backend=backend)
        assert torch.equal(out, torch.full((1, 2, S), math.log(1e-4))), f"{backend} w={window}"


@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_keys_without_future_queries_get_log_eps(backend):
    S, window = 100, 9
    query, key, lse = make_inputs(1, 2, 1, S, 16)
    out = future_attention_target(query, key, lse, window, backend=backend)
    # keys t > S - 1 - window have no query far enough ahead
    assert torch.equal(out[..., S - window :], torch.full((1, 1, window), math.log(1e-6)))
    assert (out[..., : S - window] > math.log(1e-6)).all()


def test_reference_matches_the_formula_written_out():
    # the reference itself, checked once against loops over the definition in docs/method.md Sec. 4
    B, Hq, Hkv, S, D, w, eps = 1, 4, 2, 9, 4, 2, 1e-3
    query, key, lse = make_inputs(B, Hq, Hkv, S, D, seed=5)
    lse = perturb(lse, amount=0.5)
    G, scale = Hq // Hkv, D**-0.5
    for count_norm in (True, False):
        for agg in ("max", "mean"):
            want = torch.empty(B, Hkv, S, dtype=torch.float64)
            for h in range(Hkv):
                for t in range(S):
                    n = max(1, S - (t + w))
                    masses = []
                    for g in range(G):
                        hq = h * G + g
                        s = sum(
                            math.exp(
                                scale * float(query[0, hq, d].double() @ key[0, h, t].double()) - float(lse[0, hq, d])
                            )
                            for d in range(t + w, S)
                        )
                        masses.append(s / n if count_norm else s)
                    if count_norm:
                        logs = [math.log(eps + m) for m in masses]
                        want[0, h, t] = max(logs) if agg == "max" else sum(logs) / G
                    else:
                        pooled = max(masses) if agg == "max" else sum(masses) / G
                        want[0, h, t] = math.log(eps + pooled)
            got = future_attention_target_reference(query, key, lse, w, scale, eps, agg, count_norm)
            assert_close(got, want, 1e-6, f"reference {agg} count_norm={count_norm}")


def test_bf16_inputs_reduce_in_float32():
    query, key, lse = make_inputs(1, 6, 2, 200, 32, dtype=torch.bfloat16)
    ref = reference(query, key, lse, 4)
    for backend in ("chunked", "flex"):
        out = future_attention_target(query, key, lse, 4, backend=backend, chunk=50)
        assert out.dtype == torch.float32
        assert_close(out, ref, ATOL_F32, f"{backend} bf16")


def test_contract():
    query, key, lse = make_inputs(2, 6, 3, 40, 8)
    query.requires_grad_(True)
    out = future_attention_target(query, key, lse, 3)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    assert not out.requires_grad, "the target is a label: no graph"
    # scale=None means D ** -0.5
    assert torch.equal(out, future_attention_target(query, key, lse, 3, scale=8**-0.5))
    assert torch.equal(out, future_attention_target(query, key, lse, 3, backend="chunked"))


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(query=torch.zeros(2, 6, 40)), ValueError),
        (dict(key=torch.zeros(2, 3, 41, 8)), ValueError),
        (dict(key=torch.zeros(2, 4, 40, 8)), ValueError),
        (dict(lse=torch.zeros(2, 3, 40)), ValueError),
        (dict(key=torch.zeros(2, 3, 40, 8, dtype=torch.float64)), TypeError),
        (dict(lse=torch.zeros(2, 6, 40, dtype=torch.int64)), TypeError),
        (dict(window=0), ValueError),
        (dict(window=2.0), TypeError),
        (dict(window=True), TypeError),
        (dict(eps=0.0), ValueError),
        (dict(agg="sum"), ValueError),
        (dict(backend="triton"), ValueError),
        (dict(chunk=0), ValueError),
    ],
)
def test_validation(change, error):
    query, key, lse = make_inputs(2, 6, 3, 40, 8)
    args = dict(query=query, key=key, lse=lse, window=3)
    args.update(change)
    with pytest.raises(error):
        future_attention_target(**args)


@pytest.mark.parametrize("S", [1, 63, 128, 200, 257, 300])
@pytest.mark.parametrize("window", [1, 64, 127, 129, 300])
@pytest.mark.parametrize("block", [32, 128])
def test_block_mask_from_structure_equals_create_block_mask(S, window, block):
    def blocks(bm):
        # block-level maps (partial, full), independent of the order of the indices
        n_q, n_kv = bm.kv_num_blocks.shape[-1], bm.kv_indices.shape[-1]
        maps = []
        for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
            m = torch.zeros(n_q, n_kv, dtype=torch.int64)
            for i in range(n_q):
                m[i].index_add_(
                    0, idx[0, 0, i, : num[0, 0, i]].long(), torch.ones(int(num[0, 0, i]), dtype=torch.int64)
                )
            maps.append(m)
        return maps

    ours, want = (
        blocks(future_block_mask(S, window, "cpu", block)),
        blocks(future_block_mask_reference(S, window, block)),
    )
    assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1])


# runs in a fresh interpreter so the measure sees only this computation. VmHWM is the process's peak
# resident set; writing 5 to /proc/self/clear_refs resets it to the current RSS, so after the reset
# "VmHWM - VmRSS" is exactly the peak growth of what runs next, torch's allocations included
# (tracemalloc does not see them). If the reset is refused the peak since start is used instead,
# which can only over-estimate. A control allocation of one S x S float32 checks the measure is live.
MEMORY_SCRIPT = textwrap.dedent(
    """
    import torch
    from kvpop.ops.target import future_attention_target

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def reset_peak():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        return status("VmRSS")

    S = 8192
    torch.manual_seed(0)
    query, key = torch.randn(1, 3, S, 64), torch.randn(1, 1, S, 64)
    lse = torch.randn(1, 3, S) + 6
    # warm up thread pools and lazy initialisation on a short prefix
    future_attention_target(query[:, :, :300], key[:, :, :300], lse[:, :, :300], 16, chunk=256)
    before = reset_peak()
    out = future_attention_target(query, key, lse, 256, backend="chunked", chunk=256)
    grown = status("VmHWM") - before
    assert out.shape == (1, 1, S)
    before = reset_peak()
    dense = torch.ones(S, S)
    control = status("VmHWM") - before
    print(grown, control)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_chunked_memory_stays_far_below_s_by_s():
    src = str(Path(__file__).resolve().parents[1] / "src")
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert run.returncode == 0, run.stderr
    grown, control = (int(x) for x in run.stdout.split())
    s_by_s = 8192 * 8192 * 4
    assert control >= 0.9 * s_by_s, f"the measure missed a {s_by_s / 1e6:.0f} MB tensor (saw {control / 1e6:.0f} MB)"
    assert grown < MEM_LIMIT_MB * 1e6, f"chunked backend grew by {grown / 1e6:.0f} MB (limit {MEM_LIMIT_MB} MB)"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(1, 8, 2, 1000, 128)], ids=lambda s: "x".join(map(str, s)))
def test_compiled_flex_matches_reference(shape, dtype):
    query, key, lse = make_inputs(*shape, dtype=dtype, device="cuda")
    lse = perturb(lse)
    atol = ATOL_F32 if dtype == torch.float32 else ATOL_BF16
    for window, agg, count_norm in ((1, "max", True), (64, "mean", False)):
        ref = reference(query, key, lse, window, agg=agg, count_norm=count_norm)
        out = future_attention_target(query, key, lse, window, agg=agg, count_norm=count_norm)
        assert out.is_cuda and out.dtype == torch.float32
        assert_close(out, ref, atol, f"flex cuda {shape} {dtype} w={window} {agg} count_norm={count_norm}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compiled_flex_matches_chunked_at_length(dtype):
    query, key, lse = make_inputs(1, 8, 2, 4096, 64, seed=7, dtype=dtype, device="cuda")
    lse = perturb(lse)
    flex = future_attention_target(query, key, lse, 256, backend="flex")
    chunked = future_attention_target(query, key, lse, 256, backend="chunked", chunk=512)
    assert_close(flex, chunked, ATOL_F32, f"flex vs chunked cuda {dtype}")


@pytest.mark.parametrize("backend", ["reference", "chunked", "flex"])
def test_soft_capped_logits(backend):
    # Gemma 2 caps its logits (`c * tanh(l / c)`): p(d -> t) uses the capped logit, minus the lse the capped attention
    # returned. Written out densely here; the uncapped target is far from it
    B, Hq, Hkv, S, D, window, cap = 1, 4, 1, 90, 16, 5, 1.5
    query, key, _ = make_inputs(B, Hq, Hkv, S, D, seed=4, sharpness=3.0)
    G, scale = Hq // Hkv, D**-0.5
    logits = torch.einsum("bhsx,bhtx->bhst", query.double(), key.double().repeat_interleave(G, 1)) * scale
    logits = cap * torch.tanh(logits / cap)
    pos = torch.arange(S)
    lse = torch.logsumexp(logits.masked_fill(pos[None, :] > pos[:, None], float("-inf")), -1)  # [B, Hq, S]
    p = torch.exp(logits - lse[..., None]).masked_fill(pos[:, None] < pos[None, :] + window, 0.0)  # [B, Hq, d, t]
    mass = p.sum(-2) / (S - window - pos).clamp(min=1)
    want = torch.log(1e-6 + mass).reshape(B, Hkv, G, S).amax(2).float()
    out = future_attention_target(query, key, lse.float(), window, backend=backend, chunk=32, softcap=cap)
    assert_close(out, want, ATOL_F32, f"{backend} soft-capped")
    uncapped = future_attention_target(query, key, lse.float(), window, backend=backend, chunk=32)
    assert (uncapped - want).abs().max() > 0.5
    with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
        future_attention_target(query, key, lse.float(), window, backend=backend, softcap=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compiled_flex_soft_caps_like_the_reference(dtype):
    query, key, lse = make_inputs(1, 8, 1, 1000, 64, seed=5, sharpness=3.0, dtype=dtype, device="cuda")
    lse = perturb(lse)
    ref = reference(query, key, lse, 16, softcap=2.0)
    out = future_attention_target(query, key, lse, 16, softcap=2.0)
    assert_close(out, ref, ATOL_F32 if dtype == torch.float32 else ATOL_BF16, f"flex cuda soft-capped {dtype}")
