"""Attach KVpop to a Hugging Face causal LM, and save / load the result.

`retrofit(model, cfg)` adds one `LayerPolicy` (scorer + decay) per attention layer under
`model.kvpop`, switches the model's attention implementation to "kvpop", and installs one forward
pre-hook per attention module that hands the layer's policy and the call's cache to the attention
function. `save` writes one directory: the base model (safetensors + HF config), the scorers
(`kvpop_scorers.safetensors`) and the config (`kvpop_config.json`); `load` restores it exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kvpop.attention import ATTENTION_NAME, register
from kvpop.config import KVpopConfig
from kvpop.modules import KVpopModules, kvpop_modules

TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
CONFIG_FILE = "kvpop_config.json"
SCORERS_FILE = "kvpop_scorers.safetensors"


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, or a clear error naming the model type."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    supported = (
        f"kvpop supports decoder-only models whose attention goes through transformers' attention interface "
        f"with (grouped-query) attention in every layer; tested: {', '.join(TESTED_MODEL_TYPES)}"
    )
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model type {model_type!r} is not supported: {supported}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"model type {model_type!r} is not supported: it has non-full attention layers "
            f"({sorted(set(layer_types))}); {supported}"
        )
    try:
        layers = model.get_decoder().layers
    except (AttributeError, NotImplementedError):
        raise ValueError(f"model type {model_type!r} is not supported: no decoder layers found; {supported}") from None
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    ok = getattr(model, "_supports_attention_backend", False) and all(
        a is not None and hasattr(a, "layer_idx") and hasattr(a, "num_key_value_groups") for a in attns
    )
    if not ok or not attns:
        raise ValueError(f"model type {model_type!r} is not supported: {supported}")
    return attns


def model_head_dim(model: nn.Module) -> int:
    """The attention head dim `D` of a Hugging Face model."""
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def resolve_config(model: nn.Module, cfg: KVpopConfig) -> KVpopConfig:
    """`cfg` as `retrofit(model, cfg)` will run it: with `match_mlp_memory`, `topk` reduced by the mLSTM state."""
    return cfg.resolve(model_head_dim(model))


def retrofit(model: nn.Module, cfg: KVpopConfig) -> nn.Module:
    """Give `model` KVpop attention in every layer (in place) and return it.

    The scorers start from a random initialisation; train them with `kvpop train`. The model runs (and
    `save` writes) `resolve_config(model, cfg)`, readable as `model.kvpop.config`.
    """
    if not isinstance(cfg, KVpopConfig):
        raise TypeError(f"cfg must be a KVpopConfig, got {type(cfg).__name__}")
    if isinstance(getattr(model, "kvpop", None), KVpopModules):
        raise ValueError("model is already retrofitted; call kvpop.detach(model) first to change its config")
    attns = _attention_modules(model)
    config = model.config
    head_dim = model_head_dim(model)
    cfg = cfg.resolve(head_dim)
    num_kv = config.num_key_value_heads or config.num_attention_heads
    ref = next(model.parameters())
    mods = KVpopModules(cfg, len(attns), num_kv, head_dim).to(device=ref.device)
    # the policies follow the model's mode (DMS relaxes its gates in training mode only)
    mods.train(model.training)
    register()
    mods.previous_attn_implementation = config._attn_implementation
    model.kvpop = mods
    model.set_attn_implementation(ATTENTION_NAME)

    for attn, policy in zip(attns, mods.layers):
        def inject(module, args, kwargs, policy=policy):
            kwargs["kvpop_layer"] = policy
            kwargs["kvpop_config"] = cfg
            kwargs["kvpop_cache"] = kwargs.get("past_key_values", kwargs.get("cache"))
            return args, kwargs

        mods.hooks.append(attn.register_forward_pre_hook(inject, with_kwargs=True))
    mods.hooks.append(model.register_forward_pre_hook(_check_inputs, with_kwargs=True))
    return model


def _check_inputs(model, args, kwargs):
    """Clear errors for inputs the rule cannot serve (empty, or longer than the model's positions).

    Skipped inside a compiled step: it would branch on the cache's length tensor (its eager prefill was checked).
    """
    if torch.compiler.is_compiling():
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    x = ids if ids is not None else embeds
    if x is None:
        return None
    n = x.shape[1] if x.dim() >= 2 else x.shape[0]
    if x.numel() == 0 or n == 0:
        raise ValueError(f"empty input: got {'input_ids' if ids is not None else 'inputs_embeds'} of shape {tuple(x.shape)}")
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    past = int(cache.get_seq_length()) if cache is not None else 0
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and past + n > limit:
        raise ValueError(
            f"input too long: {past} cached + {n} new tokens = {past + n} positions, but the model has "
            f"max_position_embeddings={limit}"
        )
    return None


def detach(model: nn.Module) -> nn.Module:
    """Undo `retrofit`: remove the hooks and scorers and restore the original attention."""
    mods = kvpop_modules(model)
    for handle in mods.hooks:
        handle.remove()
    model.set_attn_implementation(mods.previous_attn_implementation or "sdpa")
    del model.kvpop
    return model


def save(model: nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Write base weights, scorer weights and the KVpop config into directory `path`."""
    mods = kvpop_modules(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in model.state_dict().items() if not k.startswith("kvpop.")}
    # the saved HF config must name a stock attention so that a plain from_pretrained also works
    attn = model.config._attn_implementation
    model.config._attn_implementation = mods.previous_attn_implementation or "sdpa"
    try:
        model.save_pretrained(path, state_dict=base)
    finally:
        model.config._attn_implementation = attn
    save_file({k: v.detach().contiguous().cpu() for k, v in mods.state_dict().items()}, str(path / SCORERS_FILE))
    (path / CONFIG_FILE).write_text(mods.config.to_json())
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load(path: str | Path, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Load a directory written by `save`: the base model, retrofitted, with its trained scorers."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{path} is not a kvpop model directory: {CONFIG_FILE} is missing")
    cfg = KVpopConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True)
    if device is not None:
        model.to(device)
    retrofit(model, cfg)
    state = load_file(str(path / SCORERS_FILE), device=str(next(model.parameters()).device))
    kvpop_modules(model).load_state_dict(state)
    model.eval()
    return model
