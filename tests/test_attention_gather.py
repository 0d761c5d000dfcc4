"""`ops/attention/gather.py`: attention over each query tile's gathered keys equals the rule's sparse attention, values
and gradients, and a tile never sees more than the budget plus the tile."""

import pytest
import torch

from helpers import left_padded
from kvpop.config import KVpopConfig
from kvpop.ops.attention import sparse_attention
from kvpop.ops.attention.gather import gather_sparse_attention, tile_keys
from kvpop.ops.topk import eviction_positions

# (B, Hkv, G, S, D, budget, block): GQA groups 1..4, tiles that do not divide S, a budget above S, tiny tiles
SHAPES = [(1, 2, 2, 96, 16, 24, 32), (2, 1, 4, 70, 8, 16, 16), (2, 3, 1, 50, 8, 64, 16), (1, 2, 3, 128, 8, 20, 8)]


def _inputs(B, Hkv, G, S, D, budget, pad, ties, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = KVpopConfig.for_budget(budget)
    q = torch.randn(B, Hkv * G, S, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    pri = torch.randn(B, Hkv, S, generator=g)
    if ties:
        pri = pri.round()  # many equal priorities: ties go to the newer token
    valid = left_padded(B, S, seed) if pad else torch.ones(B, S, dtype=torch.bool)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    evict = eviction_positions(pri, pos[:, None], valid[:, None], cfg.sink, cfg.window, cfg.topk, ordered=True)
    return cfg, q, k, v, pos, valid, evict


def _bench_module(name):
    """A script of bench/ as a module (they are not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pad,ties", [(False, False), (True, True)])
@pytest.mark.parametrize("backend", ["reference", "cpu"])  # "cpu": the CPU's fused kernel, inside as on the sequence
def test_gathered_tiles_equal_the_sparse_attention(shape, pad, ties, backend):
    B, Hkv, G, S, D, budget, block = shape
    cfg, q, k, v, pos, valid, evict = _inputs(B, Hkv, G, S, D, budget, pad, ties, seed=S)
    rule = (pos, valid, pos, valid, evict, cfg.sink, cfg.window, D**-0.5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # against the same backend on the whole sequence: the CPU's fused kernel gives its lse no gradient (training
    # detaches it), the reference does; "cpu" and "reference" never gather on their own
    want, want_lse = sparse_attention(*leaves, *rule, return_lse=True, backend=backend)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    got, got_lse = gather_sparse_attention(*mine, pos, valid, pos, valid, evict, cfg.sink, cfg.window, cfg.topk,
                                           D**-0.5, return_lse=True, block=block, backend=backend)
    real = valid[:, None, :, None]
    # the reference computes in float32 (over all N keys here, over the tile's U there): rounding apart
    torch.testing.assert_close(got * real, want * real, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got_lse[real[..., 0].expand_as(got_lse)], want_lse[real[..., 0].expand_as(want_lse)],
                               rtol=1e-5, atol=2e-6)
    # gradients through the gather: a loss on the real queries' outputs and lse
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)) * real
    lse_real = real[..., 0].expand_as(want_lse)
    ((want * grad).sum() + want_lse[lse_real].sum()).backward()
    ((got * grad).sum() + got_lse[lse_real].sum()).backward()
    for a, b, name in zip(mine, leaves, "qkv"):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=f"grad {name}")


@pytest.mark.parametrize("seed", range(6))
def test_a_tile_sees_at_most_the_budget_plus_the_tile(seed):
    g = torch.Generator().manual_seed(seed)
    S, block = 300, int(torch.randint(4, 64, (1,), generator=g))
    cfg = KVpopConfig.for_budget(int(torch.randint(8, 120, (1,), generator=g)))
    pri = torch.randn(1, 2, S, generator=g).round(decimals=int(seed % 2))
    pos, valid = torch.arange(S)[None], torch.ones(1, S, dtype=torch.bool)
    evict = eviction_positions(pri, pos[:, None], valid[:, None], cfg.sink, cfg.window, cfg.topk, ordered=True)
    width = cfg.sink + cfg.window + cfg.topk + block - 1
    idx, used = tile_keys(pos, valid, pos, valid, evict, cfg.sink, cfg.window, S, block)  # room for every key
    assert int(used.sum(-1).max()) <= width
    # the used keys come first, in position order, each once
    first = used.long().argmin(-1, keepdim=True).where(~used.all(-1, keepdim=True), used.shape[-1])
    assert bool((used == (torch.arange(used.shape[-1]) < first)).all())
    ordered = torch.where(used, idx, S)
    assert bool((ordered[..., 1:] >= ordered[..., :-1]).all())
    with pytest.raises(ValueError, match="more keys than the width"):
        tile_keys(pos, valid, pos, valid, evict, cfg.sink, cfg.window, cfg.sink + cfg.window, block)


def test_the_flex_backend_forward_on_the_cpu():
    # FlexAttention runs forward (no backward) off CUDA: the gathered batch through the training path's kernel
    B, Hkv, G, S, D, budget, block = 1, 2, 2, 200, 16, 48, 32
    cfg, q, k, v, pos, valid, evict = _inputs(B, Hkv, G, S, D, budget, False, False, seed=3)
    rule = (pos, valid, pos, valid, evict, cfg.sink, cfg.window, D**-0.5)
    with torch.no_grad():
        want, want_lse = sparse_attention(q, k, v, *rule, return_lse=True, backend="reference")
        got, got_lse = gather_sparse_attention(q, k, v, pos, valid, pos, valid, evict, cfg.sink, cfg.window,
                                               cfg.topk, D**-0.5, return_lse=True, block=block, backend="flex")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-4, atol=1e-5)


def test_the_bench_rows_of_the_gathered_attention(monkeypatch):
    # `bench_train_attention.py --gather` on the CPU with one call in place of do_bench (CUDA only): its rows and
    # its check against the sparse forward
    import types

    bench = _bench_module("bench_train_attention")
    monkeypatch.setattr(bench, "_bench", lambda fn, rep: (fn(), 0.5)[1])
    B, Hkv, G, S, D, budget = 1, 2, 2, 300, 16, 64  # three query tiles of the default 128, the last one short
    cfg, q, k, v, pos, valid, evict = _inputs(B, Hkv, G, S, D, budget, False, False, seed=5)
    rule = (pos, valid, pos, valid, evict, cfg.sink, cfg.window, D**-0.5)

    def sparse_fwd():
        return sparse_attention(q, k, v, *rule, return_lse=True, backend="reference")

    args = types.SimpleNamespace(rep=1, quick=True, gather_blocks="128,64", gather_profile=None)
    row = bench.time_gather(q, k, v, None, pos, valid, evict, cfg, D**-0.5, sparse_fwd, args)
    assert row["gather_fwd_ms"] == row["gather_fwd_ms_b64"] == 0.5 and "gather_fwd_bwd_ms" not in row
    assert row["gather_max_abs_diff"] < 1e-5 and row["gather_max_abs_diff_b64"] < 1e-5
    assert row["gather_tiles_ms"] == row["gather_inner_fwd_ms"] == 0.5
    assert 0 <= row["gather_tiles_full_pct"] <= 100


def test_training_on_the_cpu_runs_the_gathered_tiles(monkeypatch):
    # `sparse_attention`'s "auto" with gradients (the training path on the CPU) is the gathered form: the values and
    # gradients of the whole-sequence fused kernel; without gradients it stays the block kernel
    B, Hkv, G, S, D, budget = 2, 2, 2, 300, 16, 64
    cfg, q, k, v, pos, valid, evict = _inputs(B, Hkv, G, S, D, budget, True, False, seed=9)
    rule = (pos, valid, pos, valid, evict, cfg.sink, cfg.window, D**-0.5)
    import kvpop.ops.attention.gather as gather

    calls = []
    real_gather = gather.gather_sparse_attention
    monkeypatch.setattr(gather, "gather_sparse_attention", lambda *a, **kw: calls.append(1) or real_gather(*a, **kw))
    grads = []
    for backend in ("auto", "cpu"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = sparse_attention(*leaves, *rule, backend=backend)
        (out * valid[:, None, :, None]).sum().backward()
        grads.append((out.detach() * valid[:, None, :, None], *(t.grad for t in leaves)))
    assert len(calls) == 1  # "auto" gathered, "cpu" did not
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        sparse_attention(q, k, v, *rule)
    assert len(calls) == 1  # no gradient: the block kernel
    with pytest.raises(ValueError, match="shared by the heads"):
        sparse_attention(q, k, v, pos, valid, pos[:, None].expand(B, Hkv, S), valid[:, None].expand(B, Hkv, S), evict,
                         cfg.sink, cfg.window, D**-0.5, backend="gather")


def test_the_gathered_keys_are_ordered_to_fill_flex_tiles():
    # Each tile's older keys by when they stop being visible, its own keys causally after them: FlexAttention's
    # tiles of the gathered batch come out mostly full (no mask_mod), where the same keys in position order give
    # mostly partial ones (S = 4096, B = 1024, tiles of 512 queries, random priorities: 732 full / 340 partial
    # against 208 / 944)
    from kvpop.ops.attention.block_mask import sparse_block_mask
    from kvpop.ops.attention.gather import gather_tiles

    B, Hkv, G, S, D, budget, block = 1, 2, 2, 4096, 8, 1024, 512
    cfg, q, k, v, pos, valid, evict = _inputs(B, Hkv, G, S, D, budget, False, False, seed=0)
    t = gather_tiles(q, k, v, pos, valid, pos, valid, evict, cfg.sink, cfg.window, cfg.topk, block)
    by_position = torch.where(t.k_valid, t.k_pos, 2 * S).argsort(dim=-1, stable=True)

    def tiles(k_pos, k_valid, ev):
        bm = sparse_block_mask(t.q_pos, t.q_valid, k_pos, k_valid, ev, cfg.sink, cfg.window, G, backend="torch")
        return int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())

    full, partial = tiles(t.k_pos, t.k_valid, t.evict)
    full_pos, partial_pos = tiles(t.k_pos.gather(-1, by_position), t.k_valid.gather(-1, by_position),
                                  t.evict.gather(-1, by_position[:, None]))
    assert full + partial <= full_pos + partial_pos  # no more tiles to compute (the block statistics are bounds)
    assert full > 1.5 * partial and full_pos < 0.5 * partial_pos


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("pad,ties", [(False, False), (True, True)])
@pytest.mark.parametrize("block", [None, 128])  # None: through sparse_attention at the CUDA default (512)
def test_training_on_cuda_gathers_and_equals_the_sequence_flex(pad, ties, block):
    # `kvpop train --attention gather` on CUDA: the gathered tiles on compiled FlexAttention give the values, lse and
    # gradients of FlexAttention over the whole sequence, float32
    B, Hkv, G, S, D, budget = 2, 2, 4, 1300, 64, 256
    cfg, q, k, v, pos, valid, evict = (t.cuda() if torch.is_tensor(t) else t
                                       for t in _inputs(B, Hkv, G, S, D, budget, pad, ties, seed=11))
    rule = (pos, valid, pos, valid, evict, cfg.sink, cfg.window, D**-0.5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = sparse_attention(*leaves, *rule, return_lse=True, backend="flex")
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    if block is None:
        import kvpop.ops.attention.gather as gather

        calls = []
        real_gather = gather.gather_sparse_attention
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gather, "gather_sparse_attention", lambda *a, **kw: calls.append(1) or real_gather(*a, **kw))
            got, got_lse = sparse_attention(*mine, *rule, return_lse=True, backend="gather", topk=cfg.topk)
        assert calls == [1]
    else:
        got, got_lse = gather_sparse_attention(*mine, pos, valid, pos, valid, evict, cfg.sink, cfg.window, cfg.topk,
                                               D**-0.5, return_lse=True, block=block, backend="flex")
    real = valid[:, None, :, None]
    torch.testing.assert_close(got * real, want * real, rtol=1e-4, atol=2e-5)
    lse_real = real[..., 0].expand_as(want_lse)
    torch.testing.assert_close(got_lse[lse_real], want_lse[lse_real], rtol=1e-4, atol=2e-5)
    grad = torch.randn(want.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) * real
    (want * grad).sum().backward()
    (got * grad).sum().backward()
    for a, b, name in zip(mine, leaves, "qkv"):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=f"grad {name}")



def test_the_distillation_benches_pin_the_students_attention(tmp_path, capsys):
    # `bench_distill.py --attention` and `profile_distill_step.py` on the CPU (their smoke-test mode), tiny model:
    # the pinned attention is the one each row reports and runs
    distill = _bench_module("bench_distill")
    argv = ["--model", "tiny-random-llama", "--data", "prose", "--seq-len", "256", "--budget", "64", "--window", "16",
            "--warmup", "1", "--steps", "1", "--device", "cpu"]
    assert distill.main(argv + ["--attention", "gather", "--json-out", str(tmp_path / "d.json")]) == 0
    import json

    assert json.loads((tmp_path / "d.json").read_text())["rows"][0]["attention"] == "gather"
    profile = _bench_module("profile_distill_step")
    assert profile.main(argv[:10] + ["--attention", "auto,gather", "--device", "cpu", "--warmup", "1", "--steps", "1",
                                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "# auto: GPU busy" in out and "# gather: GPU busy" in out
    assert (tmp_path / "profile_gather.txt").read_text().count("aten::") > 5
