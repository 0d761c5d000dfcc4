"""FlexAttention backend (`ops/attention/flex.py`) and its block masks (`ops/attention/block_mask.py`).

On CPU, eager FlexAttention (forward only) is compared with `masked_attention` under
`mask_from_eviction`, and the fast block mask with the dense predicate and `create_block_mask`.
Eager FlexAttention ignores the block structure, so the tile tests are what keep the block mask
honest on CPU; the GPU tests run the compiled kernel, which skips the tiles marked empty.

    python -m pytest tests/test_attention_flex.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from kvpop.ops.attention.block_mask import (
    EMPTY,
    FULL,
    PARTIAL,
    block_mask_reference,
    sparse_block_mask,
    tile_states,
)
from kvpop.ops.attention.flex import flex_sparse_attention
from kvpop.ops.attention.reference import masked_attention
from kvpop.ops.topk import eviction_positions, mask_from_eviction

ATOL_F32 = 1e-5
"""Eager FlexAttention vs the reference, float32 on CPU (both compute in float32)."""
ATOL_CUDA_F32 = 2e-5
"""Compiled FlexAttention vs the reference, float32 on CUDA: outputs and LSE."""
ATOL_CUDA_F32_GRAD = 1e-4
"""Compiled FlexAttention vs the reference's autograd, float32 gradients on CUDA."""
BF16_FACTOR = 2.0
"""bf16 kernel error vs float64 may be at most this times the bf16 reference's error (attention-gym's rule) ..."""
BF16_ATOL = 1e-2
"""... plus this much, for entries the reference happens to get nearly exact."""

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@dataclass
class Case:
    query: Tensor  # [B, Hq, Q, D]
    key: Tensor  # [B, Hkv, N, D]
    value: Tensor  # [B, Hkv, N, D]
    q_pos: Tensor  # [B, Q]
    q_valid: Tensor  # [B, Q]
    k_pos: Tensor  # [B, N]
    k_valid: Tensor  # [B, N]
    evict: Tensor  # [B, Hkv, N]
    sink: int
    window: int

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def mask(self) -> Tensor:
        """The dense predicate, bool [B, Hkv, Q, N]."""
        return mask_from_eviction(
            self.q_pos, self.q_valid, self.k_pos[:, None], self.k_valid[:, None], self.evict, self.sink, self.window
        )

    def flex(self, return_lse=True, block_size=128):
        c = self
        return flex_sparse_attention(
            c.query, c.key, c.value, c.q_pos, c.q_valid, c.k_pos, c.k_valid, c.evict,
            c.sink, c.window, c.scale, return_lse=return_lse, block_size=block_size,
        )  # fmt: skip

    def block_args(self):
        return (self.q_pos, self.q_valid, self.k_pos, self.k_valid, self.evict, self.sink, self.window)


