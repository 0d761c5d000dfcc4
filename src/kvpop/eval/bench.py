"""Decode latency per token and memory against context length: Hugging Face's dense cache vs `KVpopCache`.

    kvpop bench --model tiny-random-qwen3 --contexts 256,512,1024 --budget 128
    python -m kvpop.eval.bench --model qwen3-8b-shape --device cuda --contexts 4096,16384,65536,131072 --budget 2048

For each context length a seeded random prompt is prefilled (in chunks, so long contexts fit), then
`--new-tokens` greedy decode steps are timed one by one (after `--warmup` untimed steps); the median
is reported. The dense rows run the same weights without KVpop (a `DynamicCache` and the model's
own attention); the KVpop rows run the retrofitted model with a `KVpopCache`.

`--compile` adds a compiled row beside each eager one ("compiled": true): the step runs through
`kvpop.decode.Decoder` - `torch.compile(fullgraph=True)` with inductor (on CUDA with kvpop's
options, `kvpop.decode.COMPILE_OPTIONS`), or with `--compile-backend cudagraph` the eager step captured
once as a CUDA graph, with KVpop's per-layer step compiled inside it ("fused") - and the dense baseline
on Hugging Face's `StaticCache` under the same compile (the fair comparison), with at least 3 warm-up
steps; the first one captures or compiles ("compile_s": from inductor's on-disk cache when an earlier
process compiled the same graph, cold otherwise). A compiled run that fails records its exception in "error".

Cache kinds: "dense", "kvpop" (the static rule, or the model's own retrofit), any other policy name at the
same budget, and "cascade": the recommended policy, the layer-wide KVpop-cascade at TOVA's split of the same
budget (`KVpopConfig.recommended`; `--tova-pool-layer` sets its pool, default 3/4 of `budget - 1`).

`--fill random` skips running the model over the context: each cache is filled directly with random
keys/values as if `context` tokens had been seen (a `KVpopCache` with every slot occupied, positions
as its slot layout places them and random priorities; dense caches up to `context`). Decode latency
does not depend on the values, and prefilling 128k tokens of an 8B model costs minutes. "prefill_s"
then times the fill. The JSON records which in "fill".

Memory: on CUDA, the peak allocated during decoding (weights + cache + transients; the peak counter
is reset after the prefill, whose activations are not part of generation); on the CPU, the bytes
of the cache tensors. Every row names which in "memory_kind", and "cache_mb" is always the cache.

Output: a header with the shapes, a human table, then one JSON line
`{"rows": [...], "device": ..., "model": ..., "command": ...}`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Iterator, Sequence

import torch

from kvpop.cache import KVpopCache, cache_kwargs
from kvpop.config import RECOMMENDED_POOL_DECAY, KVpopConfig
from kvpop.eval.args import BENCH_ARGS
from kvpop.retrofit import KVpopModules, detach, retrofit

DENSE = "dense"
RECOMMENDED = "cascade"
"""The benchmarks' name for the recommended policy of a trained KVpop-mlp (`KVpopConfig.for_rule`)."""


def recommended_config(config: KVpopConfig, pool: int | None = None) -> KVpopConfig:
    """KVpop-mlp `config` as the recommended policy (`KVpopConfig.recommended`), or, with `pool`, as the same
    layer-wide KVpop-cascade with a pool of `pool` slots instead of `config.recommended_pool(budget)`."""
    if pool is None:
        return config.recommended()
    return config.with_tova_pool(pool, layer=True, decay=RECOMMENDED_POOL_DECAY)


def chunked_name(name: str) -> tuple[str, int | None]:
    """A benchmark's policy or cache name `NAME+chunkC` as (NAME, C), the chunked rule of `tova`, `h2o` or `cascade`;
    any other name as (name, None)."""
    base, sep, chunk = name.partition("+chunk")
    if not sep:
        return name, None
    if not chunk.isdigit() or int(chunk) < 2 or base not in ("tova", "h2o", RECOMMENDED):
        raise ValueError(f"policy {name!r}: the chunked rule is tova+chunkC, h2o+chunkC or {RECOMMENDED}+chunkC "
                         "with C >= 2")
    return base, int(chunk)


