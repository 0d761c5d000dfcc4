"""Memory checked before kvpop allocates: a length, budget or batch that cannot fit is refused up front.

    need = limits.generation_bytes(model, cfg, batch=1, prompt=40, new=64)  # {"KV slots": ..., "activations": ...}
    limits.check_fits(need, "cpu", "--budget 512 with a prompt of 40 tokens", "lower --budget")

Each estimate is a dict of named byte counts (the model's weights, the bounded cache's slots, a
forward pass's activations, ...), compared with the memory the device has free: on the CPU the
kernel's `MemAvailable` (and a cgroup's limit where one is set), on CUDA `torch.cuda.mem_get_info`.
A refusal is one line naming the flags, the estimate part by part, and the limit:

    kvpop generate: error: --budget 1000000012 (sink 4, window 8, topk 1000000000) with a prompt of 11 tokens,
    --max-new-tokens 4 needs about 576.0 GB (KV slots 576.0 GB, activations 29.2 KB, token ids 120 B), more than
    the 20.5 GB of memory available on cpu; lower --budget

The bounded cache's slots and the weights are counted exactly; activations are counted low (what
autograd must keep at the least: the inputs of each layer's matrices, the logits), so that a
refused command could never have run, while one that passes may still run out of memory where its
kernels take more. `--max-new-tokens` does not grow the bounded cache: it costs only its token ids.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class ResourceError(ValueError):
    """What was asked cannot fit the memory of the device; the message holds the estimate and the limit."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