def make_case(
    layout: str,
    B: int,
    Hq: int,
    Hkv: int,
    N: int,
    sink: int,
    window: int,
    topk: int,
    Q: int | None = None,
    D: int = 16,
    seed: int = 0,
    ties: bool = False,
    decay: float = 0.0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Seeded inputs; the queries are the last `Q` of the `N` tokens (all of them by default).

    layouts: "contiguous" (positions `0 .. N-1`), "padded" (left padding of a different length per
    sequence, positions restart after it), "gaps" (strictly increasing positions with gaps).
    `decay` > 0 adds `floor(pos / 128) * decay` to the random scores, as `-log(gamma)` does in the
    static priority, so that old tokens tend to be evicted.
    """
    g = torch.Generator().manual_seed(seed)
    Q = N if Q is None else Q
    pos = torch.arange(N).expand(B, N).clone()
    valid = torch.ones(B, N, dtype=torch.bool)
    if layout == "padded":
        for b in range(B):
            pad = min(N - 1, 3 + 7 * b)
            valid[b, :pad] = False
            pos[b] -= pad
    elif layout == "gaps":
        pos = torch.cumsum(torch.randint(1, 4, (B, N), generator=g), dim=-1) - 1
    elif layout != "contiguous":
        raise ValueError(layout)
    priority = torch.randn(B, Hkv, N, generator=g)
    if ties:
        priority = priority.round()
    priority = priority + torch.div(pos, 128, rounding_mode="floor")[:, None].float() * decay
    evict = eviction_positions(priority, pos[:, None], valid[:, None], sink, window, topk)
    q = torch.randn(B, Hq, Q, D, generator=g)
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    to = dict(device=device)
    return Case(
        q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype),
        pos[:, N - Q:].to(**to), valid[:, N - Q:].to(**to), pos.to(**to), valid.to(**to), evict.to(**to),
        sink, window,
    )  # fmt: skip


def assert_close(actual: Tensor, expected: Tensor, atol: float, name: str) -> None:
    """Entries equal where non-finite (-inf LSE of empty rows), within `atol` elsewhere; reports max and mean error."""
    actual, expected = actual.double(), expected.double()
    same_inf = torch.isinf(expected) & (actual == expected)
    assert torch.equal(torch.isfinite(actual), torch.isfinite(expected)) and bool(
        (same_inf | torch.isfinite(expected)).all()
    ), f"{name}: non-finite entries differ"
    err = (actual - expected).abs()[torch.isfinite(expected)]
    if err.numel():
        assert err.max() <= atol, f"{name}: max error {err.max():.3g} (mean {err.mean():.3g}) > {atol:g}"


# (layout, B, Hq, Hkv, N, sink, window, topk, Q)
FORWARD_CASES = [
    ("contiguous", 1, 4, 4, 63, 4, 8, 16, None),
    ("contiguous", 2, 6, 2, 200, 4, 16, 32, None),
    ("contiguous", 1, 6, 2, 257, 4, 16, 32, 100),  # a chunk of queries after a prefix
    ("contiguous", 1, 6, 2, 257, 0, 1, 0, None),  # sink = 0, topk = 0, window = 1
    ("contiguous", 1, 4, 4, 200, 0, 1, 24, None),  # window = 1 with a top-k
    ("contiguous", 2, 4, 4, 257, 4, 300, 64, None),  # budget larger than the sequence
    ("padded", 2, 6, 2, 200, 4, 16, 32, None),
    ("gaps", 2, 4, 2, 150, 2, 8, 24, 70),
]


@pytest.mark.parametrize("layout,B,Hq,Hkv,N,sink,window,topk,Q", FORWARD_CASES)
def test_flex_matches_reference_cpu(layout, B, Hq, Hkv, N, sink, window, topk, Q):
    case = make_case(layout, B, Hq, Hkv, N, sink, window, topk, Q=Q, seed=N + topk)
    out, lse = case.flex(return_lse=True)
    ref_out, ref_lse = masked_attention(case.query, case.key, case.value, case.mask(), case.scale, return_lse=True)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.dtype == torch.float32
    assert_close(out, ref_out, ATOL_F32, "out")
    assert_close(lse, ref_lse, ATOL_F32, "lse")


def test_flex_without_lse_and_ties_cpu():
    case = make_case("padded", 2, 6, 3, 130, 4, 8, 16, ties=True, seed=3)
    out, lse = case.flex(return_lse=False, block_size=64)
    ref_out, _ = masked_attention(case.query, case.key, case.value, case.mask(), case.scale)
    assert lse is None
    assert_close(out, ref_out, ATOL_F32, "out")
    # padding queries see no key: zeros, like the reference
    assert bool((out[~case.q_valid[:, None, :, None].expand_as(out)] == 0).all())


def test_flex_refuses_backward_on_cpu():
    case = make_case("contiguous", 1, 2, 2, 20, 2, 4, 4)
    case.query.requires_grad_(True)
    with pytest.raises(NotImplementedError):
        case.flex()


def _tile_any_all(mask: Tensor, bs: int) -> tuple[Tensor, Tensor]:
    """Per tile of a bool [B, H, Q, N] mask: any point visible, every in-range point visible."""
    pq, pn = -mask.shape[-2] % bs, -mask.shape[-1] % bs
    any_ = F.pad(mask, (0, pn, 0, pq), value=False)
    all_ = F.pad(mask, (0, pn, 0, pq), value=True)
    B, H, Qp, Np = any_.shape
    shape = (B, H, Qp // bs, bs, Np // bs, bs)
    return any_.reshape(shape).any(-1).any(-2), all_.reshape(shape).all(-1).all(-2)


def _decode(num: Tensor, idx: Tensor, cols: int) -> Tensor:
    """Dense bool [..., rows, cols] from BlockMask's (num_blocks, indices) form."""
    taken = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    dense = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, torch.where(taken, idx.long(), cols), True)
    return dense[..., :cols]