def policy_config(name: str, budget: int, pool: int | None = None) -> KVpopConfig:
    """The config a benchmark runs for a policy name at `budget`: `cascade`, the recommended policy (the layer-wide
    KVpop-cascade a trained KVpop-mlp directory runs by default; `pool` its pool, default the recommended one), else
    `KVpopConfig.for_budget(budget, policy=name)`. `NAME+chunkC` (`tova`, `h2o` or `cascade`): that rule deciding once
    every `C` steps (`KVpopConfig.decision_chunk`)."""
    base, chunk = chunked_name(name)
    if chunk is not None:
        return policy_config(base, budget, pool).with_decision_chunk(chunk)
    if name == RECOMMENDED:
        return recommended_config(KVpopConfig.for_budget(budget), pool)
    return KVpopConfig.for_budget(budget, policy=name)


def cache_bytes(cache) -> int:
    """Bytes held by a cache: every tensor its decode step updates (`kvpop.decode.cache_tensors`).

    For a `KVpopCache`: the slot buffers (with the decode step's scratch slot), the counters, and a
    stateful scorer's memory (the mLSTM's `C`, `n`, `m`, which `--match-mlp-memory` pays for in
    top-k slots). For a dense cache: its keys and values.
    """
    from kvpop.decode import cache_tensors

    return sum(t.numel() * t.element_size() for t in cache_tensors(cache))


def _is_retrofitted(model) -> bool:
    return isinstance(getattr(model, "kvpop", None), KVpopModules)


@contextlib.contextmanager
def _prepared(model, kind: str, config: KVpopConfig | None, seed: int,
              pool: int | None = None) -> Iterator[KVpopConfig | None]:
    """The model as cache `kind` needs it, in place: plain for "dense", retrofitted otherwise; restored after.

    No copy of the weights is made, so CUDA peak memory counts one model. "kvpop" uses the model's
    own retrofit if it has one, else `config`; "cascade" runs that config as the recommended policy (`pool` its pool,
    `recommended_config`); any other kind is a policy name run with `config`'s budget.
    """
    stashed = None
    if _is_retrofitted(model):
        if kind == "kvpop":
            yield model.kvpop.config
            return
        stashed = model.kvpop
        config = config or stashed.config
        detach(model)
    try:
        if kind == DENSE:
            yield None
        else:
            if config is None:
                raise ValueError(f"cache kind {kind!r} needs a KVpopConfig for a model that is not retrofitted")
            base, chunk = chunked_name(kind)
            if base == RECOMMENDED:
                cfg = recommended_config(config, pool)
            elif chunk is not None:
                # TOVA's or H2O's chunked rule needs the paper's split of the budget (no sinks), as `policy_config`
                cfg = KVpopConfig.for_budget(config.budget, policy=base)
            else:
                cfg = config if kind == "kvpop" else dataclasses.replace(config, policy=kind)
            if chunk is not None:
                cfg = cfg.with_decision_chunk(chunk)
            # the scorers' random init draws from a private generator state: runs repeat exactly
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                retrofit(model, cfg)
            try:
                yield cfg
            finally:
                detach(model)
    finally:
        if stashed is not None:
            with torch.random.fork_rng(devices=[]):
                retrofit(model, stashed.config)
            model.kvpop.load_state_dict(stashed.state_dict(), assign=True)


