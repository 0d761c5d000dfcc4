"""Attach KVpop to a Hugging Face causal LM, and save / load the result.

`retrofit(model, cfg)` adds one `LayerPolicy` (scorer + decay) per attention layer under
`model.kvpop`, switches the model's attention implementation to "kvpop", and installs one forward
pre-hook per attention module that hands the layer's policy and the call's cache to the attention
function. `save` writes one directory: the base model (safetensors + HF config), the scorers
(`kvpop_scorers.safetensors`), what identifies the base it was retrofitted on (`kvpop_base.json`)
and, last, the config (`kvpop_config.json`); `load` restores it exactly, and names the file and the
fault when one is missing or damaged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from kvpop.attention import ATTENTION_NAME, register
from kvpop.config import KVpopConfig
from kvpop.files import FileFormatError, load_pretrained, read_json_object, read_safetensors, write_atomic
from kvpop.modules import KVpopModules, kvpop_modules

TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
CONFIG_FILE = "kvpop_config.json"
SCORERS_FILE = "kvpop_scorers.safetensors"
BASE_FILE = "kvpop_base.json"
KVPOP_FILES = (CONFIG_FILE, SCORERS_FILE, BASE_FILE)
"""A directory holding any of these was written by `save`."""


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The list of decoder layers, wherever the architecture keeps it (`.layers`, GPT-2's `.h`)."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = None
    for holder in (decoder, model):
        for name in ("layers", "h", "blocks"):
            layers = getattr(holder, name, None)
            if isinstance(layers, nn.ModuleList) and len(layers):
                return layers
    return None


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, or a clear error naming the model type and why."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    supported = (
        f"kvpop supports decoder-only models whose attention goes through transformers' attention interface "
        f"with (grouped-query) attention in every layer; tested: {', '.join(TESTED_MODEL_TYPES)}"
    )

    def refuse(why: str) -> ValueError:
        return ValueError(f"model type {model_type!r} is not supported: {why}; {supported}")

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise refuse("it is not a decoder-only model")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise refuse(f"it has non-full attention layers ({sorted(set(layer_types))})")
    layers = _decoder_layers(model)
    if layers is None:
        raise refuse("no list of decoder layers found")
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    if any(a is None for a in attns):
        held = sorted({f"{type(m).__name__} as .{n}" for layer in layers for n, m in layer.named_children()
                       if "attn" in n.lower() or "attention" in n.lower()})
        raise refuse("its decoder layers have no `self_attn` module with grouped key/value heads"
                     + (f" (they hold {', '.join(held)})" if held else ""))
    missing = [name for name in ("layer_idx", "num_key_value_groups") if not hasattr(attns[0], name)]
    if missing:
        raise refuse(f"its attention module {type(attns[0]).__name__} has no {' or '.join(missing)}")
    if not getattr(model, "_supports_attention_backend", False):
        raise refuse("it does not route attention through transformers' attention interface")
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
    group = config.num_attention_heads // num_kv
    mods = KVpopModules(cfg, len(attns), num_kv, head_dim, group).to(device=ref.device)
    # the policies follow the model's mode (DMS relaxes its gates in training mode only)
    mods.train(model.training)
    register()
    mods.previous_attn_implementation = config._attn_implementation
    mods.base = base_identity(model)
    # on a GPU, `model.generate` compiles a KVpopCache's decode step with kvpop's inductor options, unless the user
    # set a compile config of their own (`kvpop.decode.generation_compile_config`)
    mods.compile_config = _generate_compile_config(model, ref.device)
    model.kvpop = mods
    model.set_attn_implementation(ATTENTION_NAME)

    for i, (attn, policy) in enumerate(zip(attns, mods.layers)):
        def inject(module, args, kwargs, policy=policy, i=i):
            kwargs["kvpop_layer"] = policy
            # each layer runs its own split (per-layer budgets), read at call time: `mods.config` may change
            kwargs["kvpop_config"] = mods.layer_config(i)
            kwargs["kvpop_cache"] = kwargs.get("past_key_values", kwargs.get("cache"))
            # (cos, sin) of the new tokens: `scorer_keys="pre_rope"` undoes the rotation with them
            kwargs["kvpop_rope"] = kwargs.get("position_embeddings")
            return args, kwargs

        mods.hooks.append(attn.register_forward_pre_hook(inject, with_kwargs=True))
    mods.hooks.append(model.register_forward_pre_hook(_check_inputs, with_kwargs=True))
    return model


def _check_inputs(model, args, kwargs):
    """Clear errors for inputs the rule cannot serve (empty, or longer than the model's positions).

    Skipped inside a compiled step (it would branch on the cache's length tensor) and inside a CUDA
    graph capture (reading that length is a host sync, which a capture forbids); the prefill was checked.
    One-token steps on a GPU are not checked either: the check would cost a host sync per token.
    """
    if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
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
    if cache is not None and n == 1 and x.is_cuda:
        return None
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
    generation = getattr(model, "generation_config", None)
    if mods.compile_config is not None and getattr(generation, "compile_config", None) is mods.compile_config:
        generation.compile_config = None
    del model.kvpop
    return model


def _generate_compile_config(model: nn.Module, device: torch.device):
    """The compile config `retrofit` gives `model.generate` (None where it sets none)."""
    generation = getattr(model, "generation_config", None)
    if generation is None or getattr(generation, "compile_config", None) is not None:
        return None
    from kvpop.decode import generation_compile_config

    generation.compile_config = generation_compile_config(device)
    return generation.compile_config


BASE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size")
SAMPLED_TENSORS = 8
SAMPLED_VALUES = 16
BASE_RTOL = 2e-2
"""Sampled weights agree within this (relative, and absolute on the tensor's scale): a bfloat16 or
float16 copy of the same model matches, another model does not (its weights differ by their own size)."""


def base_identity(model: nn.Module) -> dict[str, Any] | None:
    """What identifies a model's weights, cheaply: architecture fields and a few values of 8 weight matrices
    spread over the model. None for a model without weights in memory (meta tensors)."""
    params = [(n, p) for n, p in model.named_parameters() if not n.startswith("kvpop.")]
    if not params or any(p.is_meta for _, p in params):
        return None
    # matrices only: norms and biases often start constant (ones, zeros) and would match across models
    params = [(n, p) for n, p in params if p.dim() >= 2]
    config = getattr(model.config, "text_config", None) or model.config
    n = min(SAMPLED_TENSORS, len(params))
    picked = [params[i * (len(params) - 1) // max(1, n - 1)] for i in range(n)]
    sample = {}
    with torch.no_grad():
        for name, p in picked:
            flat = p.detach().reshape(-1)
            k = min(SAMPLED_VALUES, flat.numel())
            # evenly spaced, in integers: float positions round past the end of a large tensor
            idx = torch.tensor([i * (flat.numel() - 1) // max(1, k - 1) for i in range(k)], device=flat.device)
            values = flat[idx].float().cpu()
            sample[name] = {"values": values.tolist(), "scale": float(values.abs().mean())}
    return {"name": getattr(model.config, "_name_or_path", None) or None,
            "architecture": {k: getattr(config, k, None) for k in BASE_FIELDS}, "weights": sample}


def same_base(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """None when two `base_identity` records describe the same weights, else what differs."""
    arch_a, arch_b = recorded.get("architecture", {}), current.get("architecture", {})
    differ = [f"{k} {arch_a.get(k)} vs {arch_b.get(k)}" for k in BASE_FIELDS if arch_a.get(k) != arch_b.get(k)]
    if differ:
        return "architecture: " + ", ".join(differ)
    a, b = recorded.get("weights", {}), current.get("weights", {})
    # the tensors both sampled (all of them, unless the sampling itself changed): the same architecture
    # has the same parameter names, so none in common means that change, not another model
    for name in sorted(a.keys() & b.keys()):
        va, vb = a[name]["values"], b[name]["values"]
        tol = BASE_RTOL * max(a[name]["scale"], b[name]["scale"], 1e-12)
        if len(va) != len(vb) or any(not math.isclose(x, y, rel_tol=BASE_RTOL, abs_tol=tol) for x, y in zip(va, vb)):
            return f"weights: {name} differs"
    return None


def save(model: nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Write base weights, scorer weights, the base's identity and the KVpop config into directory `path`.

    `kvpop_config.json` is written last and atomically: a directory that has it is complete.
    """
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
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if mods.base is not None:
        write_atomic(path / BASE_FILE, json.dumps(mods.base, indent=1))
    write_atomic(path / CONFIG_FILE, mods.config.to_json())
    return path


def read_config(path: str | Path) -> KVpopConfig:
    """The `KVpopConfig` of a `save` directory, or a clear error naming the file."""
    file = Path(path) / CONFIG_FILE
    try:
        return KVpopConfig.from_dict(read_json_object(file, "the KVpop config"))
    except FileFormatError:
        raise
    except (TypeError, ValueError) as err:
        raise FileFormatError(f"{file}: {err}") from None


def read_base(path: str | Path) -> dict[str, Any] | None:
    """The recorded identity of the base a `save` directory was retrofitted on; None for older directories."""
    file = Path(path) / BASE_FILE
    if not file.exists():
        return None
    base = read_json_object(file, "the base model's identity")
    if not isinstance(base.get("architecture"), dict) or not isinstance(base.get("weights"), dict):
        raise FileFormatError(f"{file}: the base model's identity needs 'architecture' and 'weights'")
    return base


def load(path: str | Path, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
         config: KVpopConfig | None = None) -> nn.Module:
    """Load a directory written by `save`: the base model, retrofitted, with its trained scorers.

    `config`: run the saved weights under another config with the same parameters instead of the saved one, e.g.
    a KVpop-mlp run as KVpop-cascade (`tova_pool`) or at per-layer budgets (`layer_topk`); its scorer, its
    hidden size and its keys must be the saved ones, or the weights do not fit.
    """
    path = Path(path)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{path} is not a complete kvpop model directory: {CONFIG_FILE} is missing")
    cfg = read_config(path) if config is None else config
    base = read_base(path)
    model = load_pretrained(path, "the base model", dtype=dtype or "auto")
    if device is not None:
        model.to(device)
    retrofit(model, cfg)
    state = read_safetensors(path / SCORERS_FILE, "the scorer weights", device=str(next(model.parameters()).device))
    try:
        kvpop_modules(model).load_state_dict(state)
    except RuntimeError as err:
        raise FileFormatError(f"{path / SCORERS_FILE}: the scorer weights do not fit {CONFIG_FILE} ({err})") from None
    # the identity of the base it was trained from, not of the (possibly distilled) weights loaded
    kvpop_modules(model).base = base
    model.eval()
    return model
