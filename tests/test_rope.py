"""Keys before RoPE (`scorer_keys="pre_rope"`): the inverse rotation, what the scorer sees, and train == decode."""

from __future__ import annotations

import pytest
import torch

import kvpop
from helpers import ARCHS, LOGIT_ATOL, assert_close, cache_kwargs, quiet, retrofitted
from kvpop.rope import unrotate

KEY_ATOL = 1e-5  # float32 rotation and its inverse


def _distinct_ids(n: int, seed: int = 0) -> torch.Tensor:
    # in layer 0 the same token id gives the same key before RoPE at any position: equal scores, whose
    # order then rests on rounding that may differ between executions (README of scorers); avoid repeats
    return (3 + torch.randperm(290, generator=torch.Generator().manual_seed(seed))[:n])[None]


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_unrotate_inverts_the_models_rotation(rope_scaling):
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=4096)
    if rope_scaling is not None:
        config.rope_parameters = {**rope_scaling, "rope_theta": 10000.0}
    rotary = LlamaRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    key = torch.randn(2, 2, 300, 16, generator=g)
    position = torch.randint(0, 4000, (2, 300), generator=g)
    cos, sin = rotary(key, position)
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        assert not torch.allclose(cos * cos + sin * sin, torch.ones(()))  # the attention scaling is exercised
    _, rotated = apply_rotary_pos_emb(key, key, cos, sin)
    assert_close(unrotate(rotated, (cos, sin)), key, KEY_ATOL, f"unrotate, {rope_scaling}")
    with pytest.raises(ValueError, match="rotary"):
        unrotate(rotated, None)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_the_scorer_reads_the_key_before_rope(arch):
    # Qwen3 normalises keys before RoPE: the scorer gets k_norm(k_proj(x)), Llama k_proj(x)
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16, scorer_keys="pre_rope")
    model = retrofitted(arch, cfg)
    attn = model.model.layers[1].self_attn
    policy = model.kvpop.layers[1]
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)
    real = type(policy).scorer_key
    with pytest.MonkeyPatch.context() as mp, quiet():
        mp.setattr(type(policy), "scorer_key", lambda self, key, rope: seen.setdefault(id(self), real(self, key, rope)))
        model(_distinct_ids(20))
    hook.remove()
    x = seen["x"]
    want = attn.k_proj(x).view(1, 20, -1, 16)
    if arch == "qwen3":
        want = attn.k_norm(want)
    assert_close(seen[id(policy)], want.transpose(1, 2), KEY_ATOL, f"{arch}: scorer key vs key before RoPE")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("split", [(1,), (9,), (7, 7, 7)], ids=str)
@pytest.mark.parametrize("pool", [0, 3], ids=["mlp", "cascade"])  # KVpop-mlp, and KVpop-cascade with 3 TOVA slots
@torch.no_grad()
def test_mlp_on_keys_before_rope_teacher_forced_equals_prefill_and_decode(arch, split, pool):
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16, scorer_keys="pre_rope", tova_pool=pool)
    model = retrofitted(arch, cfg)
    plain = retrofitted(arch, kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16))
    ids = _distinct_ids(48)
    with quiet():
        full = model(ids).logits
        cache = kvpop.KVpopCache(model)
        outs, start = [], 0
        for n in list(split) + [1] * (48 - sum(split)):
            outs.append(model(ids[:, start : start + n], **cache_kwargs(cache)).logits)
            start += n
        # the same weights on cached keys rank differently: the option is not a no-op
        assert not torch.allclose(plain(ids).logits, full)
    assert_close(torch.cat(outs, 1), full, LOGIT_ATOL, f"{arch}/{split}")
