"""Sparse attention backends against the explicit reference (forward, LSE and backward)."""

import pytest
import torch

from kvpop.ops.attention import masked_attention, sparse_attention
from kvpop.ops.attention.cpu import available, cpu_masked_attention
from kvpop.ops.topk import eviction_positions

ATOL = 2e-5


def _inputs(B, Hq, Hkv, S, D, sink, window, topk, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, :pad] = False
    pos = valid.long().cumsum(-1) - 1
    evict = eviction_positions(torch.randn(B, Hkv, S, generator=g), pos[:, None], valid[:, None], sink, window, topk)
    return q, k, v, pos, valid, evict


@pytest.mark.skipif(not available(torch.zeros(1)), reason="no fused CPU attention op in this torch")
@pytest.mark.parametrize("B,Hq,Hkv,S,D,sink,window,topk,pad", [
    (1, 4, 2, 63, 16, 2, 5, 7, 0), (2, 6, 2, 200, 8, 0, 1, 20, 9), (2, 3, 3, 257, 32, 4, 16, 0, 0),
    (1, 4, 1, 40, 16, 4, 64, 64, 3),
])
def test_cpu_kernel_matches_reference(B, Hq, Hkv, S, D, sink, window, topk, pad):
    q, k, v, pos, valid, evict = _inputs(B, Hq, Hkv, S, D, sink, window, topk, pad)
    args = (pos, valid, pos, valid, evict, sink, window, D**-0.5)
    qs = [q.clone().requires_grad_() for _ in range(2)]
    (o1, l1), (o2, l2) = (sparse_attention(x, k, v, *args, return_lse=True, backend=b) for x, b in
                          zip(qs, ("reference", "cpu")))
    assert (o1 - o2).abs().max() < ATOL
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    fin = torch.isfinite(l1)
    assert (l1[fin] - l2[fin]).abs().max() < ATOL
    grad = torch.randn_like(o1)
    (o1 * grad).sum().backward()
    (o2 * grad).sum().backward()
    assert (qs[0].grad - qs[1].grad).abs().max() < 1e-4


def test_padding_rows_are_zero_in_both_backends():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 2:, :3] = True
    for fn in (masked_attention, cpu_masked_attention):
        out, lse = fn(q, k, v, mask, 0.3, return_lse=True)
        assert (out[:, :, :2] == 0).all() and torch.isinf(lse[:, :, :2]).all() and torch.isfinite(out).all()


