"""Attach KVpop to a Hugging Face causal LM, and save / load the result.

`retrofit(model, cfg)` adds one `LayerPolicy` (scorer + decay) per attention layer under
`model.kvpop`, switches the model's attention implementation to "kvpop", and installs one forward
pre-hook per attention module that hands the layer's policy and the call's cache to the attention
function.

`save` writes one directory, in one of two layouts that `kvpop_format.json` names:

    full      the base model (safetensors + HF config), for a base whose weights were trained
    adapter   no base weights: where the base is found (a preset or a local directory), for a base
              left as it was (`base_weights=False`; `kvpop train --freeze-base` saves this way)

and in both the scorers (`kvpop_scorers.safetensors`), what identifies the base it was retrofitted
on (`kvpop_base.json`) and, last, the config (`kvpop_config.json`). `load` restores either exactly:
an adapter's base is loaded from where it was recorded (or from `base=`) and refused unless its
identity is the recorded one. A directory without `kvpop_format.json` (written before it existed)
is a full save. Every missing or damaged file is named with its fault.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from kvpop.attention import ATTENTION_NAME, register
from kvpop.config import KVpopConfig
from kvpop.files import (
    FileFormatError,
    check_scorers,
    load_pretrained,
    read_json_object,
    read_safetensors,
    write_atomic,
)
from kvpop.layer_kinds import layer_windows
from kvpop.modules import KVpopModules, kvpop_modules

TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text")
CONFIG_FILE = "kvpop_config.json"
SCORERS_FILE = "kvpop_scorers.safetensors"
BASE_FILE = "kvpop_base.json"
FORMAT_FILE = "kvpop_format.json"
KVPOP_FILES = (CONFIG_FILE, SCORERS_FILE, BASE_FILE, FORMAT_FILE)
"""A directory holding any of these was written by `save`."""
FORMAT = 2
"""The layout `save` writes. 1: no `kvpop_format.json`, the base weights in the directory. 2: `kvpop_format.json`
says whether they are there (`base_weights`) and, where not, where the base is found (`base`)."""


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


def _attention_modules(model: nn.Module) -> tuple[list[nn.Module], list[int | None]]:
    """The self-attention module of every decoder layer and its sliding window (None: full attention), or a clear
    error naming the model type and why."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    supported = (
        f"kvpop supports decoder-only models whose attention goes through transformers' attention interface, with "
        f"(grouped-query) full attention in every layer or in some layers and a sliding window in the others; "
        f"tested: {', '.join(TESTED_MODEL_TYPES)}"
    )

    def refuse(why: str) -> ValueError:
        return ValueError(f"model type {model_type!r} is not supported: {why}; {supported}")

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise refuse("it is not a decoder-only model")
    try:
        windows = layer_windows(config)
    except ValueError as err:
        raise refuse(str(err)) from None
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
    if len(windows) != len(attns):
        raise refuse(f"its config has {len(windows)} layers but the model {len(attns)}")
    if any(isinstance(getattr(a, "sinks", None), nn.Parameter) for a in attns):
        raise refuse("its attention adds learned sink logits to every softmax (gpt-oss's `sinks`), which the "
                     "retention rule's attention does not compute")
    limit = getattr(config, "max_position_embeddings", None)
    for i, (attn, w) in enumerate(zip(attns, windows)):
        # the module's own window, where it keeps one, must be the one read from the config (a window no position
        # reaches past is full attention)
        own = getattr(attn, "sliding_window", w)
        if own != w and not (w is None and limit is not None and own >= limit):
            raise refuse(f"layer {i} attends a sliding window of {own} tokens, but its config says {w}")
    return attns, windows


def model_head_dim(model: nn.Module) -> int:
    """The attention head dim `D` of a Hugging Face model."""
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def resolve_config(model: nn.Module, cfg: KVpopConfig) -> KVpopConfig:
    """`cfg` as `retrofit(model, cfg)` will run it: with `match_mlp_memory`, `topk` reduced by the mLSTM state."""
    return cfg.resolve(model_head_dim(model))


