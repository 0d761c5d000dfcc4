"""`kvpop.decode`: the compiled one-token step equals eager decoding, traces as one graph, and never recompiles."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvpop
from helpers import assert_close, quiet, retrofitted, tiny_model
from kvpop.cache import cache_kwargs
from kvpop.decode import Decoder, fill_random, static_cache
from kvpop.eval.bench import bench_decode

# the CPU tests trace with aot_eager: the same graph capture as inductor, without minutes of C++ compilation
BACKEND = "aot_eager"
STEPS = 10
LOGIT_ATOL = 1e-4

CONFIGS = {
    "kvpop": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer_hidden=16),
    "mlstm": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="mlstm", mlstm_hidden=16),
    "tova": kvpop.KVpopConfig(sink=2, window=3, topk=9, policy="tova"),
    # the window sums and keys before RoPE are per-step state too
    "evidence": kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="evidence", scorer_hidden=16, scorer_keys="pre_rope"),
    # KVpop-cascade: two pools of long-range slots, the static priority carried per slot
    "cascade": kvpop.KVpopConfig(sink=2, window=3, topk=9, tova_pool=4, scorer_hidden=16),
    # the layer-wide cascade: TOVA's head average takes each token first, a per-head static pool its evictions
    "cascade-mean": kvpop.KVpopConfig(sink=0, window=1, topk=13, tova_pool=8, tova_head_average=True, scorer_hidden=16),
    # its pool ranked by the accumulated attention instead (each step 0.9 x the last plus the latest)
    "cascade-sum": kvpop.KVpopConfig(sink=0, window=1, topk=13, tova_pool=8, tova_head_average=True, pool_decay=0.9,
                                     scorer_hidden=16),
}


@contextlib.contextmanager
def strict_dynamo():
    """Fail on any recompilation; start from an empty compile cache."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def _model(name: str):
    return tiny_model("qwen3") if name == "dense" else retrofitted("qwen3", CONFIGS[name])


def _cache(model, name: str, length: int):
    return static_cache(model, length) if name == "dense" else kvpop.KVpopCache(model)


@torch.no_grad()
def _decode(model, name: str, ids: torch.Tensor, compile: bool, backend: str | None = BACKEND):
    """Prefill `ids`, then STEPS greedy steps: (tokens [B, STEPS + 1], logits [B, STEPS, V], cache)."""
    cache = _cache(model, name, ids.shape[1] + STEPS + 1)
    decoder = Decoder(model, cache, compile=compile, backend=backend)
    with quiet():
        nxt = decoder.prefill(ids, chunk=8).argmax(-1, keepdim=True)
        tokens, logits = [nxt], []
        position = torch.full((ids.shape[0], 1), ids.shape[1], device=ids.device)
        with decoder.decoding():
            for _ in range(STEPS):
                out = decoder.step(nxt, position).clone()
                nxt = out.argmax(-1, keepdim=True)
                tokens.append(nxt)
                logits.append(out)
                position += 1
    return torch.cat(tokens, 1), torch.stack(logits, 1), cache


@pytest.mark.parametrize("name", ["kvpop", "mlstm", "tova", "evidence", "cascade", "cascade-mean", "cascade-sum",
                                  "dense"])
def test_compiled_step_equals_eager(name):
    model = _model(name)
    # long enough that the window and top-k slots fill and evict during the decode steps
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0))
    eager_tokens, eager_logits, eager_cache = _decode(model, name, ids, compile=False)
    with strict_dynamo():
        tokens, logits, cache = _decode(model, name, ids, compile=True)
    assert torch.equal(tokens, eager_tokens)
    assert_close(logits, eager_logits, LOGIT_ATOL, f"{name}: compiled vs eager logits")
    assert int(cache.get_seq_length()) == int(eager_cache.get_seq_length()) == ids.shape[1] + STEPS
    if name != "dense":
        for a, b in zip(cache.layers, eager_cache.layers):
            assert torch.equal(a.pos, b.pos) and torch.equal(a.seen, b.seen)