# --- what the device has ---


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    # a container's memory limit (cgroup v2) binds before the machine's
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def available_memory(device: str | torch.device) -> int | None:
    """Bytes free for new tensors on `device`; None where it cannot be known (then nothing is refused)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        found = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
        return min(found) if found else None
    return None


def check_fits(need: Mapping[str, int], device: str | torch.device, what: str, hint: str) -> None:
    """Raise `ResourceError` when the bytes of `need` (name -> bytes) exceed what `device` has free.

    `what` names the request (`--seq-len 8192 with --batch-size 4`), `hint` what to change."""
    total = sum(need.values())
    limit = available_memory(device)
    if limit is None or total <= limit:
        return
    parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in need.items() if n)
    raise ResourceError(f"{what} needs about {format_bytes(total)} ({parts}), more than the {format_bytes(limit)} of "
                        f"memory available on {torch.device(device).type}; {hint}")


# --- what a model is made of ---


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only transformer that its memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        """From a Hugging Face config (its text config where it has one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", 1) or 1
        hidden = getattr(text, "hidden_size", 0) or 0
        return cls(
            layers=getattr(text, "num_hidden_layers", 0) or 0,
            hidden=hidden,
            intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or hidden // heads,
            vocab=getattr(text, "vocab_size", 0) or 0,
        )

    def layer_activations(self) -> int:
        """Values per token and layer that a backward pass must keep at the least: the inputs of the attention's
        and the MLP's matrices (normed hidden states, the attention's output, the MLP's gate and up)."""
        return 4 * self.hidden + 2 * self.intermediate + (self.heads + 2 * self.kv_heads) * self.head_dim


def parameter_bytes(model: nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable)


def _dtype_bytes(dtype: Any, default: int = 4) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value.itemsize
    return default


# --- estimates ---


def kv_slot_bytes(shape: Shape, cfg: Any, batch: int, dtype_bytes: int) -> int:
    """The bounded cache (`KVpopCache`) of `batch` rows: per layer and KV head `budget + 1` slots of a key, a value,
    a position (int64), a priority (float32) and, for KVpop-TOVA and KVpop-cascade, a prior (float32); plus a
    stateful scorer's memory."""
    prior = cfg.tova_prior is not None or cfg.tova_pool > 0
    per_slot = 2 * shape.head_dim * dtype_bytes + 8 + 4 + (4 if prior else 0)
    low = cfg.sink + cfg.window + 1
    slots = sum(low + k for k in cfg.layer_topk) if cfg.layer_topk else shape.layers * (cfg.budget + 1)
    state_bytes = shape.layers * cfg.state_entries(shape.head_dim) * 2 * shape.head_dim * 4
    return batch * shape.kv_heads * (slots * per_slot + state_bytes)


def forward_bytes(shape: Shape, batch: int, tokens: int, dtype_bytes: int, logits: int = 1) -> int:
    """One layer's activations of a forward pass without gradients over `tokens` tokens, and `logits` [B, S, V]
    float32 tensors (the dense reference's and a policy's: a teacher-forced evaluation)."""
    layer = batch * tokens * shape.layer_activations() * dtype_bytes
    return layer + logits * batch * tokens * shape.vocab * 4


def generation_bytes(model: nn.Module, cfg: Any, batch: int, prompt: int, new: int) -> dict[str, int]:
    """What generating `new` tokens after a `prompt`-token prompt adds to a loaded model: the bounded cache, the
    prompt's forward pass and the token ids."""
    shape = Shape.of(model.config)
    size = next(model.parameters()).element_size()
    return {"KV slots": kv_slot_bytes(shape, cfg, batch, size),
            "activations": forward_bytes(shape, batch, prompt, size, logits=0) + batch * shape.vocab * 4,
            "token ids": batch * (prompt + new) * 8}


def evaluation_bytes(model: nn.Module, batch: int, seq_len: int) -> dict[str, int]:
    """A teacher-forced pass over `seq_len` tokens beside the dense reference's (`kvpop eval`, `kvpop budgets`)."""
    shape = Shape.of(model.config)
    size = next(model.parameters()).element_size()
    rule = batch * shape.kv_heads * seq_len * (4 + 8) * shape.layers
    return {"activations": forward_bytes(shape, batch, seq_len, size, logits=2) + rule}


def training_bytes(model: nn.Module, rows: int, seq_len: int, *, teacher: bool, trainable: int,
                   device: str | torch.device) -> dict[str, int]:
    """One optimizer step of `kvpop train` on a loaded model: `rows` sequences of `seq_len` tokens per micro-batch
    on this rank, a dense teacher copy when `teacher`, and AdamW's gradient and two moments for `trainable` bytes
    of float32 parameters."""
    shape = Shape.of(model.config)
    # under CUDA autocast the matrices' inputs are kept in bfloat16
    size = 2 if torch.device(device).type == "cuda" else next(model.parameters()).element_size()
    acts = rows * seq_len * shape.layers * shape.layer_activations() * size
    # the student's logits, and the teacher's, for the KL; a scorer-only run computes the last position's only
    logits = 2 * rows * seq_len * shape.vocab * 4 if teacher else 0
    return {"activations": acts + logits, "teacher copy": parameter_bytes(model) if teacher else 0,
            "gradients and optimizer": 3 * trainable}


def check_generation(model: nn.Module, prompt: int, new: int, batch: int = 1) -> None:
    """`kvpop generate`: the bounded cache at the model's budget, the prompt's forward pass and the token ids."""
    from kvpop.modules import kvpop_modules

    c = kvpop_modules(model).config
    rows = f" and {batch} rows" if batch > 1 else ""
    check_fits(generation_bytes(model, c, batch, prompt, new), next(model.parameters()).device,
               f"--budget {c.budget} (sink {c.sink}, window {c.window}, topk {c.topk}) with a prompt of {prompt} tokens, "
               f"--max-new-tokens {new}{rows}", "lower --budget")


def check_decoding(model: nn.Module, cfgs: list[Any], batch: int, tokens: int, chunk: int, what: str,
                   hint: str) -> None:
    """Decoding `batch` rows of up to `tokens` tokens, beside the dense model's own (`eval --suite`, `eval --generate`,
    `selfgen`): the largest bounded cache among `cfgs`, the dense cache of the dense row, a forward pass over `chunk`
    tokens and its logits."""
    shape = Shape.of(model.config)
    size = next(model.parameters()).element_size()
    need = {"KV slots": max((kv_slot_bytes(shape, c, batch, size) for c in cfgs), default=0),
            "dense KV cache": batch * tokens * shape.layers * shape.kv_heads * 2 * shape.head_dim * size,
            "activations": forward_bytes(shape, batch, chunk, size, logits=1)}
    check_fits(need, next(model.parameters()).device, what, hint)


def check_evaluation(model: nn.Module, seq_len: int, batch: int = 1) -> None:
    """`kvpop eval` and `kvpop budgets`: teacher-forced passes over `seq_len` tokens."""
    check_fits(evaluation_bytes(model, batch, seq_len), next(model.parameters()).device,
               f"--seq-len {seq_len}", "lower --seq-len")


def check_training(model: nn.Module, tcfg: Any, world: int, device: str | torch.device, teacher: bool) -> None:
    """`kvpop train`, before the teacher copy and the first step: a step's micro-batch of `batch_size / world` rows."""
    from kvpop.modules import kvpop_modules

    scorers = sum(p.numel() for p in kvpop_modules(model).parameters()) * 4 if hasattr(model, "kvpop") else 0
    trainable = scorers if tcfg.freeze_base else parameter_bytes(model) + scorers
    need = training_bytes(model, tcfg.batch_size // world, tcfg.seq_len, teacher=teacher, trainable=trainable,
                          device=device)
    check_fits(need, device, f"--seq-len {tcfg.seq_len} with --batch-size {tcfg.batch_size}"
               + (f" over {world} ranks" if world > 1 else ""),
               "lower --seq-len or --batch-size (--grad-accum N keeps the batch in N smaller steps)")


def parameter_estimate(sizes: Mapping[str, int]) -> int:
    """Parameters of a decoder-only transformer of the sizes a config.json gives (`kvpop.files.check_model_config`),
    roughly: embeddings (and an untied output matrix), attention, MLP (times its experts)."""
    h = sizes.get("hidden_size", 0)
    heads = sizes.get("num_attention_heads", 1)
    kv = sizes.get("num_key_value_heads", heads)
    d = sizes.get("head_dim", h // max(1, heads))
    inter = sizes.get("intermediate_size", 4 * h)
    attention = h * heads * d * 2 + h * kv * d * 2
    mlp = 3 * h * inter * sizes.get("num_experts", 1)
    embeddings = sizes.get("vocab_size", 0) * h * (1 + sizes.get("output_matrices", 0))
    return embeddings + sizes.get("num_hidden_layers", 0) * (attention + mlp)


def check_weights(sizes: Mapping[str, int], dtype: Any, device_map: Any, what: str) -> None:
    """Before `from_pretrained`: the weights a config.json describes (`kvpop.files.check_model_config`'s sizes)
    must fit the CPU's memory, where transformers loads them."""
    if device_map is not None:
        return
    count = parameter_estimate(sizes)
    per = _dtype_bytes(dtype, default=sizes.get("dtype_bytes", 4))
    check_fits({"weights": count * per}, "cpu", f"{what} (about {count:.3g} parameters)",
               "load it on a machine with more memory, or in a smaller --dtype")