def retrofit(model: nn.Module, cfg: KVpopConfig) -> nn.Module:
    """Give `model` KVpop attention in every layer (in place) and return it.

    The policy runs in the full-attention layers; a sliding-window layer keeps exactly its window
    (`kvpop.layer_kinds`). The scorers start from a random initialisation; train them with `kvpop train`.
    The model runs (and `save` writes) `resolve_config(model, cfg)`, readable as `model.kvpop.config`.
    """
    if not isinstance(cfg, KVpopConfig):
        raise TypeError(f"cfg must be a KVpopConfig, got {type(cfg).__name__}")
    if isinstance(getattr(model, "kvpop", None), KVpopModules):
        raise ValueError("model is already retrofitted; call kvpop.detach(model) first to change its config")
    attns, windows = _attention_modules(model)
    config = model.config
    head_dim = model_head_dim(model)
    cfg = cfg.resolve(head_dim)
    num_kv = config.num_key_value_heads or config.num_attention_heads
    ref = next(model.parameters())
    group = config.num_attention_heads // num_kv
    mods = KVpopModules(cfg, windows, num_kv, head_dim, group).to(device=ref.device)
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
        rank = mods.policy_layers.index(i) if i in mods.policy_layers else None

        def inject(module, args, kwargs, policy=policy, i=i, rank=rank):
            kwargs["kvpop_layer"] = policy
            # its place among the full-attention layers (None: a sliding one), which `kvpop_priority` lists
            kwargs["kvpop_policy_layer"] = rank
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


@dataclass(frozen=True)
class Layout:
    """What `kvpop_format.json` says of a `save` directory."""

    format: int
    """1 (written before the file existed) or 2."""
    base_weights: bool
    """Whether the directory holds the base weights (full) or finds them elsewhere (adapter)."""
    base: dict[str, str] | None
    """An adapter's base: `{"preset": NAME}` or `{"path": DIR}` (absolute); None for a full save."""

    @property
    def base_location(self) -> str | None:
        """The preset name or directory an adapter's base is loaded from."""
        return None if self.base is None else next(iter(self.base.values()))

    def describe_base(self) -> str:
        """Where the base weights come from, in words: "the preset smollm2-135m", "the model in /models/x"."""
        if self.base is None:
            return "the base weights it holds"
        kind, where = next(iter(self.base.items()))
        return f"the preset {where}" if kind == "preset" else f"the model in {where}"


def read_layout(path: str | Path) -> Layout:
    """The layout of a `save` directory: `kvpop_format.json`, or format 1 (full) where there is none."""
    file = Path(path) / FORMAT_FILE
    if not file.exists():
        return Layout(1, True, None)
    d = read_json_object(file, "the directory's format")
    version, weights, base = d.get("format"), d.get("base_weights"), d.get("base")
    if not isinstance(version, int) or isinstance(version, bool) or version < 2:
        raise FileFormatError(f"{file}: 'format' must be an integer >= 2, found {version!r}")
    if version > FORMAT:
        raise FileFormatError(f"{file}: format {version} was written by a newer kvpop; this one reads formats 1 to "
                              f"{FORMAT}: upgrade kvpop")
    if not isinstance(weights, bool):
        raise FileFormatError(f"{file}: 'base_weights' must be true or false, found {weights!r}")
    if weights:
        return Layout(version, True, None)
    if not (isinstance(base, dict) and len(base) == 1 and set(base) <= {"preset", "path"}
            and isinstance(next(iter(base.values())), str)):
        raise FileFormatError(f"{file}: a directory without base weights needs 'base': {{\"preset\": NAME}} or "
                              f"{{\"path\": DIR}}, found {base!r}")
    return Layout(version, False, dict(base))


