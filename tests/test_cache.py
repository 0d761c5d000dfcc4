"""The central claim: teacher-forced sparse forward == prefill (whole or chunked) + token-by-token decode."""

import pytest
import torch

import kvpop
from helpers import ARCHS, LOGIT_ATOL, assert_close, cache_kwargs, padded_batch, quiet, retrofitted, run_cached
from kvpop.attention import Capture

S = 48
CONFIGS = {
    "base": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16),
    "no-sink": kvpop.KVpopConfig(sink=0, window=3, topk=4, scorer_hidden=16),
    "window-1": kvpop.KVpopConfig(sink=2, window=1, topk=5, scorer_hidden=16),
    "topk-0": kvpop.KVpopConfig(sink=3, window=4, topk=0, scorer_hidden=16),
    "budget>S": kvpop.KVpopConfig(sink=4, window=30, topk=30, scorer_hidden=16),
    "streaming_llm": kvpop.KVpopConfig.for_budget(14, sink=2, policy="streaming_llm"),
    "tova": kvpop.KVpopConfig(sink=2, window=3, topk=9, policy="tova"),
    "tova-head-average": kvpop.KVpopConfig(sink=0, window=1, topk=13, policy="tova", tova_head_average=True),
    "h2o": kvpop.KVpopConfig(sink=2, window=5, topk=7, policy="h2o"),
    # TOVA and H2O as their papers define them: no sinks; a window of 1 (TOVA), half the budget (H2O)
    "tova-paper": kvpop.KVpopConfig.for_budget(14, policy="tova"),
    "h2o-paper": kvpop.KVpopConfig.for_budget(14, policy="h2o"),
    # per-token eviction gates (-inf priorities) with the oldest-first overflow of the fixed buffer
    "dms": kvpop.KVpopConfig(sink=2, window=5, topk=7, policy="dms", scorer_hidden=16),
    # the stateful scorer: read out when leaving the window (the method), at insertion, and in between
    "mlstm": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="mlstm", mlstm_hidden=16),
    "mlstm-delay0": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="mlstm", mlstm_hidden=16, delay=0),
    "mlstm-delay2": kvpop.KVpopConfig(sink=0, window=4, topk=5, scorer="mlstm", mlstm_hidden=0, delay=2),
    # per-layer budgets at the same total memory (docs/method.md Sec. 8): each layer its own static shapes
    "layers": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16, layer_topk=(3, 11)),
    "tova-layers": kvpop.KVpopConfig(sink=2, window=3, topk=9, policy="tova", layer_topk=(0, 18)),
    # the delayed evidence scorer (Sec. 7b): window sums per ring slot, read out when leaving the window
    "evidence": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="evidence", scorer_hidden=16),
    "evidence-w1-additive": kvpop.KVpopConfig(sink=0, window=1, topk=5, scorer="evidence", scorer_hidden=16,
                                              evidence_mix="additive"),
    "evidence-pre-rope": kvpop.KVpopConfig(sink=3, window=4, topk=6, scorer="evidence", scorer_hidden=16,
                                           scorer_keys="pre_rope"),
    "evidence-layers": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="evidence", scorer_hidden=16,
                                         layer_topk=(12, 2)),
    # KVpop-TOVA (Sec. 7b extension): TOVA's evidence plus the scorer's prior, carried per slot
    "kvpop-tova": kvpop.KVpopConfig.for_budget(14, tova_prior=1.0, scorer_hidden=16),
    "kvpop-tova-windowed": kvpop.KVpopConfig(sink=2, window=3, topk=9, tova_prior=0.5, scorer_hidden=16,
                                             scorer_keys="pre_rope"),
    # KVpop-cascade (Sec. 7b extension): the static rule's rejects compete for a TOVA-ranked pool
    "kvpop-cascade": kvpop.KVpopConfig.for_budget(14, tova_pool=3, scorer_hidden=16),
    "kvpop-cascade-layers": kvpop.KVpopConfig(sink=2, window=3, topk=9, tova_pool=4, scorer_hidden=16,
                                              layer_topk=(5, 13)),
    # the layer-wide cascade: TOVA's paper ranking takes each token first, per-head static pools keep its evictions
    "kvpop-cascade-mean": kvpop.KVpopConfig.for_budget(14, tova_pool=9, tova_head_average=True, scorer_hidden=16),
    "kvpop-cascade-mean-windowed": kvpop.KVpopConfig(sink=2, window=3, topk=9, tova_pool=5, tova_head_average=True,
                                                     scorer_hidden=16, scorer_keys="pre_rope"),
}


