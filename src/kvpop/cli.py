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
import os
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
    arg("--compile", action="store_true",
        help="greedy decoding with a compiled one-token step (torch.compile; CUDA graphs on CUDA), no streaming"),
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
    if args.compile:
        return _generate_compiled(args, model, tokenizer, inputs["input_ids"], cache)
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
          f"{int(cache.get_seq_length())} tokens seen", file=sys.stderr)
    return 0


def _generate_compiled(args: argparse.Namespace, model, tokenizer, input_ids, cache) -> int:
    """`generate --compile`: `kvpop.decode.Decoder`, greedy, the text printed at the end (no host sync per token)."""
    import time

    from kvpop.decode import Decoder

    if args.do_sample:
        raise ValueError("--compile decodes greedily: drop --do-sample")
    if input_ids.shape[0] != 1:
        raise ValueError(f"--compile takes one prompt, got a batch of {input_ids.shape[0]}")
    decoder = Decoder(model, cache, compile=True)
    start = time.perf_counter()
    new = decoder.generate(input_ids, args.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(new[0], skip_special_tokens=True))
    n_new = new.shape[1]
    used = int(cache.slots_used()[0].max())
    print(f"[kvpop] {n_new} tokens in {elapsed:.2f} s ({n_new / elapsed:.1f} tokens/s, prefill and compilation "
          f"included); cache: {used} of {cache.config.budget} slots per layer and KV head used for "
          f"{int(cache.get_seq_length())} tokens seen", file=sys.stderr)
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
        if c.get("scorer") == "mlstm":
            matched = c.get("extra", {}).get("match_mlp_memory")
            rows["retrofitted with"] += (f", delay {c['window'] if c.get('delay') is None else c['delay']}"
                                         + (f", topk matched to the MLP's {matched['mlp_topk']}" if matched else ""))
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
    arg("--policy", default="kvpop", choices=["kvpop", "streaming_llm_plus", "dms"],
        help="kvpop (learned scorer), streaming_llm_plus (sinks + window only, base distilled; topk 0) or dms "
             "(learned per-token eviction gates, Dynamic Memory Sparsification)"),
    arg("--dms-temperature", type=float, default=0.1, help="dms: Gumbel-sigmoid temperature (default 0.1)"),
    arg("--dms-target-retention", type=float, default=None,
        help="dms: share of tokens past the window each head may keep (default topk / (seq_len - sink - window))"),
    arg("--scorer", default="mlp", choices=["mlp", "mlstm"],
        help="scorer architecture: mlp (KVpop-mlp) or mlstm (stateful KVpop, delayed readout) (default mlp)"),
    arg("--scorer-hidden", type=int, default=256, help="hidden size of the MLP scorer (default 256)"),
    arg("--delay", type=int, default=None,
        help="mlstm: read a token out N steps after insertion, 0..window (default: the window; 0 is the ablation)"),
    arg("--mlstm-dim", type=int, default=None, help="mlstm: memory size d (default: the head dim)"),
    arg("--mlstm-hidden", type=int, default=64, help="mlstm: hidden size of the readout head, 0 linear (default 64)"),
    arg("--match-mlp-memory", action="store_true",
        help="mlstm: reduce topk by the state's size in KV entries, the MLP variant's total memory"),
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
    arg("--max-tokens", type=int, default=0,
        help="training tokens packed (default: what the run uses); the same value gives runs of any --steps the same data order"),
    arg("--fsdp", action="store_true", help="under torchrun: FSDP2 sharding instead of DDP"),
    arg("--deterministic", action="store_true",
        help="deterministic kernels only: a run repeats bitwise on the same GPU and software (slower)"),
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
        scorer = dict(scorer=args.scorer, scorer_hidden=args.scorer_hidden, policy=args.policy,
                      loss_query_fraction=args.query_fraction)
        if args.scorer == "mlstm":
            scorer.update(delay=args.delay, mlstm_dim=args.mlstm_dim, mlstm_hidden=args.mlstm_hidden,
                          match_mlp_memory=args.match_mlp_memory)
        elif args.delay is not None or args.mlstm_dim is not None or args.match_mlp_memory:
            raise ValueError("--delay, --mlstm-dim and --match-mlp-memory need --scorer mlstm")
        if args.policy == "dms":
            scorer.update(dms_temperature=args.dms_temperature, dms_target_retention=args.dms_target_retention)
        if args.budget is not None:
            if args.topk is not None:
                raise ValueError("give --budget or --topk, not both")
            kcfg = kvpop.KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window, **scorer)
        else:
            window = 256 if args.window is None else args.window
            topk = (0 if args.policy == "streaming_llm_plus" else 64) if args.topk is None else args.topk
            kcfg = kvpop.KVpopConfig(sink=args.sink, window=window, topk=topk, **scorer)
    tcfg = TrainConfig(
        model=args.model, data=args.data, text_field=args.text_field, chat=args.chat, seq_len=args.seq_len,
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr_base=args.lr_base,
        lr_scorer=args.lr_scorer, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, freeze_base=args.freeze_base, kl_topk=args.kl_topk, out=args.out,
        save_every=args.save_every, seed=args.seed, device=args.device, fsdp=args.fsdp, max_tokens=args.max_tokens,
        deterministic=args.deterministic,
    )
    try:
        final = run_training(tcfg, kcfg, resume=args.resume, progress=not args.no_progress,
                             argv=args.command_line.split())
    except KeyboardInterrupt as err:
        print(f"kvpop train: {err or 'interrupted'}", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one line for the run, not one per rank
        print(f"kvpop train: final model in {final} (load it with kvpop.load or --model {final})", file=sys.stderr)
    return 0


@command("eval", "compare eviction policies and budgets side by side on held-out text (teacher-forced, + pass@1)", [
    MODEL,
    arg("--data", default="champ", help="champ (held-out problems), a file, a directory or a dataset name"),
    arg("--text-field", default=None),
    arg("--split", default="eval", choices=["eval", "train", "all"], help="which split of --data (default eval)"),
    arg("--seq-len", type=int, default=2048, help="tokens per evaluated sequence (default 2048)"),
    arg("--sequences", type=int, default=4, help="number of sequences (default 4)"),
    arg("--budgets", default="512,256", help="comma-separated budgets for the training-free policies"),
    arg("--policies", default="streaming_llm,tova,h2o,oracle",
        help="comma-separated training-free policies (streaming_llm, tova, h2o, oracle), or none"),
    arg("--trained", action="append", default=[], metavar="DIR",
        help="a kvpop.save directory (e.g. OUT/final of kvpop train), evaluated at its own budget; repeatable"),
    arg("--sink", type=int, default=4),
    arg("--rollouts", type=int, default=0, help="pass@1: sampled answers per champ problem (default 0: skip)"),
    arg("--problems", type=int, default=8, help="pass@1: held-out champ problems (default 8)"),
    arg("--max-new-tokens", type=int, default=512, help="pass@1: tokens per answer (default 512)"),
    arg("--out", default="runs/eval", help="output directory (default runs/eval)"),
    arg("--device", default=None),
    arg("--seed", type=int, default=0),
])
def evaluate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch
    from tqdm.auto import tqdm

    from kvpop.eval.evaluate import Evaluator, format_table, from_directory, headline, training_free
    from kvpop.models import load_model
    from kvpop.train.data import load_texts, pack_sequences

    device = _device(args.device)
    torch.manual_seed(args.seed)
    base, tokenizer = load_model(args.model, device=device)
    if getattr(base, "kvpop", None) is not None:
        raise ValueError(f"--model must be the base model; pass kvpop directories with --trained ({args.model})")
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None and args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings={limit}")
    policies = [p for p in args.policies.split(",") if p and p != "none"]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    entries = [from_directory(d) for d in args.trained]
    entries += [training_free(p, b, sink=args.sink) for b in budgets for p in policies]
    if not entries:
        raise ValueError("nothing to evaluate: give --policies and --budgets, or --trained")
    for e in entries:
        if e.budget >= args.seq_len:
            raise ValueError(f"budget {e.budget} ({e.name}) is not below --seq-len {args.seq_len}: nothing is evicted")
    texts = load_texts(args.data, split=args.split, text_field=args.text_field, tokenizer=tokenizer, seed=args.seed)
    tokens = pack_sequences(texts, tokenizer, args.seq_len)[: args.sequences]
    evaluator = Evaluator(base, entries, device=device)
    for row in tqdm(tokens, desc="kvpop eval", unit="seq"):
        evaluator.add(row[None])
    rows = evaluator.rows(args.seq_len)
    if args.rollouts:
        from kvpop.eval.evaluate import rollouts_pass_at_1
        from kvpop.retrofit import detach, load, retrofit
        from kvpop.train.data import champ_problems

        problems = champ_problems("eval", seed=args.seed)[: args.problems]
        for entry, row in zip(evaluator.entries, rows):
            if entry.cfg.policy == "oracle":
                continue
            model = load(entry.trained, device=device) if entry.trained else retrofit(base, entry.cfg)
            row["pass_at_1"], _ = rollouts_pass_at_1(model, tokenizer, problems, args.rollouts, args.max_new_tokens,
                                                     seed=args.seed)
            if not entry.trained:
                detach(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    (out / "table.txt").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"rows": rows, "command": args.command_line,
                                                  "args": {k: v for k, v in vars(args).items() if k != "run"},
                                                  "sequences": len(tokens)},
                                                 indent=2, default=str))
    print(table)
    print(json.dumps(headline(rows)))
    return 0