@pytest.mark.parametrize("name", ["kvpop", "dense"])
def test_a_new_prompt_length_does_not_compile_the_step_again(name):
    # the first token sliced from the prompt is a view whose row stride is the prompt's length: dynamo guards on it,
    # so each prompt length compiled the step again (76 s at the 8B shape) until `step` gave its inputs plain strides
    from kvpop.decode import Decoder

    model = _model(name)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        for S in (19, 23):
            ids = torch.randint(3, 300, (1, S), generator=torch.Generator().manual_seed(S))
            # one static length for both prompts: a dense `StaticCache` of another size is another graph
            decoder = Decoder(model, _cache(model, name, 30), compile=True, backend=backend)
            with quiet(), torch.no_grad():
                decoder.prefill(ids, chunk=8)
                position = torch.full((1, 1), S)
                with decoder.decoding():
                    token = ids[:, -1:]  # stride (S, 1)
                    for _ in range(3):
                        token = decoder.step(token, position).argmax(-1, keepdim=True)
                        position += 1
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs for two prompt lengths"


@pytest.mark.parametrize("name", ["kvpop", "mlstm", "tova", "evidence", "cascade", "cascade-mean", "cascade-sum"])
def test_compiled_step_takes_each_cache_tensor_once_at_a_static_address(name):
    # a view of a mutated buffer read in the step (`layer.keys`, `layer.pos`, ...) was a second graph input aliasing
    # it: AOT autograd merged the two into a synthetic base, and inductor's CUDA graphs then skipped the step for the
    # stateful and cascade policies ("mutated inputs", the H100). The cache's inputs must be its own tensors, static
    from kvpop.decode import Decoder, cache_tensors

    model = _model(name)
    seen = []

    def backend(gm, example_inputs):
        seen.append([t for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    try:
        ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0))
        cache = _cache(model, name, 30)
        decoder = Decoder(model, cache, compile=True, backend=backend)
        with quiet(), torch.no_grad():
            decoder.prefill(ids, chunk=8)
            position = torch.full((2, 1), 19)
            with decoder.decoding():
                for _ in range(2):
                    decoder.step(ids[:, -1:], position)
                    position += 1
    finally:
        torch._dynamo.reset()
    own = cache_tensors(cache)
    storages = {t.untyped_storage().data_ptr() for t in own}
    assert len(seen) == 1
    inputs = [t for t in seen[0] if t.untyped_storage().data_ptr() in storages]
    assert len(inputs) == len(own), f"{len(inputs)} graph inputs share the {len(own)} cache tensors' memory"
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kvpop", "mlstm", "evidence", "cascade", "dense"])
def test_cuda_graph_step_equals_eager(name):
    """On CUDA: inductor + CUDA graphs (mode "reduce-overhead"), captured once, no step skipped out of the graph."""
    from torch._dynamo.utils import counters

    model = _model(name).cuda()
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0)).cuda()
    eager_tokens, eager_logits, _ = _decode(model, name, ids, compile=False)
    with strict_dynamo():
        counters.clear()
        tokens, logits, _ = _decode(model, name, ids, compile=True, backend="inductor")
        skips = dict(counters["inductor"])
    assert torch.equal(tokens, eager_tokens)
    assert_close(logits, eager_logits, 1e-3, f"{name}: cuda graph vs eager logits")
    assert not skips.get("cudagraph_skips"), skips


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kvpop", "mlstm", "evidence", "cascade", "cascade-mean", "cascade-sum", "dense"])
def test_captured_cuda_graph_step_equals_eager(name):
    """On CUDA: the eager step captured once with torch.cuda.CUDAGraph (the default backend) replays the eager decode."""
    model = _model(name).cuda()
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0)).cuda()
    eager_tokens, eager_logits, eager_cache = _decode(model, name, ids, compile=False)
    tokens, logits, cache = _decode(model, name, ids, compile=True, backend="cudagraph")
    assert torch.equal(tokens, eager_tokens)
    assert_close(logits, eager_logits, 1e-3, f"{name}: captured graph vs eager logits")
    if name != "dense":
        # the capture's warm-up run inserted a token too: it must have been undone. The slots and counts
        # are exact; priorities only to rounding, since the graph runs the norms and MLPs compiled
        # (fuse_blocks), which rounds keys, and so the scorer's inputs, differently (seen on an H200)
        for a, b in zip(cache.layers, eager_cache.layers):
            assert torch.equal(a.pos, b.pos) and torch.equal(a.seen, b.seen)
            torch.testing.assert_close(a.pri, b.pri, rtol=1e-4, atol=1e-5)