@pytest.fixture(scope="module")
def models():
    return {(arch, name): retrofitted(arch, cfg) for arch in ARCHS for name, cfg in CONFIGS.items()}


def _ids(seed=0, n=S, batch=1):
    return torch.randint(3, 300, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("split", [(1,), (9,), (23,), (7, 7, 7), (13, 20, 15)], ids=str)
@torch.no_grad()
def test_teacher_forced_equals_prefill_and_decode(models, arch, cfg_name, split):
    # every policy: the sparse teacher-forced forward is what prefill + decode computes
    model = models[(arch, cfg_name)]
    ids = _ids()
    with quiet():
        full = model(ids).logits
        cached, _ = run_cached(model, ids, split)
    assert_close(cached, full, LOGIT_ATOL, f"{arch}/{cfg_name}/{split}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "mlstm", "mlstm-delay0", "dms", "evidence"])
@torch.no_grad()
def test_cache_holds_exactly_what_the_rule_retains(models, arch, cfg_name):
    model = models[(arch, cfg_name)]
    cfg = model.kvpop.config
    ids = _ids(1)
    records = Capture()
    with quiet():
        model(ids, kvpop_capture=records)
        _, cache = run_cached(model, ids, (10,))
    for rec, layer in zip(records, cache.layers):
        mask = kvpop.retention_mask(rec.priority, cfg.sink, cfg.window, cfg.topk)  # [1, H, S, S]
        want = mask[0, :, -1]  # what the last query may see
        for h in range(want.shape[0]):
            held = sorted(p for p in layer.pos[0, h].tolist() if p >= 0)
            assert held == want[h].nonzero().flatten().tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "no-sink", "window-1", "topk-0", "budget>S", "streaming_llm", "dms",
                                      "layers", "tova", "kvpop-cascade"])
@pytest.mark.parametrize("n", [1, 13, 40], ids=str)
@torch.no_grad()
def test_fresh_prefill_equals_the_general_chunk_path(models, arch, cfg_name, n):
    # a fresh cache runs the rule over the chunk alone (no empty slots among the candidates) and writes the survivors
    # by one gather: the slots must hold exactly what the general path (slots + chunk) leaves, bit for bit
    model = models[(arch, cfg_name)]
    a, b = _ids(6, 40)[0][:n], _ids(7, 40)[0]
    ids, mask, pos = padded_batch([a, b])  # left padding: invalid tokens in the chunk too
    caches = [kvpop.KVpopCache(model), kvpop.KVpopCache(model)]
    for layer in caches[1].layers:
        layer.fresh = False  # empty slots, but the general path
    with quiet():
        outs = [model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(c)).logits for c in caches]
    assert_close(outs[0], outs[1], LOGIT_ATOL, f"{arch}/{cfg_name}/{n}")
    for fast, general in zip(*(c.layers for c in caches)):
        for name in ("pos", "pri", "keys", "values"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "streaming_llm", "tova", "h2o", "mlstm", "mlstm-delay0", "dms", "evidence",
                                      "evidence-pre-rope", "kvpop-tova", "kvpop-cascade", "kvpop-cascade-mean"])
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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg_name", ["base", "mlstm", "streaming_llm", "tova", "h2o", "dms", "evidence", "kvpop-tova",
                                      "kvpop-cascade", "kvpop-cascade-mean"])
@torch.no_grad()
def test_generate_greedy_batched_equals_single(models, arch, cfg_name):
    model = models[(arch, cfg_name)]
    a, b = _ids(4, 30)[0], _ids(5, 21)[0]
    ids, mask, _ = padded_batch([a, b])
    with quiet():
        # min_new_tokens: a row that hit EOS would be padded, which is not what is compared here
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25, do_sample=False,
                               pad_token_id=0, **cache_kwargs(kvpop.KVpopCache(model)))
        for row, x in enumerate((a, b)):
            single = model.generate(x[None], max_new_tokens=25, min_new_tokens=25, do_sample=False,
                                    **cache_kwargs(kvpop.KVpopCache(model)))
            assert torch.equal(batch[row, -single.shape[1]:], single[0])