def _states(bm) -> Tensor:
    """int8 [B, H, Qb, Nb] tile states (EMPTY / PARTIAL / FULL) of a BlockMask."""
    nb = bm.kv_indices.shape[-1]
    partial = _decode(bm.kv_num_blocks, bm.kv_indices, nb)
    full = _decode(bm.full_kv_num_blocks, bm.full_kv_indices, nb)
    assert not bool((partial & full).any()), "a tile is both partial and full"
    return partial.to(torch.int8) * PARTIAL + full.to(torch.int8) * FULL


# (layout, B, Hq, Hkv, N, sink, window, topk, Q, block)
BLOCK_CASES = [
    ("contiguous", 1, 4, 2, 1024, 4, 64, 96, None, 64),
    ("contiguous", 2, 6, 2, 257, 4, 16, 32, None, 32),
    ("contiguous", 1, 4, 4, 1000, 4, 64, 128, 333, 64),  # a chunk of queries after a prefix
    ("contiguous", 1, 2, 1, 1024, 0, 64, 0, None, 64),  # topk = 0: only the window band
    ("contiguous", 1, 2, 2, 500, 0, 1, 40, None, 16),
    ("contiguous", 1, 2, 2, 300, 4, 512, 64, None, 32),  # budget larger than the sequence
    ("padded", 2, 4, 2, 700, 4, 32, 48, None, 64),
    ("gaps", 2, 4, 2, 600, 2, 32, 48, 250, 32),
]


@pytest.mark.parametrize("layout,B,Hq,Hkv,N,sink,window,topk,Q,bs", BLOCK_CASES)
def test_block_mask_is_sound_and_tight(layout, B, Hq, Hkv, N, sink, window, topk, Q, bs):
    case = make_case(layout, B, Hq, Hkv, N, sink, window, topk, Q=Q, D=4, seed=N)
    states = tile_states(*case.block_args(), block_size=bs)  # [B, Hkv, Qb, Nb]
    any_, all_ = _tile_any_all(case.mask(), bs)
    assert states.shape == any_.shape
    assert not bool(any_[states == EMPTY].any()), "a tile marked EMPTY holds a visible pair"
    assert bool(all_[states == FULL].all()), "a tile marked FULL holds an invisible pair"

    # the BlockMask the kernel gets, per query head, against create_block_mask over every point
    G = Hq // Hkv
    fast = _states(sparse_block_mask(*case.block_args(), num_q_heads=Hq, block_size=bs))
    ref = _states(block_mask_reference(*case.block_args(), num_q_heads=Hq, block_size=bs))
    assert torch.equal(fast, states.repeat_interleave(G, dim=1))
    assert not bool(((ref != EMPTY) & (fast == EMPTY)).any()), "fast mask drops a non-empty tile"
    assert not bool(((fast == FULL) & (ref != FULL)).any()), "fast mask marks a tile FULL that is not"
    if layout == "contiguous":
        # contiguous positions: the derivation is exact (README.md), tile for tile
        assert torch.equal(fast, ref)


