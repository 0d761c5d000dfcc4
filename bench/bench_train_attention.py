"""Training attention on the GPU: KVpop's pieces against dense SDPA, side by side in one run.

    python bench/bench_train_attention.py --lengths 16384 --budget 2048

The first length compiles FlexAttention's forward, backward and the target pass (about a minute on
an H200); each measurement is printed as it lands.

Qwen3-4B's attention shape by default (32 query heads, 8 KV heads, head dim 128, bf16, batch 1).
Per sequence length it times, with CUDA events (`triton.testing.do_bench`, median):

- `cutoffs`: the eviction positions of every key (`eviction_positions`, the training path's call:
  the two-level Triton kernel with its small operations fused, `kernel.evictions_ordered`) and, beside it,
  the same kernel with those operations unfused (`cutoffs_unfused_ms`, backend "triton_unfused": the fusion's
  baseline), the one-level tile-scan kernel (`cutoffs_scan_ms`, backend "triton_scan") and the wavelet form;
- `block_mask`: FlexAttention's `BlockMask` built from the eviction positions (`sparse_block_mask`:
  the two Triton launches on CUDA), beside its torch form (`block_mask_torch_ms`) and, for scale, `create_block_mask` evaluating the same `mask_mod` at every point (optional);
- `sparse_fwd`, `sparse_fwd_bwd`: compiled FlexAttention with that block mask (mask prebuilt);
- `target`: the scorers' label, the transposed future-attention pass (`future_attention_target`);
- `dense_fwd`, `dense_fwd_bwd`: causal `scaled_dot_product_attention` (flash) on the same tensors.

`--gather` adds the attention over each query tile's gathered keys (`ops/attention/gather.py`: the same rule on
the keys a tile sees, about a quarter of the causal pairs), its forward and, unless `--quick`, forward + backward
and the memory that allocates, with its largest difference from the sparse forward's output, at every tile size of
`--gather-blocks` (default 512); the first size also piece by piece (the tiles' keys, the whole gathering, the
gathered batch alone, its share of full tiles), and `--gather-profile FILE` writes the kernels of three calls.

`--quick` skips what the mask-share ratio does not need (dense and sparse forward + backward, the
target pass): it keeps the cutoffs, the block mask and the sparse forward.

Targets of the GPU-speed issue, reported as ratios: (cutoffs + block mask) / sparse forward <= 0.10,
and (sparse forward + backward + target) / dense forward + backward (`train_vs_dense`; with the gathered
attention, `train_vs_dense_gather`) <= 1.5, then <= 1.0.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F


def _bench(fn, reps: int) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, rep=reps, return_mode="median"))


def _note(row: dict, key: str) -> None:
    """One line per measurement as it lands: a run stopped at a time limit keeps what it measured."""
    print(f"# S={row['S']} {key} = {row[key]}", flush=True)


def sweep_cutoffs(pri: torch.Tensor, topk: int, rep: int) -> dict:
    """Where the cutoffs' time goes: the sort that ranks the row, and the two-level kernel at each tile choice.

    Every choice must give the default's result (checked here); the fastest is printed last."""
    import functools
    import itertools

    from kvpop.ops.topk.kernel import _tile_size, kth_beater_tiled

    R, N = pri.shape[0] * pri.shape[1], pri.shape[-1]
    ranked = torch.ones(R, N, dtype=torch.bool, device=pri.device)

    def ranks():  # as `_eviction_ordered_kernel` ranks a row: best first, ties to the newer token
        key = pri.reshape(R, N).float().flip(-1)
        order = (N - 1) - torch.argsort(key, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=pri.device).expand(R, N))
        return order, rank

    order, rank = ranks()
    out = {"sweep_sort_ms": _bench(ranks, rep)}
    print(f"# sort and rank: {out['sweep_sort_ms']:.4f} ms", flush=True)
    want = kth_beater_tiled(rank, ranked, topk, order=order)
    times = {}
    for br, bu, bj, nw in itertools.product((32, 64, 128), (64, 128, 256), (16, 32, 64), (4, 8)):
        name = f"r{br}-u{bu}-j{bj}-w{nw}"
        try:
            fn = functools.partial(kth_beater_tiled, rank, ranked, topk, order=order, block_r=br, block_u=bu,
                                   block_j=bj, num_warps=nw)
            if not torch.equal(fn(), want):
                print(f"# {name}: differs from the default", flush=True)
                continue
            times[name] = _bench(fn, rep)
        except Exception as e:  # a tile that does not fit (registers, shared memory) is skipped, said why
            print(f"# {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"# {name}: {times[name]:.4f} ms", flush=True)
    best = min(times, key=times.get)
    default = f"r128-u{_tile_size(N)}-j32-w4"  # kth_beater_tiled's defaults
    out.update({"sweep_kernel_ms": times, "sweep_default": default, "sweep_default_ms": times.get(default), "sweep_best": best,
                "sweep_best_ms": times[best]})
    print(f"# kernel default {default} {out['sweep_default_ms']} ms, best {best} {times[best]:.4f} ms", flush=True)
    return out


def run(S: int, args) -> dict:
    from kvpop.config import KVpopConfig
    from kvpop.ops.attention.block_mask import retention_mask_mod, sparse_block_mask
    from kvpop.ops.attention.flex import _flex_for
    from kvpop.ops.target import future_attention_target
    from kvpop.ops.topk import eviction_positions

    cfg = KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    B, Hq, Hkv, D = 1, args.q_heads, args.kv_heads, args.head_dim
    dtype = torch.bfloat16
    q = torch.randn(B, Hq, S, D, device=dev, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype, generator=g, requires_grad=True)
    pri = torch.randn(B, Hkv, S, device=dev, generator=g)
    pos = torch.arange(S, device=dev)[None].expand(B, S)
    valid = torch.ones(B, S, dtype=torch.bool, device=dev)
    scale = D**-0.5
    s, w, topk = cfg.sink, cfg.window, cfg.topk
    row = {"S": S, "sink": s, "window": w, "topk": topk, "budget": cfg.budget, "q_heads": Hq, "kv_heads": Hkv,
           "head_dim": D}

    # the dense baseline first: it compiles nothing, so a run stopped while FlexAttention compiles keeps it
    grad = torch.randn(B, Hq, S, D, device=dev, dtype=dtype, generator=g)

    def dense_fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    with torch.no_grad():
        row["dense_fwd_ms"] = _bench(dense_fwd, args.rep)
        _note(row, "dense_fwd_ms")

    def dense_fwd_bwd():
        dense_fwd().backward(grad)

    if not args.quick:
        dense_fwd_bwd()
        row["dense_fwd_bwd_ms"] = _bench(dense_fwd_bwd, args.rep)
        _note(row, "dense_fwd_bwd_ms")

    def cutoffs(backend="auto"):
        return eviction_positions(pri, pos[:, None], valid[:, None], s, w, topk, ordered=True, backend=backend)

    evict = cutoffs()
    row["cutoffs_equal_wavelet"] = bool(torch.equal(evict, cutoffs("wavelet")))
    _note(row, "cutoffs_equal_wavelet")
    row["cutoffs_equal_scan"] = bool(torch.equal(evict, cutoffs("triton_scan")))
    _note(row, "cutoffs_equal_scan")
    row["cutoffs_equal_unfused"] = bool(torch.equal(evict, cutoffs("triton_unfused")))
    _note(row, "cutoffs_equal_unfused")
    row["cutoffs_ms"] = _bench(cutoffs, args.rep)
    _note(row, "cutoffs_ms")
    row["cutoffs_unfused_ms"] = _bench(lambda: cutoffs("triton_unfused"), args.rep)
    _note(row, "cutoffs_unfused_ms")
    row["cutoffs_scan_ms"] = _bench(lambda: cutoffs("triton_scan"), args.rep)
    _note(row, "cutoffs_scan_ms")
    row["cutoffs_wavelet_ms"] = _bench(lambda: cutoffs("wavelet"), args.rep)
    _note(row, "cutoffs_wavelet_ms")
    if args.sweep:
        row.update(sweep_cutoffs(pri, topk, args.rep))

    def build():
        return sparse_block_mask(pos, valid, pos, valid, evict, s, w, Hq)

    bm = build()
    torch_bm = sparse_block_mask(pos, valid, pos, valid, evict, s, w, Hq, backend="torch")
    tables = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    row["block_mask_equal_torch"] = all(torch.equal(getattr(bm, n), getattr(torch_bm, n)) for n in tables)
    _note(row, "block_mask_equal_torch")
    row["block_mask_ms"] = _bench(build, args.rep)
    _note(row, "block_mask_ms")
    row["block_mask_torch_ms"] = _bench(
        lambda: sparse_block_mask(pos, valid, pos, valid, evict, s, w, Hq, backend="torch"), args.rep)
    _note(row, "block_mask_torch_ms")
    if args.naive_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        mod = retention_mask_mod(pos, valid, pos, valid, evict, s, w, Hq // Hkv)
        try:  # compiled point evaluation, as FlexAttention recommends for long sequences
            row["create_block_mask_ms"] = _bench(
                lambda: create_block_mask(mod, B, Hq, S, S, device=dev, _compile=True), args.rep)
        except Exception as e:  # noqa: BLE001 - the comparison is optional, the rest of the row is not
            row["create_block_mask_ms"] = None
            row["create_block_mask_error"] = f"{type(e).__name__}: {e}"[:300]
    # BlockMask.sparsity(): the percentage of tiles skipped (this field was "tiles_kept" before, a misnomer)
    row["tiles_skipped_pct"] = float(bm.sparsity()) if hasattr(bm, "sparsity") else None

    flex = _flex_for(dev)

    def sparse_fwd():
        return flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True, return_lse=True)

    with torch.no_grad():
        sparse_fwd()
        row["sparse_fwd_ms"] = _bench(sparse_fwd, args.rep)
        _note(row, "sparse_fwd_ms")
    row["mask_share_of_sparse_fwd"] = (row["cutoffs_ms"] + row["block_mask_ms"]) / row["sparse_fwd_ms"]
    _note(row, "mask_share_of_sparse_fwd")
    # the same share with the simpler pieces (tile-scan cutoffs, torch block mask), measured in this run
    row["mask_share_before"] = (row["cutoffs_scan_ms"] + row["block_mask_torch_ms"]) / row["sparse_fwd_ms"]
    _note(row, "mask_share_before")
    if args.gather:
        row.update(time_gather(q, k, v, grad, pos, valid, evict, cfg, scale, sparse_fwd, args))
    if args.quick:
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return row
    out, lse = sparse_fwd()

    def sparse_fwd_bwd():
        o, _ = sparse_fwd()
        o.backward(grad)

    sparse_fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sparse_fwd_bwd()
    torch.cuda.synchronize()
    row["sparse_fwd_bwd_extra_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    row["sparse_fwd_bwd_ms"] = _bench(sparse_fwd_bwd, args.rep)
    _note(row, "sparse_fwd_bwd_ms")

    qd, kd, lsed = q.detach(), k.detach(), lse.detach()

    def target():
        return future_attention_target(qd, kd, lsed, w, scale=scale, backend="flex")

    target()
    row["target_ms"] = _bench(target, args.rep)
    _note(row, "target_ms")

    row["train_vs_dense"] = (row["sparse_fwd_bwd_ms"] + row["target_ms"]) / row["dense_fwd_bwd_ms"]
    if "gather_fwd_bwd_ms" in row:  # the same ratio with the gathered attention in place of the sparse one
        row["train_vs_dense_gather"] = (row["gather_fwd_bwd_ms"] + row["target_ms"]) / row["dense_fwd_bwd_ms"]
        _note(row, "train_vs_dense_gather")
    row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def time_gather(q, k, v, grad, pos, valid, evict, cfg, scale, sparse_fwd, args) -> dict:
    """`--gather`: attention over each query tile's gathered keys (`ops/attention/gather.py`), the whole call (the
    tiles' keys, the gather, the inner block mask and FlexAttention), beside the sparse forward; its output
    against the sparse forward's, forward + backward unless `--quick`, at every query tile of `--gather-blocks`
    (the first is the one the pieces are timed at: the tiles' keys, the whole gathering, the attention on the
    gathered batch alone and its share of full tiles; the peak memory of each), and with `--gather-profile` the CUDA kernels of one forward +
    backward."""
    from kvpop.ops.attention.block_mask import sparse_block_mask
    from kvpop.ops.attention.flex import flex_sparse_attention
    from kvpop.ops.attention.gather import gather_sparse_attention, gather_tiles, tile_keys

    out = {}
    blocks = [int(b) for b in args.gather_blocks.split(",")]
    for block in blocks:
        tag = "" if block == blocks[0] else f"_b{block}"

        def gather_fwd(block=block):
            return gather_sparse_attention(q, k, v, pos, valid, pos, valid, evict, cfg.sink, cfg.window, cfg.topk,
                                           scale, return_lse=True, block=block, backend="flex")

        with torch.no_grad():
            got, want = gather_fwd()[0], sparse_fwd()[0]
            out[f"gather_max_abs_diff{tag}"] = float((got.float() - want.float()).abs().max())
            out[f"gather_fwd_ms{tag}"] = _bench(gather_fwd, args.rep)
        if not args.quick:
            def gather_fwd_bwd(gather_fwd=gather_fwd):
                gather_fwd()[0].backward(grad)

            gather_fwd_bwd()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            gather_fwd_bwd()
            torch.cuda.synchronize()
            out[f"gather_fwd_bwd_extra_gb{tag}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            out[f"gather_fwd_bwd_ms{tag}"] = _bench(gather_fwd_bwd, args.rep)
        for key in [k_ for k_ in out if k_.endswith(tag) or not tag]:
            if key.startswith("gather") and (tag or "_b" not in key):
                print(f"# block {block}: {key} = {out[key]}", flush=True)
    # the default tile's pieces: what the gathered call spends outside FlexAttention
    block = blocks[0]
    U = min(q.shape[2], cfg.sink + cfg.window + cfg.topk + block - 1)
    rule = (pos, valid, pos, valid, evict, cfg.sink, cfg.window)
    with torch.no_grad():
        out["gather_tile_keys_ms"] = _bench(lambda: tile_keys(*rule, U, block), args.rep)
        out["gather_tiles_ms"] = _bench(lambda: gather_tiles(q, k, v, *rule, cfg.topk, block), args.rep)
        tiles = gather_tiles(q, k, v, *rule, cfg.topk, block)
        qg, kg, vg, qp, qv, kp, used, eg, _ = tiles
        # the gathered batch alone, as gather_sparse_attention hands it to FlexAttention; its tiles by kind
        bm = sparse_block_mask(qp, qv, kp, used, eg, cfg.sink, cfg.window, qg.shape[1])
        n_full, n_part = int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())
        out["gather_tiles_full_pct"] = 100.0 * n_full / max(1, n_full + n_part)
        print(f"# block {block}: {n_full} full and {n_part} partial tiles in the gathered batch", flush=True)

        def inner():
            return flex_sparse_attention(qg, kg, vg, qp, qv, kp, used, eg, cfg.sink, cfg.window, scale,
                                         return_lse=True)

        out["gather_inner_fwd_ms"] = _bench(inner, args.rep)
    if not args.quick:
        qg, kg, vg = (t.detach().requires_grad_() for t in (qg, kg, vg))
        ginner = torch.randn_like(qg)

        def inner_fwd_bwd():
            flex_sparse_attention(qg, kg, vg, qp, qv, kp, used, eg, cfg.sink, cfg.window, scale,
                                  return_lse=True)[0].backward(ginner)

        inner_fwd_bwd()
        out["gather_inner_fwd_bwd_ms"] = _bench(inner_fwd_bwd, args.rep)
        if args.gather_profile:
            from torch.profiler import ProfilerActivity, profile

            def whole():
                gather_sparse_attention(q, k, v, pos, valid, pos, valid, evict, cfg.sink, cfg.window, cfg.topk,
                                        scale, return_lse=True, block=block, backend="flex")[0].backward(grad)

            whole()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    whole()
                torch.cuda.synchronize()
            with open(args.gather_profile, "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    for key in ("gather_tile_keys_ms", "gather_tiles_ms", "gather_inner_fwd_ms", "gather_inner_fwd_bwd_ms"):
        if key in out:
            print(f"# block {block}: {key} = {out[key]}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="16384")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=None, help="default: a quarter of the budget (KVpopConfig.for_budget)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rep", type=int, default=200, help="do_bench's target milliseconds per measurement")
    p.add_argument("--naive-mask", action="store_true", help="also time create_block_mask over every point")
    p.add_argument("--gather", action="store_true",
                   help="also time attention over each query tile's gathered keys (ops/attention/gather.py)")
    p.add_argument("--gather-blocks", default="512",
                   help="query tiles of the gathered attention, comma-separated; the first is timed piece by piece")
    p.add_argument("--gather-profile", default=None,
                   help="with --gather, write the CUDA kernels of three gathered forward + backward calls here")
    p.add_argument("--quick", action="store_true",
                   help="skip dense/sparse forward+backward and the target (keeps cutoffs, block mask, sparse forward)")
    p.add_argument("--sweep", action="store_true",
                   help="also time the cutoffs' sort alone and the two-level kernel at every tile choice")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_train_attention needs CUDA", file=sys.stderr)
        return 2
    # every gathered tile size is another FlexAttention shape: past dynamo's default of 8 compiled variants it falls
    # back to eager FlexAttention, which builds the S x S scores (a 32 GB allocation at 16k, the first sweep)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    rows = [run(int(S), args) for S in args.lengths.split(",")]
    cols = ("S", "cutoffs_ms", "cutoffs_unfused_ms", "cutoffs_scan_ms", "cutoffs_wavelet_ms", "block_mask_ms", "block_mask_torch_ms",
            "sparse_fwd_ms", "sparse_fwd_bwd_ms",
            "target_ms", "dense_fwd_ms", "dense_fwd_bwd_ms", "mask_share_before", "mask_share_of_sparse_fwd", "train_vs_dense",
            "train_vs_dense_gather")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r.get(c):>14.3f}" if isinstance(r.get(c), float) else f"{r.get(c)!s:>14}" for c in cols))
    result = {"rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python bench/bench_train_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