def _base_source(name: str | Path | None) -> dict[str, str]:
    """Where an adapter's base is found, as `kvpop_format.json` records it: a preset, or a directory's absolute path."""
    from kvpop.presets import PRESETS, is_kvpop_dir, preset_of

    how = ("pass base= the preset or local Hugging Face directory the model was loaded from (kvpop.save(model, "
           "path, base_weights=False, base=...))")
    if name is None:
        raise ValueError(f"base_weights=False: the model records no name of its base; {how}")
    preset = preset_of(str(name))
    if preset is not None:
        return {"preset": preset}
    where = Path(name)
    if not where.is_dir():
        raise ValueError(f"base={str(name)!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory; {how}")
    if is_kvpop_dir(str(where)):
        layout = read_layout(where)
        if layout.base_weights:
            raise ValueError(f"base={str(name)!r} is a kvpop.save directory with its own base weights: an adapter "
                             "cannot point into it; save the model whole (base_weights=True)")
        # the base of that adapter is this one's too
        return dict(layout.base)
    return {"path": str(where.resolve())}


def save(model: nn.Module, path: str | Path, tokenizer=None, *, base_weights: bool = True,
         base: str | Path | None = None) -> Path:
    """Write the scorers, the base's identity, the KVpop config and (unless `base_weights=False`) the base weights
    into directory `path`.

    Args:
        tokenizer: written into the directory when given (an adapter otherwise takes its base's).
        base_weights: False writes no base weights (an adapter, a few MB): for a base left as it was retrofitted,
            which is checked (its identity must still match); a base whose weights were trained must be saved whole.
        base: with `base_weights=False`, where the base is found again: a preset name or a local Hugging Face
            directory; default: the name the base recorded when it was retrofitted (a preset that `kvpop train`
            started from, or the directory `from_pretrained` read).

    `kvpop_config.json` is written last and atomically: a directory that has it is complete.
    """
    mods = kvpop_modules(model)
    path = Path(path)
    if base_weights:
        if base is not None:
            raise ValueError(f"base={str(base)!r} says where an adapter's base is found; with base_weights=True the "
                             "base weights are saved in the directory")
        layout: dict[str, Any] = {"format": FORMAT, "base_weights": True}
    else:
        current = base_identity(model)
        if mods.base is None or current is None:
            raise ValueError("base_weights=False needs the identity of the base the model was retrofitted on, and "
                             "this model records none (retrofitted on weights not in memory); save it whole")
        why = same_base(mods.base, current)
        if why is not None:
            raise ValueError(f"base_weights=False, but the base weights are no longer those the model was "
                             f"retrofitted on ({why}): they were trained; save them whole (base_weights=True)")
        layout = {"format": FORMAT, "base_weights": False,
                  "base": _base_source(base if base is not None else mods.base.get("name"))}
    path.mkdir(parents=True, exist_ok=True)
    if base_weights:
        weights = {k: v for k, v in model.state_dict().items() if not k.startswith("kvpop.")}
        # the saved HF config must name a stock attention so that a plain from_pretrained also works
        attn = model.config._attn_implementation
        model.config._attn_implementation = mods.previous_attn_implementation or "sdpa"
        try:
            model.save_pretrained(path, state_dict=weights)
        finally:
            model.config._attn_implementation = attn
    save_file({k: v.detach().contiguous().cpu() for k, v in mods.state_dict().items()}, str(path / SCORERS_FILE))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if mods.base is not None:
        write_atomic(path / BASE_FILE, json.dumps(mods.base, indent=1))
    write_atomic(path / FORMAT_FILE, json.dumps(layout, indent=1))
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