def test_block_mask_q_side_is_the_transpose():
    case = make_case("contiguous", 1, 4, 2, 700, 4, 32, 48, D=4)
    bm = sparse_block_mask(*case.block_args(), num_q_heads=4, block_size=64)
    nq, nk = bm.kv_indices.shape[-2], bm.kv_indices.shape[-1]
    for kv_num, kv_idx, q_num, q_idx in (
        (bm.kv_num_blocks, bm.kv_indices, bm.q_num_blocks, bm.q_indices),
        (bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_q_num_blocks, bm.full_q_indices),
    ):
        assert torch.equal(_decode(kv_num, kv_idx, nk), _decode(q_num, q_idx, nq).transpose(-2, -1))
    assert bm.shape == (1, 4, 700, 700) and bm.BLOCK_SIZE == (64, 64)
    assert bm.kv_indices.dtype == bm.q_num_blocks.dtype == torch.int32


def test_block_mask_empties_as_eviction_progresses():
    # with strongly decaying priorities (gamma = 1/e per 128 tokens) the far past is evicted and its
    # tiles become empty; random priorities scatter the top-k over nearly every block instead
    N, bs, sink, window, topk = 4096, 128, 4, 128, 256
    case = make_case("contiguous", 1, 1, 1, N, sink, window, topk, D=4, decay=1.0)
    states = tile_states(*case.block_args(), block_size=bs)[0, 0]
    causal = torch.arange(1, N // bs + 1)
    kept = (states != EMPTY).sum(-1)
    assert bool((kept <= causal).all())
    assert kept[-1] < causal[-1] // 2, f"last q block keeps {kept[-1]} of {causal[-1]} kv blocks"
    # topk = 0: exactly the sink block, the diagonal and the window band stay
    case0 = make_case("contiguous", 1, 1, 1, N, 0, window, 0, D=4)
    kept0 = (tile_states(*case0.block_args(), block_size=bs)[0, 0] != EMPTY).sum(-1)
    assert int(kept0.max()) <= math.ceil(window / bs) + 1


# ---------------------------------------------------------------- CUDA: the compiled kernel


def _attention_f64(case: Case) -> Tensor:
    """Dense masked attention in float64: the ground truth for the bf16 comparison."""
    G = case.query.shape[1] // case.key.shape[1]
    mask = case.mask().repeat_interleave(G, dim=1)
    k = case.key.double().repeat_interleave(G, dim=1)
    v = case.value.double().repeat_interleave(G, dim=1)
    logits = (case.query.double() @ k.transpose(-1, -2)) * case.scale
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v


def _forward_backward(case: Case, fn, dout: Tensor):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (case.query, case.key, case.value))
    out, lse = fn(replace(case, query=q, key=k, value=v))
    (out.float() * dout).sum().backward()
    return out.detach(), lse, q.grad, k.grad, v.grad


def _flex_fn(c: Case):
    return c.flex(return_lse=True)


def _ref_fn(c: Case):
    return masked_attention(c.query, c.key, c.value, c.mask(), c.scale, return_lse=True)


