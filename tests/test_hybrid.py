"""Hybrid models (sliding-window and full-attention layers) and the Gemma family's details, on the tiny random presets.

The policy runs in the full-attention layers; a sliding-window layer runs the rule with no sinks, its window and no
top-k. The central claim holds for both kinds of layer: teacher-forced == prefill (whole or chunked) + decode.
"""

import pytest
import torch

import kvpop
from helpers import (
    HYBRID_ARCHS,
    LOGIT_ATOL,
    assert_close,
    cache_kwargs,
    hybrid_model,
    padded_batch,
    quiet,
    retrofitted,
    run_cached,
    tiny_model,
)
from kvpop.attention import Capture
from kvpop.layer_kinds import FULL, SLIDING, describe_layers, kv_bytes, layer_kinds, layer_windows

S = 48
WINDOWS = {"gemma3": [16, 16, None, 16, 16, None], "gemma2": [24, None, 24, None]}
CONFIGS = {
    "base": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16),
    # every priority equal: the newer token wins each tie, in every execution
    "ties": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16),
    "pre-rope": kvpop.KVpopConfig(sink=2, window=4, topk=8, scorer_hidden=16, scorer_keys="pre_rope"),
    "mlstm": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="mlstm", mlstm_hidden=16),
    "streaming_llm": kvpop.KVpopConfig.for_budget(14, sink=2, policy="streaming_llm"),
    "tova": kvpop.KVpopConfig(sink=2, window=3, topk=9, policy="tova"),
    "tova-paper": kvpop.KVpopConfig.for_budget(14, policy="tova"),
    "h2o": kvpop.KVpopConfig(sink=2, window=5, topk=7, policy="h2o"),
    "dms": kvpop.KVpopConfig(sink=2, window=5, topk=7, policy="dms", scorer_hidden=16),
    "kvpop-tova": kvpop.KVpopConfig.for_budget(14, tova_prior=1.0, scorer_hidden=16),
    "cascade": kvpop.KVpopConfig.for_budget(14, tova_pool=3, scorer_hidden=16),
    "cascade-mean": kvpop.KVpopConfig.for_budget(14, tova_pool=9, tova_head_average=True, scorer_hidden=16),
    # per-layer budgets over the two full-attention layers
    "layers": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16, layer_topk=(3, 11)),
    "evidence": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="evidence", scorer_hidden=16),
}
SPLITS = [(1,), (7, 7, 7), (20, 15)]


def _model(arch: str, name: str):
    model = retrofitted(arch, CONFIGS[name])
    if name == "ties":
        with torch.no_grad():
            for policy in model.kvpop.policies:
                policy.scorer.w2.zero_()
                policy.scorer.b2.zero_()
    return model


# the evidence scorer reads the attention's own probabilities: Gemma 2's soft-capping refuses it (below)
CASES = [(arch, name) for arch in HYBRID_ARCHS for name in CONFIGS if (arch, name) != ("gemma2", "evidence")]


@pytest.fixture(scope="module")
def models():
    return {case: _model(*case) for case in CASES}


def _ids(seed=0, n=S, batch=1):
    return torch.randint(3, 250, (batch, n), generator=torch.Generator().manual_seed(seed))


# --- layer kinds ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_presets_mix_sliding_and_full_layers_with_one_kv_head(arch):
    model = retrofitted(arch)
    assert layer_windows(model.config) == WINDOWS[arch]
    assert model.config.num_key_value_heads == 1 and model.config.num_attention_heads == 4
    mods = model.kvpop
    assert mods.hybrid and mods.policy_layers == tuple(i for i, w in enumerate(WINDOWS[arch]) if w is None)
    for i, w in enumerate(WINDOWS[arch]):
        c = mods.layer_config(i)
        if w is None:
            assert mods.layers[i].sliding is False and (c.sink, c.window, c.topk) == (2, 5, 7)
        else:
            # a sliding layer is the rule with no sinks, its window and no long-range slots, and has no parameters
            assert mods.layers[i].sliding and (c.sink, c.window, c.topk) == (0, w, 0)
            assert not list(mods.layers[i].parameters())
    cache = kvpop.KVpopCache(model)
    with torch.no_grad(), quiet():
        model(_ids(0, 60), **cache_kwargs(cache))
    # a sliding layer holds its window, a full-attention layer its budget
    assert [layer.keys.shape[2] for layer in cache.layers] == [14 if w is None else w for w in WINDOWS[arch]]
    assert [int(u.max()) for u in cache.slots_used()] == [14 if w is None else w for w in WINDOWS[arch]]


