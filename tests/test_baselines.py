"""Baselines: hand-made attention patterns with a known eviction, and a plain-Python reference of the
step semantics of TOVA and H2O against the vectorised cache."""

import math

import pytest
import torch

import kvpop
from helpers import cache_kwargs, quiet, retrofitted
from kvpop.baselines import H2OPolicy, TOVAPolicy, make_policy
from kvpop.cache import KVpopLayerCache
from kvpop.policy import static_priority

ATOL = 1e-5


def _policy(name, sink, window, topk, **kw):
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, policy=name, **kw)
    return cfg, make_policy(cfg, num_kv_heads=1, head_dim=2)


def _feed(layer, policy, q, k, v, scale=1.0):
    """Tokens one at a time through a layer cache; q: [B, Hq, S, D], k/v: [B, Hkv, S, D]."""
    B, _, S, _ = k.shape
    outs = []
    for t in range(S):
        valid = torch.ones(B, 1, dtype=torch.bool)
        outs.append(layer.attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], valid, policy, scale))
    return torch.cat(outs, 2)


def _held(layer, b=0, h=0):
    return sorted(p for p in layer.pos[b, h].tolist() if p >= 0)


def test_tova_evicts_the_least_attended_token():
    # one head, the query always [10, 0]: attention to token t grows with key[t][0]
    cfg, policy = _policy("tova", sink=0, window=1, topk=2)
    k0 = torch.tensor([1.0, 0.0, 0.8, 0.1, 0.5])
    k = torch.stack([k0, torch.zeros(5)], -1)[None, None]
    q = torch.tensor([10.0, 0.0]).expand(1, 1, 5, 2)
    layer = KVpopLayerCache(cfg.sink, cfg.window, cfg.topk)
    _feed(layer, policy, q, k, torch.randn(1, 1, 5, 2))
    # step 3: token 2 leaves the window and beats token 1 (weight ~e^0), which is evicted;
    # step 4: token 3 (weight ~e^1 at step 3) loses to tokens 0 and 2 and is dropped
    assert _held(layer) == [0, 2, 4]


def test_h2o_keeps_the_heavy_hitter_that_tova_forgets():
    # token 1 draws all attention early, then none: H2O keeps it for its accumulated mass, TOVA drops it
    S = 7
    k = torch.zeros(1, 1, S, 2)
    k[0, 0, 1] = torch.tensor([1.0, 0.0])  # the early heavy hitter
    k[0, 0, 2] = torch.tensor([0.0, 1.0])  # attended late
    k[0, 0, 3] = torch.tensor([0.0, 0.9])
    q = torch.zeros(1, 1, S, 2)
    q[0, 0, :4] = torch.tensor([8.0, 0.0])  # queries 0-3 look at token 1
    q[0, 0, 4:] = torch.tensor([0.0, 8.0])  # queries 4-6 look at tokens 2 and 3
    held = {}
    for name in ("tova", "h2o"):
        cfg, policy = _policy(name, sink=0, window=1, topk=2)
        layer = KVpopLayerCache(cfg.sink, cfg.window, cfg.topk)
        _feed(layer, policy, q, k, torch.randn(1, 1, S, 2))
        held[name] = _held(layer)
    # TOVA: equal weights tie and go to the newer token, so each token leaving the window pushes out
    # the older one of the same (tiny) weight; token 1 goes at step 5, once queries stop looking at it
    assert held["tova"] == [3, 5, 6]
    assert held["h2o"] == [0, 1, 6]


def test_streaming_llm_keeps_sinks_and_the_recent_window():
    cfg = kvpop.KVpopConfig.for_budget(6, sink=2, policy="streaming_llm")
    assert (cfg.window, cfg.topk) == (4, 0)
    policy = make_policy(cfg, 1, 2)
    layer = KVpopLayerCache(cfg.sink, cfg.window, cfg.topk)
    S = 20
    _feed(layer, policy, torch.randn(1, 1, S, 2), torch.randn(1, 1, S, 2), torch.randn(1, 1, S, 2))
    assert _held(layer) == [0, 1, 16, 17, 18, 19]
    assert not list(policy.parameters())