def test_cudagraph_backend_needs_cuda():
    model = tiny_model("qwen3")
    kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=4, topk=4))
    with pytest.raises(ValueError, match="cudagraph"):
        Decoder(model, kvpop.KVpopCache(model), compile=True, backend="cudagraph")


def test_decoder_matches_hf_dynamic_cache():
    """The eager step on a StaticCache is the dense model's own greedy decoding (a DynamicCache)."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with quiet(), torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 12:]
        got = Decoder(model, static_cache(model, 20), compile=False).generate(ids, 6)
    assert torch.equal(got, want)


def test_compiled_step_is_one_graph_without_recompiles():
    """fullgraph=True raises on a graph break; the counters show one frame compiled for all steps."""
    from torch._dynamo.utils import counters

    model = _model("kvpop")
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with strict_dynamo():
        counters.clear()
        _decode(model, "kvpop", ids, compile=True)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])


def _padded(lengths, seed=4):
    """Left-padded random prompts of the given lengths: ids [B, max], mask [B, max] (0 = padding)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(3, 300, (n,), generator=g)
        mask[r, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("name", ["kvpop", "tova", "dense"])
def test_left_padded_rows_decode_as_they_do_alone(name):
    """`generate(attention_mask=...)`: per-row positions through the step (no mask for a KVpopCache, a fixed one
    for a dense StaticCache); each row of the batch is that row decoded alone, eager and traced alike."""
    model = _model(name)
    lengths = [19, 7, 12]
    ids, mask = _padded(lengths)
    steps = 8

    def run(ids, mask, compile):
        cache = _cache(model, name, ids.shape[1] + steps)
        with quiet():
            return Decoder(model, cache, compile=compile, backend=BACKEND).generate(ids, steps, attention_mask=mask)

    alone = torch.cat([run(ids[r : r + 1, -n:], None, False) for r, n in enumerate(lengths)])
    assert torch.equal(run(ids, mask, False), alone)
    with strict_dynamo():
        assert torch.equal(run(ids, mask, True), alone)


def test_a_closed_decoder_is_freed_at_once():
    import gc
    import weakref

    model = _model("kvpop")
    decoder = Decoder(model, kvpop.KVpopCache(model), compile=True, backend=BACKEND)
    with quiet():
        decoder.generate(torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(5)), 3)
    decoder.close()
    with pytest.raises(RuntimeError, match="closed"):
        decoder.step(torch.ones(1, 1, dtype=torch.long), torch.full((1, 1), 12))
    ref = weakref.ref(decoder)
    gc.disable()
    try:
        del decoder
        # no cycle left: reference counting frees it (and its cache) without a garbage collection
        assert ref() is None
    finally:
        gc.enable()


def test_eager_steps_are_counted():
    model = _model("kvpop")
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    _, _, cache = _decode(model, "kvpop", ids, compile=False)
    assert cache.get_seq_length() == 9 + STEPS


@pytest.mark.parametrize("name,context", [("kvpop", 40), ("mlstm", 40), ("evidence", 40), ("kvpop", 9), ("dense", 40),
                                          ("cascade-mean", 40), ("cascade-sum", 40)])