def test_a_window_no_position_reaches_past_is_full_attention():
    import transformers as tf

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, max_window_layers=1)
    assert layer_windows(tf.Qwen2Config(**common, sliding_window=8)) == [None, 8]
    assert layer_windows(tf.Qwen2Config(**common, sliding_window=64)) == [None, None]
    # Qwen2 with a sliding layer is a hybrid too: 2 KV heads, no QK-norm
    torch.manual_seed(0)
    model = kvpop.retrofit(tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, sliding_window=8)).eval(),
                           kvpop.KVpopConfig(sink=1, window=3, topk=4, scorer_hidden=16))
    ids = _ids(1, 40)
    with torch.no_grad(), quiet():
        full = model(ids).logits
        cached, _ = run_cached(model, ids, (11,))
    assert_close(cached, full, LOGIT_ATOL, "qwen2 hybrid")


def _with_layer_types(types):
    model = tiny_model("qwen3")
    model.config.layer_types = types
    return model


@pytest.mark.parametrize("build, match", [
    (lambda: _with_layer_types(["chunked_attention", "full_attention"]),
     r"'qwen3' is not supported: it has chunked_attention layers \(attention within fixed-size chunks, as in Llama 4"),
    (lambda: _with_layer_types(["linear_attention", "full_attention"]), r"linear_attention layers \(linear attention"),
    (lambda: _with_layer_types(["mamba", "full_attention"]), r"mamba layers \(an attention kvpop does not run\)"),
    # every layer slides: the model's own cache is bounded already, and nothing is left to evict in
    (lambda: _sliding_mistral(8), r"'mistral' is not supported: every layer attends a sliding window of 8 tokens: its "
                                  r"cache is already bounded by that window, and kvpop's policies evict in "
                                  r"full-attention layers, of which it has none"),
    (lambda: _bidirectional_gemma3(), r"'gemma3_text' is not supported: its attention is bidirectional"),
    (lambda: _with_sinks(), r"learned sink logits to every softmax \(gpt-oss's `sinks`\)"),
], ids=["chunked", "linear", "other", "all-sliding", "bidirectional", "learned-sinks"])
def test_unsupported_attention_is_refused_with_its_reason(build, match):
    with pytest.raises(ValueError, match=match):
        kvpop.retrofit(build(), kvpop.KVpopConfig(sink=1, window=2, topk=2))


def _sliding_mistral(window):
    import transformers as tf

    return tf.MistralForCausalLM(tf.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=16, sliding_window=window))


def _bidirectional_gemma3():
    model = hybrid_model("gemma3")
    model.config.use_bidirectional_attention = True
    return model


def _with_sinks():
    model = tiny_model("qwen3")
    for layer in model.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    return model


def test_a_window_the_model_does_not_attend_is_refused_at_the_call():
    model = retrofitted("gemma3")
    model.model.layers[0].self_attn.sliding_window = 8  # the module now attends another window than its config's
    with pytest.raises(ValueError, match="layer 0 was retrofitted as a sliding window of 16, but the model attends it "
                                         "with sliding_window=8"), quiet():
        model(_ids(0, 10))


def test_per_layer_budgets_name_the_full_attention_layers():
    with pytest.raises(ValueError, match=r"one entry per full-attention layer of the model \(2 of its 6 layers\), got 6"):
        retrofitted("gemma3", kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=(7,) * 6))


# --- the central claim, both kinds of layer -------------------------------------------------------------------