def _cache_like(B, Hq, Hkv, slots, C, D, sink, window, topk, seed=0):
    """A cache's chunk: `slots` keys with per-head positions (some empty) followed by `C` new tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, C, D, generator=g)
    k, v = (torch.randn(B, Hkv, slots + C, D, generator=g) for _ in range(2))
    seen = 3 * slots
    old = torch.stack([torch.randperm(seen, generator=g)[:slots] for _ in range(B * Hkv)]).reshape(B, Hkv, slots)
    old = torch.where(torch.rand(B, Hkv, slots, generator=g) < 0.2, -1, old)
    valid = torch.ones(B, C, dtype=torch.bool)
    valid[-1, : C // 3] = False
    pos = seen + valid.long().cumsum(-1) - 1
    k_pos = torch.cat([old, torch.where(valid, pos, -1)[:, None].expand(B, Hkv, C)], -1)
    evict = eviction_positions(torch.randn(B, Hkv, slots + C, generator=g), k_pos, k_pos >= 0, sink, window, topk)
    return q, k, v, pos, valid, k_pos, k_pos >= 0, evict


@pytest.mark.skipif(not available(torch.zeros(1)), reason="no fused CPU attention op in this torch")
@pytest.mark.parametrize("B,Hq,Hkv,S,D,sink,window,topk,pad,block", [
    (1, 4, 2, 63, 16, 2, 5, 7, 0, 16), (2, 6, 2, 500, 8, 0, 1, 20, 9, 64), (2, 3, 3, 257, 32, 4, 16, 0, 0, 256),
    (1, 4, 1, 40, 16, 4, 64, 64, 3, 7),
])
def test_cpu_block_kernel_matches_reference(B, Hq, Hkv, S, D, sink, window, topk, pad, block):
    from kvpop.ops.attention.cpu import cpu_block_sparse_attention

    q, k, v, pos, valid, evict = _inputs(B, Hq, Hkv, S, D, sink, window, topk, pad)
    args = (pos, valid, pos, valid, evict, sink, window, D**-0.5)
    qs = [q.clone().requires_grad_() for _ in range(2)]
    o1, l1 = sparse_attention(qs[0], k, v, *args, return_lse=True, backend="reference")
    o2, l2 = cpu_block_sparse_attention(qs[1], k, v, *args, return_lse=True, block=block)
    assert (o1 - o2).abs().max() < ATOL, (o1 - o2).abs().max()
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    fin = torch.isfinite(l1)
    assert (l1[fin] - l2[fin]).abs().max() < ATOL
    grad = torch.randn_like(o1)
    (o1 * grad).sum().backward()
    (o2 * grad).sum().backward()
    assert (qs[0].grad - qs[1].grad).abs().max() < ATOL


@pytest.mark.skipif(not available(torch.zeros(1)), reason="no fused CPU attention op in this torch")
@pytest.mark.parametrize("batch,index", [(1, 1 << 24), (48, 1 << 24), (10_000, 1 << 24), (48, 1), (10_000, 3000)])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,sink,window,topk,pad,block", [
    # left padding longer than a block (whole blocks of padding queries), a ramp of key counts, a block > S
    (2, 4, 2, 300, 16, 2, 8, 30, 70, 32), (1, 6, 3, 500, 8, 0, 1, 40, 0, 16), (2, 2, 1, 45, 8, 1, 3, 4, 5, 64),
])
def test_cpu_block_kernel_batches_of_blocks(monkeypatch, batch, index, B, Hq, Hkv, S, D, sink, window, topk, pad,
                                            block):
    # blocks go through the kernel in batches of at most `_BATCH` queries, split where counts differ, and their
    # index work in groups of at most `_INDEX` elements: every split (one block per call or group, a few, all at
    # once) gives the reference's answer
    from kvpop.ops.attention import cpu

    monkeypatch.setattr(cpu, "_BATCH", batch)
    monkeypatch.setattr(cpu, "_INDEX", index)
    q, k, v, pos, valid, evict = _inputs(B, Hq, Hkv, S, D, sink, window, topk, pad, seed=1)
    args = (pos, valid, pos, valid, evict, sink, window, D**-0.5)
    o1, l1 = sparse_attention(q, k, v, *args, return_lse=True, backend="reference")
    o2, l2 = cpu.cpu_block_sparse_attention(q, k, v, *args, return_lse=True, block=block)
    assert (o1 - o2).abs().max() < ATOL, ((o1 - o2).abs().max(), (o1 - o2).abs().mean())
    assert torch.equal(torch.isinf(l1), torch.isinf(l2)) and (o2[0, :, :pad] == 0).all()
    fin = torch.isfinite(l1)
    assert (l1[fin] - l2[fin]).abs().max() < ATOL


def test_cpu_block_batches_cover_every_block_once():
    from kvpop.ops.attention.cpu import _PAD, _batches

    counts = [16, 32, 48, 64, 80, 80, 80, 79, 80, 3, 80]
    for most in (1, 3, 100):
        runs = _batches(counts, most)
        assert [b for r in runs for b in range(*r)] == list(range(len(counts)))
        for b0, b1 in runs:
            assert b1 - b0 <= most
            assert b1 - b0 == 1 or max(counts[b0:b1]) * (b1 - b0) <= (1 + _PAD) * sum(counts[b0:b1])


@pytest.mark.skipif(not available(torch.zeros(1)), reason="no fused CPU attention op in this torch")
@pytest.mark.parametrize("backend", ["cpu", "cpu_blocks", "sdpa"])
@pytest.mark.parametrize("B,Hq,Hkv,slots,C,D,sink,window,topk", [(2, 4, 2, 14, 33, 16, 2, 5, 7), (1, 6, 3, 9, 300, 8, 0, 1, 8)])
def test_per_head_key_positions(backend, B, Hq, Hkv, slots, C, D, sink, window, topk):
    # a cache's chunk: its slots' positions differ per KV head
    q, k, v, pos, valid, k_pos, k_valid, evict = _cache_like(B, Hq, Hkv, slots, C, D, sink, window, topk)
    args = (pos, valid, k_pos, k_valid, evict, sink, window, D**-0.5)
    want, _ = sparse_attention(q, k, v, *args, backend="reference")
    got, _ = sparse_attention(q, k, v, *args, backend=backend)
    assert (want - got).abs().max() < ATOL
    assert (got[-1, :, : C // 3] == 0).all()  # padding queries
    with pytest.raises(ValueError, match="shared"):
        sparse_attention(q, k, v, *args, backend="flex")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference(dtype):
    from kvpop.ops.attention import decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 6, 1, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    occupied = torch.rand(3, 2, 40, generator=g) < 0.6
    occupied[2, 1] = False  # a row with no slot yet (padding before its first token)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    want, _ = masked_attention(q, k, v, occupied[:, :, None, :], 0.25)
    got = decode_attention(q, k, v, occupied, 0.25)
    assert got.dtype == dtype and torch.isfinite(got).all() and (got[2, 3:] == 0).all()
    # the slots' positions as the occupancy (-1: empty), as the cache's decode step passes them
    assert torch.equal(decode_attention(q, k, v, torch.where(occupied, torch.arange(40), -1), 0.25), got)
    assert (got.float() - want.float()).abs().max() < (ATOL if dtype == torch.float32 else 2e-2)


def _soft_capped(q, k, v, mask, scale, cap):
    """Soft-capped attention as Hugging Face's eager attention writes it (heads repeated, the cap before the mask)."""
    G = q.shape[1] // k.shape[1]
    logits = torch.tanh(q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale / cap) * cap
    logits = logits.masked_fill(~mask.repeat_interleave(G, 1), float("-inf"))
    empty = ~mask.any(-1).repeat_interleave(G, 1)[..., None]
    probs = torch.softmax(logits.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return probs @ v.repeat_interleave(G, 1)


@pytest.mark.parametrize("B,Hq,Hkv,S,D,sink,window,topk,pad", [
    (1, 4, 1, 63, 16, 2, 5, 7, 0), (2, 6, 2, 150, 8, 0, 1, 20, 9), (2, 4, 1, 40, 16, 0, 16, 0, 5),
])
def test_soft_capping_in_every_backend_that_takes_it(B, Hq, Hkv, S, D, sink, window, topk, pad):
    # Gemma 2's `c * tanh(l / c)`: the backends that take it give the written-out attention, forward and backward;
    # the fused kernels that cannot take it refuse it rather than drop it
    from kvpop.ops.topk import mask_from_eviction

    cap, scale = 2.0, D**-0.5
    q, k, v, pos, valid, evict = _inputs(B, Hq, Hkv, S, D, sink, window, topk, pad)
    q = q * 3  # logits well past the cap
    args = (pos, valid, pos, valid, evict, sink, window, scale)
    mask = mask_from_eviction(pos, valid, pos[:, None], valid[:, None], evict, sink, window)
    want = _soft_capped(q, k, v, mask, scale, cap)
    ref, ref_lse = sparse_attention(q, k, v, *args, return_lse=True, backend="reference", softcap=cap)
    assert (ref - want).abs().max() < ATOL
    assert (sparse_attention(q, k, v, *args, backend="reference")[0] - ref).abs().max() > 0.05
    with torch.no_grad():
        for backend in ("auto", "gather", "flex"):
            out, lse = sparse_attention(q, k, v, *args, return_lse=True, backend=backend, topk=topk, softcap=cap)
            assert (out - ref).abs().max() < ATOL, backend
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_lse[fin]).abs().max() < ATOL, backend
    # with gradients ("auto": the gathered tiles, the reference inside each)
    qs = [q.clone().requires_grad_() for _ in range(2)]
    outs = [sparse_attention(x, k, v, *args, backend=b, topk=topk, softcap=cap)[0] for x, b in zip(qs, ("reference",
                                                                                                       "auto"))]
    grad = torch.randn_like(outs[0])
    for o in outs:
        (o * grad).sum().backward()
    assert (outs[0] - outs[1]).abs().max() < ATOL and (qs[0].grad - qs[1].grad).abs().max() < 1e-4
    for backend in ("cpu", "cpu_blocks", "sdpa"):
        with pytest.raises(ValueError, match=f"backend='{backend}' takes no logit soft-capping"):
            sparse_attention(q, k, v, *args, backend=backend, softcap=cap)


