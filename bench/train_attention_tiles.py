"""Why the training path's sparse attention is not cheaper than dense: the work its tiles do, counted on any device.

    python bench/train_attention_tiles.py --length 16384 --budget 2048 --blocks 128,64,32,16

The same rule and inputs as `bench_train_attention.py` (8 KV heads, random priorities by default, the budget split by
`KVpopConfig.for_budget`), without timing anything. Per tile size it counts, from the eviction positions (no S x S):
- the tiles FlexAttention skips, computes with its `mask_mod` (partial) and computes without it (full), per KV head
  (`tile_states`, the block mask's own classification), against the lower triangle dense causal attention computes;
- the pairs those tiles compute, against the pairs the rule lets through (each key is visible on `[pos, alive)`);
- per query tile, the union of the keys visible to any of its queries: what a kernel that gathers the held keys of
  each query tile would compute instead.

`--priorities recent` ranks the older tokens by recency plus noise (kept tokens then cluster near the window), to see
how much the count depends on where the kept tokens sit. `--model DIR` takes a trained run's own priorities instead
(`kvpop.save` directory, its config's budget split): every layer of one held-out champ row of `--length` tokens, the
counts summed over the layers (CPU is fine for SmolLM2 at 8192).

    python bench/train_attention_tiles.py --model runs/b1024/final --length 8192

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from kvpop.config import KVpopConfig
from kvpop.ops.attention.block_mask import EMPTY, FULL, PARTIAL, alive_until, tile_states
from kvpop.ops.attention.gather import tile_sight
from kvpop.ops.topk import eviction_positions


def count(alive: torch.Tensor, pos: torch.Tensor, S: int, bs: int) -> dict:
    """Tiles, pairs and per-tile key unions at tile size `bs` for keys visible on `[pos, alive)` ([H, S])."""
    visible = (alive.clamp(max=S) - pos).clamp(min=0).sum().item()  # pairs (query, key) the rule lets through
    # the keys some query of each tile sees, one head at a time (the trained case has layers x heads of them)
    valid = torch.ones(1, S, dtype=torch.bool)
    union = torch.cat([tile_sight(pos[None], valid, pos[None], a[None, None], bs)[0, 0].sum(-1)[None] for a in alive])
    rows = torch.tensor([min(bs, S - i) for i in range(0, S, bs)], dtype=torch.float32)
    return {"visible_pairs": visible, "gather_pairs": float((union.float() * rows).sum()),
            "union_mean": float(union.float().mean()), "union_max": int(union.max())}


def trained_priorities(path: str, S: int) -> tuple[torch.Tensor, KVpopConfig]:
    """A trained run's priorities [L, Hkv, S] on the first held-out champ row of S tokens, and its config."""
    from kvpop.attention import Capture
    from kvpop.eval.evaluate import held_out_rows
    from kvpop.models import is_kvpop_dir, load_model
    from kvpop.retrofit import read_config

    try:
        # the static rule's priorities are what the training attention's tiles see, whatever rule the run decodes with
        config = read_config(path).static_rule if is_kvpop_dir(path) else None
        model, tokenizer = load_model(path, config=config)
    except (ValueError, OSError) as err:  # not a model directory, or its files missing or damaged
        raise SystemExit(f"train_attention_tiles.py --model {path}: {err}") from None
    if getattr(model, "kvpop", None) is None:
        raise SystemExit(f"train_attention_tiles.py --model {path}: not a kvpop run (a directory written by "
                         "kvpop.save or kvpop train): it has no scorer whose priorities to count")
    ids = held_out_rows("champ", tokenizer, S, 1)
    if ids.shape[0] == 0:
        raise SystemExit(f"--length {S}: no held-out champ row is that long")
    records = Capture()
    with torch.no_grad():
        model(ids, kvpop_capture=records, use_cache=False, logits_to_keep=1)
    return torch.cat([r.priority.float() for r in records]), model.kvpop.config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--blocks", default="128,64,32,16")
    ap.add_argument("--priorities", choices=("random", "recent"), default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a trained run's directory: its priorities on a held-out row")
    args = ap.parse_args(argv)
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        ap.error(f"--blocks {args.blocks!r}: comma-separated tile sizes, e.g. 128,64")
    if min(blocks) < 1:
        ap.error(f"--blocks {args.blocks!r}: tile sizes must be at least 1")
    S = args.length
    if args.model:
        pri, cfg = trained_priorities(args.model, S)  # [L, Hkv, S]: the layers as rows of one batch
        pri = pri.reshape(1, -1, S)
        # --kv-heads is the model's: the rows counted are its KV heads times its layers
        args.priorities, args.budget, args.kv_heads = f"trained ({args.model})", cfg.budget, None
    else:
        cfg = KVpopConfig.for_budget(args.budget)
        g = torch.Generator().manual_seed(args.seed)
        pri = torch.randn(1, args.kv_heads, S, generator=g)
        if args.priorities == "recent":
            pri = torch.arange(S, dtype=torch.float32) / S * 4 + pri
    if cfg.budget >= S:
        raise SystemExit(f"budget {cfg.budget} must be below --length {S}: nothing would be evicted")
    H = pri.shape[1]
    pos = torch.arange(S)
    valid = torch.ones(1, S, dtype=torch.bool)
    evict = eviction_positions(pri, pos[None, None], valid[:, None], cfg.sink, cfg.window, cfg.topk, ordered=True)
    alive = alive_until(pos[None], valid, evict, cfg.sink, cfg.window)[0]  # [H, S]
    causal_pairs = S * (S + 1) / 2 * H
    rows = []
    for bs in blocks:
        tiles = tile_states(pos[None], valid, pos[None], valid, evict, cfg.sink, cfg.window, bs)[0]  # [H, nb, nb]
        nb = tiles.shape[-1]
        lower = nb * (nb + 1) // 2 * H  # the tiles dense causal attention computes
        n = {name: int((tiles == v).sum()) for name, v in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}
        computed = (n["partial"] + n["full"]) * bs * bs
        row = {"block": bs, **n, "causal_tiles": lower, "computed_vs_causal_tiles": (n["partial"] + n["full"]) / lower,
               "partial_share": n["partial"] / max(1, n["partial"] + n["full"]), **count(alive, pos, S, bs)}
        row["pair_efficiency"] = row["visible_pairs"] / computed
        row["gather_vs_causal_pairs"] = row["gather_pairs"] / causal_pairs
        rows.append(row)
    print(f"# train_attention_tiles {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: S={S}, "
          f"{H} KV heads (x layers), budget {cfg.budget} (sink {cfg.sink}, window {cfg.window}, topk {cfg.topk}), "
          f"{args.priorities} priorities; the rule lets through "
          f"{rows[0]['visible_pairs'] / causal_pairs:.3f} of the causal pairs")
    print(f"{'tile':>5} {'computed/causal tiles':>22} {'partial share':>14} {'visible/computed pairs':>23} "
          f"{'union keys mean/max':>20} {'gather/causal pairs':>20}")
    for r in rows:
        print(f"{r['block']:>5} {r['computed_vs_causal_tiles']:>22.3f} {r['partial_share']:>14.3f} "
              f"{r['pair_efficiency']:>23.3f} {r['union_mean']:>11.0f} / {r['union_max']:<6} "
              f"{r['gather_vs_causal_pairs']:>20.3f}")
    print(json.dumps({"bench": "train_attention_tiles", "args": vars(args), "head_rows": H, "causal_pairs": causal_pairs,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