@pytest.mark.parametrize("arch, cfg_name", CASES, ids="-".join)
@pytest.mark.parametrize("split", SPLITS, ids=str)
@torch.no_grad()
def test_teacher_forced_equals_prefill_and_decode(models, arch, cfg_name, split):
    model = models[(arch, cfg_name)]
    ids = _ids()
    with quiet():
        full = model(ids).logits
        cached, _ = run_cached(model, ids, split)
    assert_close(cached, full, LOGIT_ATOL, f"{arch}/{cfg_name}/{split}")


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "ties", "dms", "layers"])
@torch.no_grad()
def test_cache_holds_exactly_what_each_layer_retains(models, arch, cfg_name):
    model = models[(arch, cfg_name)]
    mods = model.kvpop
    ids = _ids(1)
    records = Capture()
    with quiet():
        model(ids, kvpop_capture=records)
        _, cache = run_cached(model, ids, (10,))
    # records come from the full-attention layers only
    assert [r.layer_idx for r in records] == list(mods.policy_layers)
    for rec in records:
        c = mods.layer_config(rec.layer_idx)
        want = kvpop.retention_mask(rec.priority, c.sink, c.window, c.topk)[0, :, -1]  # what the last query may see
        layer = cache.layers[rec.layer_idx]
        for h in range(want.shape[0]):
            assert sorted(p for p in layer.pos[0, h].tolist() if p >= 0) == want[h].nonzero().flatten().tolist()
    for i, w in enumerate(mods.windows):
        if w is not None:
            assert sorted(cache.layers[i].pos[0, 0].tolist()) == list(range(S - w, S))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@torch.no_grad()
def test_dense_mode_and_an_unreached_budget_are_the_original_model(arch):
    # the teacher attends each sliding layer's window with the model's own scale and soft-capping: bit-near equal
    base = hybrid_model(arch)
    ids = _ids(2, 60)
    want = base(ids).logits
    model = kvpop.retrofit(base, kvpop.KVpopConfig(sink=4, window=30, topk=40, scorer_hidden=16))
    with quiet():
        assert_close(model(ids, kvpop_dense=True).logits, want, 1e-5, "kvpop_dense")
        # a budget above the length evicts nothing from the full layers; the sliding layers slide as before
        assert_close(model(ids).logits, want, 1e-5, "budget > length")
        cached, _ = run_cached(model, ids, (23,))
        assert_close(cached, want, LOGIT_ATOL, "cached, budget > length")
        kvpop.detach(model)
        assert_close(model(ids).logits, want, 1e-5, "after detach")


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@torch.no_grad()
def test_eviction_acts_in_the_full_layers_only(arch):
    # a small budget in the full layers changes the logits; a sliding window wider than the sequence is dense
    model = retrofitted(arch)
    ids = _ids(3, 14)
    with quiet():
        dense = model(ids, kvpop_dense=True).logits
        sparse = model(ids).logits
        longer = torch.cat([ids, _ids(4, 34)], 1)
        assert (model(longer).logits - model(longer, kvpop_dense=True).logits).abs().max() > 1e-3
    assert_close(sparse, dense, 1e-5, "within budget and window")


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "tova"])
@pytest.mark.parametrize("n", [1, 13, 40], ids=str)
@torch.no_grad()
def test_fresh_prefill_equals_the_general_chunk_path(models, arch, cfg_name, n):
    # a fresh cache runs the rule over the chunk alone: in both kinds of layer its slots are the general path's. Bit
    # for bit where both paths run one kernel; with Gemma 2's soft-capping the fresh chunk's attention runs per
    # gathered tile and the general one over all candidates, so the later layers' keys differ by float rounding
    exact = arch != "gemma2"
    model = models[(arch, cfg_name)]
    ids, mask, pos = padded_batch([_ids(6, 40)[0][:n], _ids(7, 40)[0]])
    caches = [kvpop.KVpopCache(model), kvpop.KVpopCache(model)]
    for layer in caches[1].layers:
        layer.fresh = False  # empty slots, but the general path
    with quiet():
        outs = [model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(c)).logits for c in caches]
    assert_close(outs[0], outs[1], LOGIT_ATOL, f"{arch}/{cfg_name}/{n}")
    for fast, general in zip(*(c.layers for c in caches)):
        assert torch.equal(fast.pos, general.pos)
        for name in ("pri", "keys", "values"):
            a, b = getattr(fast, name), getattr(general, name)
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "mlstm", "tova", "dms", "cascade", "kvpop-tova"])
@torch.no_grad()
def test_batch_with_left_padding(models, arch, cfg_name):
    model = models[(arch, cfg_name)]
    a, b = _ids(2, 40)[0], _ids(3, 29)[0]
    ids, mask, pos = padded_batch([a, b])
    with quiet():
        alone = [model(x[None]).logits[0] for x in (a, b)]
        full = model(ids, attention_mask=mask, position_ids=pos).logits
        cached, _ = run_cached(model, ids, (15,), attention_mask=mask, position_ids=pos)
    for out, what in ((full, "teacher-forced"), (cached, "cached")):
        assert_close(out[0], alone[0], LOGIT_ATOL, f"{what} row 0")
        assert_close(out[1, -29:], alone[1], LOGIT_ATOL, f"{what} row 1 (padded)")


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "tova"])
@torch.no_grad()
def test_generate_greedy_batched_equals_single(models, arch, cfg_name):
    model = models[(arch, cfg_name)]
    a, b = _ids(4, 30)[0], _ids(5, 21)[0]
    ids, mask, _ = padded_batch([a, b])
    with quiet():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0, **cache_kwargs(kvpop.KVpopCache(model)))
        for row, x in enumerate((a, b)):
            single = model.generate(x[None], max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                    **cache_kwargs(kvpop.KVpopCache(model)))
            assert torch.equal(batch[row, -single.shape[1]:], single[0])
        # each generated token is the argmax of the teacher-forced sparse forward at the previous position
        logits = model(single).logits
    assert torch.equal(logits[0, b.shape[0] - 1 : -1].argmax(-1), single[0, b.shape[0]:])