def test_soft_capping_over_a_caches_slots_and_in_the_decode_step():
    from kvpop.ops.attention import attention_with_probs, decode_attention
    from kvpop.ops.topk import mask_from_eviction

    cap, sink, window, topk = 1.5, 2, 3, 6
    q, k, v, pos, valid, cand_pos, cand_valid, evict = _cache_like(2, 4, 1, sink + window + topk, 9, 16, sink, window,
                                                                   topk)
    q = q * 3
    mask = mask_from_eviction(pos, valid, cand_pos, cand_valid, evict, sink, window)
    out, _ = sparse_attention(q, k, v, pos, valid, cand_pos, cand_valid, evict, sink, window, 0.25, softcap=cap)
    assert (out - _soft_capped(q, k, v, mask, 0.25, cap)).abs().max() < ATOL
    # one query over the slots: the decode step's attention (no fused kernel takes the cap) and its probabilities
    occupied = cand_pos[..., :11] >= 0
    one, slots, values = q[:, :, :1], k[:, :, :11], v[:, :, :11]
    want = _soft_capped(one, slots, values, occupied[:, :, None], 0.25, cap)
    assert (decode_attention(one, slots, values, cand_pos[..., :11], 0.25, softcap=cap) - want).abs().max() < ATOL
    got, probs = attention_with_probs(one, slots, values, occupied, 0.25, softcap=cap)
    assert (got - want).abs().max() < ATOL and torch.allclose(probs.sum(-1), torch.ones(2, 1, 4))
    assert (decode_attention(one, slots, values, occupied, 0.25) - want).abs().max() > 0.05