def load_base(path: str | Path, base: str | Path | nn.Module | None = None, *,
              device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    """The base model of an adapter directory (saved with `base_weights=False`) and a preset's tokenizer, checked.

    `base`: where to load it from instead of the recorded place (a preset name or a local Hugging Face directory),
    or the base model itself. The tokenizer is None unless the base is a preset (a directory's is read with it).
    Refused, naming both, unless the base's identity is the one recorded.
    """
    from kvpop.presets import PRESETS, build_preset, is_kvpop_dir

    path = Path(path)
    layout = read_layout(path)
    if layout.base_weights:
        raise ValueError(f"{path} holds its base weights (a full save): it has no base to find")
    recorded = read_base(path)
    if recorded is None:
        raise FileFormatError(f"{path / BASE_FILE}: the base model's identity is missing; a directory without base "
                              "weights needs it to check its base")
    if isinstance(base, nn.Module):
        model, tokenizer, given = base, None, "the base model given"
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
    else:
        where = layout.base_location if base is None else str(base)
        if base is None and "path" in layout.base and not os.path.isdir(where):
            raise FileNotFoundError(f"{path}: its base model {where} (recorded in {FORMAT_FILE}) is not there; pass "
                                    "where it is now: kvpop.load(path, base=DIR), or --base DIR")
        if where in PRESETS:
            model, tokenizer = build_preset(where, dtype=dtype, device=device)
        elif not os.path.isdir(where):
            raise ValueError(f"base {where!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")
        elif is_kvpop_dir(where):
            raise ValueError(f"base {where} is a kvpop directory; give the base model itself (a preset or a local "
                             "Hugging Face directory)")
        else:
            model, tokenizer = load_pretrained(where, "the base model", dtype=dtype or "auto").eval(), None
            if device is not None:
                model.to(device)
        given = where
    current = base_identity(model)
    why = None if current is None else same_base(recorded, current)
    if why is not None:
        raise ValueError(f"{path} holds scorers trained on {layout.describe_base()}, but the base model {given} is "
                         f"another model ({why}); load it with the base it was trained on (base=, or --base)")
    return model, tokenizer


def load(path: str | Path, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
         config: KVpopConfig | None = None, rule: str | None = None,
         base: str | Path | nn.Module | None = None) -> nn.Module:
    """Load a directory written by `save`: the base model, retrofitted, with its trained scorers.

    A KVpop-mlp trained for the static rule runs as the recommended policy, the layer-wide KVpop-cascade with
    `recommended_pool(budget)` slots (`KVpopConfig.for_rule`); `rule="static"` runs the paper's static rule, and
    `rule="cascade"` insists on the recommended policy. Every other directory runs its saved config.
    `config`: run the saved weights under another config with the same parameters instead, e.g. a KVpop-mlp run as
    KVpop-cascade with another pool (`tova_pool`) or at per-layer budgets (`layer_topk`); its scorer, its hidden
    size and its keys must be the saved ones, or the weights do not fit.

    `base`: for a directory saved without base weights (an adapter), where its base is loaded from instead of the
    recorded place, or the base model itself (retrofitted in place); its identity must be the recorded one.
    """
    path = Path(path)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{path} is not a complete kvpop model directory: {CONFIG_FILE} is missing")
    if config is not None and rule is not None:
        raise ValueError(f"rule={rule!r} and config: give one of them (config is the whole rule)")
    cfg = read_config(path).for_rule(rule) if config is None else config
    recorded = read_base(path)
    if read_layout(path).base_weights:
        if base is not None:
            raise ValueError(f"{path} holds its base weights (a full save); base= applies to a directory saved "
                             "without them (kvpop.save(..., base_weights=False))")
        model = load_pretrained(path, "the base model", dtype=dtype or "auto")
        if device is not None:
            model.to(device)
    else:
        model, _ = load_base(path, base, device=device, dtype=dtype)
    check_scorers(model, cfg, retrofit, path / SCORERS_FILE, path / CONFIG_FILE)
    retrofit(model, cfg)
    state = read_safetensors(path / SCORERS_FILE, "the scorer weights", device=str(next(model.parameters()).device))
    try:
        kvpop_modules(model).load_state_dict(state)
    except RuntimeError as err:
        raise FileFormatError(f"{path / SCORERS_FILE}: the scorer weights do not fit {CONFIG_FILE} ({err})") from None
    # the identity of the base it was trained from, not of the (possibly distilled) weights loaded
    kvpop_modules(model).base = recorded
    model.eval()
    return model