@torch.no_grad()
def test_generate_compiles_one_graph_for_both_kinds_of_layer(models):
    # generate's compiled decode step (forced on the CPU, traced without code generation) over a soft-capped hybrid
    # model with a dynamic policy: one graph, no break, no recompilation, the eager tokens
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model = models[("gemma2", "tova")]
    ids, mask, _ = padded_batch([_ids(7, 30)[0], _ids(8, 21)[0]])
    config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with quiet():
        eager = model.generate(ids, **kw, **cache_kwargs(kvpop.KVpopCache(model)), disable_compile=True)
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = model.generate(ids, **kw, **cache_kwargs(kvpop.KVpopCache(model)), compile_config=config)
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    assert torch.equal(compiled, eager)


def test_compiled_decoder_step_equals_eager(models):
    from kvpop.decode import Decoder

    model = models[("gemma3", "base")]
    ids = _ids(9, 19, batch=2)
    results = []
    for compile in (False, True):
        cache = kvpop.KVpopCache(model)
        decoder = Decoder(model, cache, compile=compile, backend="aot_eager")
        torch._dynamo.reset()
        with quiet(), torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            nxt = decoder.prefill(ids, chunk=8).argmax(-1, keepdim=True)
            position = torch.full((2, 1), ids.shape[1])
            logits = []
            with decoder.decoding():
                for _ in range(10):
                    out = decoder.step(nxt, position).clone()
                    nxt = out.argmax(-1, keepdim=True)
                    logits.append(out)
                    position += 1
        torch._dynamo.reset()
        results.append((torch.stack(logits, 1), [layer.pos.clone() for layer in cache.layers]))
    assert_close(results[1][0], results[0][0], LOGIT_ATOL, "compiled vs eager")
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


