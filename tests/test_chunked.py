"""The chunked rule (`ops/dynamic/chunked.py`): one decision per chunk of steps, TOVA's, the layer-wide cascade's and
H2O's.

The claims: the vectorised decision equals the rule stated slot by slot (ties of score, of static priority, empty
slots, padding); with chunks of one token it makes exactly the per-token rules' decisions (the walk of
`ops.dynamic`); the teacher-forced evictions of longer chunks equal an independent float64 walk over Python sets;
no query ever sees more than `topk + chunk` tokens; the model runs it teacher-forced and a cache refuses it.
"""

import dataclasses
import math

import pytest
import torch

import kvpop
from kvpop.ops.attention import sparse_attention
from kvpop.ops.dynamic import NEVER, dynamic_eviction_positions
from kvpop.ops.dynamic.chunked import (
    chunk_decision,
    chunk_decision_reference,
    chunk_scores,
    chunked_eviction_positions,
)


def _candidates(B, H, K, P, L, gen, empty_slots=0, pad=0, ties=False):
    """Random candidates: K slots (the last P the pool, the same tokens in every head) and L chunk tokens."""
    S = K - P
    pos = torch.full((B, H, K + L), -1, dtype=torch.long)
    for b in range(B):
        perm = torch.randperm(1000, generator=gen)[: K + L]
        held = perm[:K].sort().values
        pos[b, :, S:K] = held[S:K]
        for h in range(H):
            pos[b, h, :S] = torch.randperm(1000, generator=gen)[:S] + 1000 * (h + 1)  # each head its own static tokens
        pos[b, :, K:] = torch.arange(5000, 5000 + L)
    if empty_slots:
        pos[:, :, :empty_slots] = -1
        pos[:, :, S:S + empty_slots] = -1
    if pad:
        pos[:, :, K:K + pad] = -1
    score = torch.rand(B, K + L, generator=gen)
    prior = torch.randn(B, H, K + L, generator=gen)
    if ties:
        score = (score * 3).floor() / 3
        prior = (prior * 2).round() / 2
    return score, pos, prior


@pytest.mark.parametrize("K,P,L", [(6, 3, 4), (6, 6, 4), (6, 0, 3), (1, 1, 1), (9, 4, 1), (5, 2, 8)])
@pytest.mark.parametrize("ties", [False, True])
def test_decision_matches_the_slot_by_slot_rule(K, P, L, ties):
    gen = torch.Generator().manual_seed(K * 100 + P * 10 + L + ties)
    for empty, pad in ((0, 0), (min(1, K - P), min(1, L - 1)), (0, L - 1)):
        score, pos, prior = _candidates(2, 3, K, P, L, gen, empty_slots=empty if K - P > empty else 0, pad=pad,
                                        ties=ties)
        keep, evicted = chunk_decision(score, pos, prior, K, P)
        ref = chunk_decision_reference(score, pos, prior, K, P)
        for b in range(2):
            for h in range(3):
                got = {int(m) for m in evicted[b, h] if int(pos[b, h, m]) >= 0}
                assert got == ref[b][h], (b, h)
                kept = [int(m) for m in keep[b, h] if int(pos[b, h, m]) >= 0]
                # every real candidate is kept or evicted, once
                assert sorted(kept + sorted(got)) == sorted(m for m in range(K + L) if int(pos[b, h, m]) >= 0)
        # the pool's slots hold the same tokens in every head
        pool_pos = pos.gather(-1, keep)[..., K - P:]
        assert torch.equal(pool_pos, pool_pos[:, :1].expand_as(pool_pos))


