"""The attention kind of each layer of a Hugging Face model, and the KV each kind holds.

Many models mix full attention with sliding-window attention (Gemma 2 and 3, Cohere's Command R7B,
gpt-oss, Mistral and Qwen2 configurations with a window). KVpop's policies evict in the full-attention
layers only. A sliding-window layer already keeps a bounded cache: query `q` sees key `t` when
`q - t < W` (Hugging Face's semantics), the `W` most recent tokens, the current one included. That is
the retention rule with no sinks, a window of `W` and no long-range slots (`window_config`), so a
retrofitted model runs those layers through the same rule, cache and kernels, with no scorer.

Read from the model's config alone, so that a model can be described (`kv_bytes`) without loading
its weights. Layer kinds kvpop does not run are refused with the reason (`layer_windows`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvpop.config import KVpopConfig

FULL = "full_attention"
SLIDING = "sliding_attention"
KINDS = (FULL, SLIDING)

_OTHER_KINDS = {
    "chunked_attention": "attention within fixed-size chunks, as in Llama 4, which no window or eviction rule expresses",
    "linear_attention": "linear attention, which keeps a recurrent state instead of a KV cache",
}


def layer_windows(config: Any) -> list[int | None]:
    """Per decoder layer: None for full attention, or the layer's sliding window `W`.

    A config's `layer_types` names each layer's kind; without it, a `sliding_window` applies to every
    layer (as Mistral's attention reads it). A window at least as long as the model's positions never
    slides: that layer is full attention.

    Raises:
        ValueError: naming why kvpop cannot run the model's attention (bidirectional attention, a layer
            kind other than full and sliding-window attention, or no full-attention layer at all).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise ValueError("its attention is bidirectional; kvpop's rule and cache are causal")
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    types = list(types) if types is not None else [SLIDING if window is not None else FULL] * n
    others = sorted(set(types) - set(KINDS))
    if others:
        what = ", ".join(f"{t} layers ({_OTHER_KINDS.get(t, 'an attention kvpop does not run')})" for t in others)
        raise ValueError(f"it has {what}; kvpop runs {FULL} and {SLIDING} layers only")
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"it has {SLIDING} layers but sliding_window={window!r} (needs an integer >= 1)")
    limit = getattr(config, "max_position_embeddings", None)
    # a window no position reaches past is full attention: kvpop evicts there, rather than keeping `W` slots
    slides = SLIDING in types and (limit is None or window < limit)
    windows = [window if t == SLIDING and slides else None for t in types]
    if all(w is not None for w in windows):
        raise ValueError(
            f"every layer attends a sliding window of {window} tokens: its cache is already bounded by that window, "
            "and kvpop's policies evict in full-attention layers, of which it has none")
    return windows


def describe_layers(config: Any) -> str:
    """One line for reports: where the layers attend in full and where through a window (`layer_windows`)."""
    windows = layer_windows(config)
    full = [i for i, w in enumerate(windows) if w is None]
    if len(full) == len(windows):
        return f"full attention in all {len(windows)} layers"
    sliding = sorted({w for w in windows if w is not None})
    return (f"full attention in layers {', '.join(map(str, full))}; a sliding window of "
            f"{' / '.join(map(str, sliding))} tokens in the other {len(windows) - len(full)}")


def layer_kinds(config: Any) -> list[str]:
    """Per decoder layer: `FULL` or `SLIDING`, as `layer_windows` decides (and refuses)."""
    return [FULL if w is None else SLIDING for w in layer_windows(config)]


def check_layer_topk(cfg: KVpopConfig, windows: list[int | None]) -> None:
    """Raise unless `cfg.layer_topk` (if given) has one entry per full-attention layer (the layers its policy runs in)."""
    full = windows.count(None)
    if full == len(windows) or cfg.layer_topk is None or len(cfg.layer_topk) == full:
        cfg.check_layers(full)
        return
    raise ValueError(f"KVpopConfig.layer_topk={cfg.layer_topk!r} is invalid: must have one entry per full-attention "
                     f"layer of the model ({full} of its {len(windows)} layers), got {len(cfg.layer_topk)}")


def window_config(window: int) -> KVpopConfig:
    """The rule a sliding-window layer of `window` tokens runs: no sinks, the window, no long-range slots."""
    return KVpopConfig(sink=0, window=window, topk=0, policy="streaming_llm")


class KindKV(NamedTuple):
    """What the layers of one kind hold for one sequence at a given length."""

    layers: int
    tokens: int
    """Entries per KV head, summed over the kind's layers."""
    bytes: int
    """Keys and values of all its KV heads."""


def kv_bytes(config: Any, length: int, cfg: KVpopConfig | None = None,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, KindKV]:
    """The KV cache each layer kind holds after `length` tokens of one sequence, by kind (`FULL`, `SLIDING`).

    Dense (`cfg` None): a full-attention layer holds every token, a sliding one its last `W`. Retrofitted with
    `cfg`: a full-attention layer holds at most its budget (`sink + window + topk`, its own with `layer_topk`).
    Counts the keys and values only (not a decode step's scratch slot, nor a stateful scorer's memory).

    Args:
        config: a Hugging Face model config (its text config is read).
        length: tokens seen, >= 0.
        cfg: a resolved `KVpopConfig` (`resolve_config`), or None for the model's own cache.
        dtype: the cache's dtype.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length={length!r} must be an integer >= 0")
    windows = layer_windows(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = heads * 2 * head_dim * dtype.itemsize
    if cfg is not None:
        check_layer_topk(cfg, windows)
    held: dict[str, list[int]] = {FULL: [], SLIDING: []}
    for w in windows:
        if w is not None:
            held[SLIDING].append(min(length, w))
        else:
            # the j-th full-attention layer runs `cfg.for_layer(j)` (its own top-k with per-layer budgets)
            budget = None if cfg is None else cfg.for_layer(len(held[FULL])).budget
            held[FULL].append(length if budget is None else min(length, budget))
    return {kind: KindKV(len(n), sum(n), sum(n) * per_token) for kind, n in held.items() if n}


__all__ = ["FULL", "KINDS", "SLIDING", "KindKV", "check_layer_topk", "describe_layers", "kv_bytes", "layer_kinds", "layer_windows", "window_config"]