# --- save / load, training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, cfg_name", [("gemma3", "base"), ("gemma2", "mlstm")])
def test_save_load_round_trip(models, tmp_path, arch, cfg_name):
    model = models[(arch, cfg_name)]
    ids = _ids(10)
    with torch.no_grad(), quiet():
        want = model(ids).logits
        kvpop.save(model, tmp_path / "m")
        # the rule it was saved with (a static KVpop-mlp loads as the recommended policy otherwise)
        loaded = kvpop.load(tmp_path / "m", rule="static")
        got = loaded(ids).logits
        cached, _ = run_cached(loaded, ids, (17,))
    assert torch.equal(got, want)
    assert_close(cached, want, LOGIT_ATOL, "cached after load")
    assert loaded.kvpop.windows == model.kvpop.windows
    # scorer weights of the full-attention layers only: the sliding layers have none
    saved = {k.split(".")[1] for k in loaded.kvpop.state_dict()}
    assert saved == {str(i) for i in model.kvpop.policy_layers}


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_training_forward_equals_inference_and_grads_reach_the_full_layers_only(arch):
    # with gradients the CPU attends each query tile's gathered keys (soft-capped logits in Gemma 2's case), every
    # layer under its own mask: the logits are those of the inference path
    model = retrofitted(arch, CONFIGS["base"])
    ids = _ids(11)
    with torch.no_grad(), quiet():
        want = model(ids).logits
    records = Capture()
    with quiet():
        logits = model(ids, kvpop_capture=records).logits
    assert_close(logits, want, 1e-5, "grad vs no-grad path")
    assert [r.layer_idx for r in records] == list(model.kvpop.policy_layers)
    # what the model's module passes: Gemma 2's query_pre_attn_scalar (32, not the head dim) and soft-capping
    assert all(r.scale == (32**-0.5 if arch == "gemma2" else 16**-0.5) for r in records)
    assert all(r.softcap == (3.0 if arch == "gemma2" else None) for r in records)
    torch.stack([r.priority.sum() for r in records]).sum().backward()
    for i, policy in enumerate(model.kvpop.layers):
        grads = [p.grad for p in policy.parameters()]
        assert all(g is not None for g in grads) if i in model.kvpop.policy_layers else not grads