def _reference_dynamic(kind, q, k, v, sink, window, topk, scale, head_average=False, prior=None):
    """TOVA / H2O step semantics written out token by token, per (batch, KV head), in plain Python.

    `kind="prior"` (KVpop-TOVA): TOVA's mean over every query head of the layer plus each token's own prior
    `prior[b, h, t]` (equal in every KV head, so the heads hold the same tokens)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, S, D)
    held_all = []
    for b in range(B):
        held = [dict() for _ in range(Hkv)]  # per head: position -> score
        for p in range(S):
            for h in range(Hkv):
                cache = held[h]
                leaving = p - window
                if leaving >= sink and topk > 0:
                    longrange = [t for t in cache if sink <= t < leaving]
                    if len(longrange) == topk:
                        weakest = min(longrange, key=lambda t: (cache[t], t))
                        if (cache[leaving], leaving) > (cache[weakest], weakest):
                            del cache[weakest]
                        else:
                            del cache[leaving]
                elif leaving >= sink:
                    del cache[leaving]
                cache[p] = 0.0
            probs_all = []
            for h in range(Hkv):
                ts = sorted(held[h])
                logits = torch.stack([q[b, h * G : (h + 1) * G, p] @ k[b, h, t] * scale for t in ts], -1)  # [G, n]
                probs = torch.softmax(logits, -1)
                out[b, h * G : (h + 1) * G, p] = probs @ v[b, h, ts]
                probs_all.append((ts, probs))
            for h, (ts, probs) in enumerate(probs_all):
                if kind == "prior":
                    score = torch.stack([pr.mean(0) for _, pr in probs_all]).mean(0) + prior[b, h, ts]
                elif head_average:
                    score = torch.stack([pr.mean(0) for _, pr in probs_all]).mean(0)
                elif kind == "tova":
                    score = probs.amax(0)
                else:
                    score = probs.sum(0)
                for i, t in enumerate(ts):
                    held[h][t] = float(score[i]) if kind in ("tova", "prior") else held[h][t] + float(score[i])
        held_all.append([sorted(c) for c in held])
    return out, held_all


@pytest.mark.parametrize("kind,sink,window,topk,avg", [
    ("tova", 0, 1, 5, False), ("tova", 2, 3, 4, False), ("h2o", 1, 2, 6, False), ("h2o", 0, 4, 3, False),
    ("tova", 0, 1, 5, True),
])
def test_dynamic_policies_match_the_plain_reference(kind, sink, window, topk, avg):
    torch.manual_seed(0)
    B, Hkv, G, S, D = 2, 2, 2, 30, 4
    q, k, v = torch.randn(B, Hkv * G, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, policy=kind, tova_head_average=avg)
    policy = make_policy(cfg, Hkv, D)
    layer = KVpopLayerCache(sink, window, topk)
    got = _feed(layer, policy, q, k, v, scale=D**-0.5)
    want, held = _reference_dynamic(kind, q, k, v, sink, window, topk, D**-0.5, head_average=avg)
    err = (got - want).abs().max().item()
    assert err < ATOL, err
    for b in range(B):
        for h in range(Hkv):
            assert _held(layer, b, h) == held[b][h]


@pytest.mark.parametrize("sink,window,topk,alpha", [(0, 1, 5, 1.0), (2, 3, 4, 0.3), (0, 2, 6, 0.0)])
def test_kvpop_tova_matches_the_plain_reference(sink, window, topk, alpha):
    # KVpop-TOVA (extension): TOVA's head average plus the scorer's prior, fixed per token at insertion
    torch.manual_seed(1)
    B, Hkv, G, S, D = 2, 2, 2, 30, 4
    q, k, v = torch.randn(B, Hkv * G, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, tova_prior=alpha, scorer_hidden=8)
    policy = make_policy(cfg, Hkv, D).eval()
    with torch.no_grad():
        policy.scorer.b2.fill_(-3.0)  # priors of the order of the attention probabilities
        prior = policy.priority(k, v, torch.arange(S).expand(B, S))
    assert policy.dynamic and policy.score == "prior" and torch.all(prior >= 0)
    layer = KVpopLayerCache(sink, window, topk)
    with torch.no_grad():
        got = _feed(layer, policy, q, k, v, scale=D**-0.5)
    want, held = _reference_dynamic("prior", q, k, v, sink, window, topk, D**-0.5, prior=prior)
    err = (got - want).abs().max().item()
    assert err < ATOL, err
    for b in range(B):
        for h in range(Hkv):
            assert _held(layer, b, h) == held[b][h]
    if alpha >= 1:  # the prior changes what is kept
        zero = torch.zeros_like(prior)
        assert held != _reference_dynamic("prior", q, k, v, sink, window, topk, D**-0.5, prior=zero)[1]


def test_kvpop_tova_with_weight_zero_is_tova():
    # alpha = 0: the prior adds nothing, so the ranking is the paper TOVA's (the head average), token for token
    torch.manual_seed(2)
    B, Hkv, G, S, D = 2, 2, 3, 40, 4
    q, k, v = torch.randn(B, Hkv * G, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    ours = kvpop.KVpopConfig.for_budget(9, tova_prior=0.0, scorer_hidden=8)
    tova = kvpop.KVpopConfig.for_budget(9, policy="tova")
    assert (ours.sink, ours.window, ours.topk) == (tova.sink, tova.window, tova.topk) and tova.tova_head_average
    layers = [KVpopLayerCache(c.sink, c.window, c.topk) for c in (ours, tova)]
    with torch.no_grad():
        outs = [_feed(layer, make_policy(c, Hkv, D).eval(), q, k, v, D**-0.5) for layer, c in zip(layers, (ours, tova))]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(layers[0].pos, layers[1].pos) and torch.equal(layers[0].pri, layers[1].pri)


def test_kvpop_tova_trains_as_the_static_rule():
    # in training mode the policy is KVpop-mlp (static priorities, the boundary loss); evaluated, it is dynamic
    cfg = kvpop.KVpopConfig.for_budget(16, tova_prior=1.0, scorer_hidden=8)
    assert (cfg.sink, cfg.window, cfg.topk) == (0, 1, 15)  # TOVA's paper split
    policy = make_policy(cfg, 2, 4)
    k, v, pos = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), torch.arange(9)[None]
    assert policy.training and not policy.dynamic
    static = policy.priority(k, v, pos)
    assert torch.equal(static, static_priority(policy.scorer(k, v), pos, policy.log_gamma, cfg.decay_step))
    policy.eval()
    assert policy.dynamic
    # evaluated: one prior per token for the layer, alpha * exp(r) averaged over the KV heads
    prior = policy.priority(k, v, pos)
    assert torch.equal(prior, torch.exp(policy.scorer(k, v)).mean(dim=1, keepdim=True).expand(1, 2, 9))
    assert not torch.equal(prior[:, 0], torch.exp(policy.scorer(k, v))[:, 0])  # the heads' own scores differ


def test_policy_classes_supply_only_what_differs():
    assert TOVAPolicy.dynamic and H2OPolicy.dynamic
    cfg, policy = _policy("kvpop", 1, 1, 1)
    assert not policy.dynamic and math.isclose(float(policy.log_gamma[0].detach().exp()), 0.9, rel_tol=1e-6)


@torch.no_grad()
def test_oracle_is_teacher_forced_only():
    model = retrofitted("qwen3", kvpop.KVpopConfig(sink=2, window=5, topk=7, policy="oracle"))
    ids = torch.randint(3, 300, (1, 30))
    with quiet():
        with pytest.raises(ValueError, match="oracle"):
            model(ids)
        pri = [torch.randn(1, 2, 30) for _ in model.kvpop.layers]
        given = model(ids, kvpop_priority=pri).logits
        # the same priorities through a KVpop model's rule give the same logits
        other = retrofitted("qwen3", kvpop.KVpopConfig(sink=2, window=5, topk=7))
        assert torch.allclose(other(ids, kvpop_priority=pri).logits, given, atol=1e-5)
        with pytest.raises(ValueError, match="cannot decode"):
            model(ids, **cache_kwargs(kvpop.KVpopCache(model)))