def test_fill_random(name, context):
    model = _model(name)
    cache = _cache(model, name, context + 4)
    fill_random(model, cache, 2, context, seed=0)
    if name != "dense":
        cfg = CONFIGS[name]
        want = min(context, cfg.budget)
        assert all(bool((used == want).all()) for used in cache.slots_used())
        for layer in cache.layers:
            pos = layer.pos[0, 0]
            assert torch.equal(pos[: cfg.sink], torch.arange(cfg.sink))
            # the window ring holds the last `window` positions, each in its own ring slot
            ring = pos[cfg.sink : cfg.sink + cfg.window]
            if context >= cfg.sink + cfg.window:
                assert sorted(ring.tolist()) == list(range(context - cfg.window, context))
                assert torch.equal(cfg.sink + (ring - cfg.sink) % cfg.window,
                                   torch.arange(cfg.sink, cfg.sink + cfg.window))
            assert bool((layer.seen == context).all()) and layer.processed == context
            # the cascades' static pool ranks by the prior buffer: filled where a slot is
            assert (layer.prior is not None) == name.startswith("cascade")
            if layer.prior is not None:
                assert torch.equal(torch.isfinite(layer.prior), layer.pos >= 0)
    assert int(cache.get_seq_length()) == context
    # and decoding runs from it, eager and compiled alike
    decoder = Decoder(model, cache, compile=True, backend=BACKEND)
    position = torch.full((2, 1), context)
    with strict_dynamo(), quiet(), torch.no_grad(), decoder.decoding():
        for _ in range(3):
            logits = decoder.step(torch.ones(2, 1, dtype=torch.long), position)
            position += 1
    assert logits.shape == (2, model.config.vocab_size) and torch.isfinite(logits).all()
    assert int(cache.get_seq_length()) == context + 3


def test_bench_compiled_rows_and_random_fill():
    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=6, scorer_hidden=16)
    model = tiny_model("qwen3")
    with quiet():
        rows = bench_decode(model, (32,), new_tokens=2, warmup=1, device="cpu", config=cfg, compile=True,
                            fill="random", compile_backend=BACKEND)
    assert [(r["cache"], r["compiled"]) for r in rows] == [("dense", False), ("dense", True), ("kvpop", False),
                                                           ("kvpop", True)]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["fill"] == "random" and r["ms_per_token"] > 0
        # compiled runs take at least 3 warm-up steps (CUDA graph trees record on the second call)
        assert r["seen"] == 32 + (3 if r["compiled"] else 1) + 2
        assert (r["compile_s"] is not None) == r["compiled"]
    assert rows[1]["vs_dense"] == 1.0


def test_bench_runs_the_layer_wide_cascade_beside_the_static_rule():
    from kvpop.eval.bench import recommended_config

    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=9, scorer_hidden=16)
    assert recommended_config(cfg) == cfg.recommended()
    assert recommended_config(cfg, 6) == kvpop.KVpopConfig(sink=0, window=1, topk=14, tova_pool=6,
                                                           tova_head_average=True, scorer_hidden=16)
    with quiet():
        rows = bench_decode(tiny_model("qwen3"), (32,), cache_kinds=("kvpop", "cascade"), new_tokens=2, warmup=1,
                            device="cpu", config=cfg, compile=True, fill="random", compile_backend=BACKEND,
                            cascade_pool=6)
    assert [(r["cache"], r["compiled"], r["budget"]) for r in rows] == [("kvpop", False, 15), ("kvpop", True, 15),
                                                                        ("cascade", False, 15), ("cascade", True, 15)]
    assert all(r["error"] is None and r["ms_per_token"] > 0 for r in rows), [r["error"] for r in rows]


def test_compile_options_are_scoped_to_kvpops_compiles():
    from kvpop.decode import COMPILE_OPTIONS, compile_options, generation_compile_config

    assert compile_options(torch.device("cpu")) is None and generation_compile_config(torch.device("cpu")) is None
    config = generation_compile_config(torch.device("cuda"))
    assert config.mode is None and config.options == COMPILE_OPTIONS and config.backend == "inductor"
    # torch.compile takes them as transformers passes them: one bad option name would raise here
    torch.compile(lambda x: x, **config.to_dict())
    # nothing leaked into inductor's global config
    import torch._inductor.config as inductor

    assert not inductor.coordinate_descent_tuning and not inductor.max_autotune_gemm


