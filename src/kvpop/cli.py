"""The `kvpop` command.

    kvpop --help
    kvpop info --model tiny-random-qwen3
    kvpop generate --model tiny-random-qwen3 --prompt "Once upon a time" --window 32 --topk 64

A subcommand is one function decorated with `@command(name, help, args)`: `args` lists its flags,
the function receives the parsed namespace and returns the exit status. `kvpop` itself is imported
inside the functions, so `kvpop --help` does not pay for torch and transformers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    help: str
    args: Sequence[tuple[tuple[str, ...], dict[str, Any]]]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def arg(*flags: str, **kwargs: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One `add_argument` call, written down for later."""
    return flags, kwargs


def command(name: str, help: str, args: Sequence[tuple[tuple[str, ...], dict[str, Any]]] = ()):
    """Register the decorated function as `kvpop <name>`."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(help, args, run)
        return run

    return register


MODEL = arg("--model", required=True, metavar="PATH_OR_PRESET",
            help="a preset (tiny-random-qwen3, tiny-random-llama), a local Hugging Face model directory, "
                 "or a directory written by kvpop.save; nothing is downloaded")
DEVICE = arg("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
DTYPE = arg("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
            help="model dtype (default: float32 for presets, the checkpoint's own otherwise)")


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


@command("generate", "generate text with a bounded KVpop cache, streaming tokens as they come", [
    MODEL,
    arg("--prompt", required=True, help="the prompt text"),
    arg("--chat", action="store_true", help="wrap the prompt as a user turn with the tokenizer's chat template"),
    arg("--sink", type=int, default=None, help="sink tokens always kept (default 4)"),
    arg("--window", type=int, default=None, help="most recent tokens always kept (default 32)"),
    arg("--topk", type=int, default=None, help="slots for the best-scored older tokens (default 64)"),
    arg("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)"),
    arg("--do-sample", action="store_true", help="sample instead of greedy decoding"),
    arg("--temperature", type=float, default=1.0, help="sampling temperature (with --do-sample)"),
    arg("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --do-sample)"),
    arg("--seed", type=int, default=0, help="random seed (default 0)"),
    DEVICE,
    DTYPE,
])
def generate(args: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import TextStreamer

    import kvpop
    from kvpop.cache import cache_kwargs
    from kvpop.models import is_kvpop_dir, load_model

    if not args.prompt:
        raise ValueError("--prompt is empty")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    # seeds the scorers of a fresh retrofit as well as sampling, so a run repeats exactly
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=_device(args.device))
    rule = {"sink": args.sink, "window": args.window, "topk": args.topk}
    if is_kvpop_dir(args.model):
        given = [f"--{k}" for k, v in rule.items() if v is not None]
        if given:
            print(f"kvpop: {args.model} is already retrofitted; ignoring {' '.join(given)}", file=sys.stderr)
    else:
        defaults = {"sink": 4, "window": 32, "topk": 64}
        cfg = kvpop.KVpopConfig(**{k: defaults[k] if v is None else v for k, v in rule.items()})
        model = kvpop.retrofit(model, cfg)

    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).to(model.device)
    n_prompt = inputs["input_ids"].shape[1]

    cache = kvpop.KVpopCache(model)
    sampling = {"do_sample": False}
    if args.do_sample:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    start = time.perf_counter()
    out = model.generate(
        **inputs,
        **cache_kwargs(model, cache),
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
        **sampling,
    )
    elapsed = time.perf_counter() - start

    n_new = out.shape[1] - n_prompt
    used = int(cache.slots_used()[0].max())
    print(f"[kvpop] {n_new} tokens in {elapsed:.2f} s ({n_new / elapsed:.1f} tokens/s, prefill included); "
          f"cache: {used} of {cache.config.budget} slots per layer and KV head used for "
          f"{cache.get_seq_length()} tokens seen", file=sys.stderr)
    return 0


def _supported(config) -> str:
    # retrofit a weightless copy: the same checks a real retrofit makes, at no memory cost
    import torch
    from transformers import AutoModelForCausalLM

    import kvpop

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        kvpop.retrofit(model, kvpop.KVpopConfig())
    except ValueError as err:
        return f"no: {err}"
    return "yes"


@command("info", "show a model's architecture and whether kvpop supports it", [MODEL])
def info(args: argparse.Namespace) -> int:
    import json
    import os

    from kvpop.models import KVPOP_CONFIG_FILE, is_kvpop_dir, load_config

    config = load_config(args.model)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rows = {
        "model": args.model,
        "model type": config.model_type,
        "layers": config.num_hidden_layers,
        "query heads": heads,
        "KV heads": f"{kv_heads} (groups of {heads // kv_heads})",
        "head dim": head_dim,
        "max positions": getattr(config, "max_position_embeddings", "unknown"),
        "vocab size": config.vocab_size,
        "kvpop supports it": _supported(config),
    }
    if is_kvpop_dir(args.model):
        with open(os.path.join(args.model, KVPOP_CONFIG_FILE)) as f:
            c = json.load(f)
        rows["retrofitted with"] = (f"sink={c['sink']} window={c['window']} topk={c['topk']} "
                                    f"(budget {c['sink'] + c['window'] + c['topk']}), policy {c['policy']}, "
                                    f"scorer {c['scorer']}")
    for key, value in rows.items():
        print(f"{key + ':':20s}{value}")
    return 0


@command("train", "distill a KVpop retrofit: scorers by the boundary loss, base weights by KL to the dense model", [
    MODEL,
    arg("--data", default="champ", help="champ, a .txt/.jsonl/.parquet file or directory, or a dataset name"),
    arg("--text-field", default=None, help="record field holding the text (jsonl/parquet/datasets)"),
    arg("--chat", action="store_true", help="format conversations with the tokenizer's chat template"),
    arg("--seq-len", type=int, default=512, help="tokens per packed training sequence (default 512)"),
    arg("--sink", type=int, default=4, help="sink tokens (default 4)"),
    arg("--window", type=int, default=None, help="protected window (default a quarter of the budget)"),
    arg("--topk", type=int, default=None, help="long-range top-k slots (default: budget - sink - window)"),
    arg("--budget", type=int, default=None, help="sink + window + topk; give this or --window/--topk"),
    arg("--policy", default="kvpop", choices=["kvpop", "streaming_llm_plus"],
        help="kvpop (learned scorer) or streaming_llm_plus (sinks + window only, base distilled; topk 0)"),
    arg("--scorer", default="mlp", choices=["mlp"], help="scorer architecture (default mlp)"),
    arg("--scorer-hidden", type=int, default=256, help="hidden size of the MLP scorer (default 256)"),
    arg("--query-fraction", type=float, default=1.0, help="share of boundary queries used per sequence (default 1)"),
    arg("--steps", type=int, default=100, help="optimizer steps (default 100)"),
    arg("--batch-size", type=int, default=1, help="sequences per micro-batch over all ranks (default 1)"),
    arg("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)"),
    arg("--lr-base", type=float, default=8e-5, help="constant learning rate of the base weights (default 8e-5)"),
    arg("--lr-scorer", type=float, default=1e-3, help="peak scorer learning rate, warm-up + cosine (default 1e-3)"),
    arg("--warmup-steps", type=int, default=-1, help="scorer warm-up steps (default 5%% of --steps)"),
    arg("--weight-decay", type=float, default=1e-4),
    arg("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 disables (default 1)"),
    arg("--freeze-base", action="store_true", help="train the scorers only: no teacher copy, no KL (CPU mode)"),
    arg("--kl-topk", type=int, default=0, help="KL over the teacher's top-N logits only (default 0: full vocab)"),
    arg("--out", default="runs/train", help="output directory (default runs/train)"),
    arg("--resume", action="store_true", help="continue the run in --out from its checkpoint"),
    arg("--save-every", type=int, default=50, help="checkpoint every N steps (default 50)"),
    arg("--seed", type=int, default=0),
    arg("--max-tokens", type=int, default=0, help="cap on training tokens packed (default: what the run uses)"),
    arg("--fsdp", action="store_true", help="under torchrun: FSDP2 sharding instead of DDP"),
    arg("--device", default="auto", help="auto, cpu, cuda, ... (default auto)"),
    arg("--no-progress", action="store_true", help="no progress bar"),
])
def train(args: argparse.Namespace) -> int:
    import kvpop
    from kvpop.models import is_kvpop_dir
    from kvpop.train.distill import TrainConfig
    from kvpop.train.distill import train as run_training

    kcfg = None
    if not is_kvpop_dir(args.model):
        if args.budget is not None:
            if args.topk is not None:
                raise ValueError("give --budget or --topk, not both")
            kcfg = kvpop.KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window, scorer=args.scorer,
                                                scorer_hidden=args.scorer_hidden, policy=args.policy,
                                                loss_query_fraction=args.query_fraction)
        else:
            window = 256 if args.window is None else args.window
            topk = (0 if args.policy == "streaming_llm_plus" else 64) if args.topk is None else args.topk
            kcfg = kvpop.KVpopConfig(sink=args.sink, window=window, topk=topk, scorer=args.scorer, policy=args.policy,
                                     scorer_hidden=args.scorer_hidden, loss_query_fraction=args.query_fraction)
    tcfg = TrainConfig(
        model=args.model, data=args.data, text_field=args.text_field, chat=args.chat, seq_len=args.seq_len,
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr_base=args.lr_base,
        lr_scorer=args.lr_scorer, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, freeze_base=args.freeze_base, kl_topk=args.kl_topk, out=args.out,
        save_every=args.save_every, seed=args.seed, device=args.device, fsdp=args.fsdp, max_tokens=args.max_tokens,
    )
    try:
        final = run_training(tcfg, kcfg, resume=args.resume, progress=not args.no_progress,
                             argv=["kvpop", *sys.argv[1:]])
    except KeyboardInterrupt as err:
        print(f"kvpop train: {err or 'interrupted'}", file=sys.stderr)
        return 130
    print(f"kvpop train: final model in {final} (load it with kvpop.load or --model {final})", file=sys.stderr)
    return 0


@command("demo", "the main job: train KVpop on SmolLM2-135M + champ math, compare with the baselines, plot", [
    arg("--quick", action="store_true", help="a shorter run (within 15 minutes on 2 CPU cores)"),
    arg("--out", default="runs/demo", help="output directory (default runs/demo)"),
    arg("--device", default=None, help="cpu, cuda, ... (default: cuda if available, else cpu)"),
    arg("--seed", type=int, default=0),
])
def demo(args: argparse.Namespace) -> int:
    from kvpop.eval.demo import run_demo

    run_demo(args.out, quick=args.quick, device=args.device, seed=args.seed)
    return 0


def _bench_args():
    from kvpop.eval.args import BENCH_ARGS

    return BENCH_ARGS


@command("bench", "decode latency per token and peak memory against context length: dense cache vs KVpopCache",
         _bench_args())
def bench(args: argparse.Namespace) -> int:
    from kvpop.eval.bench import run_bench

    return run_bench(args, command=" ".join(["kvpop", *sys.argv[1:]]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpop",
        description="KVpop: a fixed-size KV cache with a learned eviction policy for Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        for flags, kwargs in cmd.args:
            p.add_argument(*flags, **kwargs)
        p.set_defaults(run=cmd.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpop")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (ValueError, OSError, NotImplementedError, RuntimeError) as err:
        print(f"kvpop {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
