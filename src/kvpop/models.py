"""Models by name: a built-in preset (`kvpop.presets`), a local Hugging Face directory, a GGUF file or a
`kvpop.save` directory.

    model, tokenizer = load_model("smollm2-135m")        # a preset
    model, tokenizer = load_model("runs/b1024/final")    # a kvpop.save directory, returned retrofitted

A GGUF file is converted once (see `kvpop.gguf_models`); nothing is ever fetched from the Hugging Face
hub. A `kvpop.save` directory saved without base weights (an adapter) loads its base from the preset or
directory it records, or from `base=`.
"""

from __future__ import annotations

import os

import torch

from kvpop import gguf_models
from kvpop.files import FileFormatError, check_model_config, load_pretrained
from kvpop.presets import (  # noqa: F401  (the names every loader shares, kept importable from here)
    CHAT_TEMPLATE,
    GGUF_PRESETS,
    KVPOP_CONFIG_FILE,
    KVPOP_MARKERS,
    PRESETS,
    SPECIAL_TOKENS,
    TOKENIZER_FILES,
    Preset,
    _as_dtype,
    _has_tokenizer,
    _known_ggufs,
    _load_tokenizer,
    _unknown,
    build_preset,
    byte_tokenizer,
    is_kvpop_dir,
    preset_of,
    resolve_device,
)


def load_model(name_or_path: str, *, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
               config=None, base: str | None = None):
    """Load `(model, tokenizer)` by preset name or local directory, never from the hub.

    Args:
        name_or_path: a key of `PRESETS`, a local Hugging Face model directory, a directory
            written by `kvpop.save` (recognised by its `kvpop_config.json`; returned retrofitted),
            or a GGUF file (converted once into the cache of `kvpop.gguf_models`).
        dtype: e.g. `torch.float32` or `"bfloat16"`; None keeps the preset's float32 or the
            checkpoint's own dtype.
        device: where to put the model; None leaves it on the CPU.
        config: a `kvpop.save` directory only: its weights under this `KVpopConfig` instead of the saved one
            (`kvpop.load`'s `config`, e.g. a KVpop-mlp run as KVpop-cascade).
        base: a `kvpop.save` directory without base weights only: load its base from this preset or local
            directory instead of the recorded one (`kvpop.load`'s `base`). Its tokenizer is the directory's own
            where it holds one, else the base's.
    """
    dtype = _as_dtype(dtype)
    if device is not None:
        device = resolve_device(device)
    if name_or_path in PRESETS:
        model, tokenizer = build_preset(name_or_path)
    elif os.path.isdir(name_or_path) and is_kvpop_dir(name_or_path):
        from kvpop.retrofit import load, load_base, read_layout

        if read_layout(name_or_path).base_weights:
            tokenizer = _load_tokenizer(name_or_path)
            model = load(name_or_path, device=device, dtype=dtype, config=config, base=base)
        else:
            model, tokenizer = load_base(name_or_path, base, device=device, dtype=dtype)
            if _has_tokenizer(name_or_path):
                tokenizer = _load_tokenizer(name_or_path)
            elif tokenizer is None:
                # a base directory's own
                tokenizer = _load_tokenizer(str(base) if base is not None else read_layout(name_or_path).base_location)
            model = load(name_or_path, config=config, base=model)
        return model, tokenizer
    elif os.path.isdir(name_or_path):
        _check_not_partial_save(name_or_path)
        tokenizer = _load_tokenizer(name_or_path)
        kwargs = {} if dtype is None else {"dtype": dtype}
        model = load_pretrained(name_or_path, "the model", **kwargs)
        model.eval()
    elif os.path.isfile(name_or_path):
        model, tokenizer = gguf_models.load_file(name_or_path, _known_ggufs())
    else:
        raise _unknown(name_or_path)
    if config is not None:
        raise ValueError(f"config= runs a kvpop.save directory's weights under another config; {name_or_path} is not one")
    if base is not None:
        raise ValueError(f"base= says where a kvpop.save directory without base weights finds its base; "
                         f"{name_or_path} is not one")
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model, tokenizer


def _check_not_partial_save(path: str) -> None:
    # loading it as a plain model would bring fresh random scorers and another budget, without a word
    found = [name for name in KVPOP_MARKERS if os.path.exists(os.path.join(path, name))]
    if found and not is_kvpop_dir(path):
        raise FileFormatError(f"{os.path.join(path, KVPOP_CONFIG_FILE)}: missing, but {path} holds {', '.join(found)}: "
                              "it is an incomplete kvpop.save directory (a save that did not finish, or a lost file); "
                              "save the model again")


def load_config(name_or_path: str):
    """The Hugging Face config of a preset, local directory or GGUF file, without loading weights (presets: built,
    GGUF files: converted once)."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        return preset.config() if preset.config is not None else preset.build()[0].config
    if os.path.isdir(name_or_path) and is_kvpop_dir(name_or_path):
        from kvpop.retrofit import read_layout

        layout = read_layout(name_or_path)
        if not layout.base_weights:
            # an adapter holds no HF config: its base's is the model's
            return load_config(layout.base_location)
    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        _check_not_partial_save(name_or_path)
        check_model_config(name_or_path)
        try:
            return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise FileFormatError(f"{name_or_path}: cannot read the model's config.json ({err})") from None
    if os.path.isfile(name_or_path):
        return gguf_models.load_file_config(name_or_path, _known_ggufs())
    raise _unknown(name_or_path)