def test_retrofit_gives_generate_the_compile_config_and_detach_takes_it_back(monkeypatch):
    from transformers.generation.configuration_utils import CompileConfig

    import kvpop.decode

    ours = CompileConfig(backend="aot_eager", mode=None)
    # the CPU stands in for a GPU here: where `generate` compiles, the retrofit sets its config
    monkeypatch.setattr(kvpop.decode, "generation_compile_config", lambda device: ours)
    model = tiny_model("qwen3")
    kvpop.retrofit(model, CONFIGS["kvpop"])
    assert model.generation_config.compile_config is ours
    kvpop.detach(model)
    assert model.generation_config.compile_config is None
    # a config of the user's own stays, through the retrofit and after it
    mine = CompileConfig(mode="max-autotune")
    model.generation_config.compile_config = mine
    kvpop.retrofit(model, CONFIGS["kvpop"])
    kvpop.detach(model)
    assert model.generation_config.compile_config is mine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kvpop", "cascade-mean", "cascade-sum"])
def test_generate_on_cuda_compiles_with_kvpops_options(name):
    """`model.generate` with a KVpopCache and nothing set: the retrofit's compile config (inductor with kvpop's
    options, CUDA graphs), the eager run's tokens, one graph for the decode."""
    from torch._dynamo.utils import counters

    from kvpop.decode import COMPILE_OPTIONS

    model = tiny_model("qwen3").cuda()
    kvpop.retrofit(model, CONFIGS[name])
    assert model.generation_config.compile_config.options == COMPILE_OPTIONS
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with quiet(), torch.no_grad():
        eager = model.generate(ids, **kw, **cache_kwargs(model, kvpop.KVpopCache(model)), disable_compile=True)
        torch._dynamo.reset()
        counters.clear()
        compiled = model.generate(ids, **kw, **cache_kwargs(model, kvpop.KVpopCache(model)))
        skips, graphs = dict(counters["inductor"]), counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert graphs >= 1 and not skips.get("cudagraph_skips"), (graphs, skips)


def test_the_first_step_is_timed():
    model = _model("kvpop")
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = _cache(model, "kvpop", 30)
    decoder = Decoder(model, cache, compile=True, backend=BACKEND)
    assert decoder.first_step_s is None
    with quiet(), torch.no_grad():
        decoder.prefill(ids)
        with decoder.decoding():
            decoder.step(ids[:, -1:], torch.full((1, 1), 9))
            first = decoder.first_step_s
            decoder.step(ids[:, -1:], torch.full((1, 1), 10))
    assert first is not None and first > 0 and decoder.first_step_s == first
    torch._dynamo.reset()


def test_bench_compiled_failure_is_a_row_error(monkeypatch):
    import kvpop.decode

    def broken(self, *args):
        raise RuntimeError("no graph today")

    monkeypatch.setattr(kvpop.decode.Decoder, "step", broken)
    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=6, scorer_hidden=16)
    with quiet():
        rows = bench_decode(tiny_model("qwen3"), (16,), cache_kinds=("kvpop",), new_tokens=1, warmup=0,
                            device="cpu", config=cfg, compile=True, compile_backend=BACKEND)
    assert rows[0]["error"] is None and rows[0]["ms_per_token"] > 0
    assert "no graph today" in rows[1]["error"] and rows[1]["ms_per_token"] is None


@pytest.mark.parametrize("policy", ["tova", "h2o", "kvpop"])
def test_stepwise_logits_equal_the_teacher_forced_pass(policy):
    from kvpop.decode import stepwise_logits

    model = retrofitted("qwen3", kvpop.KVpopConfig(sink=2, window=4, topk=5, policy=policy))
    ids = torch.randint(3, 300, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), quiet():
        expected = model(ids, use_cache=False).logits.float()
        got = stepwise_logits(model, ids, compile=False)
    assert_close(got, expected, 1e-4, f"{policy}: stepwise vs teacher-forced logits")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy,batch", [("tova", 1), ("tova", 3), ("h2o", 3)])
