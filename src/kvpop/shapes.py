"""Random-weight models with the shapes of real architectures, for speed and memory benchmarks.

Only the shapes matter for latency and memory, so these presets need no checkpoint: the weights are
random (seeded), built directly on the target device and in the target dtype (bf16 by default).

    kvpop bench --model qwen3-8b-shape --device cuda --contexts 4096,16384,65536,131072 --budget 2048

`tiny-qwen3-shape` keeps the head layout (32 query / 8 KV heads of dim 128) with a small hidden
size, a small vocabulary and 2 layers, so CPU tests run the same attention shapes in seconds.
The presets come without a tokenizer: benchmarks feed random token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# room for a 128k-token context plus the decode steps measured after it
MAX_POSITIONS = 262_144


def _qwen3_config(**fields: Any):
    from transformers import Qwen3Config

    defaults = dict(
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151_936,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=151_643,
        eos_token_id=151_645,
        pad_token_id=151_643,
    )
    return Qwen3Config(**{**defaults, **fields})


def qwen3_4b_config(**overrides: Any):
    """Qwen3-4B's shapes: hidden 2560, 36 layers, 32 query / 8 KV heads of dim 128, tied embeddings."""
    return _qwen3_config(**{**dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   tie_word_embeddings=True), **overrides})


def qwen3_8b_config(**overrides: Any):
    """Qwen3-8B's shapes: hidden 4096, 36 layers, 32 query / 8 KV heads of dim 128, untied embeddings."""
    return _qwen3_config(**{**dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   tie_word_embeddings=False), **overrides})


def tiny_qwen3_config(**overrides: Any):
    """Qwen3's head layout (32 query / 8 KV heads of dim 128) at hidden 256, 2 layers, vocabulary 512."""
    return _qwen3_config(**{**dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512,
                                   max_position_embeddings=8192, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=0), **overrides})


def smollm2_135m_config(**overrides: Any):
    """SmolLM2-135M's shapes (Llama): hidden 576, 30 layers, 9 query / 3 KV heads of dim 64, tied embeddings.

    The default model's layout without its GGUF, for machines that do not carry the file."""
    from transformers import LlamaConfig

    fields = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49_152, max_position_embeddings=8192,
                  rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}, rms_norm_eps=1e-5,
                  hidden_act="silu", attention_bias=False, mlp_bias=False, initializer_range=0.02,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaConfig(**{**fields, **overrides})


SHAPE_PRESETS: dict[str, Callable[..., Any]] = {
    "smollm2-135m-shape": smollm2_135m_config,
    "qwen3-4b-shape": qwen3_4b_config,
    "qwen3-8b-shape": qwen3_8b_config,
    "tiny-qwen3-shape": tiny_qwen3_config,
}
"""Name -> config factory (keyword overrides allowed, e.g. `num_hidden_layers=4`)."""

SHAPE_DESCRIPTIONS: dict[str, str] = {
    "smollm2-135m-shape": "random weights with SmolLM2-135M's shapes (Llama, 30 layers, 9 query / 3 KV heads of "
                          "dim 64), the default model's layout without its file",
    "qwen3-4b-shape": "random weights with Qwen3-4B's shapes (36 layers, 32 query / 8 KV heads of dim 128), "
                      "for GPU benchmarks",
    "qwen3-8b-shape": "random weights with Qwen3-8B's shapes (36 layers, 32 query / 8 KV heads of dim 128), "
                      "for GPU benchmarks",
    "tiny-qwen3-shape": "random weights, Qwen3 head layout (32 query / 8 KV heads of dim 128), hidden 256, "
                        "2 layers (for CPU tests)",
}


def shape_config(name: str, num_layers: int | None = None):
    """The Hugging Face config of preset `name`, optionally with `num_layers` decoder layers."""
    if name not in SHAPE_PRESETS:
        raise ValueError(f"unknown shape preset {name!r}; known: {', '.join(SHAPE_PRESETS)}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    overrides = {} if num_layers is None else {"num_hidden_layers": num_layers}
    return SHAPE_PRESETS[name](**overrides)


@torch.no_grad()
def _init_random(model: torch.nn.Module, std: float, seed: int) -> None:
    """Seeded normal weights, unit norm scales, zero biases, and the rotary tables recomputed."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            # every 1-D weight of these models is an RMSNorm scale
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "config"):
            # buffers made on the meta device hold no values: rebuild the rotary module on the cpu and copy
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for buf_name, buf in fresh.named_buffers(recurse=False):
                getattr(module, buf_name).copy_(buf)


def build_shape_model(
    name: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int | None = None,
    seed: int = 0,
):
    """Build preset `name` with random weights directly on `device` in `dtype`; returns `(model, None)`.

    The model is made on the meta device, then given uninitialised storage on `device` and filled
    with seeded normal weights (std = `initializer_range`), skipping Hugging Face's per-module
    initialisation: an 8B-parameter model takes well under a second on a GPU.

    Args:
        name: a key of `SHAPE_PRESETS`.
        device: where the weights live.
        dtype: the weights' dtype (bf16 by default, as the real checkpoints).
        num_layers: fewer (or more) decoder layers than the real model, e.g. for a quick run.
        seed: the weights depend on it only.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = shape_config(name, num_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    # to_empty gives every parameter fresh storage, which unties the embeddings
    if config.tie_word_embeddings:
        model.lm_head.weight = model.get_input_embeddings().weight
    _init_random(model, config.initializer_range, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.eval()
    return model, None