def sync(device: torch.device) -> None:
    """Wait for the device, so that a wall clock read after it times the work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_cache(model, kind: str, static_length: int | None = None):
    """A fresh cache of `kind`; the dense one is a `StaticCache` of `static_length` when given (compiled rows)."""
    if kind != DENSE:
        return KVpopCache(model)
    if static_length is not None:
        from kvpop.decode import static_cache

        return static_cache(model, static_length)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def _run_one(model, kind: str, ids: torch.Tensor, new_tokens: int, warmup: int, chunk: int, compiled: bool = False,
             fill: str = "prefill", seed: int = 0, backend: str | None = None) -> dict:
    """Fill the cache with `ids` [B, S] (prefilled, or random), then time `new_tokens` decode steps.

    Memory as the module docstring says. `compiled`: the step runs through `kvpop.decode.Decoder`
    (a `StaticCache` for "dense"); its first warm-up step compiles, and is reported as "compile_s".
    """
    from kvpop.decode import Decoder, fill_random

    device = ids.device
    B, S = ids.shape
    if compiled:
        # CUDA graph trees need a few calls (warm-up, record) before replays
        warmup = max(warmup, 3)
        cache = _new_cache(model, kind, static_length=S + warmup + new_tokens + 1)
        decoder = Decoder(model, cache, compile=True, backend=backend)
    else:
        cache, decoder = _new_cache(model, kind), None
    kw = cache_kwargs(model, cache)
    sync(device)
    start = time.perf_counter()
    if fill == "random":
        fill_random(model, cache, B, S, seed=seed)
        # any token will do: the values in the cache are random too
        nxt = ids[:, -1:]
    elif decoder is not None:
        nxt = decoder.prefill(ids, chunk).argmax(-1, keepdim=True)
    else:
        for i in range(0, S, chunk):
            logits = model(ids[:, i : i + chunk], **kw, use_cache=True, logits_to_keep=1).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    prefill_s = time.perf_counter() - start
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    with contextlib.ExitStack() as stack:
        if decoder is None:
            def step(tok):
                return model(tok, **kw, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        else:
            stack.enter_context(decoder.decoding())
            position = torch.full((B, 1), S, dtype=torch.long, device=device)

            def step(tok):
                out = decoder.step(tok, position).argmax(-1, keepdim=True)
                position.add_(1)
                return out
        compile_s = None
        for i in range(warmup):
            t0 = time.perf_counter()
            nxt = step(nxt)
            if i == 0 and compiled:
                sync(device)
                compile_s = time.perf_counter() - t0
        times_ms = []
        if device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(new_tokens)]
            for begin, end in events:
                begin.record()
                nxt = step(nxt)
                end.record()
            torch.cuda.synchronize(device)
            times_ms = [begin.elapsed_time(end) for begin, end in events]
            peak_mb, memory_kind = torch.cuda.max_memory_allocated(device) / 2**20, "cuda peak (decode)"
        else:
            for _ in range(new_tokens):
                t0 = time.perf_counter()
                nxt = step(nxt)
                times_ms.append((time.perf_counter() - t0) * 1e3)
            peak_mb, memory_kind = None, "cache tensors"
    cache_mb = cache_bytes(cache) / 2**20
    ms = statistics.median(times_ms)
    return {
        "ms_per_token": ms,
        "ms_min": min(times_ms),
        "tokens_per_s": B * 1e3 / ms,
        "prefill_s": prefill_s,
        "compile_s": compile_s,
        "warmup": warmup,
        # compiled rows: whether norms, MLPs (and KVpop's layer step) ran compiled inside the graph
        "fused": bool(decoder is not None and decoder.fuse and (not isinstance(cache, KVpopCache)
                                                                 or any(layer.fused for layer in cache.layers))),
        "peak_mb": cache_mb if peak_mb is None else peak_mb,
        "cache_mb": cache_mb,
        "memory_kind": memory_kind,
        "seen": int(cache.get_seq_length()),
    }


def bench_decode(
    model,
    contexts: Sequence[int],
    cache_kinds: Sequence[str] = (DENSE, "kvpop"),
    new_tokens: int = 16,
    batch: int = 1,
    warmup: int = 2,
    device: str | torch.device | None = None,
    config: KVpopConfig | None = None,
    prefill_chunk: int = 2048,
    seed: int = 0,
    compile: bool = False,
    fill: str = "prefill",
    compile_backend: str | None = None,
    cascade_pool: int | None = None,
) -> list[dict]:
    """Per-token decode latency and memory for each cache kind at each context length.

    Args:
        model: a Hugging Face causal LM, plain or retrofitted (it is used in place and left as given).
        contexts: prompt lengths to prefill before decoding.
        cache_kinds: "dense" (`DynamicCache`, no KVpop), "kvpop" (the model's retrofit, or `config`),
            or another policy name, run with `config`'s budget.
        new_tokens: timed decode steps per run (the median is reported).
        batch: rows per step, all of the same length.
        warmup: untimed decode steps before the timed ones.
        device: where to run (default: the model's device).
        config: the `KVpopConfig` for a model that is not retrofitted.
        prefill_chunk: tokens per prefill forward.
        seed: seeds the prompts (one per context length, the same for every cache kind).
        compile: also time each kind through `kvpop.decode.Decoder` (torch.compile, CUDA graphs on
            CUDA): "dense" then runs on a `StaticCache`. A failure of a compiled run is recorded in
            its row's "error" and the others go on.
        fill: "prefill" runs the model over the context; "random" fills the caches with random
            keys/values as if the context had been seen (`kvpop.decode.fill_random`): decode latency
            does not depend on the values, and long prefills cost minutes.
        compile_backend: how compiled rows run the step (`kvpop.decode.Decoder`): a `torch.compile`
            backend ("inductor", the default, with `kvpop.decode.COMPILE_OPTIONS` on CUDA) or "cudagraph"
            (the eager step captured as a CUDA graph).
        cascade_pool: the pool of cache kind "cascade" (default the recommended policy's, 3/4 of `budget - 1`).
    Returns:
        One dict per (context, cache kind, compiled): "cache", "compiled", "fill", "context", "batch",
        "new_tokens", "ms_per_token", "ms_min", "tokens_per_s", "prefill_s", "compile_s" (compiled rows),
        "peak_mb", "cache_mb", "memory_kind", "budget" (None for dense), "vs_dense" (latency ratio to the
        dense row of the same "compiled"), "no_eviction" (the budget is not below the context: nothing
        was evicted, a warning went to stderr) and "error" (None, "out of memory", or the exception).
    """
    if fill not in ("prefill", "random"):
        raise ValueError(f"fill={fill!r} must be 'prefill' or 'random'")
    for name, value, lo in (("new_tokens", new_tokens, 1), ("batch", batch, 1), ("warmup", warmup, 0),
                            ("prefill_chunk", prefill_chunk, 1)):
        if value < lo:
            raise ValueError(f"{name}={value} must be >= {lo}")
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts={list(contexts)} must be non-empty positive lengths")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(contexts) + warmup + new_tokens > limit:
        raise ValueError(f"context {max(contexts)} + {warmup + new_tokens} decode steps exceeds the model's "
                         f"max_position_embeddings={limit}")
    budget = None if config is None else config.budget
    if budget is None and _is_retrofitted(model):
        budget = model.kvpop.config.budget
    covered = [n for n in contexts if budget is not None and budget >= n]
    if covered and any(kind != DENSE for kind in cache_kinds):
        print(f"kvpop bench: warning: budget {budget} is not below context {', '.join(map(str, covered))}: nothing "
              "is evicted there, so those rows measure a dense cache of the budget's size, not KVpop "
              "(marked no_eviction)", file=sys.stderr)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device)
    model.eval()
    vocab = model.config.vocab_size
    rows = []
    for kind in cache_kinds:
        if compile:
            # compiled code of another cache kind would only add guards; within a kind it is reused:
            # KVpopCache's step has the same shapes at every context, so only its first row compiles
            torch._dynamo.reset()
        with _prepared(model, kind, config, seed, cascade_pool) as cfg:
            for context in contexts:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + context)
                ids = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
                for compiled in (False, True) if compile else (False,):
                    rows.append(_row(model, kind, cfg, ids, new_tokens, warmup, prefill_chunk, compiled, fill, seed,
                                     compile_backend))
                    # a long run killed at a time limit still leaves the rows done so far
                    print(f"# row {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        if compile:
            torch._dynamo.reset()
    order = {kind: i for i, kind in enumerate(cache_kinds)}
    rows.sort(key=lambda r: (r["context"], order[r["cache"]], r["compiled"]))
    for r in rows:
        # a budget that holds the whole context evicts nothing: the row measures a dense cache of `budget` slots
        r["no_eviction"] = r["budget"] is not None and r["budget"] >= r["context"]
    dense = {(r["context"], r["compiled"]): r["ms_per_token"] for r in rows if r["cache"] == DENSE}
    for r in rows:
        base = dense.get((r["context"], r["compiled"]))
        r["vs_dense"] = r["ms_per_token"] / base if base and r["ms_per_token"] is not None else None
    return rows


def _row(model, kind, cfg, ids, new_tokens, warmup, chunk, compiled, fill, seed, backend) -> dict:
    """One timed run as a row; a failure becomes the row's "error" rather than ending the benchmark."""
    B, context = ids.shape
    row = {"cache": kind, "compiled": compiled, "fill": fill, "context": context, "batch": B,
           "new_tokens": new_tokens, "budget": None if cfg is None else cfg.budget, "error": None}
    failed = dict(ms_per_token=None, tokens_per_s=None, peak_mb=None, cache_mb=None)
    try:
        row.update(_run_one(model, kind, ids, new_tokens, warmup, chunk, compiled, fill, seed, backend))
    except torch.OutOfMemoryError:
        row.update(failed, error="out of memory")
    except Exception as e:
        if not compiled:
            raise
        # the compiled path depends on torch/transformers internals: report it and keep the eager rows
        traceback.print_exc(file=sys.stderr)
        row.update(failed, error=f"{type(e).__name__}: {e}"[:500])
    gc.collect()
    if ids.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
"""Memory bandwidth in bytes/s by card (the SXM parts' HBM), matched in the device name: the floor's denominator."""


def weight_bytes(model) -> int:
    """The weights a decode step reads: every parameter once, but the input embedding only where the output layer
    shares it (an untied embedding table is read one row per token)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight.data_ptr() != embedding.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return total


def add_floor(rows: Sequence[dict], weights: int, device_name: str) -> float | None:
    """Each row's bandwidth floor, in place: "floor_ms" (the weights' and the cache's bytes over the card's bandwidth,
    `PEAK_BANDWIDTH`) and "x_floor" (its latency over that). Returns the bandwidth, None for an unknown card."""
    bandwidth = next((bw for card, bw in PEAK_BANDWIDTH.items() if card in device_name), None)
    for r in rows:
        floor = None if bandwidth is None or r.get("cache_mb") is None else \
            (weights + r["cache_mb"] * 2**20) / bandwidth * 1e3
        r["floor_ms"] = floor
        r["x_floor"] = None if floor is None or r.get("ms_per_token") is None else r["ms_per_token"] / floor
    return bandwidth


def format_table(rows: Sequence[dict]) -> str:
    """The rows as an aligned text table for people."""
    head = ("cache", "context", "budget", "mode", "ms/token", "vs dense", "x floor", "tokens/s", "prefill s",
            "compile s", "cache MB", "peak MB")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    def mb(v):
        return "-" if v is None else format(v, ".1f" if v >= 10 else ".3f")

    def mode(r):
        return "compiled" if r.get("compiled") else "eager"

    lines = [head]
    for r in rows:
        if r.get("error"):
            lines.append((r["cache"], str(r["context"]), fmt(r["budget"], "d"), mode(r), r["error"].splitlines()[0][:60],
                          "", "", "", "", "", "", ""))
            continue
        budget = fmt(r["budget"], "d") + ("*" if r.get("no_eviction") else "")
        lines.append((r["cache"], str(r["context"]), budget, mode(r), fmt(r["ms_per_token"], ".2f"),
                      fmt(r["vs_dense"], ".2f"), fmt(r.get("x_floor"), ".2f"), fmt(r["tokens_per_s"], ".1f"),
                      fmt(r["prefill_s"], ".2f"), fmt(r.get("compile_s"), ".1f"), mb(r["cache_mb"]),
                      mb(r["peak_mb"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    if any(r.get("no_eviction") for r in rows):
        out.append("* budget not below the context: nothing was evicted (a dense cache of that size)")
    return "\n".join(out)




def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `kvpop bench`'s flags to `parser`."""
    for flags, kwargs in BENCH_ARGS:
        parser.add_argument(*flags, **kwargs)
    return parser


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated integers") from None


def _rule_config(args: argparse.Namespace) -> KVpopConfig:
    return KVpopConfig.for_budget(args.budget, sink=args.sink, window=args.window, topk=args.topk)


def load_bench_model(name: str, device: str, dtype: str | None = None, num_layers: int | None = None,
                     seed: int = 0):
    """A model to benchmark: a `*-shape` preset (random weights, bfloat16 unless `dtype`) or any model
    `load_model` takes. The benchmark scripts under bench/ load theirs here too."""
    from kvpop.shapes import SHAPE_PRESETS, build_shape_model

    if name in SHAPE_PRESETS:
        return build_shape_model(name, device, dtype=getattr(torch, dtype or "bfloat16"), num_layers=num_layers,
                                 seed=seed)[0]
    if num_layers is not None:
        raise ValueError(f"--num-layers applies to the *-shape presets only, not {name!r}")
    from kvpop.models import load_model

    return load_model(name, dtype=dtype, device=device)[0]


def _load(args: argparse.Namespace, device: str):
    return load_bench_model(args.model, device, args.dtype, args.num_layers, args.seed)


def _layers_note(config) -> str:
    """For the header of a hybrid model: the budget holds in its full-attention layers, the others keep their window."""
    from kvpop.layer_kinds import describe_layers, layer_windows

    try:
        hybrid = any(layer_windows(config))
    except ValueError:
        # a model kvpop refuses (its dense rows may still run): nothing to add
        return ""
    return f" in the full-attention layers ({describe_layers(config)})" if hybrid else ""


def run_bench(args: argparse.Namespace, command: str | None = None) -> int:
    """`kvpop bench`: print the header and table, then the JSON line; write --json-out and --plot.

    `command` is recorded with the result (default: `kvpop` and this process's arguments).
    """
    import transformers

    from kvpop.decode import compile_options
    from kvpop.files import refuse_existing
    from kvpop.models import is_kvpop_dir

    for flag, path in (("--json-out", args.json_out), ("--plot", args.plot)):
        refuse_existing(path, flag, getattr(args, "force", False))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    contexts = _ints(args.contexts, "--contexts")
    kinds = [k.strip() for k in args.caches.split(",") if k.strip()]
    model = _load(args, device)
    config = None if is_kvpop_dir(args.model) else _rule_config(args)
    c = model.config
    kv_heads = c.num_key_value_heads or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_params = sum(p.numel() for p in model.parameters())
    rule = config or model.kvpop.config
    dtype = next(model.parameters()).dtype
    print(f"# kvpop bench: {args.model} ({n_params / 1e6:.0f}M parameters, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} query / {kv_heads} KV heads of dim {head_dim}, {str(dtype).removeprefix('torch.')}) "
          f"on {device}; batch {args.batch}, {args.new_tokens} timed steps after {args.warmup}; "
          f"cache filled by {args.fill}{'; eager and compiled' if args.compile else ''}; "
          f"KVpop sink={rule.sink} window={rule.window} topk={rule.topk} (budget {rule.budget}){_layers_note(c)}")
    rows = bench_decode(model, contexts, kinds, new_tokens=args.new_tokens, batch=args.batch, warmup=args.warmup,
                        device=device, config=config, prefill_chunk=args.prefill_chunk, seed=args.seed,
                        compile=args.compile, fill=args.fill, compile_backend=args.compile_backend,
                        cascade_pool=args.tova_pool_layer)
    bandwidth = add_floor(rows, weight_bytes(model), _device_name(device))
    print(format_table(rows))
    if args.plot:
        from kvpop.eval.plots import plot_memory_latency

        # one line per (cache, mode)
        lines = [{**r, "cache": r["cache"] + (" (compiled)" if r["compiled"] else "")} for r in rows]
        path = plot_memory_latency(lines, args.plot, title=f"{args.model} on {_device_name(device)}")
        print(f"# plot: {path}")
    result = {
        "rows": rows,
        "device": _device_name(device),
        "model": args.model,
        "command": command or shlex.join(["kvpop", *sys.argv[1:]]),
        "dtype": str(dtype).removeprefix("torch."),
        "params": n_params,
        "kvpop_config": {"sink": rule.sink, "window": rule.window, "topk": rule.topk, "policy": rule.policy},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compile": args.compile,
        "compile_backend": (args.compile_backend or "inductor") if args.compile else None,
        "compile_options": (compile_options(device) if (args.compile_backend or "inductor") == "inductor" else None)
        if args.compile else None,
        "fill": args.fill,
        "bandwidth_bytes_s": bandwidth,
        "weight_bytes": weight_bytes(model),
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


def _device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_bench_args(argparse.ArgumentParser(prog="kvpop bench", description=__doc__.splitlines()[0]))
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run_bench(parser.parse_args(argv), shlex.join(["python", "-m", "kvpop.eval.bench", *argv]))
    except ValueError as err:  # bad input: what was wrong and what is allowed, as `kvpop bench` says it
        print(f"kvpop bench: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