def _inputs(B, Hkv, G, S, D, seed, dup=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, S, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    if dup:  # exact duplicates: equal logits for several tokens
        k[:, :, 5:9] = k[:, :, 4:5]
    prior = torch.randn(B, Hkv, S, generator=gen)
    pos = torch.arange(S).expand(B, S).contiguous()
    return q, k, pos, torch.ones(B, S, dtype=torch.bool), prior


@pytest.mark.parametrize("K,P", [(7, 7), (7, 5), (7, 0), (12, 9), (3, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_of_one_token_are_the_per_token_rules(K, P, seed):
    """With C = 1 the chunked decision is the per-token walk's: TOVA (pool = topk) and the layer-wide cascade."""
    q, k, pos, valid, prior = _inputs(2, 2, 3, 37, 8, seed)
    score = "mean" if P == K else "cascade_mean"
    want = dynamic_eviction_positions(q, k, pos, valid, prior, 0, 1, K, 0.35, score, backend="torch",
                                      pool=None if P == K else P)
    got = chunked_eviction_positions(q, k, pos, valid, prior, K, P, 1, 0.35)
    assert torch.equal(got, want)


def _walk_float64(q, k, pos, valid, prior, K, P, C, scale):
    """The chunked rule over Python sets with float64 probabilities: the eviction position of every token."""
    B, Hq, S, D = q.shape
    H = k.shape[1]
    G = Hq // H
    evict = torch.full((B, H, S), NEVER, dtype=torch.long)
    for b in range(B):
        pool: list[int] = []
        static: list[list[int]] = [[] for _ in range(H)]
        for c0 in range(0, S - C, C):
            chunk = [t for t in range(c0, c0 + C) if valid[b, t]]
            if c0 + C >= S:
                break
            score: dict[int, float] = {}
            seen: dict[int, int] = {}
            for h in range(H):
                held = pool + static[h]
                for qi in chunk:
                    vis = held + [t for t in chunk if t <= qi]
                    for g in range(G):
                        lg = torch.tensor([float((q[b, h * G + g, qi].double() @ k[b, h, t].double()) * scale)
                                           for t in vis], dtype=torch.float64)
                        pr = torch.softmax(lg, 0)
                        for t, p in zip(vis, pr.tolist()):
                            if t in pool or t in chunk:
                                score[t] = score.get(t, 0.0) + p
                                seen[t] = seen.get(t, 0) + 1
            avg = {t: score[t] / seen[t] for t in score}
            ranked = sorted(pool + chunk, key=lambda t: (avg[t], t), reverse=True)
            pool, losers = ranked[:P], ranked[P:]
            when = next(int(pos[b, t]) for t in range(c0 + C, S) if valid[b, t])
            for h in range(H):
                cands = sorted(static[h] + losers, key=lambda t: (float(prior[b, h, t]), t), reverse=True)
                static[h] = cands[: K - P]
                for t in cands[K - P:]:
                    evict[b, h, t] = when
    return evict


@pytest.mark.parametrize("K,P,C", [(6, 4, 4), (6, 6, 5), (8, 2, 3), (5, 0, 7), (4, 3, 16)])
def test_teacher_forced_evictions_match_an_independent_walk(K, P, C):
    q, k, pos, valid, prior = _inputs(2, 2, 2, 30, 8, seed=K * C + P)
    got = chunked_eviction_positions(q, k, pos, valid, prior, K, P, C, 0.4)
    want = _walk_float64(q, k, pos, valid, prior, K, P, C, 0.4)
    assert torch.equal(got, want)


def _h2o_walk_float64(q, k, pos, valid, K, C, protect, scale):
    """H2O's chunked rule over Python sets with float64 probabilities: per KV head, each token's attention summed over
    the queries that saw it; at each decision the `protect` newest stay and the best of the rest fill `K` slots."""
    B, Hq, S, D = q.shape
    H = k.shape[1]
    G = Hq // H
    evict = torch.full((B, H, S), NEVER, dtype=torch.long)
    for b in range(B):
        held: list[list[int]] = [[] for _ in range(H)]
        acc: list[dict[int, float]] = [{} for _ in range(H)]
        for c0 in range(0, S - C, C):
            if c0 + C >= S:
                break
            chunk = [t for t in range(c0, c0 + C) if valid[b, t]]
            when = next(int(pos[b, t]) for t in range(c0 + C, S) if valid[b, t])
            for h in range(H):
                for t in chunk:
                    acc[h][t] = 0.0
                for qi in chunk:
                    vis = held[h] + [t for t in chunk if t <= qi]
                    for g in range(G):
                        lg = torch.tensor([float((q[b, h * G + g, qi].double() @ k[b, h, t].double()) * scale)
                                           for t in vis], dtype=torch.float64)
                        for t, p in zip(vis, torch.softmax(lg, 0).tolist()):
                            acc[h][t] += p
                cands = held[h] + chunk
                if not cands:  # a chunk of padding before the row's first token
                    continue
                newest = max(int(pos[b, t]) for t in cands)
                kept = [t for t in cands if int(pos[b, t]) > newest - protect]
                rest = sorted((t for t in cands if t not in kept), key=lambda t: (acc[h][t], int(pos[b, t])),
                              reverse=True)
                held[h] = kept + rest[: K - len(kept)]
                for t in rest[K - len(kept):]:
                    evict[b, h, t] = when
    return evict


@pytest.mark.parametrize("W,Kh", [(4, 3), (1, 5), (6, 1), (9, 9)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", ["random", "ties", "padding"])
def test_h2o_chunks_of_one_token_are_the_per_token_rule(W, Kh, seed, case):
    """With C = 1 H2O's chunked rule (protect = window - 1, window - 1 + topk slots) evicts what the per-token walk
    of H2O's paper split evicts, at the same steps: duplicated keys (equal scores) and left padding included."""
    q, k, pos, valid, prior = _inputs(2, 2, 3, 41, 8, seed, dup=case == "ties")
    if case == "padding":
        valid[1, :6] = False
        pos = torch.cumsum(valid.long(), -1) - 1
    zero = torch.zeros_like(prior)  # H2O's starting score
    want = dynamic_eviction_positions(q, k, pos, valid, zero, 0, W, Kh, 0.35, "sum", backend="torch")
    got = chunked_eviction_positions(q, k, pos, valid, zero, W - 1 + Kh, 0, 1, 0.35, protect=W - 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("K,C,protect", [(6, 4, 2), (8, 3, 0), (5, 7, 4), (9, 2, 5), (3, 16, 1)])
@pytest.mark.parametrize("pad", [0, 5])
def test_h2o_teacher_forced_evictions_match_an_independent_walk(K, C, protect, pad):
    q, k, pos, valid, prior = _inputs(2, 2, 2, 30, 8, seed=K * C + protect)
    if pad:
        valid[1, :pad] = False
        pos = torch.cumsum(valid.long(), -1) - 1
    got = chunked_eviction_positions(q, k, pos, valid, torch.zeros_like(prior), K, 0, C, 0.4, protect=protect)
    assert torch.equal(got, _h2o_walk_float64(q, k, pos, valid, K, C, protect, 0.4))
    if pad:
        assert (got[1, :, :pad] == NEVER).all()


def test_h2o_refuses_a_protected_window_without_room():
    q, k, pos, valid, prior = _inputs(1, 1, 1, 12, 4, seed=0)
    with pytest.raises(ValueError, match="protect=4"):
        chunked_eviction_positions(q, k, pos, valid, prior, 4, 0, 2, 0.4, protect=4)
    with pytest.raises(ValueError, match="pool 0"):
        chunked_eviction_positions(q, k, pos, valid, prior, 4, 2, 2, 0.4, protect=1)


def test_h2o_with_decision_chunk_keeps_its_split():
    h2o = kvpop.KVpopConfig.for_budget(256, policy="h2o")
    chunked = h2o.with_decision_chunk(64)
    assert (chunked.sink, chunked.window, chunked.topk, chunked.budget) == (0, 128, 128, 256)
    assert chunked.chunk_layout == (192, 0, 64)  # 192 long-range slots + a ring of 64 = the budget
    assert h2o.with_decision_chunk(1).chunk_layout == (255, 0, 127)
    with pytest.raises(ValueError, match="window = 128"):
        h2o.with_decision_chunk(129)
    with pytest.raises(ValueError, match="sink"):
        kvpop.KVpopConfig.for_budget(256, policy="h2o", windowed=True).with_decision_chunk(16)
    assert "its newest 64 a ring" in chunked.describe()


@pytest.mark.parametrize("C", [1, 3, 8])
def test_no_query_sees_more_than_topk_plus_chunk(C):
    K, P, S = 6, 4, 40
    q, k, pos, valid, prior = _inputs(1, 2, 2, S, 8, seed=C, dup=True)
    evict = chunked_eviction_positions(q, k, pos, valid, prior, K, P, C, 0.4)
    t = torch.arange(S)
    for qi in range(S):
        visible = ((t <= qi) & (evict[0] > qi)).sum(-1)  # [H]
        assert int(visible.max()) <= K + C
        # and the full cache holds K + (the chunk so far) once it has filled
        if qi >= K + C:
            assert int(visible.min()) == K + qi % C + 1


def test_left_padding_rows_decide_at_the_same_steps():
    """A left-padded row: its padding neither scores nor is evicted, and its decisions take effect at its next real
    query's position."""
    q, k, pos, valid, prior = _inputs(2, 2, 2, 24, 8, seed=3)
    valid[1, :5] = False
    pos = torch.cumsum(valid.long(), -1) - 1
    got = chunked_eviction_positions(q, k, pos, valid, prior, 5, 3, 4, 0.4)
    assert (got[1, :, :5] == NEVER).all()
    want = _walk_float64(q, k, pos, valid, prior, 5, 3, 4, 0.4)
    assert torch.equal(got, want)


def test_scores_average_over_the_queries_that_see_a_token():
    """One KV head, one query head, a chunk of two tokens after one held slot: the scores by hand."""
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # [1, 1, 2, 2]
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]]])  # held slot, then the chunk's two tokens
    held = torch.tensor([[[True]]])
    s = chunk_scores(q, keys, held, torch.tensor([[True, True]]), scale=1.0)
    e = math.e
    q0 = [e / (e + 1), 1 / (e + 1), 0.0]  # query 0 sees the slot and itself
    q1 = [1 / (2 + e), 1 / (2 + e), e / (2 + e)]  # query 1 sees all three
    want = torch.tensor([[(q0[0] + q1[0]) / 2, (q0[1] + q1[1]) / 2, q1[2]]])
    assert torch.allclose(s, want, atol=1e-6)


@pytest.mark.parametrize("policy", ["tova", "cascade", "h2o"])
def test_the_model_teacher_forced_equals_its_prefill_and_decode(policy):
    """Train == prefill == decode on a model: the teacher-forced logits, a prompt through a `KVpopCache` and the rest
    one token per step agree; `generate` runs it eagerly."""
    from kvpop.cache import cache_kwargs
    from kvpop.models import load_model

    model, _ = load_model("tiny-random-llama", dtype="float32")
    cfg = kvpop.KVpopConfig.for_budget(24, policy="h2o" if policy == "h2o" else "tova")
    if policy == "cascade":
        cfg = kvpop.KVpopConfig.for_budget(24).with_tova_pool(17, layer=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    outs = {}
    for chunk in (1, 8):
        torch.manual_seed(0)
        kvpop.retrofit(model, cfg.with_decision_chunk(chunk) if chunk > 1 else cfg)
        model.eval()
        with torch.no_grad():
            outs[chunk] = model(ids).logits
            if chunk > 1:
                cache = kvpop.KVpopCache(model)
                assert not cache.is_compileable
                steps = [model(ids[:, :37], use_cache=True, **cache_kwargs(model, cache)).logits]
                for t in range(37, 64):
                    steps.append(model(ids[:, t : t + 1], use_cache=True, **cache_kwargs(model, cache)).logits)
                assert torch.allclose(torch.cat(steps, dim=1), outs[chunk], atol=1e-4)
                held = max(int(n.max()) for n in cache.slots_used())
                assert held <= 24  # the budget: 16 long-range slots and a ring of 8 (H2O: 4 of them its window's)
                gen = model.generate(ids[:, :40], max_new_tokens=6, do_sample=False, pad_token_id=0,
                                     **cache_kwargs(model, kvpop.KVpopCache(model)))
                assert gen.shape == (2, 46)
                from kvpop.decode import Decoder

                for compiled in (False, True):
                    decoder = Decoder(model, kvpop.KVpopCache(model), compile=compiled, backend="aot_eager")
                    toks = decoder.generate(ids[:, :40], 6, chunk=40)
                    assert torch.equal(toks, gen[:, 40:])
        kvpop.detach(model)
    # before the first decision (the budget, then a chunk) the two rules see the same tokens
    assert torch.allclose(outs[1][:, :24], outs[8][:, :24], atol=1e-5)
    assert not torch.allclose(outs[1], outs[8], atol=1e-3)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(policy="tova", decision_chunk=0), "integer >= 1"),
    (dict(policy="tova", decision_chunk=8), "TOVA with tova_head_average"),
    (dict(policy="h2o", decision_chunk=8, sink=4, window=12), "H2O without sinks"),
    (dict(policy="h2o", decision_chunk=20), "at most window = 16"),
    (dict(policy="tova", decision_chunk=8, window=1), "window as its ring"),
])
def test_config_refuses_what_the_chunked_rule_does_not_apply_to(kwargs, msg):
    budget = 32
    base = kvpop.KVpopConfig.for_budget(budget, policy=kwargs.pop("policy"))
    if "head" in msg:  # TOVA per KV head (not the head average)
        base = dataclasses.replace(base, tova_head_average=False, window=8, topk=24)
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(base, **kwargs)


def test_sparse_attention_bound_covers_a_full_chunk():
    """The teacher-forced attention under chunked evictions equals the dense reference under the same visibility."""
    q, k, pos, valid, prior = _inputs(1, 2, 2, 40, 8, seed=7)
    v = torch.randn(1, 2, 40, 8)
    K, C = 6, 8
    evict = chunked_eviction_positions(q, k, pos, valid, prior, K, 4, C, 0.4)
    out, _ = sparse_attention(q, k, v, pos, valid, pos, valid, evict, 0, 1, 0.4, topk=K + C - 1)
    ref, _ = sparse_attention(q, k, v, pos, valid, pos, valid, evict, 0, 1, 0.4, backend="reference")
    assert torch.allclose(out, ref, atol=1e-5)


class _Policy:
    """What `ChunkedLayerCache.attend` asks of a layer policy: its chunk, its pool and the static priorities."""

    def __init__(self, chunk, prior):
        self.chunk, self.prior_all, self.offset = chunk, prior, 0

    def scorer_key(self, key, rope):
        return key

    def priority(self, key, value, position):
        n = key.shape[2]
        out = self.prior_all[:, :, self.offset : self.offset + n]
        self.offset += n
        return out


@pytest.mark.parametrize("K,P,C,protect", [(6, 4, 4, None), (6, 6, 5, None), (8, 2, 3, None), (5, 0, 7, None),
                                            (8, 0, 3, 4), (7, 0, 4, 0), (9, 0, 2, 5)])
@pytest.mark.parametrize("split", ["prompt", "tokens", "pieces"])
def test_the_cache_makes_the_teacher_forced_decisions(K, P, C, protect, split):
    """Prefill at once, one token per step, or in uneven pieces: the cache's slots after every piece are the tokens
    the teacher-forced evictions keep visible to the next query, and its outputs are the teacher-forced ones (H2O's
    rule with `protect`, its scores carried in the slots)."""
    from kvpop.cache import ChunkedLayerCache

    S = 31
    q, k, pos, valid, prior = _inputs(2, 2, 2, S, 8, seed=K + P + C)
    if protect is not None:
        prior = torch.zeros_like(prior)  # H2O's starting score
    v = torch.randn(2, 2, S, 8, generator=torch.Generator().manual_seed(1))
    evict = chunked_eviction_positions(q, k, pos, valid, prior, K, P, C, 0.4, protect=protect)
    want, _ = sparse_attention(q, k, v, pos, valid, pos, valid, evict, 0, 1, 0.4, backend="reference")
    cache = ChunkedLayerCache(K, C, None if P == K else P, protect)
    policy = _Policy(C, prior)
    cuts = {"prompt": [0, S], "tokens": list(range(S + 1)), "pieces": [0, 3, 4, 11, 12, 20, 29, S]}[split]
    outs = []
    for a, b in zip(cuts, cuts[1:]):
        outs.append(cache.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], valid[:, a:b], policy, 0.4))
        # the cache holds exactly what the next query would see under the teacher-forced evictions
        held = [sorted(int(p) for p in cache.pos[bb, h] if p >= 0) for bb in range(2) for h in range(2)]
        t = torch.arange(b)
        visible = [sorted(int(x) for x in t[(evict[bb, h, :b] > b - 1) if b == S else (evict[bb, h, :b] > b)])
                   for bb in range(2) for h in range(2)]
        assert held == visible, (a, b)
        assert int((cache.pos >= 0).sum(-1).max()) <= K + C
    assert torch.allclose(torch.cat(outs, dim=2), want, atol=1e-5)