# the shapes of the measurements behind `auto_backend`'s CUDA rule (docs/training.md): (batch, query heads, head dim)
SMOLLM2, QWEN3_4B = (1, 9, 64), (1, 32, 128)


@pytest.mark.parametrize("shape,S,split,grad,topk_known,want", [
    # a SmolLM2 distillation step at 8k (its step is bound by launches; the tiles were slower): FlexAttention
    (SMOLLM2, 8192, (4, 256, 764), True, True, "flex"),
    # Qwen3-4B's attention at 16k, B = 2048 (one layer's forward + backward 3.4x faster gathered): the tiles
    (QWEN3_4B, 16384, (4, 512, 1532), True, True, "gather"),
    # the same without a gradient (evaluation), or without a known bound (a host sync): FlexAttention
    (QWEN3_4B, 16384, (4, 512, 1532), False, True, "flex"),
    (QWEN3_4B, 16384, (4, 512, 1532), True, False, "flex"),
    # the dense teacher keeps everything: nothing to save
    (QWEN3_4B, 16384, (16384, 16384, 0), True, True, "flex"),
    # short sequences: the budget holds most of the causal triangle
    (QWEN3_4B, 4096, (4, 512, 1532), True, True, "flex"),
])
def test_auto_backend_on_cuda_picks_by_shape_and_budget(shape, S, split, grad, topk_known, want):
    from kvpop.ops.attention.backends import auto_backend

    sink, window, topk = split
    B, Hq, D = shape
    assert auto_backend("cuda", B, Hq, D, S, sink, window, topk if topk_known else None, True, grad) == want


def test_auto_backend_threshold_and_the_other_devices():
    from kvpop.ops.attention.backends import GATHER_MIN_WORK, GATHER_TILE_CUDA, auto_backend

    # the rule's boundary: the saved work just below and at GATHER_MIN_WORK
    B, Hq, D, S = 1, 32, 128, 8192
    free = S / 2 - GATHER_TILE_CUDA  # what the budget may take before nothing is saved
    at = int(free - GATHER_MIN_WORK / (B * Hq * D * S))  # the largest budget at which the work still counts
    assert auto_backend("cuda", B, Hq, D, S, 0, 1, at - 1, True, True) == "gather"
    assert auto_backend("cuda", B, Hq, D, S, 0, 1, at + 1, True, True) == "flex"
    # a batch multiplies the work saved
    assert auto_backend("cuda", 8, *SMOLLM2[1:], 8192, 4, 256, 764, True, True) == "gather"
    # a cache's slots (positions per head) on CUDA: SDPA under the dense mask
    assert auto_backend("cuda", *QWEN3_4B, 16384, 4, 512, 1532, False, True) == "sdpa"
    # the CPU: the gathered tiles in training when the rule evicts, the fused kernel otherwise
    assert auto_backend("cpu", *SMOLLM2, 2048, 4, 128, 380, True, True) == "gather"
    assert auto_backend("cpu", *SMOLLM2, 2048, 2048, 2048, None, True, True) == "cpu"
    assert auto_backend("cpu", *SMOLLM2, 2048, 4, 128, 380, False, True) == "cpu"
    assert auto_backend("cpu", *SMOLLM2, 2048, 4, 128, 380, True, False) == "cpu_blocks"
    assert auto_backend("cpu", *SMOLLM2, 2048, 4, 128, 380, True, True, cpu_kernels=False) == "reference"
    assert auto_backend("mps", *SMOLLM2, 2048, 4, 128, 380, True, True) == "reference"
