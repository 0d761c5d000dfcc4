"""One distillation step on the GPU: tokens/s, and where the time goes (attention, target, scorer, ...).

    python bench/bench_distill.py --model smollm2-135m --seq-len 8192 --budget 2048 --window 256
    python bench/bench_distill.py --model qwen3-4b-shape --num-layers 4 --data prose --seq-len 16384 --budget 2048 \
        --window 512 --attention auto

A `*-shape` preset (random weights, bf16 as the real checkpoints) is written with kvpop's byte tokenizer to a
temporary directory that `kvpop train` then loads like any model (no model file needed) (`--num-layers` fewer decoder layers: a
4B-shape step at 16k with all 36 layers and a teacher does not fit one GPU). "attention_auto" in the result
is what `--attention auto` picks for the run's shape and budget (`ops.attention.backends.auto_backend`).

Builds the same `Distiller` as `kvpop train` (full distillation: teacher forward, student forward
with the rule, future-attention target, boundary loss, KL, backward, two clipped AdamW groups),
runs `--warmup` untimed steps (compilation), then times `--steps` steps. The time shares come from
the `kvpop.timing.timed` ranges of the trainer and the attention function, timed with CUDA events
on the stream (`RangeTimer`), over the steps' wall time. Ranges nest: `kvpop.scorer`, `kvpop.rule`
and `kvpop.sparse_attention` are parts of `kvpop.student_forward` (all 30 layers); the backward pass
is one range (`kvpop.backward`, attention's backward included), as autograd runs it.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time

import torch

from kvpop.presets import model_help

RANGES = ("kvpop.teacher_forward", "kvpop.student_forward", "kvpop.scorer", "kvpop.rule", "kvpop.sparse_attention",
          "kvpop.kl", "kvpop.target", "kvpop.boundary_loss", "kvpop.backward", "kvpop.optimizer")
NESTED = ("kvpop.scorer", "kvpop.rule", "kvpop.sparse_attention")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help=f"{model_help(shapes=True)} (default smollm2-135m)")
    p.add_argument("--data", default="champ")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--scorer", default="mlp", choices=("mlp", "mlstm"))
    p.add_argument("--freeze-base", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (CPU times then)")
    p.add_argument("--attention", default="auto", choices=("auto", "flex", "gather"),
                   help="the student's training attention, as `kvpop train --attention`: auto (FlexAttention over the "
                        "sequence on CUDA), flex, or gather (each query tile over its own keys)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="decoder layers of a *-shape preset (default: the real count)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the weights of a *-shape preset (default bfloat16, as the real checkpoints; SmolLM2's preset "
                        "loads in float32)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_distill needs CUDA (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from kvpop.config import KVpopConfig
    from kvpop.ops.attention.backends import auto_backend
    from kvpop.shapes import SHAPE_PRESETS
    from kvpop.timing import RangeTimer
    from kvpop.train.distill import Distiller, TrainConfig

    if args.num_layers is not None and args.model not in SHAPE_PRESETS:
        print(f"bench_distill: --num-layers applies to the *-shape presets only, not {args.model!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as shaped:
        model = args.model
        if model in SHAPE_PRESETS:
            model = _write_shape_model(args.model, args.num_layers, getattr(torch, args.dtype), shaped)
        tcfg = TrainConfig(model=model, data=args.data, seq_len=args.seq_len, steps=args.warmup + args.steps,
                           out=out, save_every=0, device=args.device, freeze_base=args.freeze_base,
                           attention=args.attention)
        kcfg = KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window, scorer=args.scorer)
        t0 = time.perf_counter()
        d = Distiller(tcfg, kcfg)
        setup_s = time.perf_counter() - t0
        stream = d.batches()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            d.train_step(next(stream))
        sync()
        warmup_s = time.perf_counter() - t0
        step_s = []
        with RangeTimer(args.device) as timer:
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                d.train_step(next(stream))
                sync()
                step_s.append(time.perf_counter() - t0)
        range_ms = {name: ms / args.steps for name, ms in timer.totals().items()}
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        c = d.model.config
        layers = c.num_hidden_layers
        picked = auto_backend("cuda", 1, c.num_attention_heads, getattr(c, "head_dim", None) or
                              c.hidden_size // c.num_attention_heads, args.seq_len, d.kcfg.sink, d.kcfg.window,
                              d.kcfg.topk, True, not args.freeze_base)

    med = statistics.median(step_s)
    mean_ms = 1e3 * sum(step_s) / len(step_s)
    row = {
        "model": args.model, "seq_len": args.seq_len, "budget": kcfg.budget, "sink": kcfg.sink, "window": kcfg.window,
        "topk": d.kcfg.topk, "scorer": args.scorer, "attention": args.attention, "attention_auto": picked,
        "num_layers": layers, "full_distillation": not args.freeze_base,
        "step_s_median": med, "tokens_per_s": args.seq_len / med, "setup_s": setup_s, "warmup_s": warmup_s,
        "range_ms_per_step": range_ms, "shares": {k: v / mean_ms for k, v in range_ms.items()}, "peak_gb": peak_gb,
    }
    print(f"# {args.model} ({layers} layers) S={args.seq_len} budget={kcfg.budget} scorer={args.scorer} attention "
          f"{args.attention} (auto: {picked}): {row['tokens_per_s']:.0f} tokens/s, {med * 1e3:.0f} ms/step (median of "
          f"{args.steps}), peak {peak_gb:.1f} GB")
    for name in RANGES:
        if name in range_ms:
            indent = "    " if name in NESTED else "  "
            print(f"{indent}{name:<26} {range_ms[name]:8.1f} ms  {100 * row['shares'][name]:5.1f} % of the step")
    result = {"rows": [row], "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "command": "python bench/bench_distill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


def _write_shape_model(name: str, num_layers: int | None, dtype: torch.dtype, path: str) -> str:
    """Preset `name` with random weights (bf16) and kvpop's byte tokenizer (built locally: no model file is needed,
    and a random model reads any ids alike), saved to `path` for `kvpop train`."""
    from kvpop.models import byte_tokenizer
    from kvpop.shapes import build_shape_model

    model, _ = build_shape_model(name, "cpu", dtype=dtype, num_layers=num_layers)
    tokenizer = byte_tokenizer()
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"{name} has {model.config.vocab_size} token ids, fewer than the byte tokenizer's "
                         f"{len(tokenizer)}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