@torch.no_grad()
def test_generate_greedy_matches_teacher_forced_argmax(models):
    model = models[("qwen3", "base")]
    ids = _ids(6, 12)
    with quiet():
        out = model.generate(ids, max_new_tokens=30, do_sample=False, **cache_kwargs(kvpop.KVpopCache(model)))
        logits = model(out).logits
    # each generated token is the argmax of the teacher-forced sparse forward at the previous position
    assert torch.equal(logits[0, 11:-1].argmax(-1), out[0, 12:])


@torch.no_grad()
def test_generate_sampling_and_multi_turn(models):
    model = models[("llama", "base")]
    ids = _ids(7, 20)
    with quiet():
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=20, do_sample=True, top_p=0.9, temperature=0.8,
                                 **cache_kwargs(kvpop.KVpopCache(model)))
        assert sampled.shape == (1, 40)
        cache = kvpop.KVpopCache(model)
        turn1 = model.generate(ids, max_new_tokens=10, do_sample=False, **cache_kwargs(cache))
        turn2_in = torch.cat([turn1, _ids(8, 9)], 1)
        turn2 = model.generate(turn2_in, max_new_tokens=10, do_sample=False, **cache_kwargs(cache))
        fresh = model.generate(turn2_in, max_new_tokens=10, do_sample=False, **cache_kwargs(kvpop.KVpopCache(model)))
    assert torch.equal(turn2, fresh)
    assert cache.get_seq_length() == turn2.shape[1] - 1


@torch.no_grad()
def test_past_key_values_keyword_still_works(models):
    model = models[("qwen3", "base")]
    ids = _ids(9, 20)
    with quiet():
        full = model(ids).logits
        cache = kvpop.KVpopCache(model)
        first = model(ids[:, :12], past_key_values=cache).logits
        rest = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(12, 20)]
    assert_close(torch.cat([first, *rest], 1), full, LOGIT_ATOL, "past_key_values=")


@torch.no_grad()
def test_decoding_without_the_bounded_cache_is_refused(models):
    model = models[("qwen3", "base")]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with quiet():
        model(_ids(0, 10), **cache_kwargs(cache))  # a fresh cache is a plain teacher-forced forward
        with pytest.raises(ValueError, match="KVpopCache"):
            model(_ids(0, 1), **cache_kwargs(cache))


def test_cache_memory_is_flat():
    model = retrofitted("qwen3", CONFIGS["base"])
    cache = kvpop.KVpopCache(model)
    with torch.no_grad(), quiet():
        model(_ids(0, 20), **cache_kwargs(cache))
        sizes = {layer.keys.data_ptr(): layer.keys.numel() for layer in cache.layers}
        for t in range(200):
            model(_ids(t, 1), **cache_kwargs(cache))
    # same buffers, same sizes, however long the generation
    assert {layer.keys.data_ptr(): layer.keys.numel() for layer in cache.layers} == sizes
    assert cache.get_seq_length() == 220


