"""Turn a trained run's OUT/final into the scorers shipped for a preset, and measure what bfloat16 storage changes.

    python bench/ship_scorers.py runs/smollm2/final --preset smollm2-135m --force

Writes `src/kvpop/pretrained/<preset>/` (`kvpop.pretrained.export`: the scorers in bfloat16, the config with
the run's command and date in `extra["shipped"]`, the base's identity; the base must be the preset's, unchanged,
so the run must have trained with `--freeze-base`). Then runs FINAL's float32 scorers and the bfloat16 ones just
written over `--rows` held-out rows of `--data`, teacher-forced at FINAL's own config (the static rule), and
compares their retention decisions (whether each query keeps each older token, in every layer and KV head, and
how many tokens' eviction times are equal) and their next tokens (top-1 agreement and mean KL past the budget). Prints the files with their sizes, a table, and one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch


def decisions(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced eviction times, int64 [L, Hkv, S], and log-probabilities, float32 [S, V], of one row [1, S]."""
    import kvpop
    from kvpop.attention import Capture

    cfg = model.kvpop.config
    capture = Capture()
    with torch.no_grad():
        logits = model(input_ids=ids, kvpop_capture=capture, use_cache=False).logits[0].float()
    times = torch.stack([kvpop.eviction_times(r.priority.float(), cfg.sink, cfg.window, cfg.topk)[0] for r in capture])
    return times, logits.log_softmax(-1)


def compare(a, b, rows: torch.Tensor) -> dict:
    """How often `b` keeps and evicts as `a` does, and how close its next-token distribution stays, past the budget.

    A token `t` past the sinks is kept by query `q` (`t + window <= q < S`) iff `q < e[t]`: the rule's decisions
    for it differ at `|e_a[t] - e_b[t]|` of those queries.
    """
    cfg = a.kvpop.config
    same = tokens = differ = decided = agree = 0
    kl = []
    for row in rows:
        ta, la = decisions(a, row[None])
        tb, lb = decisions(b, row[None])
        S = ta.shape[-1]
        same += int((ta == tb).sum())
        tokens += ta.numel()
        differ += int((ta - tb)[..., cfg.sink :].abs().sum())
        decided += ta.shape[0] * ta.shape[1] * sum(max(0, S - t - cfg.window) for t in range(cfg.sink, S))
        agree += int((la[cfg.budget :].argmax(-1) == lb[cfg.budget :].argmax(-1)).sum())
        kl.append((la[cfg.budget :].exp() * (la[cfg.budget :] - lb[cfg.budget :])).sum(-1))
    kl = torch.cat(kl)
    return {"retention_agreement": 1 - differ / max(decided, 1), "eviction_time_agreement": same / tokens,
            "top1_agreement": agree / kl.numel(), "mean_kl": float(kl.mean()), "positions": kl.numel(),
            "tokens": tokens, "decisions": decided}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("final", help="a kvpop.save directory trained with --freeze-base (a run's OUT/final)")
    p.add_argument("--preset", default="smollm2-135m", help="the preset it was trained on (default smollm2-135m)")
    p.add_argument("--out", default=None, help="where to write (default: the package's pretrained/<preset>/)")
    p.add_argument("--recipe", default=None, help="how it was trained (default: the run's command)")
    p.add_argument("--date", default=None, help="when it was trained, YYYY-MM-DD (default: the day FINAL was written)")
    p.add_argument("--note", default=None, help="shown with the weights, e.g. the card and commit of the run")
    p.add_argument("--force", action="store_true", help="replace an existing shipped directory")
    p.add_argument("--data", default="champ", help="held-out text for the comparison (default champ)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per compared row (default 2048)")
    p.add_argument("--rows", type=int, default=1, help="held-out rows compared (default 1; 0 skips the comparison)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import kvpop
    from kvpop import pretrained
    from kvpop.eval.evaluate import held_out_rows
    from kvpop.models import load_model
    from kvpop.retrofit import read_config

    out = pretrained.export(args.final, args.preset, args.out, recipe=args.recipe, date=args.date, note=args.note,
                            force=args.force)
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    for name, size in sizes.items():
        print(f"{size:>12,}  {out / name}")
    print(f"{sum(sizes.values()):>12,}  in all; {pretrained.describe(out)}")
    result = {"out": str(out), "bytes": sizes, "total_bytes": sum(sizes.values())}
    if args.rows:
        # the static rule each was trained for, whatever default a trained directory runs as
        full = kvpop.load(args.final, device=args.device, config=read_config(args.final))
        half = kvpop.load(out, device=args.device, config=read_config(args.final))
        _, tokenizer = load_model(args.preset)
        rows = held_out_rows(args.data, tokenizer, args.seq_len, args.rows).to(args.device)
        result.update(compare(full, half, rows))
        print(f"bfloat16 against float32 scorers over {len(rows)} held-out row(s) of {args.data}, {args.seq_len} "
              f"tokens, budget {full.kvpop.config.budget}:")
        print(f"  retention decisions equal  {result['retention_agreement']:.6f} of {result['decisions']:,} "
              "(query, token, layer, KV head)")
        print(f"  eviction times equal       {result['eviction_time_agreement']:.5f} of {result['tokens']:,} "
              "(token, layer, KV head)")
        print(f"  top-1 agreement            {result['top1_agreement']:.5f} of {result['positions']:,} positions "
              "past the budget")
        print(f"  mean KL(f32 || bf16)       {result['mean_kl']:.3g}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