@pytest.mark.parametrize("arch, policy", [("gemma3", "kvpop"), ("gemma2", "kvpop"), ("gemma2", "dms")])
def test_training_runs_on_a_hybrid_model(tmp_path, arch, policy):
    import json

    from kvpop.train import distill

    text = tmp_path / "notes.txt"
    text.write_text(" ".join(["the cat sat on a mat and then it ran to the big red house"] * 60))
    tcfg = distill.TrainConfig(model=f"tiny-random-{arch}", data=str(text), seq_len=64, steps=3, batch_size=2,
                               out=str(tmp_path / "run"), save_every=0, lr_scorer=1e-2, max_tokens=64 * 8)
    final = distill.train(tcfg, kvpop.KVpopConfig(sink=2, window=8, topk=8, scorer_hidden=16, policy=policy),
                          progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(torch.isfinite(torch.tensor([r["loss"], r["loss_score"]])).all() for r in log)
    model = kvpop.load(final)
    assert model.kvpop.windows == tuple(WINDOWS[arch])
    with torch.no_grad(), quiet():
        full = model(_ids(12)).logits
        cached, _ = run_cached(model, _ids(12), (9,))
    assert_close(cached, full, LOGIT_ATOL, "trained, reloaded")


@torch.no_grad()
def test_oracle_and_recall_on_a_hybrid_model(models):
    # the oracle's priorities are listed per full-attention layer and found by each layer's place among them
    from kvpop.eval.metrics import model_recall, oracle_priorities

    model = retrofitted("gemma3", kvpop.KVpopConfig(sink=2, window=5, topk=7, policy="oracle"))
    ids = _ids(13)
    with quiet():
        teacher = oracle_priorities(model, ids)
        assert len(teacher) == 2 and all(t.shape == (1, 1, S) for t in teacher)
        logits = model(ids, kvpop_priority=teacher).logits
        swapped = model(ids, kvpop_priority=teacher[::-1]).logits
        recall = model_recall(models[("gemma3", "base")], [ids])
    assert torch.isfinite(logits).all() and (swapped - logits).abs().max() > 1e-4
    assert recall.per_layer.shape == (2,) and 0 < recall.mean < 1


# --- the Gemma family's details -------------------------------------------------------------------------------


@pytest.mark.parametrize("keys", ["cached", "pre_rope"])
@torch.no_grad()
def test_the_scorer_reads_keys_as_cached_after_qk_norm_or_unrotated_by_its_own_layer_rope(keys):
    # Gemma 3 normalises keys (k_norm) before RoPE, with another RoPE base in the sliding layers: the scorer of a
    # full layer reads the cached key (normalised, rotated), or with pre_rope the normalised key before its own
    # layer's rotation (unrotating with the sliding layers' base would give something else)
    from kvpop.rope import rotate_half

    model = retrofitted("gemma3", kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16, scorer_keys=keys))
    ids = _ids(14, 20)
    normed, scored, attended = {}, {}, {}
    hooks = []
    for i in model.kvpop.policy_layers:
        attn = model.model.layers[i].self_attn
        hooks.append(attn.k_norm.register_forward_hook(lambda m, a, out, i=i: normed.__setitem__(i, out)))
        scorer = model.kvpop.layers[i].scorer
        hooks.append(scorer.register_forward_pre_hook(lambda m, a, i=i: scored.__setitem__(i, a[0])))
    records = Capture()
    with quiet():
        model(ids, kvpop_capture=records)
    for h in hooks:
        h.remove()
    for rec in records:
        attended[rec.layer_idx] = rec.key
    rope = model.model.rotary_emb
    pos = torch.arange(20)[None]
    for i in model.kvpop.policy_layers:
        if keys == "cached":
            assert torch.equal(scored[i], attended[i])
            continue
        assert_close(scored[i], normed[i], 1e-5, f"layer {i}: pre-RoPE key")
        cos, sin = rope(normed[i], pos, "sliding_attention")
        wrong = attended[i] * cos[:, None] - rotate_half(attended[i]) * sin[:, None]
        assert (wrong - normed[i]).abs().max() > 1e-2


@torch.no_grad()
def test_the_attention_is_soft_capped_in_every_execution():
    # without its soft-capping Gemma 2 gives other logits; kvpop's teacher-forced, prefill and decode paths all give
    # the capped ones (the dense teacher equals the model's own eager attention: test above)
    model = retrofitted("gemma2", CONFIGS["tova"])
    ids = _ids(15)
    with quiet():
        capped = model(ids).logits
        cached, _ = run_cached(model, ids, (13,))
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(ids).logits
    assert_close(cached, capped, LOGIT_ATOL, "cached, soft-capped")
    assert (uncapped - capped).abs().max() > 1e-2


def test_evidence_scorer_refuses_soft_capping():
    model = retrofitted("gemma2", CONFIGS["evidence"])
    with pytest.raises(ValueError, match="the evidence scorer does not take logit soft-capping"), quiet():
        model(_ids(0, 10))


# --- what each kind holds ---------------------------------------------------------------------------------------


def test_kv_bytes_per_layer_kind():
    config = hybrid_model("gemma3").config
    assert layer_kinds(config) == [SLIDING, SLIDING, FULL] * 2
    assert describe_layers(config) == "full attention in layers 2, 5; a sliding window of 16 tokens in the other 4"
    # one KV head of dim 16: 64 bytes per token and layer in bfloat16 (keys and values)
    dense = kv_bytes(config, 100)
    assert dense[FULL] == (2, 200, 200 * 64) and dense[SLIDING] == (4, 64, 64 * 64)
    assert kv_bytes(config, 10)[SLIDING].tokens == 40
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=(3, 11))
    bounded = kv_bytes(config, 100, cfg, dtype=torch.float32)
    assert bounded[FULL] == (2, 10 + 18, 28 * 128) and bounded[SLIDING] == (4, 64, 64 * 128)
    assert kv_bytes(tiny_model("qwen3").config, 100).keys() == {FULL}
    with pytest.raises(ValueError, match="one entry per full-attention layer"):
        kv_bytes(config, 100, kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=(7, 7, 7)))
    with pytest.raises(ValueError, match="length=-1"):
        kv_bytes(config, -1)