@torch.no_grad()
def test_stateful_memory_follows_the_batch_rows(models):
    # reset / batch_select / reorder / repeat_interleave carry the mLSTM memory with the slots
    model = models[("qwen3", "mlstm")]
    a, b = _ids(10, 30), _ids(11, 30)
    with quiet():
        alone = [run_cached(model, x, (17,))[0] for x in (a, b)]
        cache = kvpop.KVpopCache(model)
        model(torch.cat([a, b])[:, :17], **cache_kwargs(cache))
        assert all(layer.state is not None for layer in cache.layers)
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.batch_repeat_interleave(2)  # rows b, b, a, a
        cache.batch_select_indices(torch.tensor([1, 2]))  # rows b, a
        rest = [model(torch.cat([b, a])[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(17, 30)]
        rest = torch.cat(rest, 1)
        assert_close(rest[0], alone[1][0, 17:], LOGIT_ATOL, "row b after reorder/repeat/select")
        assert_close(rest[1], alone[0][0, 17:], LOGIT_ATOL, "row a after reorder/repeat/select")
        cache.reset()
        assert all(layer.state is None for layer in cache.layers)
        ab = torch.cat([a, b])
        again = [model(ab[:, :17], **cache_kwargs(cache)).logits]
        again += [model(ab[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(17, 30)]
    again = torch.cat(again, 1)
    for row in range(2):
        assert_close(again[row], alone[row][0], LOGIT_ATOL, f"row {row} after reset")


@torch.no_grad()
def test_stateful_padding_steps_leave_the_memory_unchanged(models):
    model = models[("llama", "mlstm-delay2")]
    ids = _ids(12, 20)
    cache = kvpop.KVpopCache(model)
    with quiet():
        model(ids[:, :12], **cache_kwargs(cache))
        before = [tuple(t.clone() for t in layer.state) for layer in cache.layers]
        pri = [layer.pri.clone() for layer in cache.layers]
        mask = torch.cat([torch.ones(1, 12, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)], 1)
        model(ids[:, 12:13], attention_mask=mask, **cache_kwargs(cache))
    for layer, state, p in zip(cache.layers, before, pri):
        assert all(torch.equal(x, y) for x, y in zip(layer.state, state))
        assert torch.equal(layer.pri, p)


def test_match_mlp_memory_cache_and_refusal():
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=30, scorer="mlstm", mlstm_hidden=8, match_mlp_memory=True)
    model = retrofitted("qwen3", cfg)
    # head dim 16: ceil((16 * 16 + 16) / 32) = 9 entries of state
    assert model.kvpop.config.topk == 21 and kvpop.KVpopCache(model).config.budget == 28
    with pytest.raises(ValueError, match="resolved config"):
        kvpop.KVpopCache(2, config=cfg)
    ids = _ids(13, 60)
    with torch.no_grad(), quiet():
        full = model(ids).logits
        cached, cache = run_cached(model, ids, (31,))
    assert_close(cached, full, LOGIT_ATOL, "match_mlp_memory")
    assert max(int(u.max()) for u in cache.slots_used()) == 28


@pytest.mark.parametrize("cfg_name", ["base", "tova"])
@torch.no_grad()
def test_generate_compiles_the_kvpop_step_like_a_static_cache(models, cfg_name):
    # transformers' generate compiles the decode step of a compileable cache (on CUDA by default; here forced
    # on the CPU, with a backend that traces without code generation): one graph for every step, no graph
    # break, no recompilation as the cache fills, and the tokens of the eager run
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model = models[("qwen3", cfg_name)]
    a, b = _ids(7, 30)[0], _ids(8, 21)[0]
    ids, mask, _ = padded_batch([a, b])
    config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert kvpop.KVpopCache(model).is_compileable
    with quiet():
        eager = model.generate(ids, **kw, **cache_kwargs(kvpop.KVpopCache(model)), disable_compile=True)
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = model.generate(ids, **kw, **cache_kwargs(kvpop.KVpopCache(model)), compile_config=config)
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("rows", ["one", "one-padded", "two-padded"])
@torch.no_grad()
def test_generate_compiles_one_static_decode_graph(models, rows):
    # generate's compile path with its defaults (automatic dynamic shapes, as on CUDA), forced on the CPU with a
    # backend that only records graphs: one graph for the whole decode, every input of a static shape and stride.
    # The padding mask of the new token used to be a view of generate's growing mask, whose row stride changed
    # every step: a recompile, then a graph with a symbolic stride (transformers 5.17; 5.24 for a batch of one)
    from transformers.generation.configuration_utils import CompileConfig

    model = models[("qwen3", "base")]
    a, b = _ids(7, 30)[0], _ids(8, 21)[0]
    ids, mask, _ = padded_batch([a, b] if rows == "two-padded" else [a])
    if rows == "one-padded":
        # a batch of one with left padding (a padded batch cut down to one row, say)
        ids, mask = (torch.cat([torch.zeros_like(t[:, :4]), t], dim=1) for t in (ids, mask))
    graphs = []

    def record(gm, example_inputs):
        symbolic = [node.name for node in gm.graph.nodes if node.op == "placeholder" and _symbolic(node)]
        graphs.append(symbolic)
        return gm.forward

    config = CompileConfig(backend=record, mode=None)
    config._compile_all_devices = True
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with quiet():
        eager = model.generate(ids, **kw, **cache_kwargs(kvpop.KVpopCache(model)), disable_compile=True)
        torch._dynamo.reset()
        compiled = model.generate(ids, **kw, **cache_kwargs(kvpop.KVpopCache(model)), compile_config=config)
        torch._dynamo.reset()
    assert graphs == [[]], f"graphs compiled (their symbolic inputs): {graphs}"
    assert torch.equal(compiled, eager)


def _symbolic(node) -> bool:
    """A graph input that is a SymInt, or a tensor of symbolic size or stride."""
    v = node.meta.get("example_value")
    if isinstance(v, torch.Tensor):
        return any(isinstance(x, torch.SymInt) for x in (*v.shape, *v.stride()))
    return isinstance(v, torch.SymInt)