def test_stepwise_logits_on_cuda_graphs_equal_the_teacher_forced_pass(policy, batch):
    # batch > 1: the quality study's TOVA and H2O workers evaluate several held-out sequences per pass
    from kvpop.decode import stepwise_logits

    model = retrofitted("qwen3", kvpop.KVpopConfig(sink=2, window=4, topk=5, policy=policy)).cuda()
    ids = torch.randint(3, 300, (batch, 40), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
        got = stepwise_logits(model, ids)
    assert_close(got, expected, 1e-3, f"{policy} x{batch}: CUDA-graph steps vs teacher-forced logits")


@pytest.mark.parametrize("policy", ["kvpop", "tova", "dms", "evidence", "cascade", "cascade-mean", "cascade-sum"])
def test_fused_layer_step_equals_the_eager_step(policy):
    """`KVpopCache.fuse`: the per-layer decode step compiled once (here traced with aot_eager) changes nothing."""
    if policy == "cascade":
        cfg = kvpop.KVpopConfig(sink=2, window=3, topk=6, tova_pool=2, scorer_hidden=16)
    elif policy == "cascade-mean":
        cfg = kvpop.KVpopConfig(sink=0, window=1, topk=10, tova_pool=6, tova_head_average=True, scorer_hidden=16)
    elif policy == "cascade-sum":
        cfg = kvpop.KVpopConfig(sink=0, window=1, topk=10, tova_pool=6, tova_head_average=True, pool_decay=1.0,
                                scorer_hidden=16)
    elif policy == "kvpop":
        cfg = kvpop.KVpopConfig(sink=2, window=4, topk=5, scorer="mlstm", mlstm_dim=8)
    elif policy == "evidence":
        cfg = kvpop.KVpopConfig(sink=2, window=4, topk=5, scorer="evidence", scorer_hidden=16)
    else:
        cfg = kvpop.KVpopConfig(sink=2, window=4, topk=5, policy=policy)
    model = retrofitted("qwen3", cfg)
    ids = torch.randint(3, 300, (2, 15), generator=torch.Generator().manual_seed(5))

    def run(fuse: bool):
        cache = kvpop.KVpopCache(model)
        if fuse:
            cache.fuse("aot_eager")
        kw = cache_kwargs(model, cache)
        with torch.no_grad(), quiet():
            logits = [model(ids[:, :6], **kw, use_cache=True).logits[:, -1]]
            for t in range(6, ids.shape[1]):
                logits.append(model(ids[:, t : t + 1], **kw, use_cache=True).logits[:, -1])
        return torch.stack(logits, 1), cache

    eager, eager_cache = run(False)
    fused, cache = run(True)
    assert all(layer.fused is not None for layer in cache.layers)
    assert_close(fused, eager, 1e-5, f"{policy}: fused vs eager decode")
    for a, b in zip(cache.layers, eager_cache.layers):
        assert torch.equal(a.pos, b.pos) and torch.equal(a.pri, b.pri)


def test_fused_blocks_share_one_graph_per_shape_and_change_nothing():
    """`fuse_blocks`: every RMSNorm / MLP compiled in place; identical blocks reuse one graph; restored after."""
    from torch._dynamo.utils import counters

    from kvpop.decode import fuse_blocks

    model = tiny_model("qwen3")
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        torch._dynamo.reset()
        counters.clear()
        restore = fuse_blocks(model, backend="aot_eager")
        patched = [m for m in model.modules() if "forward" in vars(m)]
        got = model(ids).logits
        graphs = counters["stats"]["unique_graphs"]
        restore()
    n_layers = model.config.num_hidden_layers
    assert len(patched) == 5 * n_layers + 1  # 4 norms and an MLP per layer, and the final norm
    # one graph per input shape, whatever the number of layers: hidden-size norms, q_norm and k_norm
    # (their head counts differ), MLPs; a recompile per layer would give twice as many here
    assert graphs <= 4, graphs
    assert_close(got, expected, 1e-5, "fused blocks vs eager")
    assert not any("forward" in vars(m) for m in model.modules())
    torch._dynamo.reset()