def test_cache_bytes_count_both_kinds_of_layer():
    from kvpop.eval.bench import cache_bytes

    model = retrofitted("gemma3")
    cache = kvpop.KVpopCache(model)
    with torch.no_grad(), quiet():
        model(_ids(16, 30), **cache_kwargs(cache))
    slots = sum(layer.buffers[0].shape[2] for layer in cache.layers)  # each layer's slots and its scratch slot
    assert slots == 2 * 15 + 4 * 17
    # keys and values (float32, one head of dim 16), positions (int64) and priorities (float32) per slot
    per_slot = 2 * 16 * 4 + 8 + 4
    assert cache_bytes(cache) == slots * per_slot + sum(8 * 2 for _ in cache.layers)


def test_cli_generate_reports_both_kinds_of_layer(capsys):
    import re

    from kvpop.cli import main

    rc = main(["generate", "--model", "tiny-random-gemma3", "--prompt", "The quick brown fox jumps over the lazy dog",
               "--sink", "2", "--window", "4", "--topk", "6", "--max-new-tokens", "12"])
    err = capsys.readouterr().err
    assert rc == 0, err
    line = re.search(r"cache: (\d+) of (\d+) slots per full-attention layer and KV head \(2 layers\), (\d+) of (\d+) "
                     r"per sliding-window layer \(4 layers\)", err)
    assert line, err
    assert [int(x) for x in line.groups()] == [12, 12, 16, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch, cfg_name", [("gemma3", "base"), ("gemma2", "base"), ("gemma2", "tova")])
def test_cuda_paths_equal_the_cpu_paths(arch, cfg_name):
    # FlexAttention (its soft-capping `score_mod`), the Triton slot step, the soft-capped decode fallback, and the
    # training forward's backward and target, against the CPU's
    from kvpop.ops.target import future_attention_target

    model = _model(arch, cfg_name)
    ids = _ids(17, 300)
    with torch.no_grad(), quiet():
        cpu = model(ids).logits
    records = Capture()
    with quiet():
        model(ids, kvpop_capture=records).logits.float().square().mean().backward()
    cpu_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    model.cuda()
    with torch.no_grad(), quiet():
        gpu = model(ids.cuda()).logits.cpu()
        cache = kvpop.KVpopCache(model)
        first = model(ids[:, :100].cuda(), **cache_kwargs(cache)).logits
        rest = [model(ids[:, t : t + 1].cuda(), **cache_kwargs(cache)).logits for t in range(100, 300)]
        decoded = torch.cat([first, *rest], 1).cpu()
    assert_close(gpu, cpu, 2e-4, "flex vs cpu")
    assert_close(decoded, cpu, 2e-4, "cuda decode vs cpu")
    gpu_records = Capture()
    with quiet():
        model(ids.cuda(), kvpop_capture=gpu_records).logits.float().square().mean().backward()
    gpu_grads = [p.grad.cpu() for p in model.parameters() if p.grad is not None]
    assert len(gpu_grads) == len(cpu_grads)
    for a, b in zip(gpu_grads, cpu_grads):
        assert_close(a, b, 1e-3 * max(1.0, b.abs().max().item()), "gradient")
    for a, b in zip(gpu_records, records):
        if a.lse is None:
            continue
        c = model.kvpop.layer_config(a.layer_idx)
        targets = [future_attention_target(r.query.detach(), r.key.detach(), r.lse.detach(), c.window, scale=r.scale,
                                           softcap=r.softcap).cpu() for r in (a, b)]
        assert_close(targets[0], targets[1], 1e-3, f"target, layer {a.layer_idx}")
