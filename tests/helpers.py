"""Shared test factories: tiny random models built locally, seeded inputs, comparison helpers."""

from __future__ import annotations

import contextlib
import dataclasses
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



@dataclasses.dataclass(frozen=True)
class GgufVocab:
    """A tokenizer as a GGUF file states it (llama.cpp's `tokenizer.ggml.*` keys)."""

    model: str
    """"gpt2" (byte-level BPE) or "llama" (sentencepiece with byte fallback)."""
    tokens: list[str]
    types: list[int]
    bos: int
    eos: int
    pad: int


def _byte_level_vocab() -> GgufVocab:
    from kvpop.models import byte_tokenizer

    tok = byte_tokenizer()
    special = set(tok.all_special_ids)
    return GgufVocab("gpt2", tok.convert_ids_to_tokens(list(range(len(tok)))),
                     [3 if i in special else 1 for i in range(len(tok))], tok.bos_token_id, tok.eos_token_id,
                     tok.pad_token_id)


def _gemma_vocab() -> GgufVocab:
    # Gemma's layout: <pad> <eos> <bos> <unk> <mask>, the 256 byte-fallback pieces, then words; a few merges' worth
    words = ["\u2581", *"abcdefghijklmnopqrstuvwxyzHT,.", "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    types = [3, 3, 3, 2, 4, *[6] * 256, *[1] * len(words)]  # control, unknown, user-defined, byte, normal
    return GgufVocab("llama", tokens, types, bos=2, eos=1, pad=0)


def tiny_gguf_model(arch: str, seed: int = 0):
    """`(model, vocab)`: a float32 random Gemma 3 or Llama whose config is exactly what transformers rebuilds from the
    GGUF metadata `write_gguf` writes (Gemma 3: 6 layers, the 5:1 pattern's full attention in layer 5, window 16, a
    sentencepiece vocabulary laid out as Gemma's; Llama: 2 layers, the byte-level tokenizer of the tiny presets)."""
    import transformers as tf

    vocab = _gemma_vocab() if arch == "gemma3" else _byte_level_vocab()
    common = dict(vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=vocab.bos, eos_token_id=vocab.eos, pad_token_id=vocab.pad, initializer_range=0.1)
    if arch == "gemma3":
        config = tf.Gemma3TextConfig(**common, num_hidden_layers=6, num_key_value_heads=1, sliding_window=16)
        model_cls = tf.Gemma3ForCausalLM
    else:
        config = tf.LlamaConfig(**common, num_hidden_layers=2, num_key_value_heads=2)
        model_cls = tf.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        # random norm weights, so that a lost offset or permutation in the file shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.normal_(0.0, 0.1)
    return model, vocab


def write_gguf(model, vocab: GgufVocab, path) -> None:
    """Write `model` and `vocab` (from `tiny_gguf_model`) as a float32 GGUF file, laid out as llama.cpp writes it."""
    import gguf
    import numpy as np

    c = model.config
    arch = {"gemma3_text": "gemma3", "llama": "llama"}[c.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny random {arch}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
        writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    else:
        writer.add_rope_dimension_count(c.head_dim)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores([0.0] * len(vocab.tokens))
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_pad_token_id(vocab.pad)
    if vocab.model == "llama":
        writer.add_unk_token_id(vocab.types.index(2))
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.LLAMA,
                                     c.num_hidden_layers)
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        w = value.detach().float().numpy().copy()
        if arch == "gemma3" and "norm" in name:
            # llama.cpp stores Gemma's RMSNorm scale as 1 + w
            w = w + 1.0
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            # llama.cpp interleaves the rotary halves of q and k
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