def test_with_decision_chunk_keeps_the_memory_and_the_pool_share():
    cascade = kvpop.KVpopConfig.for_budget(1024).recommended()
    chunked = cascade.with_decision_chunk(64)
    assert (chunked.sink, chunked.window, chunked.topk, chunked.budget) == (0, 64, 960, 1024)
    assert chunked.tova_pool == cascade.tova_pool * 960 // 1023
    assert cascade.with_decision_chunk(1) == dataclasses.replace(cascade, decision_chunk=1)
    tova = kvpop.KVpopConfig.for_budget(256, policy="tova").with_decision_chunk(16)
    assert (tova.window, tova.topk, tova.tova_pool) == (16, 240, 0)
    with pytest.raises(ValueError, match="budget - 1"):
        cascade.with_decision_chunk(1024)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_captured_round_is_the_eager_round(dtype):
    """On CUDA a whole chunk's round replays one captured graph: the same outputs and slots, bit for bit, as the
    rounds run eagerly, over many rounds, a left-padded row and a prompt that ends inside a chunk; the graphs of
    two layers share one memory pool."""
    from kvpop.cache import ChunkedLayerCache

    S, K, P, C = 203, 24, 17, 16
    q, k, _, valid, prior = _inputs(2, 2, 3, S, 32, seed=5)
    v = torch.randn(2, 2, S, 32, generator=torch.Generator().manual_seed(6))
    valid[0, :5] = False
    q, k, v, valid, prior = (t.cuda() for t in (q, k, v, valid, prior))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = {}
    pool: list = []
    for graphs in (False, True, True):
        cache = ChunkedLayerCache(K, C, P)
        cache.use_graphs, cache.graph_pool = graphs, pool
        policy = _Policy(C, prior)
        with torch.no_grad():
            out = torch.cat([cache.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], valid[:, a:b], policy, 0.3)
                             for a, b in ((0, 150), (150, S))], dim=2)
        assert bool(cache.graph) == graphs
        got.setdefault(graphs, []).append((out, cache.keys, cache.values, cache.pos, cache.prior))
    assert len(pool) == 2  # one handle for both captures, and the first graph, which keeps its pool alive
    for captured in got[True]:
        for a, b in zip(captured, got[False][0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["cascade", "h2o"])
def test_a_compiled_decoder_counts_the_steps_on_the_device(policy):
    """`Decoder` compiles the chunked rule's step: the ring's slot is a device tensor and the host decides between
    steps. Over several chunks, from a prompt that ends inside one and a left-padded row, each step's logits equal
    the model's own eager steps (the host counting, deciding inside the step) bit for bit, the slots too, and the
    step compiles once."""
    from kvpop.cache import cache_kwargs
    from kvpop.decode import Decoder
    from kvpop.models import load_model

    model, _ = load_model("tiny-random-llama", dtype="float32")
    C = 8
    cfg = kvpop.KVpopConfig.for_budget(24, policy="h2o") if policy == "h2o" else \
        kvpop.KVpopConfig.for_budget(24).with_tova_pool(17, layer=True)
    torch.manual_seed(0)
    kvpop.retrofit(model, cfg.with_decision_chunk(C))
    model.eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    P, steps = 37, 30  # the prompt ends inside a chunk; the steps cross three decisions
    with torch.no_grad():
        # the reference: the model's own forward one token per step, the layers counting on the host
        ref_cache = kvpop.KVpopCache(model)
        kw = cache_kwargs(model, ref_cache)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids[:, :P], attention_mask=mask[:, :P], position_ids=position[:, :P], use_cache=True, **kw)
        want = [model(ids[:, t : t + 1], position_ids=position[:, t : t + 1], use_cache=True, **kw).logits[:, -1]
                for t in range(P, P + steps)]
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cache = kvpop.KVpopCache(model)
        decoder = Decoder(model, cache, compile=True, backend="aot_eager")
        decoder.prefill(ids[:, :P], attention_mask=mask[:, :P])
        got = []
        with decoder.decoding():
            for t in range(P, P + steps):
                got.append(decoder.step(ids[:, t : t + 1], position[:, t : t + 1]).clone())
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for mine, ref in zip(cache.layers, ref_cache.layers):
        assert mine.filled == ref.filled and not mine.on_device
        for a, b in zip(mine.buffers, ref.buffers):
            assert torch.equal(a, b)
    kvpop.detach(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
def test_a_captured_chunked_decode_step_is_the_eager_step(backend):
    """On CUDA the chunked rule's decode step is captured (or compiled by inductor with CUDA graphs) once and replayed
    across its decisions: the same tokens as the eager decoder, the same decisions (the slots' positions), and keys
    and values within rounding (both backends compile the model's norms and MLPs, so the floats are not the eager
    kernels')."""
    from kvpop.decode import Decoder
    from kvpop.models import load_model

    model, _ = load_model("tiny-random-llama", dtype="float32", device="cuda")
    torch.manual_seed(0)
    kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(24).with_tova_pool(17, layer=True).with_decision_chunk(8))
    model.eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1)).cuda()
    caches, toks = [], []
    for compiled in (False, True):
        caches.append(kvpop.KVpopCache(model))
        decoder = Decoder(model, caches[-1], compile=compiled, backend=backend)
        toks.append(decoder.generate(ids, 30, chunk=37))
        decoder.close()
    assert torch.equal(toks[0], toks[1])
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.filled == b.filled
        assert torch.equal(a.pos, b.pos)  # the same decisions
        for x, y in zip(a.buffers, b.buffers):
            assert torch.allclose(x, y, atol=1e-3, rtol=1e-3)
    kvpop.detach(model)


