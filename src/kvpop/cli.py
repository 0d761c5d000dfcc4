"""The `kvpop` command.

    kvpop --help
    kvpop info --model tiny-random-qwen3
    kvpop generate --model tiny-random-qwen3 --prompt "Once upon a time" --window 32 --topk 64

A subcommand is one function decorated with `@command(name, help, args)`: `args` lists its flags,
the function receives the parsed namespace (with `given`, the flags written on the command line)
and returns the exit status. An expected failure (bad input, a missing or damaged file, a run that
cannot resume) is one line `kvpop <command>: error: ...` and exit status 1; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpop import limits
from kvpop.config import DEFAULT_BUDGET, DEFAULT_SINK
from kvpop.presets import model_help


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


MODEL = arg("--model", required=True, metavar="PATH_OR_PRESET", help=model_help())
BASE = arg("--base", default=None, metavar="PATH_OR_PRESET",
           help="for a --model saved without base weights (kvpop train --freeze-base's OUT/final): load its base "
                "from this preset or local directory instead of the one it records (it must be the same model)")
SCORERS = arg("--scorers", default=None, choices=("shipped", "untrained"),
              help="for a preset that ships trained scorers (smollm2-135m): shipped (the default) runs them, as "
                   "--model with their directory would; untrained retrofits random ones at --budget")
DEVICE = arg("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
DTYPE = arg("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
            help="model dtype (default: float32 for presets, the checkpoint's own otherwise)")
NO_PROGRESS = arg("--no-progress", action="store_true", help="no progress bars (transformers' own included)")
BUDGET_HELP = (f"entries kept per layer and KV head, sink + window + topk (default {DEFAULT_BUDGET}: the CPU scale, "
               f"a quarter of a 2048-token sequence; the paper's GPU setting is 2048 of 8192)")
RULE = [
    arg("--budget", type=int, default=None, help=BUDGET_HELP),
    arg("--sink", type=int, default=None, help=f"sink tokens always kept (default {DEFAULT_SINK})"),
    arg("--window", type=int, default=None,
        help="most recent tokens always kept (default a quarter of the budget; all of it past the sinks for "
             "streaming_llm policies)"),
    arg("--topk", type=int, default=None, help="slots for the best-scored older tokens (default: the rest of the budget)"),
]
RULE_FLAGS = ("budget", "sink", "window", "topk")
RECOMMENDED_HELP = ("the recommended policy: the layer-wide KVpop-cascade at TOVA's split of the budget (no sinks, "
                    "window 1), a pool of (budget - 1) * 3 // 4 slots ranked by TOVA's score (the latest query's "
                    "attention averaged over the layer's heads), the rest per KV head by the learned priority")
POLICY_RULE = arg("--rule", choices=("cascade", "static"), default=None,
                  help=f"how a trained KVpop-mlp directory runs: cascade, {RECOMMENDED_HELP} (the default), or "
                       "static, the paper's static rule")


def _device(name: str | None) -> str:
    from kvpop.models import resolve_device

    return resolve_device(name)


def _rule(args: argparse.Namespace, **kw: Any):
    """`--budget/--sink/--window/--topk` as a KVpopConfig: `KVpopConfig.for_budget` derives what is not given."""
    import kvpop

    given = {k: getattr(args, k) for k in RULE_FLAGS if getattr(args, k, None) is not None}
    return kvpop.KVpopConfig.for_budget(**given, **kw)


def _note(args: argparse.Namespace, message: str) -> None:
    print(f"kvpop {args.command}: note: {message}", file=sys.stderr)


def _trained_arg(value: str) -> tuple[str | None, str]:
    """`--trained [NAME=]DIR` -> (NAME or None, DIR); a DIR that exists is taken whole, '=' and all."""
    name, sep, path = value.partition("=")
    if not sep or Path(value).exists() or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        return None, value
    return name, path


def _untrained(args: argparse.Namespace, cfg) -> None:
    """Say so when a policy with learned parts runs with the random initialisation of a fresh retrofit."""
    if cfg.policy in ("kvpop", "dms"):
        _note(args, f"{args.model} has no trained {cfg.policy} {'scorers' if cfg.policy == 'kvpop' else 'gates'}: "
                    f"they are untrained (random), at budget {cfg.budget} (sink {cfg.sink}, window {cfg.window}, "
                    f"topk {cfg.topk}); train them with kvpop train and pass its OUT/final as --model")


def _shipped_scorers(args: argparse.Namespace, policy: str = "kvpop") -> None:
    """`--model PRESET` of a preset that ships trained scorers runs them: `args.model` becomes their directory
    (unless `--scorers untrained`, or another `policy`), and one stderr line says which weights run."""
    from kvpop import pretrained
    from kvpop.models import PRESETS

    path = pretrained.shipped(args.model) if args.model in PRESETS else None
    if args.scorers == "untrained" or (args.scorers is None and (path is None or policy != "kvpop")):
        return
    if path is None:
        ships = ", ".join(pretrained.available()) or "none"
        raise ValueError(f"--scorers shipped: --model {args.model} ships no trained scorers (presets that do: {ships})")
    if policy != "kvpop":
        raise ValueError(f"--scorers shipped runs trained KVpop scorers; --policy {policy} is another policy")
    from kvpop.retrofit import read_config

    print(f"kvpop {args.command}: {args.model} runs its shipped trained scorers at budget {read_config(path).budget} "
          f"(--scorers untrained for random ones): {pretrained.describe(path)}", file=sys.stderr)
    args.model = str(path)


def _ignored_rule_flags(args: argparse.Namespace) -> None:
    given = [f"--{k}" for k in RULE_FLAGS if k in args.given]
    if given:
        _note(args, f"{args.model} is already retrofitted; ignoring {' '.join(given)}")


@command("generate", "generate text with a bounded KVpop cache, streaming tokens as they come", [
    MODEL,
    arg("--prompt", required=True, help="the prompt text"),
    arg("--chat", action="store_true", help="wrap the prompt as a user turn with the tokenizer's chat template"),
    *RULE,
    arg("--max-new-tokens", type=int, default=64,
        help="tokens to generate (default 64; fewer when the model's positions run out first)"),
    arg("--do-sample", action="store_true", help="sample instead of greedy decoding"),
    arg("--temperature", type=float, default=1.0, help="sampling temperature (with --do-sample; default 1.0)"),
    arg("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --do-sample; default 1.0)"),
    arg("--seed", type=int, default=0, help="random seed (default 0)"),
    arg("--compile", action="store_true",
        help="greedy decoding with a compiled one-token step (torch.compile; on CUDA with CUDA graphs and tuned "
             "kernels), no streaming"),
    arg("--compile-backend", choices=("cudagraph", "inductor", "aot_eager"), default=None,
        help="with --compile: inductor (the default: the whole step compiled, on CUDA with kvpop's tuning; tens of "
             "seconds to compile the first time, less from inductor's cache, TORCHINDUCTOR_CACHE_DIR) or "
             "cudagraph (the eager step captured once, its per-layer pieces compiled: ready in seconds, about "
             "1.4x slower per token at the Qwen3-8B shape)"),
    POLICY_RULE,
    arg("--tova-pool", type=int, default=None, metavar="N",
        help="a trained KVpop-mlp directory as KVpop-cascade: N of its top-k slots ranked by TOVA per KV head"),
    arg("--tova-pool-layer", type=int, default=None, metavar="N",
        help="a trained KVpop-mlp directory as the layer-wide KVpop-cascade at TOVA's split of its budget with N pool "
             "slots ranked by TOVA's score, the rest a per-head static pool (default: the recommended policy's pool, "
             "(budget - 1) * 3 // 4; --rule static runs the paper's static rule instead)"),
    arg("--pool-decay", type=float, default=None, metavar="D",
        help="with --tova-pool-layer: rank the pool by the head-averaged attention accumulated over the steps, each "
             "step D x the last plus the latest (1: H2O's accumulated attention) (default: TOVA's latest attention, "
             "as the recommended policy ranks)"),
    arg("--decision-chunk", type=int, default=None, metavar="C",
        help="a trained directory's recommended policy deciding once every C steps from the chunk's C queries, in "
             "the same key/value memory (the window a ring of C slots; the chunk's queries are kept too): a long "
             "prompt prefills in rounds of C tokens instead "
             "of a token-by-token walk (default: after every token)"),
    SCORERS,
    BASE,
    DEVICE,
    DTYPE,
    NO_PROGRESS,
])
def generate(args: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import TextStreamer

    import kvpop
    from kvpop.cache import cache_kwargs
    from kvpop.models import is_kvpop_dir, load_model

    if args.compile_backend and not args.compile:
        raise ValueError(f"--compile-backend {args.compile_backend} chooses how --compile compiles: add --compile")
    if not args.prompt:
        raise ValueError("--prompt is empty")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if not (0 < args.top_p <= 1):
        raise ValueError(f"--top-p={args.top_p} must lie in (0, 1] (the share of probability mass sampled from)")
    if not (0 < args.temperature < float("inf")):
        raise ValueError(f"--temperature={args.temperature} must be a finite number > 0")
    # seeds the scorers of a fresh retrofit as well as sampling, so a run repeats exactly
    torch.manual_seed(args.seed)
    _shipped_scorers(args)
    cfg = None if is_kvpop_dir(args.model) else _rule(args)  # bad flags fail before the model loads
    trained = _trained_config(args)
    if args.decision_chunk is not None:
        from kvpop.models import PRESETS

        if trained is None and args.model not in PRESETS and not Path(args.model).exists():
            raise ValueError(f"--model {args.model}: no such file or directory, and not a preset ({', '.join(PRESETS)})")
        if trained is None or not trained.tova_pool:
            raise ValueError(f"--decision-chunk applies to the recommended policy of a trained KVpop-mlp directory "
                             f"(or --tova-pool-layer N); --model {args.model} runs "
                             f"{'no trained scorers' if trained is None else trained.describe()}")
        try:
            trained = trained.with_decision_chunk(args.decision_chunk)
        except ValueError as err:
            raise ValueError(f"--decision-chunk {args.decision_chunk}: {err}") from None
        _note(args, f"{args.model} runs {trained.describe()}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=_device(args.device), config=trained,
                                  base=args.base)
    if cfg is None:
        _ignored_rule_flags(args)
    else:
        model = kvpop.retrofit(model, cfg)
        _untrained(args, cfg)

    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).to(model.device)
    n_prompt = inputs["input_ids"].shape[1]
    args.max_new_tokens = _fit_new_tokens(args, model, n_prompt)
    limits.check_generation(model, n_prompt, args.max_new_tokens)

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
    print(f"[kvpop] {n_new} tokens in {elapsed:.2f} s ({n_new / elapsed:.1f} tokens/s, prefill included); "
          f"cache: {_slots_used(model, cache)} used for {int(cache.get_seq_length())} tokens seen", file=sys.stderr)
    return 0


def _slots_used(model, cache) -> str:
    """The slots a generation filled, of those each layer has, per layer kind (a hybrid model's sliding-window layers
    hold their window)."""
    from kvpop.modules import kvpop_modules

    mods, used = kvpop_modules(model), [int(u.max()) for u in cache.slots_used()]
    full = f"{max(used[i] for i in mods.policy_layers)} of {cache.config.budget} slots per"
    if not mods.hybrid:
        return f"{full} layer and KV head"
    sliding = [i for i, w in enumerate(mods.windows) if w is not None]
    return (f"{full} full-attention layer and KV head ({len(mods.policy_layers)} layers), "
            f"{max(used[i] for i in sliding)} of {max(mods.windows[i] for i in sliding)} per sliding-window layer "
            f"({len(sliding)} layers)")


def _trained_config(args: argparse.Namespace):
    """The config `generate` runs a trained directory under, checked before loading, and said on stderr: its rule
    (`--rule`; by default the recommended policy for a KVpop-mlp), or `--tova-pool N` / `--tova-pool-layer N`
    (`--pool-decay D`) over its weights. None for a model that is not a kvpop directory."""
    from kvpop.models import is_kvpop_dir
    from kvpop.retrofit import read_config

    asked = [(flag, n, layer) for flag, n, layer in (("--tova-pool", args.tova_pool, False),
                                                     ("--tova-pool-layer", args.tova_pool_layer, True)) if n is not None]
    if len(asked) > 1:
        raise ValueError("give --tova-pool or --tova-pool-layer, not both")
    if asked and args.rule is not None:
        raise ValueError(f"give --rule or {asked[0][0]}, not both ({asked[0][0]} sets the pool of the cascade it runs)")
    if args.pool_decay is not None and not (asked and asked[0][2]):
        raise ValueError("--pool-decay ranks the pool of --tova-pool-layer N: give it with --tova-pool-layer")
    if not is_kvpop_dir(args.model):
        if asked:
            raise ValueError(f"{asked[0][0]} runs a trained KVpop-mlp directory (kvpop train's OUT/final) as "
                             f"KVpop-cascade; --model {args.model} is not one")
        if args.rule == "cascade":
            raise ValueError(f"--rule cascade runs a trained KVpop-mlp directory (kvpop train's OUT/final); --model "
                             f"{args.model} has no trained scorers")
        return None
    saved = read_config(args.model)
    if asked:
        flag, n, layer = asked[0]
        _check_pool(flag, n, saved, layer, args.model)
        _check_decay("--pool-decay", args.pool_decay)
        cfg, why = saved.with_tova_pool(n, layer=layer, decay=args.pool_decay), flag
    else:
        cfg = saved.for_rule(args.rule)
        why = f"--rule {args.rule}" if args.rule else "the default" + (
            ", the recommended policy; --rule static runs the paper's static rule" if cfg != saved else "")
    _note(args, f"{args.model} runs {cfg.describe()} ({why})")
    return cfg


def _check_decay(flag: str, decay: float | None) -> None:
    if decay is not None and not 0 < decay <= 1:
        raise ValueError(f"{flag} {decay} must lie in (0, 1] (1: H2O's accumulated attention)")


def _check_pool(flag: str, n: int, cfg, layer: bool, where: str) -> None:
    """A TOVA pool of `n` slots for a KVpop-mlp config: at most its top-k, or the layer-wide cascade's `budget - 1`
    (TOVA's split of the same budget)."""
    top = cfg.budget - 1 if layer else cfg.topk
    if not 1 <= n <= top:
        raise ValueError(f"{flag} {n} must lie in [1, {'budget - 1' if layer else 'topk'}={top}] of {where}")


def _fit_new_tokens(args: argparse.Namespace, model, n_prompt: int) -> int:
    """`--max-new-tokens`, or fewer where the model's positions end first (said on stderr).

    The last generated token is returned but never run through the model: `k` new tokens need
    `n_prompt + k - 1` positions.
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return args.max_new_tokens
    if n_prompt > limit:
        raise ValueError(f"the prompt has {n_prompt} tokens, more than the model's max_position_embeddings={limit}")
    fits = limit - n_prompt + 1
    if args.max_new_tokens > fits:
        _note(args, f"the prompt has {n_prompt} tokens and the model {limit} positions: generating {fits} tokens, "
                    f"not --max-new-tokens {args.max_new_tokens}")
        return fits
    return args.max_new_tokens


def _generate_compiled(args: argparse.Namespace, model, tokenizer, input_ids, cache) -> int:
    """`generate --compile`: `kvpop.decode.Decoder`, greedy, the text printed at the end (no host sync per token)."""
    import time

    from kvpop.decode import Decoder

    if args.do_sample:
        raise ValueError("--compile decodes greedily: drop --do-sample")
    if input_ids.shape[0] != 1:
        raise ValueError(f"--compile takes one prompt, got a batch of {input_ids.shape[0]}")
    decoder = Decoder(model, cache, compile=True, backend=args.compile_backend)
    start = time.perf_counter()
    new = decoder.generate(input_ids, args.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(new[0], skip_special_tokens=True))
    n_new = new.shape[1]
    first = "" if decoder.first_step_s is None else f", {decoder.first_step_s:.1f} s of it the first step (compiling)"
    print(f"[kvpop] {n_new} tokens in {elapsed:.2f} s ({n_new / elapsed:.1f} tokens/s, prefill and compilation "
          f"included{first}); cache: {_slots_used(model, cache)} used for {int(cache.get_seq_length())} tokens seen",
          file=sys.stderr)
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


@command("info", "show a model's architecture, whether kvpop supports it, and the KV cache each layer kind holds", [
    MODEL,
    arg("--length", type=int, default=None,
        help="tokens of one sequence for the KV table (default: the model's max positions)"),
    arg("--budget", type=int, default=None,
        help=f"entries a full-attention layer keeps per KV head when retrofitted (default: a kvpop.save directory's "
             f"own, else {DEFAULT_BUDGET})"),
    arg("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
        help="the cache's dtype for the byte counts (default bfloat16)"),
])
def info(args: argparse.Namespace) -> int:
    from kvpop.models import is_kvpop_dir, load_config
    from kvpop.retrofit import read_config

    if args.length is not None and args.length < 1:
        raise ValueError(f"--length {args.length}: must be >= 1")
    if args.budget is not None and args.budget < 1:
        raise ValueError(f"--budget {args.budget}: must be >= 1")
    config = load_config(args.model)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    saved = read_config(args.model) if is_kvpop_dir(args.model) else None
    rows = {
        "model": args.model,
        "model type": config.model_type,
        "layers": _layer_summary(config),
        "query heads": heads,
        "KV heads": f"{kv_heads} (groups of {heads // kv_heads})",
        "head dim": head_dim,
        "max positions": getattr(config, "max_position_embeddings", "unknown"),
        "vocab size": config.vocab_size,
        "kvpop supports it": _supported(config),
    }
    if saved is not None:
        from kvpop.retrofit import read_layout

        layout = read_layout(args.model)
        rows["base weights"] = ("in the directory" if layout.base_weights else
                                f"from {layout.describe_base()} (the directory holds the scorers only)")
        c = saved.to_dict()
        rows["retrofitted with"] = (f"sink={c['sink']} window={c['window']} topk={c['topk']} "
                                    f"(budget {c['sink'] + c['window'] + c['topk']}), policy {c['policy']}, "
                                    f"scorer {c['scorer']}"
                                    + (f", {c['scorer_keys']} keys" if c.get("scorer_keys", "cached") != "cached" else "")
                                    + (f", {c['evidence_mix']} features" if c.get("scorer") == "evidence" else "")
                                    + (f", KVpop-TOVA prior weight {c['tova_prior']}" if c.get("tova_prior") is not None
                                       else "")
                                    + (f", KVpop-cascade with {c['tova_pool']} TOVA slots"
                                       + (" (layer-wide: TOVA's head average, fed first)" if c.get("tova_head_average")
                                          else "")
                                       + (f", pool decay {c['pool_decay']}" if c.get("pool_decay") is not None else "")
                                       if c.get("tova_pool") else ""))
        rows["runs as"] = read_config(args.model).for_rule().describe()
        if c.get("scorer") == "mlstm":
            matched = c.get("extra", {}).get("match_mlp_memory")
            rows["retrofitted with"] += (f", delay {c['window'] if c.get('delay') is None else c['delay']}"
                                         + (f", topk matched to the MLP's {matched['mlp_topk']}" if matched else ""))
    for key, value in rows.items():
        print(f"{key + ':':20s}{value}")
    for line in _kv_table(args, config, saved):
        print(line)
    return 0


def _layer_summary(config) -> str:
    """`18: full attention in layers 5, 11, 17; a sliding window of 512 tokens in the other 15`, or the kinds named."""
    from kvpop.layer_kinds import describe_layers

    try:
        return f"{config.num_hidden_layers}: {describe_layers(config)}"
    except ValueError:
        # the reason is in "kvpop supports it"
        return f"{config.num_hidden_layers} ({', '.join(sorted(set(getattr(config, 'layer_types', None) or ['?'])))})"


def _share(n: int, total: int) -> str:
    """`n` bytes and its share of `total`, 20 characters: `   96.0 MiB  92.7 %`."""
    size = next((f"{n / 2**e:.1f} {unit}" for e, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if n >= 2**e),
                f"{n} B")
    return f"{size:>11s} {100 * n / total:5.1f} %" if total else f"{size:>11s}"


def _kv_table(args: argparse.Namespace, config, saved) -> list[str]:
    """The KV cache each layer kind holds at `--length` tokens, dense and retrofitted, as lines of a table."""
    import torch

    import kvpop
    from kvpop.layer_kinds import FULL, kv_bytes, layer_windows

    try:
        windows = layer_windows(config)
    except ValueError:
        # the reason is in "kvpop supports it"
        return []
    limit = getattr(config, "max_position_embeddings", None)
    if args.length is None and not limit:
        return ["KV cache:           pass --length: the config states no max positions"]
    length = args.length or limit
    if saved is not None and args.budget is not None:
        _ignored_rule_flags(args)
    if saved is not None:
        cfg = saved
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        cfg = kvpop.KVpopConfig.for_budget(budget=args.budget).resolve(head_dim)
    dtype = getattr(torch, args.kv_dtype)
    dense = kv_bytes(config, length, None, dtype)
    bounded = kv_bytes(config, length, cfg, dtype)
    total_dense = sum(k.bytes for k in dense.values())
    total_bounded = sum(k.bytes for k in bounded.values())
    window = sorted({w for w in windows if w is not None})
    names = {FULL: "full attention", "sliding_attention": f"sliding window {'/'.join(map(str, window))}"}
    beyond = f", beyond the model's {limit} positions" if limit and length > limit else ""
    budget = cfg.for_layer(0).budget if cfg.layer_topk is None else f"{cfg.budget} on average"
    lines = [f"KV cache at {length} tokens of one sequence ({args.kv_dtype}{beyond}):",
             f"  {'layers':24s}{'dense':>20s}   {f'retrofitted, budget {budget}':>20s}"]
    for kind, d in dense.items():
        lines.append(f"  {f'{names[kind]} ({d.layers})':24s}{_share(d.bytes, total_dense)}   "
                     f"{_share(bounded[kind].bytes, total_bounded)}")
    lines.append(f"  {f'all ({config.num_hidden_layers})':24s}{_share(total_dense, total_dense)}   "
                 f"{_share(total_bounded, total_dense)} of dense")
    full = dense.get(FULL)
    if full is not None and full.bytes:
        saved_share = 1 - bounded[FULL].bytes / full.bytes
        lines.append(f"  full-attention layers compressed {100 * saved_share:.1f} %, the whole cache "
                     f"{100 * (1 - total_bounded / total_dense):.1f} %")
    return lines


@command("train", "distill a KVpop retrofit: scorers by the boundary loss, base weights by KL to the dense model", [
    MODEL,
    arg("--data", default="champ",
        help="champ (math), pystdlib (Python code), prose (generated), a .txt/.jsonl/.parquet file or directory, or "
             "a dataset name; or a mixture, SOURCE[:WEIGHT],... e.g. champ:0.5,pystdlib:0.3,prose:0.2 (weights "
             "default 1, normalised; each source packed on its own, in proportion) (default champ)"),
    arg("--text-field", default=None,
        help="record field holding the text (jsonl/parquet/datasets; default: the source's own text field)"),
    arg("--chat", action="store_true",
        help="format conversations (and champ, alone or in a mixture) with the tokenizer's chat template"),
    arg("--seq-len", type=int, default=2048,
        help="tokens per packed training sequence, above the budget (default 2048: four times the default budget)"),
    *RULE,
    arg("--policy", default="kvpop", choices=["kvpop", "streaming_llm_plus", "dms"],
        help="kvpop (learned scorer), streaming_llm_plus (sinks + window only, base distilled; topk 0) or dms "
             "(learned per-token eviction gates, Dynamic Memory Sparsification)"),
    arg("--dms-temperature", type=float, default=0.1, help="dms: Gumbel-sigmoid temperature (default 0.1)"),
    arg("--dms-target-retention", type=float, default=None,
        help="dms: share of tokens past the window each head may keep (default topk / (seq_len - sink - window))"),
    arg("--scorer", default="mlp", choices=["mlp", "mlstm", "evidence"],
        help="scorer architecture: mlp (KVpop-mlp), mlstm (stateful KVpop, delayed readout) or evidence ([k; v] and "
             "the attention the token got from its window's queries, scored when it leaves the window) (default mlp)"),
    arg("--scorer-hidden", type=int, default=256, help="hidden size of the MLP scorer (default 256)"),
    arg("--scorer-keys", default="cached", choices=["cached", "pre_rope"],
        help="mlp/evidence: keys as cached (the paper) or with RoPE undone (pre_rope) (default cached)"),
    arg("--tova-prior", type=float, default=None, metavar="ALPHA",
        help="mlp: KVpop-TOVA (an extension): evaluate and decode ranking each slot by TOVA's evidence (the latest "
             "query's attention, averaged over every query head of the layer) plus ALPHA x the scorer's predicted future "
             "attention; the scorer trains as KVpop-mlp with its bias calibrated; TOVA's split (no sinks, window 1) "
             "unless --sink/--window say otherwise (default: off, the paper's static rule)"),
    arg("--tova-pool", type=int, default=0, metavar="N",
        help="mlp: KVpop-cascade (an extension): N of the top-k slots form a pool ranked by TOVA (the latest query's "
             "attention, per KV head) that takes the static rule's rejects; the scorer trains as KVpop-mlp, decoding and "
             "evaluation are dynamic (default 0: the paper's static rule)"),
    arg("--tova-head-average", action="store_true",
        help="with --tova-pool: the layer-wide KVpop-cascade: the pool ranks by the latest query's attention averaged "
             "over the layer's query heads (TOVA's paper score) and takes each token leaving the window first; the "
             "static pool keeps the best of its evictions; TOVA's split (no sinks, window 1) unless --sink/--window "
             "say otherwise"),
    arg("--evidence-mix", default="concat", choices=["concat", "additive"],
        help="evidence: one MLP over [k; v; features] (concat) or the MLP over [k; v] plus a linear term (default concat)"),
    arg("--delay", type=int, default=None,
        help="mlstm: read a token out N steps after insertion, 0..window (default: the window; 0 is the ablation)"),
    arg("--mlstm-dim", type=int, default=None, help="mlstm: memory size d (default: the head dim)"),
    arg("--mlstm-hidden", type=int, default=64, help="mlstm: hidden size of the readout head, 0 linear (default 64)"),
    arg("--match-mlp-memory", action="store_true",
        help="mlstm: reduce topk by the state's size in KV entries, the MLP variant's total memory"),
    arg("--query-fraction", type=float, default=1.0, help="share of boundary queries used per sequence (default 1)"),
    arg("--layer-budgets", default=None, metavar="FILE",
        help="per-layer budgets at the same total memory, from `kvpop budgets` (its budget must equal --budget)"),
    arg("--steps", type=int, default=100, help="optimizer steps (default 100)"),
    arg("--batch-size", type=int, default=1, help="sequences per micro-batch over all ranks (default 1)"),
    arg("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)"),
    arg("--lr-base", type=float, default=8e-5, help="constant learning rate of the base weights (default 8e-5)"),
    arg("--lr-scorer", type=float, default=1e-3, help="peak scorer learning rate, warm-up + cosine (default 1e-3)"),
    arg("--warmup-steps", type=int, default=-1, help="scorer warm-up steps (default 5%% of --steps)"),
    arg("--weight-decay", type=float, default=1e-4, help="AdamW weight decay of the trained parameters (default 1e-4)"),
    arg("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 disables (default 1)"),
    arg("--freeze-base", action="store_true", help="train the scorers only: no teacher copy, no KL (CPU mode)"),
    arg("--kl-topk", type=int, default=0, help="KL over the teacher's top-N logits only (default 0: full vocab)"),
    arg("--out", default="runs/train", help="output directory (default runs/train); one that holds a run needs "
                                            "--resume or --overwrite"),
    arg("--resume", action="store_true",
        help="continue the run in --out from its last complete checkpoint (at its own config unless flags set one)"),
    arg("--overwrite", action="store_true",
        help="replace the run in --out: it is moved aside, and deleted once the new run has its first checkpoint"),
    arg("--init-from", default=None, metavar="DIR",
        help="start a new run (step 0, fresh optimizer and schedule) from the weights of another: a run directory, "
             "one of its checkpoints or a kvpop.save directory, at its config; e.g. full distillation after "
             "--freeze-base pre-training of the scorers"),
    arg("--save-every", type=int, default=50, help="checkpoint every N steps (default 50)"),
    arg("--keep-every", type=int, default=0,
        help="also checkpoint every N steps and keep those checkpoints, for a curve against the steps "
             "(bench/recall_curve.py) (default 0: only the newest is kept)"),
    arg("--seed", type=int, default=0, help="random seed (default 0)"),
    arg("--max-tokens", type=int, default=0,
        help="training tokens packed (default: what the run uses); the same value gives runs of any --steps the same data order"),
    arg("--fsdp", action="store_true", help="under torchrun: FSDP2 sharding instead of DDP"),
    arg("--deterministic", action="store_true",
        help="deterministic kernels only: a run repeats bitwise on the same GPU and software (slower)"),
    arg("--attention", default="auto", choices=("auto", "flex", "gather"),
        help="the student's sparse attention: auto (picked by shape and budget: on CUDA the gathered tiles where "
             "they save enough attention work, e.g. Qwen3-4B at 16k, FlexAttention over the sequence for small "
             "models such as SmolLM2; the gathered tiles on the CPU), flex, or gather (each query tile over its own "
             "keys) (default auto)"),
    arg("--device", default="auto", help="auto, cpu, cuda, ... (default auto)"),
    NO_PROGRESS,
])
def train(args: argparse.Namespace) -> int:
    from kvpop.models import is_kvpop_dir
    from kvpop.retrofit import read_config
    from kvpop.train.distill import TrainConfig
    from kvpop.train.distill import train as run_training
    from kvpop.train.mix import check_training_data

    check_training_data(args.data)
    kcfg = None
    if is_kvpop_dir(args.model):
        _refuse_other_config(args, read_config(args.model), f"--model {args.model} is already retrofitted",
                             "it trains at that config", "start from the base model")
        if args.layer_budgets:
            raise ValueError(f"--layer-budgets applies to a fresh retrofit; {args.model} already has its budgets")
    elif args.init_from and not args.resume:  # with --resume, kvpop train refuses --init-from
        from kvpop.train.weights import source_config

        _refuse_other_config(args, source_config(args.init_from), f"--init-from {args.init_from} was trained",
                             "a run started from it trains at that config", "start a fresh retrofit without --init-from")
        if args.layer_budgets:
            raise ValueError(f"--layer-budgets applies to a fresh retrofit; --init-from {args.init_from} has its budgets")
    elif args.resume and not args.given & CONFIG_ARGS:
        pass  # the run's own config, from its checkpoint
    else:
        scorer = dict(scorer=args.scorer, scorer_hidden=args.scorer_hidden, policy=args.policy,
                      loss_query_fraction=args.query_fraction, scorer_keys=args.scorer_keys,
                      evidence_mix=args.evidence_mix)
        if args.tova_prior is not None:
            scorer.update(tova_prior=args.tova_prior)
        if args.tova_pool:
            scorer.update(tova_pool=args.tova_pool)
        if args.tova_head_average:
            if not args.tova_pool:
                raise ValueError("--tova-head-average needs --tova-pool N (the layer-wide KVpop-cascade)")
            scorer.update(tova_head_average=True)
        if args.scorer == "mlstm":
            scorer.update(delay=args.delay, mlstm_dim=args.mlstm_dim, mlstm_hidden=args.mlstm_hidden,
                          match_mlp_memory=args.match_mlp_memory)
        elif args.delay is not None or args.mlstm_dim is not None or args.match_mlp_memory:
            raise ValueError("--delay, --mlstm-dim and --match-mlp-memory need --scorer mlstm")
        if args.policy == "dms":
            scorer.update(dms_temperature=args.dms_temperature, dms_target_retention=args.dms_target_retention)
        kcfg = _rule(args, **scorer)
        if args.layer_budgets:
            kcfg = kcfg.with_layer_budgets(_layer_budgets(args.layer_budgets, kcfg.budget))
    tcfg = TrainConfig(
        model=args.model, data=args.data, text_field=args.text_field, chat=args.chat, seq_len=args.seq_len,
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr_base=args.lr_base,
        lr_scorer=args.lr_scorer, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, freeze_base=args.freeze_base, kl_topk=args.kl_topk, out=args.out,
        save_every=args.save_every, keep_every=args.keep_every, seed=args.seed, device=args.device, fsdp=args.fsdp,
        max_tokens=args.max_tokens, deterministic=args.deterministic, attention=args.attention,
    )
    try:
        final = run_training(tcfg, kcfg, resume=args.resume, overwrite=args.overwrite, init_from=args.init_from,
                             progress=not args.no_progress, argv=args.command_line.split())
    except KeyboardInterrupt as err:
        print(f"kvpop train: {err or 'interrupted'}", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one line for the run, not one per rank
        print(f"kvpop train: final model in {final} (load it with kvpop.load or --model {final})", file=sys.stderr)
    return 0


# train's flags that set the KVpop config, and the field each sets (budget: the property)
CONFIG_FLAGS = {"budget": "budget", "sink": "sink", "window": "window", "topk": "topk", "policy": "policy",
                "scorer": "scorer", "scorer_hidden": "scorer_hidden", "delay": "delay", "mlstm_dim": "mlstm_dim",
                "mlstm_hidden": "mlstm_hidden", "match_mlp_memory": "match_mlp_memory",
                "dms_temperature": "dms_temperature", "dms_target_retention": "dms_target_retention",
                "query_fraction": "loss_query_fraction", "scorer_keys": "scorer_keys", "evidence_mix": "evidence_mix",
                "tova_prior": "tova_prior", "tova_pool": "tova_pool", "tova_head_average": "tova_head_average"}
CONFIG_ARGS = {*CONFIG_FLAGS, "layer_budgets"}
"""train's flags that shape the KVpop config: a --resume given none of them resumes at the run's own."""


def _as_flags(cfg):
    """A resolved config as train's flags gave it: with --match-mlp-memory, the top-k before the mLSTM state's share."""
    import dataclasses

    matched = cfg.extra.get("match_mlp_memory")
    if not matched:
        return cfg
    entries = matched["state_entries"]
    layer_topk = None if cfg.layer_topk is None else tuple(k + entries for k in cfg.layer_topk)
    return dataclasses.replace(cfg, topk=matched["mlp_topk"], layer_topk=layer_topk, match_mlp_memory=True)


def _refuse_other_config(args: argparse.Namespace, saved, what: str, consequence: str, instead: str) -> None:
    """`train --model <kvpop dir>` and `--init-from DIR` train at that config: a flag asking for another is an error."""
    saved = _as_flags(saved)
    conflicts = [f"--{flag.replace('_', '-')} {getattr(args, flag)} (the directory has {getattr(saved, field)})"
                 for flag, field in CONFIG_FLAGS.items()
                 if flag in args.given and getattr(args, flag) != getattr(saved, field)]
    if conflicts:
        raise ValueError(f"{what} (sink {saved.sink}, window {saved.window}, topk {saved.topk}: budget "
                         f"{saved.budget}, policy {saved.policy}, scorer {saved.scorer}); {consequence}: "
                         f"drop {', '.join(conflicts)}, or {instead}")


@command("convert-checkpoint", "convert checkpoints an earlier kvpop saved as pickles into data (JSON + safetensors), "
                               "once: tensors and plain data are read, anything else is refused", [
    arg("path", metavar="RUN_OR_CHECKPOINT",
        help="a run directory (each of its pickled checkpoints), one OUT/checkpoints/step-NNNNNNNN directory, or an "
             "OUT/checkpoint.pt; the pickles are kept beside the new checkpoint, renamed *.pickled"),
])
def convert_checkpoint(args: argparse.Namespace) -> int:
    from kvpop.train.convert import convert

    done = convert(args.path)
    if not done:
        _note(args, f"{args.path} holds no pickled checkpoint: nothing to convert")
    for new, kept in done:
        print(f"kvpop convert-checkpoint: wrote {new}; the pickles are kept as {kept} (kvpop no longer reads them: "
              "delete them once the run resumes)", file=sys.stderr)
    return 0


@command("selfgen", "write the dense model's own generations of held-in prompts as a JSONL training source "
                    "(kvpop train --data FILE.jsonl)", [
    MODEL,
    arg("--out", required=True, metavar="FILE.jsonl",
        help="the JSON-lines file to write, one record per sequence (text, prompt_tokens, generated_tokens, "
             "temperature, seed, model); an existing file needs --force"),
    arg("--force", action="store_true",
        help="replace an existing --out and discard an unfinished run's FILE.jsonl.partial (without it, the same "
             "command continues an unfinished run: finished sequences are kept as they are generated)"),
    arg("--prompts", default="champ", metavar="SOURCE",
        help="champ (its training-split problems, never the eval split) or any single source --data takes, "
             "its training-split documents as the prompts (default champ); each is a user turn of the chat "
             "template where the model has one"),
    arg("--text-field", default=None, help="the record field of a --prompts file or dataset that holds the prompt"),
    arg("--sequences", type=int, default=64, help="sequences to generate (default 64)"),
    arg("--tokens", type=int, default=2048,
        help="new tokens per sequence at most; a sequence stops at EOS (default 2048)"),
    arg("--temperature", default="0,0.7",
        help="sampling temperature, 0 greedy; a comma list divides the sequences evenly among them (default 0,0.7)"),
    arg("--min-tokens", type=int, default=None,
        help="sequences that stop at EOS before this many tokens are still written; the summary counts them "
             "(default 256, or --tokens if fewer)"),
    arg("--batch", type=int, default=None,
        help="sequences generated together, left-padded (default 1 on a CPU, 8 on a GPU); the texts do not depend "
             "on it (on a GPU, up to rounding at near-ties of the logits)"),
    arg("--seed", type=int, default=0, help="shuffles the prompts and seeds each sequence's sampling (default 0)"),
    DEVICE,
    DTYPE,
    NO_PROGRESS,
])
def selfgen(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from tqdm.auto import tqdm

    from kvpop.eval import selfgen as sg
    from kvpop.files import refuse_existing
    from kvpop.models import is_kvpop_dir, load_model

    device = _device(args.device)
    if args.batch is None:
        args.batch = 8 if device.startswith("cuda") else 1
    cfg = sg.SelfgenConfig(sequences=args.sequences, tokens=args.tokens,
                           temperatures=sg.parse_temperatures(args.temperature), seed=args.seed, batch=args.batch,
                           min_tokens=args.min_tokens, prompts=args.prompts, text_field=args.text_field)
    out = Path(args.out)
    if out.suffix != ".jsonl":
        raise ValueError(f"--out {args.out}: must end in .jsonl (kvpop train --data reads a file by its suffix)")
    refuse_existing(out, "--out", args.force)
    if is_kvpop_dir(args.model):
        raise ValueError(f"--model {args.model} is retrofitted: selfgen writes the dense model's generations, give "
                         "its base model")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device)
    limits.check_decoding(model, [], cfg.batch, cfg.tokens, 1, f"--tokens {cfg.tokens} with --batch {cfg.batch}",
                          "lower --tokens or --batch")
    prompts = sg.load_prompts(cfg.prompts, tokenizer, text_field=cfg.text_field)
    fits = sg.fitting(prompts, cfg.tokens, getattr(model.config, "max_position_embeddings", None))
    if len(fits) < len(prompts):
        limit = model.config.max_position_embeddings
        if not fits:
            raise ValueError(f"no prompt of --prompts {cfg.prompts} fits the model's {limit} positions with --tokens "
                             f"{cfg.tokens} new tokens: ask for fewer tokens")
        _note(args, f"{len(prompts) - len(fits)} of the {len(prompts)} prompts leave no room for --tokens "
                    f"{cfg.tokens} in the model's {limit} positions: left out")
    out.parent.mkdir(parents=True, exist_ok=True)
    header, part = sg.run_header(cfg, args.model, len(fits)), sg.partial_path(out)
    if args.force:
        part.unlink(missing_ok=True)
    done = sg.resume(out, header)
    if done:
        _note(args, f"continuing from {part}: {len(done)} of {cfg.sequences} sequences were finished")
    try:
        with tqdm(total=cfg.sequences, initial=len(done), desc="kvpop selfgen", unit="seq",
                  disable=args.no_progress) as bar:
            records = sg.generate(model, tokenizer, fits, cfg, model_name=args.model, progress=bar.update,
                                  skip=len(done))
            stats = sg.write(out, records, header, done)
    except KeyboardInterrupt:
        if part.exists():
            print(f"kvpop selfgen: stopped; the finished sequences are kept in {part}: the same command continues "
                  "from there", file=sys.stderr)
        raise
    rows = sg.summarise(stats, cfg.tokens, cfg.min_tokens)
    print(sg.format_summary(rows, cfg.min_tokens))
    print(json.dumps({"out": str(out), "prompts": len(fits), "summary": rows}))
    print(f"kvpop selfgen: wrote {len(stats)} sequences to {out} (train on it with --data {out}, or in a mixture: "
          f"--data champ:0.5,{out}:0.5)", file=sys.stderr)
    return 0


def _refuse_earlier_results(args: argparse.Namespace) -> None:
    """Before any work: the summary files this kind of eval writes into --out must not hold an earlier run's results
    (the default --out is shared by every run), unless --force. `generations.jsonl`, the store an interrupted
    --generate run resumes from, is not one of them."""
    from pathlib import Path

    names = (("suite_table.txt", "suite.json") if args.suite else
             ("fidelity.txt", "fidelity.json", "fidelity.png") if args.generate else ("table.txt", "results.json"))
    found = [n for n in names if (Path(args.out) / n).exists()]
    if found and not args.force:
        raise ValueError(f"--out {args.out} holds the results of an earlier eval ({', '.join(found)}): pass --force to "
                         "replace them, or choose another --out")


@command("eval", "compare eviction policies and budgets side by side: teacher-forced on held-out text (+ pass@1), "
                 "long-context tasks (--suite), long generation (--generate)", [
    MODEL,
    arg("--data", default="champ",
        help="champ (held-out problems), pystdlib (Python code), prose (generated), pydoc (Python's help() topics, "
             "held out from training: out of domain), a file, a directory or a dataset name; or a mixture as for "
             "train, e.g. champ,pystdlib (--sequences divided by the weights) (default champ)"),
    arg("--text-field", default=None, help="record field holding the text (jsonl/parquet/datasets; default: the "
                                           "source's own text field)"),
    arg("--split", default="eval", choices=["eval", "train", "all"], help="which split of --data (default eval)"),
    arg("--seq-len", type=int, default=2048, help="tokens per evaluated sequence (default 2048)"),
    arg("--sequences", type=int, default=4, help="number of sequences (default 4)"),
    arg("--skip-sequences", type=int, default=0, metavar="N",
        help="leave out the first N held-out sequences and evaluate the next --sequences: a development set "
             "disjoint from the rows a table reports (default 0)"),
    arg("--packing", default="document", choices=["document", "concat"],
        help="document: each sequence begins at a document start, formatted as in real use (champ as a chat, "
             "a BOS where the tokenizer adds one) (default); concat: one stream cut every --seq-len tokens "
             "(rows that begin mid-document)"),
    arg("--budgets", default="512,256",
        help="comma-separated budgets for the training-free policies, each above --sink + 1 and below --seq-len "
             "(default 512,256: CR 75 %% and 88 %% of 2048 tokens)"),
    arg("--policies", default="streaming_llm,tova,tova_windowed,h2o,h2o_windowed,oracle",
        help="comma-separated training-free policies: streaming_llm, tova and h2o (as their papers define them), "
             "tova_windowed and h2o_windowed (4 sinks, window B/4), oracle; kvpop and dms untrained; or none "
             "(default: streaming_llm,tova,tova_windowed,h2o,h2o_windowed,oracle)"),
    arg("--trained", action="append", default=[], metavar="[NAME=]DIR",
        help="a kvpop.save directory (e.g. OUT/final of kvpop train), evaluated at its own budget and labelled "
             "NAME (default: its policy); `shipped`: the trained scorers shipped for the --model preset (labelled "
             "shipped); repeatable"),
    arg("--sink", type=int, default=None, help="sinks of the training-free policies (default: each policy's own, "
                                               "0 for tova and h2o, 4 otherwise)"),
    arg("--tova-pool", default=None, metavar="N[,N]",
        help="also run each --trained KVpop-mlp directory as KVpop-cascade: N of its top-k slots form a pool ranked "
             "by TOVA that takes the static rule's rejects (rows NAME+poolN; the same weights, no training)"),
    arg("--tova-pool-layer", default=None, metavar="N[,N]",
        help="also run each --trained KVpop-mlp directory as the layer-wide KVpop-cascade at TOVA's split of its "
             "budget (no sinks, window 1): N slots ranked by TOVA's paper score (the layer's head average), which "
             "takes each token first, the other budget - 1 - N a per-head static pool that keeps the best of its "
             "evictions (rows NAME+lpoolN; the same weights). Each --trained KVpop-mlp row already runs the "
             "recommended policy, N = (budget - 1) * 3 // 4, unless --rule static"),
    arg("--pool-decay", default=None, metavar="D[,D]",
        help="the --tova-pool-layer rows with their pool ranked by the head-averaged attention accumulated over the "
             "steps, each step D x the last plus the latest: 1 is H2O's accumulated attention (rows NAME+lpoolN+h2o), "
             "below 1 older steps fade (NAME+lpoolN+dD); 'none' keeps TOVA's latest attention (NAME+lpoolN) "
             "(default: none)"),
    POLICY_RULE,
    arg("--decision-chunk", default=None, metavar="C[,C]",
        help="also run each TOVA, H2O (no sinks) and layer-wide KVpop-cascade row deciding once every C steps from "
             "the chunk's C queries instead of after every token (rows NAME+chunkC: the chunked rule in the same "
             "memory, a ring of C slots, for H2O the newest part of its window)"),
    arg("--layer-budgets", action="append", default=[], metavar="FILE",
        help="per-layer budgets from `kvpop budgets`: adds a `<policy>+layers` row per policy at that file's budget "
             "(the same total memory as the uniform row); repeatable"),
    arg("--rollouts", type=int, default=0, help="pass@1: sampled answers per champ problem (default 0: skip)"),
    arg("--problems", type=int, default=8, help="pass@1 and --generate: held-out champ problems (default 8)"),
    arg("--max-new-tokens", type=int, default=512, help="pass@1: tokens per answer (default 512)"),
    arg("--generate", type=int, default=0, metavar="N",
        help="long-generation fidelity instead of the teacher-forced table: every policy generates up to N tokens "
             "per champ problem, scored by the dense model (fidelity.json, fidelity.txt, fidelity.png; finished "
             "generations are kept in OUT/generations.jsonl and reused by a rerun)"),
    arg("--samples", type=int, default=None,
        help="--generate: sampled generations per problem at temperature 0.7, besides the greedy one (default 0); "
             "--suite: prompts per task, length and depth (default 2)"),
    arg("--ignore-eos", action="store_true", help="--generate: always generate N tokens, past the EOS token"),
    arg("--gen-batch", type=int, default=None,
        help="--generate: generations decoded together, left-padded (default 1 on a CPU, 8 on a GPU, where a "
             "captured decode step of 8 rows takes about as long as one of 1)"),
    arg("--out", default="runs/eval", help="output directory (default runs/eval); the results of an earlier eval of "
        "the same kind there are refused unless --force"),
    arg("--force", action="store_true",
        help="replace the results of an earlier eval in --out (--generate reuses its finished generations either way)"),
    DEVICE,
    arg("--seed", type=int, default=0, help="random seed (default 0)"),
    NO_PROGRESS,
    arg("--suite", default=None, metavar="NAME[,NAME]",
        help="run the long-context task suite instead: passkey, multikey, multivalue, vt, cwe, qa, or all; every "
             "policy prefills each prompt into its bounded cache and answers greedily (plus a dense row)"),
    arg("--lengths", default="1k,2k", help="suite: prompt lengths in tokens, chat template included (default 1k,2k)"),
    arg("--depths", default="0,0.5,1", help="suite: needle depths in [0, 1] (default 0,0.5,1)"),
    arg("--filler", default="prose",
        help="suite: haystack text: prose (generated), champ, stdlib (Python sources), or a local file or directory"),
    arg("--suite-batch", type=int, default=1, help="suite: prompts decoded together, left-padded (default 1)"),
    arg("--prefill-chunk", type=int, default=2048, help="suite: prompt tokens per prefill forward (default 2048)"),
])
def evaluate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch
    from tqdm.auto import tqdm

    from kvpop.eval.evaluate import Evaluator, check_base, format_table, from_directory, headline, held_out_rows
    from kvpop.models import load_model
    from kvpop.retrofit import read_config
    from kvpop.train.mix import parse_mixture

    if not args.suite:
        parse_mixture(args.data)
    _refuse_earlier_results(args)
    device = _device(args.device)
    torch.manual_seed(args.seed)
    trained = [_shipped_entry(args, *_trained_arg(t)) for t in args.trained]
    args.trained = [d for _, d in trained]
    entries = [from_directory(d, name, rule=args.rule) for name, d in trained]
    seen: dict[tuple[str, int], str] = {}
    for (_, d), e in zip(trained, entries):
        if (e.name, e.budget) in seen:
            raise ValueError(f"--trained {seen[e.name, e.budget]} and {d} are both {e.name!r} at budget {e.budget}: "
                             f"label them, e.g. --trained mine={d}")
        seen[e.name, e.budget] = d
        _note(args, f"--trained {d} ({e.name}) runs {e.cfg.describe()}"
                    + ("" if args.rule else " (the default: the recommended policy; --rule static runs the paper's "
                                            "static rule)" if e.cfg.tova_pool and not read_config(d).tova_pool else ""))
    directories = list(entries)
    entries += _tova_pool_entries(args, directories)
    entries += _training_free_entries(args)
    entries += _layer_budget_entries(args, directories)
    entries += _decision_chunk_entries(args, entries)
    base, tokenizer = load_model(args.model, device=device)
    if getattr(base, "kvpop", None) is not None:
        raise ValueError(f"--model must be the base model; pass kvpop directories with --trained ({args.model})")
    for d in args.trained:
        if not check_base(d, base):
            _note(args, f"--trained {d} records no base model (saved by an older kvpop): whether it was trained from "
                        f"--model {args.model} cannot be checked")
    if args.suite:
        return _eval_suite(args, base, tokenizer, entries, device)
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None and args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings={limit}")
    if not entries:
        raise ValueError("nothing to evaluate: give --policies and --budgets, or --trained")
    if args.generate:
        return _fidelity(args, base, tokenizer, entries, device)
    if args.rollouts:
        _held_out_problems(args)  # refused before the teacher-forced passes, not after them
    for e in entries:
        if e.budget >= args.seq_len:
            raise ValueError(f"budget {e.budget} ({e.name}) is not below --seq-len {args.seq_len}: nothing is evicted")
    limits.check_evaluation(base, args.seq_len)
    if args.skip_sequences < 0:
        raise ValueError(f"--skip-sequences {args.skip_sequences} must be >= 0")
    tokens = held_out_rows(args.data, tokenizer, args.seq_len, args.skip_sequences + args.sequences,
                           packing=args.packing, split=args.split, text_field=args.text_field,
                           seed=args.seed)[args.skip_sequences :]
    if len(tokens) < args.sequences:
        print(f"kvpop eval: the documents of {args.data!r} fill only {len(tokens)} of the {args.sequences} sequences "
              f"asked for after the {args.skip_sequences} skipped ({args.packing} packing: no document is in two "
              "rows)", file=sys.stderr)
    if not len(tokens):
        raise ValueError(f"no held-out sequence of {args.data!r} is left after --skip-sequences {args.skip_sequences}")
    evaluator = Evaluator(base, entries, device=device)
    # one tick per pass (the dense reference, then each entry) of each sequence: a long pass shows as it ends
    with tqdm(total=len(tokens) * (len(entries) + 1), desc="kvpop eval", unit="pass", disable=args.no_progress) as bar:
        for i, row in enumerate(tokens):
            bar.set_postfix(sequence=f"{i + 1}/{len(tokens)}")
            evaluator.add(row[None], progress=bar)
    rows = evaluator.rows(args.seq_len)
    if args.rollouts:
        from kvpop.eval.evaluate import rollouts_pass_at_1
        from kvpop.retrofit import detach, load, retrofit

        problems = _held_out_problems(args)
        for entry, row in zip(evaluator.entries, rows):
            if entry.cfg.policy == "oracle":
                continue
            model = load(entry.trained, device=device, config=entry.cfg) if entry.trained else retrofit(base, entry.cfg)
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


def _shipped_entry(args: argparse.Namespace, name: str | None, path: str) -> tuple[str | None, str]:
    """`--trained shipped` (no such directory here): the scorers shipped for the --model preset."""
    from kvpop import pretrained

    if path != "shipped" or Path(path).exists():
        return name, path
    found = pretrained.shipped(args.model)
    if found is None:
        raise ValueError(f"--trained shipped: --model {args.model} ships no trained scorers (presets that do: "
                         f"{', '.join(pretrained.available()) or 'none'})")
    print(f"kvpop eval: --trained shipped: {pretrained.describe(found)}", file=sys.stderr)
    return name or "shipped", str(found)


def _training_free_entries(args: argparse.Namespace) -> list:
    """`--policies` x `--budgets` as evaluation entries; a bad value is an error naming the flag and what is allowed."""
    from kvpop.eval.evaluate import training_free

    policies = [p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "none"]
    if not policies:
        return []
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--budgets={args.budgets!r} must be comma-separated integers") from None
    sink = DEFAULT_SINK if args.sink is None else args.sink
    for b in budgets:
        if b <= sink + 1:
            raise ValueError(f"--budgets: {b} must lie above --sink + 1 = {sink + 1} (room for a window and a "
                             f"top-k slot) and below --seq-len {args.seq_len}")
        if b >= args.seq_len and not (args.suite or args.generate):  # the suite and --generate set their own lengths
            raise ValueError(f"--budgets: {b} is not below --seq-len {args.seq_len}: nothing is evicted")
    entries = []
    for b in budgets:
        for p in policies:
            try:
                entries.append(training_free(p, b, sink=args.sink))
            except ValueError as err:
                raise ValueError(f"--policies {p} at --budgets {b}: {err}") from None
    from kvpop import pretrained

    ships = " (or --trained shipped: those shipped for it)" if pretrained.shipped(args.model) else ""
    for p in dict.fromkeys(p for p in policies if p in ("kvpop", "dms")):
        _note(args, f"--policies {p}: its {'scorers' if p == 'kvpop' else 'gates'} are untrained (random) here; "
                    f"pass a trained directory with --trained{ships if p == 'kvpop' else ''}")
    return entries


def _held_out_problems(args: argparse.Namespace) -> list[dict]:
    """`--problems N` of champ's held-out split, refused when the split has fewer: a user asking for 32 must not
    get 27 rows silently."""
    from kvpop.train.data import champ_problems

    problems = champ_problems("eval", seed=args.seed)
    if args.problems > len(problems):
        raise ValueError(f"--problems {args.problems}: champ's held-out split has {len(problems)} problems; "
                         f"give 1 to {len(problems)}")
    return problems[: args.problems]


def _tova_pool_entries(args: argparse.Namespace, entries: list) -> list:
    """`--tova-pool N[,N]`: each trained KVpop-mlp directory (`entries`, saved for the static rule) also as
    KVpop-cascade with N TOVA slots (`NAME+poolN`); `--tova-pool-layer N[,N]`: as the layer-wide cascade at TOVA's
    split (`NAME+lpoolN`), for each `--pool-decay` (`NAME+lpoolN+h2o`, `NAME+lpoolN+dD`)."""
    from kvpop.eval.evaluate import with_tova_pool
    from kvpop.retrofit import read_config

    decays = _pool_decays(args.pool_decay)
    if args.pool_decay is not None and args.tova_pool_layer is None:
        raise ValueError("--pool-decay ranks the pools of --tova-pool-layer rows: give --tova-pool-layer N[,N]")
    out = []
    for flag, value, layer in (("--tova-pool", args.tova_pool, False),
                               ("--tova-pool-layer", args.tova_pool_layer, True)):
        if value is None:
            continue
        try:
            pools = [int(n) for n in value.split(",") if n.strip()]
        except ValueError:
            raise ValueError(f"{flag}={value!r} must be comma-separated integers") from None
        static = [(e, read_config(e.trained)) for e in entries]
        static = [(e, saved) for e, saved in static if saved.static_mlp]
        if not static:
            raise ValueError(f"{flag} needs a --trained KVpop-mlp directory (the static rule) to run as KVpop-cascade")
        for e, saved in static:
            for n in pools:
                _check_pool(flag, n, saved, layer, f"--trained {e.trained}")
                out += [with_tova_pool(e, n, layer=layer, decay=d) for d in (decays if layer else [None])]
    return out


def _decision_chunk_entries(args: argparse.Namespace, entries: list) -> list:
    """`--decision-chunk C[,C]`: every row of TOVA's or H2O's paper rule or of a layer-wide KVpop-cascade (TOVA's
    latest attention) also deciding once every C steps (`NAME+chunkC`)."""
    from kvpop.eval.evaluate import with_decision_chunk

    if args.decision_chunk is None:
        return []
    try:
        chunks = [int(c) for c in args.decision_chunk.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--decision-chunk={args.decision_chunk!r} must be comma-separated integers >= 2") from None
    if not chunks or any(c < 2 for c in chunks):
        raise ValueError(f"--decision-chunk={args.decision_chunk!r} must be comma-separated integers >= 2 (1 is the "
                         "per-token rule every row already runs)")
    base = [e for e in entries if e.cfg.chunkable and e.cfg.decision_chunk == 1]
    if not base:
        raise ValueError("--decision-chunk needs a row it applies to: --policies tova or h2o (the papers' rules) or "
                         "a --trained KVpop-mlp directory run as the layer-wide cascade")
    return [with_decision_chunk(e, c) for e in base for c in chunks]


def _pool_decays(value: str | None) -> list[float | None]:
    """`--pool-decay D[,D]` -> decays, None for 'none' (TOVA's latest attention)."""
    if value is None:
        return [None]
    out = []
    for d in (x.strip() for x in value.split(",") if x.strip()):
        try:
            out.append(None if d == "none" else float(d))
        except ValueError:
            raise ValueError(f"--pool-decay={value!r} must be comma-separated decays in (0, 1] or 'none'") from None
        _check_decay("--pool-decay", out[-1])
    return out


def _layer_budget_entries(args: argparse.Namespace, entries: list) -> list:
    """`--layer-budgets FILE`: the same rows at per-layer budgets of equal memory (`<name>+layers`)."""
    from kvpop.eval.budgets import read
    from kvpop.eval.evaluate import training_free, with_layer_budgets
    from kvpop.retrofit import read_config

    policies = [p.strip() for p in args.policies.split(",") if p.strip() not in ("", "none", "streaming_llm")]
    out = []
    for path in args.layer_budgets:
        budget, per_layer = read(path)
        out += [training_free(p, budget, sink=args.sink, layer_budgets=per_layer) for p in policies]
        # a trained static scorer ranks the same way at any top-k: the same weights, per-layer slots
        for e in entries:
            saved = read_config(e.trained)
            if e.budget == budget and saved.layer_topk is None and saved.policy == "kvpop" and not saved.tova_pool:
                out.append(with_layer_budgets(e, per_layer))
    return out


def _layer_budgets(path: str, budget: int) -> list[int]:
    from kvpop.eval.budgets import read

    file_budget, per_layer = read(path)
    if file_budget != budget:
        raise ValueError(f"--layer-budgets {path} allocates budget {file_budget}, but the run's budget is {budget}")
    return per_layer


@command("budgets", "allocate per-layer budgets at the same total memory from each layer's measured sensitivity", [
    MODEL,
    arg("--data", default="champ", help="text to measure on (default champ, its training split)"),
    arg("--text-field", default=None, help="record field holding the text (jsonl/parquet/datasets; default: the "
                                           "source's own text field)"),
    arg("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)"),
    arg("--sequences", type=int, default=2, help="sequences to measure on (default 2)"),
    arg("--budget", type=int, default=None, help="the uniform per-layer budget B; the layers' budgets sum to L x B"),
    arg("--trained", default=None, metavar="DIR",
        help="measure where this trained kvpop directory's own scorer loses attention mass (its budget and split), "
             "instead of the oracle's rule at --budget"),
    arg("--sink", type=int, default=4, help="sink tokens always kept (default 4)"),
    arg("--window", type=int, default=None, help="protected window (default a quarter of the budget)"),
    arg("--out", required=True, help="JSON file to write (for --layer-budgets of train and eval); an existing file "
                                     "needs --force"),
    arg("--force", action="store_true", help="replace an existing --out"),
    DEVICE,
    arg("--seed", type=int, default=0, help="random seed (default 0)"),
])
def budgets(args: argparse.Namespace) -> int:
    import kvpop
    from kvpop.eval import budgets as alloc
    from kvpop.files import refuse_existing
    from kvpop.models import load_model
    from kvpop.train.data import load_texts, pack_sequences

    refuse_existing(args.out, "--out", args.force)
    if (args.budget is None) == (args.trained is None):
        raise ValueError("give --budget (the oracle's rule at that budget) or --trained DIR (its own scorer), not both")
    base, tokenizer = load_model(args.model, device=_device(args.device))
    if getattr(base, "kvpop", None) is not None:
        raise ValueError(f"--model must be a base model, not a kvpop directory ({args.model}); use --trained DIR")
    if args.trained:
        # where the scorer's own ranking loses mass: the static rule it was trained for
        model = kvpop.load(args.trained, device=_device(args.device), rule="static")
        cfg, measured = model.kvpop.config, model
    else:
        cfg = kvpop.KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window)
        measured = base
    if cfg.budget >= args.seq_len:
        raise ValueError(f"budget {cfg.budget} is not below --seq-len {args.seq_len}: nothing is evicted")
    limits.check_evaluation(base, args.seq_len)
    texts = load_texts(args.data, split="train", text_field=args.text_field, tokenizer=tokenizer, seed=args.seed)
    tokens = pack_sequences(texts[:2000], tokenizer, args.seq_len)[: args.sequences]
    candidates, curves, n = alloc.measure(measured, (row[None] for row in tokens), None if args.trained else cfg)
    per_layer = alloc.layer_budgets(cfg, candidates, curves)
    path = alloc.write(args.out, cfg, per_layer, candidates, curves, command=args.command_line, queries=n,
                       seq_len=args.seq_len, sequences=len(tokens))
    print(f"{'layer':>5} {'budget':>7}  lost attention mass at k = {', '.join(map(str, candidates))}")
    for layer, (b, row) in enumerate(zip(per_layer, curves.tolist())):
        print(f"{layer:>5} {b:>7}  " + " ".join(f"{x:.4f}" for x in row))
    low = cfg.sink + cfg.window
    print(f"mean lost mass: uniform {alloc.mean_lost(curves, candidates, [cfg.topk] * len(per_layer)):.4f}, "
          f"per-layer {alloc.mean_lost(curves, candidates, [b - low for b in per_layer]):.4f}")
    print(f"kvpop budgets: wrote {path} (sum {sum(per_layer)} = {len(per_layer)} layers x {cfg.budget})",
          file=sys.stderr)
    return 0


def _eval_suite(args: argparse.Namespace, base, tokenizer, entries: list, device: str) -> int:
    """`eval --suite`: the long-context tasks over the same entries, plus the dense model."""
    import json
    from pathlib import Path

    from kvpop.eval import suite, suite_report
    from kvpop.eval.tasks import parse_tasks

    cfg = suite.SuiteConfig(tasks=tuple(parse_tasks(args.suite)),
                            lengths=tuple(suite.parse_lengths(args.lengths)),
                            depths=tuple(suite.parse_depths(args.depths)),
                            samples=2 if args.samples is None else args.samples, seed=args.seed,
                            filler=args.filler, batch_size=args.suite_batch, prefill_chunk=args.prefill_chunk)
    if any(e.cfg.policy == "oracle" for e in entries):
        # it ranks by future attention: it has no decode path to test
        print("kvpop eval --suite: skipping the oracle (teacher-forced only, it cannot decode)", file=sys.stderr)
        entries = [e for e in entries if e.cfg.policy != "oracle"]
    samples = suite.build_samples(cfg, tokenizer, getattr(base.config, "max_position_embeddings", None))
    limits.check_decoding(base, [e.cfg for e in entries], cfg.batch_size, max(cfg.lengths), cfg.prefill_chunk,
                          f"--lengths {args.lengths} with --suite-batch {cfg.batch_size}",
                          "lower --lengths, --suite-batch or --prefill-chunk")
    records = suite.run_suite(base, tokenizer, entries, samples, batch_size=cfg.batch_size,
                              prefill_chunk=cfg.prefill_chunk, seed=args.seed, device=device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = suite_report.format_table(records)
    (out / "suite_table.txt").write_text(table + "\n")
    (out / "suite.json").write_text(json.dumps(
        {"command": args.command_line, "config": vars(cfg), "cells": suite_report.cells(records), "records": records},
        indent=2, default=str))
    for path in suite_report.write_heatmaps(records, out):
        print(f"kvpop eval --suite: wrote {path}", file=sys.stderr)
    print(table)
    print(json.dumps(suite_report.headline(records)))
    return 0


def _fidelity(args: argparse.Namespace, base, tokenizer, entries, device: str) -> int:
    """`kvpop eval --generate N`: long-generation fidelity (`kvpop.eval.fidelity`)."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from kvpop.eval.fidelity import format_fidelity_table, plot_nll_by_position, run_fidelity

    if args.data != "champ":
        raise ValueError("--generate answers held-out champ problems: use --data champ")
    if args.samples is None:
        args.samples = 0
    if args.gen_batch is None:
        args.gen_batch = 8 if str(device).startswith("cuda") else 1
    if args.generate < 1 or args.samples < 0 or args.problems < 1 or args.gen_batch < 1:
        raise ValueError(f"--generate {args.generate}, --problems {args.problems} and --gen-batch {args.gen_batch} "
                         f"must be >= 1, --samples {args.samples} >= 0")
    entries = [e for e in entries if e.cfg.policy != "oracle"]
    if not entries:
        raise ValueError("--generate needs a policy that can decode (the oracle cannot)")
    problems = _held_out_problems(args)
    # the dense model scores each text whole: its logits over the generated tokens
    limits.check_decoding(base, [e.cfg for e in entries], args.gen_batch, args.generate, args.generate,
                          f"--generate {args.generate} with --gen-batch {args.gen_batch}", "lower --generate or --gen-batch")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # finished generations are kept there and reused by a rerun with the same settings
    rows, gens = run_fidelity(base, tokenizer, entries, problems, args.generate, samples=args.samples,
                              seed=args.seed, ignore_eos=args.ignore_eos, batch=args.gen_batch,
                              store=out / "generations.jsonl",
                              tag=args.model, log=lambda msg: print(f"[kvpop eval] {msg}", file=sys.stderr, flush=True))
    table = format_fidelity_table(rows)
    (out / "fidelity.txt").write_text(table + "\n")
    plot_nll_by_position(gens, [e.budget for e in entries], out / "fidelity.png",
                         title=f"{args.model}: dense NLL of each policy's own text ({args.generate} new tokens)")
    (out / "fidelity.json").write_text(json.dumps(
        {"rows": [r.as_dict() for r in rows], "generations": [asdict(g) for g in gens], "command": args.command_line,
         "args": {k: v for k, v in vars(args).items() if k != "run"}}, indent=1, default=str))
    print(table)
    print(json.dumps({"rows": [{k: v for k, v in r.as_dict().items() if k in ("policy", "budget", "mode", "nll",
                                                                           "agreement", "repetition", "pass_at_1")}
                               for r in rows]}))
    return 0


@command("viz", "plot which tokens each layer's KV heads still hold (the paper's Fig. 6) for a model, text, policy", [
    MODEL,
    arg("--text", default=None, help="the text (default: the first held-out champ solution)"),
    arg("--file", default=None, help="read the text from this file"),
    arg("--policy", default="kvpop", choices=["kvpop", "streaming_llm", "tova", "h2o", "dms"],
        help="policy for a model that is not already retrofitted (default kvpop; kvpop and dms are untrained "
             "unless --model is a trained directory)"),
    *RULE,
    arg("--last", type=int, default=112, help="evictable tokens to show (default 112)"),
    arg("--max-tokens", type=int, default=2048, help="truncate the text to this many tokens (default 2048)"),
    arg("--out", default="eviction_pattern.png", help="PNG path (default eviction_pattern.png); an existing file "
                                                      "needs --force"),
    arg("--force", action="store_true", help="replace an existing --out"),
    SCORERS,
    BASE,
    DEVICE,
    NO_PROGRESS,
])
def viz(args: argparse.Namespace) -> int:
    import kvpop
    from kvpop.eval import plots
    from kvpop.files import refuse_existing
    from kvpop.models import is_kvpop_dir, load_model
    from kvpop.train.data import load_texts

    refuse_existing(args.out, "--out", args.force)
    _shipped_scorers(args, policy=args.policy)
    cfg = None if is_kvpop_dir(args.model) else _rule(args, policy=args.policy)
    model, tokenizer = load_model(args.model, device=_device(args.device), base=args.base)
    if cfg is None:
        _ignored_rule_flags(args)
    else:
        model = kvpop.retrofit(model, cfg)
        _untrained(args, cfg)
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
    arg("--model", default="smollm2-135m", metavar="PATH_OR_PRESET",
        help=f"the model of the whole job (default smollm2-135m; gemma3-270m, a hybrid, wants a GPU): {model_help()}"),
    arg("--quick", action="store_true", help="a shorter run (about 11 minutes on a 2-core CPU)"),
    arg("--out", default="runs/demo", help="output directory (default runs/demo)"),
    arg("--device", default=None, help="cpu, cuda, ... (default: cuda if available, else cpu)"),
    arg("--seed", type=int, default=0, help="random seed (default 0)"),
])
def demo(args: argparse.Namespace) -> int:
    from kvpop.eval.demo import run_demo

    run_demo(args.out, quick=args.quick, device=args.device, seed=args.seed, model_name=args.model,
             command=args.command_line)
    return 0


def _bench_args():
    from kvpop.eval.args import BENCH_ARGS

    return BENCH_ARGS


@command("bench", "decode latency per token and peak memory against context length: dense cache vs KVpopCache",
         _bench_args())
def bench(args: argparse.Namespace) -> int:
    from kvpop.eval.bench import run_bench

    return run_bench(args, command=args.command_line)


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag with a default states it: a help that does not name its default gets `(default: X)` appended."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        value = action.default
        if (action.option_strings and "default" not in text and value not in (None, False, [], argparse.SUPPRESS)
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            text += " (default: %(default)s)"
        return text


def build_parser(defaults: bool = True) -> argparse.ArgumentParser:
    """The `kvpop` parser; with `defaults=False` a parsed namespace holds only the flags given."""
    parser = argparse.ArgumentParser(
        prog="kvpop",
        description="KVpop: a fixed-size KV cache with a learned eviction policy for Hugging Face causal LMs.",
        argument_default=None if defaults else argparse.SUPPRESS, formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=_HelpFormatter,
                           argument_default=None if defaults else argparse.SUPPRESS)
        for flags, kwargs in cmd.args:
            p.add_argument(*flags, **(kwargs if defaults else {**kwargs, "default": argparse.SUPPRESS}))
        # also after the command; SUPPRESS keeps `kvpop --debug COMMAND` from being reset by the subcommand
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
        p.set_defaults(run=cmd.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpop")
    except PackageNotFoundError:
        return "unknown"


def _expected(err: BaseException) -> bool:
    """A failure the user can act on (bad input, a missing or damaged file), as opposed to a bug."""
    import pickle

    if isinstance(err, (ValueError, OSError, NotImplementedError, RuntimeError, EOFError, pickle.UnpicklingError)):
        return True
    # safetensors' error type derives from Exception alone
    return type(err).__name__ == "SafetensorError"


def _progress_bars(on: bool) -> None:
    """Turn transformers' and the hub's own bars ("Loading weights", "Writing model shards") on or off."""
    import transformers
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if on:
        transformers.utils.logging.enable_progress_bar()
        enable_progress_bars()
    else:
        transformers.utils.logging.disable_progress_bar()
        disable_progress_bars()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    # the exact command, saved beside every result
    args.command_line = " ".join(["kvpop", *argv])
    if args.command is None:
        parser.print_help()
        return 2
    # the flags written on the command line, told apart from defaults (a given flag that cannot apply is named)
    args.given = set(vars(build_parser(defaults=False).parse_args(argv))) - {"command", "run", "debug"}
    quiet = getattr(args, "no_progress", False)
    if quiet:
        _progress_bars(False)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"kvpop {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug or not _expected(err):
            raise
        message = str(err).strip() or type(err).__name__
        print(f"kvpop {args.command}: error: {message}", file=sys.stderr)
        print(f"kvpop {args.command}: (run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if quiet:
            # the switch is global: a caller running more than one command (tests, scripts) gets it back
            _progress_bars(True)


if __name__ == "__main__":
    sys.exit(main())