CUDA_CASES = [
    ("contiguous", 2, 6, 2, 1000, 4, 64, 128, None),
    ("contiguous", 1, 4, 4, 777, 0, 1, 0, None),
    ("padded", 2, 8, 2, 600, 4, 32, 96, None),
    ("contiguous", 1, 6, 2, 900, 4, 64, 128, 257),
]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout,B,Hq,Hkv,N,sink,window,topk,Q", CUDA_CASES)
def test_flex_cuda_float32_forward_backward(layout, B, Hq, Hkv, N, sink, window, topk, Q):
    case = make_case(layout, B, Hq, Hkv, N, sink, window, topk, Q=Q, D=64, seed=1, device="cuda")
    dout = torch.randn(case.query.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    out, lse, dq, dk, dv = _forward_backward(case, _flex_fn, dout)
    r_out, r_lse, r_dq, r_dk, r_dv = _forward_backward(case, _ref_fn, dout)
    assert_close(out, r_out, ATOL_CUDA_F32, "out")
    assert_close(lse, r_lse, ATOL_CUDA_F32, "lse")
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert bool(torch.isfinite(a).all()), f"{name} has non-finite entries"
        assert_close(a, b, ATOL_CUDA_F32_GRAD, name)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout,B,Hq,Hkv,N,sink,window,topk,Q", CUDA_CASES)
def test_flex_cuda_bf16_forward_backward(layout, B, Hq, Hkv, N, sink, window, topk, Q):
    case = make_case(layout, B, Hq, Hkv, N, sink, window, topk, Q=Q, D=64, seed=1, device="cuda")
    dout = torch.randn(case.query.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    c64 = replace(case, query=case.query.double(), key=case.key.double(), value=case.value.double())
    gold = _forward_backward(c64, lambda c: (_attention_f64(c), None), dout.double())
    bf = replace(case, query=case.query.bfloat16(), key=case.key.bfloat16(), value=case.value.bfloat16())
    kern = _forward_backward(bf, _flex_fn, dout)
    ref = _forward_backward(bf, _ref_fn, dout)
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        k_err = (kern[i].double() - gold[i]).abs()
        r_err = (ref[i].double() - gold[i]).abs()
        assert bool(torch.isfinite(kern[i]).all()), f"{name} has non-finite entries"
        bound = BF16_FACTOR * r_err.max() + BF16_ATOL
        assert k_err.max() <= bound, (
            f"{name}: bf16 kernel max error {k_err.max():.3g} (mean {k_err.mean():.3g}) vs float64, "
            f"bf16 reference {r_err.max():.3g} (mean {r_err.mean():.3g})"
        )


@cuda
@pytest.mark.gpu
def test_flex_cuda_timing_qwen3_4b_shape():
    """Print only: block-mask build vs attention at S = 16384, Qwen3-4B heads, budget 2048."""
    from torch.nn.attention.flex_attention import create_block_mask
    from triton.testing import do_bench

    # the tests above compiled flex for many head counts and dtypes; past dynamo's recompile limit
    # it would silently run flex eagerly, which materialises the 16k x 16k scores
    torch._dynamo.reset()
    S, Hq, Hkv, D, sink, window, topk = 16384, 32, 8, 128, 4, 256, 1788
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(S, device="cuda")[None]
    valid = torch.ones(1, S, dtype=torch.bool, device="cuda")
    evict = eviction_positions(torch.randn(1, Hkv, S, device="cuda", generator=g), pos[:, None], valid[:, None],
                               sink, window, topk)  # fmt: skip
    args = (pos, valid, pos, valid, evict, sink, window)
    t_build = do_bench(lambda: sparse_block_mask(*args, num_q_heads=Hq), return_mode="median")
    bm = sparse_block_mask(*args, num_q_heads=Hq)
    # the naive way, with the same mask_mod (block_mask_reference's dense predicate would not fit at 16k), compiled:
    # eager create_block_mask sums a [1, Hq, S, S] mask as int64, 64 GiB (more than an H100 holds)
    t_ref = do_bench(lambda: create_block_mask(bm.mask_mod, 1, Hq, S, S, device="cuda", _compile=True), warmup=1,
                     rep=3, return_mode="median")  # fmt: skip

    def fwd():
        return flex_sparse_attention(q, k, v, *args, scale=D**-0.5)

    t_fwd = do_bench(fwd, return_mode="median")
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    t_fb = do_bench(
        lambda: flex_sparse_attention(qg, kg, vg, *args, scale=D**-0.5)[0].sum().backward(), return_mode="median"
    )
    print(
        f"\nS={S} Hq={Hq} Hkv={Hkv} D={D} budget={sink + window + topk}: block density {1 - bm.sparsity() / 100:.3f}; "
        f"sparse_block_mask {t_build:.2f} ms, create_block_mask {t_ref:.1f} ms, "
        f"flex_sparse_attention fwd {t_fwd:.2f} ms (incl. mask), fwd+bwd {t_fb:.2f} ms"
    )