def test_bench_runs_the_chunked_rule_compiled_from_a_random_fill():
    """`kvpop bench --caches cascade+chunkC,h2o+chunkC --compile --fill random`: a cache filled as just after a
    decision (`fill_random`: `topk` older tokens, the ring empty) decodes compiled across a decision, the same
    logits as eagerly from the same fill."""
    from kvpop.decode import Decoder, fill_random
    from kvpop.eval.bench import bench_decode, load_bench_model

    model = load_bench_model("tiny-qwen3-shape", "cpu", "float32")
    cfg = kvpop.KVpopConfig.for_budget(64)
    rows = bench_decode(model, [256], ["cascade+chunk8", "h2o+chunk8"], new_tokens=10, warmup=1, config=cfg,
                        compile=True, compile_backend="aot_eager", fill="random")
    assert [(r["cache"], r["compiled"], r["error"]) for r in rows] == [
        ("cascade+chunk8", False, None), ("cascade+chunk8", True, None), ("h2o+chunk8", False, None),
        ("h2o+chunk8", True, None)]
    with pytest.raises(ValueError, match="the chunked rule is"):
        bench_decode(model, [256], ["kvpop+chunk8"], new_tokens=2, config=cfg)
    kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(64).with_tova_pool(47, layer=True).with_decision_chunk(8))
    logits = []
    for compiled in (False, True):
        cache = kvpop.KVpopCache(model)
        fill_random(model, cache, 2, 256, seed=0)
        layer = cache.layers[0]
        assert int((layer.pos[0, 0] >= 0).sum()) == layer.topk and layer.filled == 0
        decoder = Decoder(model, cache, compile=compiled, backend="aot_eager")
        position, out = torch.full((2, 1), 256), []
        with torch.no_grad(), decoder.decoding():
            for t in range(12):  # a decision after the 8th step
                out.append(decoder.step(torch.full((2, 1), 5 + t), position).clone())
                position += 1
        assert layer.filled == 4
        logits.append(torch.stack(out))
    assert torch.equal(logits[0], logits[1])
    kvpop.detach(model)