@command("viz", "plot which tokens each layer's KV heads still hold (the paper's Fig. 6) for a model, text, policy", [
    MODEL,
    arg("--text", default=None, help="the text (default: the first held-out champ solution)"),
    arg("--file", default=None, help="read the text from this file"),
    arg("--policy", default="kvpop", choices=["kvpop", "streaming_llm", "tova", "h2o", "dms"],
        help="policy for a model that is not already retrofitted (default kvpop; kvpop and dms are untrained "
             "unless --model is a trained directory)"),
    arg("--budget", type=int, default=512, help="budget for a fresh retrofit (default 512)"),
    arg("--sink", type=int, default=4),
    arg("--last", type=int, default=112, help="evictable tokens to show (default 112)"),
    arg("--max-tokens", type=int, default=2048, help="truncate the text to this many tokens (default 2048)"),
    arg("--out", default="eviction_pattern.png", help="PNG path (default eviction_pattern.png)"),
    arg("--device", default=None),
])
def viz(args: argparse.Namespace) -> int:
    import kvpop
    from kvpop.eval import plots
    from kvpop.models import load_model
    from kvpop.train.data import load_texts

    model, tokenizer = load_model(args.model, device=_device(args.device))
    if getattr(model, "kvpop", None) is None:
        model = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(args.budget, sink=args.sink, policy=args.policy))
    if args.file:
        with open(args.file) as f:
            text = f.read()
    else:
        text = args.text or load_texts("champ", split="eval", tokenizer=tokenizer)[0]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, : args.max_tokens]
    cfg = model.kvpop.config
    if ids.shape[1] <= cfg.budget:
        raise ValueError(f"the text has {ids.shape[1]} tokens, within the budget {cfg.budget}: nothing is evicted")
    ids = ids.to(model.device)
    counts, positions = plots.eviction_counts(model, ids, last=args.last)
    labels = plots.token_labels(tokenizer, ids[0, positions].tolist())
    path = plots.plot_eviction_pattern(
        counts.cpu().numpy(), labels, model.config.num_key_value_heads, args.out,
        title=f"{args.model}: {cfg.policy}, budget {cfg.budget} (sink {cfg.sink}, window {cfg.window}, topk {cfg.topk})")
    print(f"kvpop viz: wrote {path}", file=sys.stderr)
    return 0


@command("demo", "the main job: train KVpop on SmolLM2-135M + champ math, compare with the baselines, plot", [
    arg("--quick", action="store_true", help="a shorter run (within 15 minutes on 2 CPU cores)"),
    arg("--out", default="runs/demo", help="output directory (default runs/demo)"),
    arg("--device", default=None, help="cpu, cuda, ... (default: cuda if available, else cpu)"),
    arg("--seed", type=int, default=0),
])
def demo(args: argparse.Namespace) -> int:
    from kvpop.eval.demo import run_demo

    run_demo(args.out, quick=args.quick, device=args.device, seed=args.seed, command=args.command_line)
    return 0


def _bench_args():
    from kvpop.eval.args import BENCH_ARGS

    return BENCH_ARGS


@command("bench", "decode latency per token and peak memory against context length: dense cache vs KVpopCache",
         _bench_args())
def bench(args: argparse.Namespace) -> int:
    from kvpop.eval.bench import run_bench

    return run_bench(args, command=args.command_line)


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
    # the exact command, saved beside every result
    args.command_line = " ".join(["kvpop", *(sys.argv[1:] if argv is None else argv)])
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
