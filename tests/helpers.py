"""Shared test factories: tiny random models built locally, seeded inputs, comparison helpers."""

from __future__ import annotations

import contextlib
import warnings

import torch

import kvpop

LOGIT_ATOL = 1e-4  # teacher-forced vs. prefill + decode, float32 (the bar)

ARCHS = ("qwen3", "llama")
HYBRID_ARCHS = ("gemma3", "gemma2")
"""Sliding-window and full-attention layers: the presets `tiny-random-gemma3` and `tiny-random-gemma2`."""


def tiny_model(arch: str = "qwen3", layers: int = 2, seed: int = 0, max_positions: int = 4096):
    """A float32 random model of the given family: 4 query heads over 2 KV heads (GQA), head dim 16."""
    import transformers as tf

    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config_cls, model_cls = {
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch in ("qwen3", "llama", "mistral") else {}
    if arch == "mistral":
        extra["sliding_window"] = None
    torch.manual_seed(seed)
    return model_cls(config_cls(**common, **extra)).eval()


def hybrid_model(arch: str = "gemma3"):
    """The float32 random preset `tiny-random-<arch>` (its own fixed seed), with sliding-window layers."""
    from kvpop.models import PRESETS

    return PRESETS[f"tiny-random-{arch}"].build()[0]


def retrofitted(arch: str = "qwen3", cfg: kvpop.KVpopConfig | None = None, seed: int = 0, **kw):
    cfg = cfg or kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16)
    base = hybrid_model(arch) if arch in HYBRID_ARCHS else tiny_model(arch, seed=seed, **kw)
    model = kvpop.retrofit(base, cfg)
    # a scorer at its random init ranks tokens too uniformly to exercise eviction; sharpen it
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for policy in model.kvpop.layers:
            if hasattr(policy, "scorer"):
                policy.scorer.w2.mul_(4.0)
            if policy.stateful:
                # a shared positive offset on q~ and k~ keeps the readout's denominator q~.n from cancelling,
                # whose float32 rounding would otherwise differ between executions (scorers/README.md: precision)
                d = policy.scorer.d
                policy.scorer.w_in[..., : 2 * d].mul_(0.5)
                policy.scorer.b_in[:, : 2 * d].add_(1.0)
    return model


def run_cached(model, ids, split, **fwd):
    """Prefill in the chunks `split` (lengths), then decode the rest one token at a time: (logits, cache).

    Checks on the way that no layer holds more than its budget (a sliding-window layer: its window) and that the
    slots were allocated once."""
    cache = kvpop.KVpopCache(model)
    budgets = [model.kvpop.layer_config(i).budget for i in range(len(cache.layers))]
    outs, start = [], 0
    steps = list(split) + [1] * (ids.shape[1] - sum(split))
    for n in steps:
        sl = slice(start, start + n)
        extra = {k: v[:, : start + n] if k == "attention_mask" else v[:, sl] for k, v in fwd.items()}
        outs.append(model(ids[:, sl], **extra, **cache_kwargs(cache)).logits)
        for used, budget in zip(cache.slots_used(), budgets):
            assert used.max() <= budget
        start += n
    for layer, budget in zip(cache.layers, budgets):
        assert layer.keys.shape[2] == budget  # preallocated, never grown
    return torch.cat(outs, 1), cache


def cache_kwargs(cache) -> dict:
    """Pass the cache under the name this transformers version prefers (5.24 renamed it to `cache`)."""
    import inspect

    import transformers

    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


@contextlib.contextmanager
def quiet():
    """Silence transformers' deprecation chatter in a with-block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    err = (actual.float() - expected.float()).abs()
    assert err.max() <= atol, f"{what}: max err {err.max().item():.3e}, mean err {err.mean().item():.3e} (atol {atol})"


def padded_batch(seqs: list[torch.Tensor], pad_id: int = 0):
    """Left-pad 1D id tensors into (ids, attention_mask, position_ids) as `generate` would."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, S - len(s):] = s
        mask[i, S - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def run_triton_check(code: str, what: str = "<triton check>") -> None:
    """Run a Triton kernel check (a script that prints "ok" at the end): in this process on CUDA, else in a
    subprocess under Triton's CPU interpreter (`TRITON_INTERPRET=1` must be set before Triton is imported)."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        exec(compile(code, what, "exec"), {})
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def left_padded(B: int, S: int, seed: int) -> torch.Tensor:
    """bool [B, S]: row 0 full, the others left-padded by a few tokens."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, S, dtype=torch.bool)
    for b in range(1, B):
        valid[b, : int(torch.randint(1, max(2, S // 3), (1,), generator=g))] = False
    return valid
