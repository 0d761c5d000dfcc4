"""KVpop-cascade (`KVpopConfig.tova_pool`, an extension): the static rule's rejects compete for a TOVA-ranked pool.

Every execution makes the same decisions: a plain-Python statement of the step semantics, the decode step
(`cache.decode_step`), the reference walk and the torch walk (`ops/dynamic`), the Triton walk (under the
interpreter on the CPU), the chunked prefill and the teacher-forced forward (also in `tests/test_cache.py`,
configs "kvpop-cascade*"). The two ends of the pool size are the two rules it joins: `tova_pool = topk` is TOVA
with the same split, and a pool of 0 is the static rule. The layer-wide cascade's pool ranks by TOVA's latest
attention (score "cascade_mean") or by the attention accumulated over the steps (`pool_decay`, score
"cascade_sum": H2O's at decay 1). A trained KVpop-mlp directory runs as the recommended policy by default
(`KVpopConfig.for_rule`), in `kvpop.load`, `kvpop generate` and `kvpop eval`.
"""

import json
import textwrap

import pytest
import torch

import kvpop
from helpers import (
    LOGIT_ATOL,
    assert_close,
    cache_kwargs,
    left_padded,
    padded_batch,
    quiet,
    retrofitted,
    run_triton_check,
)
from kvpop.baselines import make_policy
from kvpop.cache import KVpopLayerCache
from kvpop.cli import main
from kvpop.config import RECOMMENDED_POOL_DECAY, recommended_pool
from kvpop.models import load_model
from kvpop.ops.dynamic import dynamic_eviction_positions, dynamic_walk
from kvpop.policy import CascadePolicy, eviction_times

ATOL = 1e-5


def _feed(layer, policy, q, k, v, valid=None, scale=1.0):
    """Tokens one at a time through a layer cache (the decode step); returns outputs and the slots after each step."""
    B, _, S, _ = k.shape
    valid = torch.ones(B, S, dtype=torch.bool) if valid is None else valid
    outs, held = [], []
    for t in range(S):
        sl = slice(t, t + 1)
        outs.append(layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], valid[:, sl], policy, scale))
        held.append(layer.pos.clone())
    return torch.cat(outs, 2), held


def _policy(sink, window, topk, pool, Hkv, D, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, tova_pool=pool, scorer_hidden=8, **kw)
    policy = make_policy(cfg, Hkv, D).eval()
    return cfg, policy


def _layer_policy(sink, window, topk, pool, Hkv, D, seed=0, decay=None):
    torch.manual_seed(seed)
    cfg = kvpop.KVpopConfig(sink=sink, window=window, topk=topk, tova_pool=pool, tova_head_average=True, scorer_hidden=8,
                            pool_decay=decay)
    return cfg, make_policy(cfg, Hkv, D).eval()


DECAYS = [None, 1.0, 0.5]
"""The layer-wide cascade's pool rankings: TOVA's latest attention, H2O's accumulated attention, and a mix."""
DECAY_IDS = ["tova", "h2o", "mix"]


def _score(decay):
    return "cascade_mean" if decay is None else "cascade_sum"


def _reference_cascade(q, k, v, pi, sink, window, topk, pool, scale):
    """The step semantics in plain Python, per (batch row, KV head).

    `pi[b, h, t]`: token t's static priority. Each kept long-range token sits in the static pool ("s", at most
    `topk - pool`) or the TOVA pool ("d", at most `pool`). The token leaving the window takes a free static slot,
    or displaces the static pool's weakest if its priority is at least as high (it is the newest); the loser (the
    leaving token or the displaced one) takes a free TOVA slot, or displaces the TOVA pool's weakest by (latest
    attention, position), or is evicted. The latest attention of a token is the max over its KV head's query heads.
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    static = topk - pool
    out = torch.zeros(B, Hq, S, D)
    pools = []
    for b in range(B):
        per_head = []
        for h in range(Hkv):
            held = {}  # position -> [pool, latest attention]
            for p in range(S):
                x = p - window
                if x >= sink:
                    loser = x
                    if static:
                        st = [t for t in held if held[t][0] == "s"]
                        if len(st) < static:
                            held[x][0], loser = "s", None
                        else:
                            m = min(st, key=lambda t: (float(pi[b, h, t]), t))
                            if float(pi[b, h, x]) >= float(pi[b, h, m]):
                                held[x][0], loser = "s", m
                    if loser is not None:
                        dy = [t for t in held if held[t][0] == "d"]
                        if len(dy) < pool:
                            held[loser][0] = "d"
                        elif pool:
                            d = min(dy, key=lambda t: (held[t][1], t))
                            if (held[loser][1], loser) > (held[d][1], d):
                                held[loser][0] = "d"
                                del held[d]
                            else:
                                del held[loser]
                        else:
                            del held[loser]
                held[p] = ["sink" if p < sink else "w", 0.0]
                ts = sorted(held)
                logits = torch.stack([q[b, h * G : (h + 1) * G, p] @ k[b, h, t] * scale for t in ts], -1)  # [G, n]
                probs = torch.softmax(logits, -1)
                out[b, h * G : (h + 1) * G, p] = probs @ v[b, h, ts]
                for i, t in enumerate(ts):
                    held[t][1] = float(probs[:, i].max())
            per_head.append({t: c[0] for t, c in held.items()})
        pools.append(per_head)
    return out, pools


@pytest.mark.parametrize("sink,window,topk,pool", [(2, 3, 8, 3), (0, 1, 7, 2), (1, 2, 6, 6), (2, 4, 6, 0),
                                                   (0, 3, 5, 1), (3, 2, 9, 8)])
@torch.no_grad()
def test_decode_step_matches_the_plain_reference(sink, window, topk, pool):
    B, Hkv, G, S, D = 2, 2, 3, 36, 4
    g = torch.Generator().manual_seed(topk + pool)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
    cfg, policy = _policy(sink, window, topk, pool, Hkv, D)
    if pool == 0:  # a pool of 0 never comes out of a config (it is KVpop-mlp): build the policy directly
        policy = CascadePolicy(cfg, Hkv, D).eval()
    assert policy.dynamic and policy.score == "cascade" and policy.pool == pool
    pi = policy.priority(k, v, torch.arange(S).expand(B, S))
    layer = KVpopLayerCache(sink, window, topk)
    got, _ = _feed(layer, policy, q, k, v, scale=D**-0.5)
    want, pools = _reference_cascade(q, k, v, pi, sink, window, topk, pool, D**-0.5)
    assert_close(got, want, ATOL, "outputs")
    lo = sink + window
    for b in range(B):
        for h in range(Hkv):
            slots = layer.pos[b, h].tolist()
            assert sorted(p for p in slots if p >= 0) == sorted(pools[b][h]), (b, h)
            # and each pool's tokens sit in that pool's slots
            assert sorted(p for p in slots[lo : lo + topk - pool] if p >= 0) == sorted(
                t for t, c in pools[b][h].items() if c == "s")
            assert sorted(p for p in slots[lo + topk - pool :] if p >= 0) == sorted(
                t for t, c in pools[b][h].items() if c == "d")


@pytest.mark.parametrize("layer,sink,window,Hkv", [(False, 2, 3, 2), (True, 0, 1, 3), (True, 2, 3, 3)],
                         ids=["per-head", "layer-wide", "layer-wide-windowed"])
@torch.no_grad()
def test_the_pool_joins_the_rules_it_is_made_of(layer, sink, window, Hkv):
    # tova_pool = topk: TOVA with the same sinks and window, slot for slot and priority for priority: per KV head
    # (the max over its query heads), or for the layer-wide cascade as its paper ranks (the layer's head average);
    # a pool of 0: the static rule's eviction times of the same priorities, in every head
    B, G, S, D, topk = 2, 2, 40, 4, 7
    g = torch.Generator().manual_seed(9 if layer else 5)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
    make = _layer_policy if layer else _policy
    _, cascade = make(sink, window, topk, topk, Hkv, D)
    tova = make_policy(kvpop.KVpopConfig(sink=sink, window=window, topk=topk, policy="tova", tova_head_average=layer),
                       Hkv, D)
    runs = []
    for policy in (cascade, tova):
        cache = KVpopLayerCache(sink, window, topk)
        runs.append((*_feed(cache, policy, q, k, v, scale=D**-0.5), cache))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert torch.equal(runs[0][2].pri, runs[1][2].pri)

    cfg, _ = make(sink, window, topk, 1, Hkv, D)
    static = CascadePolicy(cfg, Hkv, D).eval()
    pi = static.priority(k, v, torch.arange(S).expand(B, S))
    position = torch.arange(S).expand(B, S)
    valid = torch.ones(B, S, dtype=torch.bool)
    got = dynamic_eviction_positions(q, k, position, valid, pi, sink, window, topk, D**-0.5,
                                     "cascade_mean" if layer else "cascade", pool=0)
    want = eviction_times(pi, sink, window, topk)  # S for a token never evicted, where the walk says NEVER
    eligible = torch.arange(S) >= sink
    assert torch.equal(got.clamp(max=S)[..., eligible], want[..., eligible])


def _inputs(B, Hkv, G, S, D, ties, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
    pi = torch.randn(B, Hkv, S, generator=g)
    if ties:
        # repeated keys and queries (equal probabilities) and static priorities on a coarse grid
        k = k[:, :, torch.randint(0, min(4, S), (S,), generator=g)]
        q[:, :, 1::2] = q[:, :, 0::2][:, :, : S // 2]
        pi = pi.round()
    return q, k, v, pi


@pytest.mark.parametrize("B,Hkv,G,S,D,sink,window,topk,pool", [
    (1, 1, 1, 9, 4, 0, 1, 3, 1), (2, 3, 1, 37, 4, 1, 1, 5, 2), (1, 2, 4, 100, 8, 0, 50, 50, 25),
    (2, 1, 2, 70, 8, 3, 7, 11, 11), (3, 2, 3, 64, 8, 2, 3, 12, 0), (2, 2, 2, 80, 8, 4, 4, 8, 7),
])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("score,decay", [("cascade", 1.0), ("cascade_mean", 1.0), ("cascade_sum", 1.0),
                                         ("cascade_sum", 0.7)], ids=["cascade", "cascade_mean", "h2o", "mix"])
def test_torch_walk_equals_the_reference_walk(B, Hkv, G, S, D, sink, window, topk, pool, ties, score, decay):
    # op level, bit for bit: two chunks, the second from the slots, priorities and priors the first left
    q, k, _, pi = _inputs(B, Hkv, G, S, D, ties, seed=S + pool)
    N = sink + window + topk
    valid = left_padded(B, S, seed=3)
    position = valid.long().cumsum(-1) - 1
    empty = torch.full((B, Hkv, N), float("-inf"))
    half = S // 2
    slots = (k.new_zeros(B, Hkv, N, D), position.new_full((B, Hkv, N), -1), empty)
    first = dynamic_walk(q[:, :, :half], k[:, :, :half], *slots, position[:, :half], valid[:, :half], pi[..., :half],
                         sink, window, topk, D**-0.5, score, backend="reference", slot_prior=empty, pool=pool,
                         decay=decay)
    again = dynamic_walk(q[:, :, :half], k[:, :, :half], *slots, position[:, :half], valid[:, :half], pi[..., :half],
                         sink, window, topk, D**-0.5, score, backend="torch", slot_prior=empty, pool=pool, decay=decay)
    for a, b, what in zip(again, first, ("evicted", "pos", "pri", "prior")):
        assert torch.equal(a, b), f"first chunk: {what}"
    src = first[1].clamp(min=0)[..., None].expand(-1, -1, -1, D)
    keys = torch.where((first[1] >= 0)[..., None], k.gather(2, src), 0.0)
    args = (q[:, :, half:], k[:, :, half:], keys, first[1], first[2], position[:, half:], valid[:, half:],
            pi[..., half:], sink, window, topk, D**-0.5, score)
    want = dynamic_walk(*args, backend="reference", slot_prior=first[3], pool=pool, decay=decay)
    got = dynamic_walk(*args, backend="auto", slot_prior=first[3], pool=pool, decay=decay)
    for a, b, what in zip(got, want, ("evicted", "pos", "pri", "prior")):
        assert torch.equal(a, b), what
    # every kept token carries its own static priority
    held = want[1][0] >= 0  # row 0 has no padding: a token's position is its index
    assert torch.equal(want[3][0][held], pi[0].gather(-1, want[1][0].clamp(min=0))[held])
    # a step evicts at most one token, and a token at most once
    ev = torch.cat([first[0], want[0]], dim=-1)
    for row in ev.flatten(0, 1):
        kept = row[row >= 0]
        assert kept.unique().numel() == kept.numel()



@pytest.mark.parametrize("B,Hkv,G,S,D,sink,window,topk,pool", [
    (2, 3, 2, 40, 8, 0, 1, 9, 6), (2, 2, 2, 50, 8, 2, 3, 8, 3), (2, 3, 1, 36, 4, 0, 1, 5, 0),
    (2, 2, 2, 36, 4, 0, 1, 5, 5), (1, 2, 3, 30, 4, 1, 2, 0, 0),
])
@pytest.mark.parametrize("score,decay", [("cascade_mean", 1.0), ("cascade_sum", 0.7)], ids=["cascade_mean", "mix"])
def test_layer_cascade_walk_with_infinite_priorities(B, Hkv, G, S, D, sink, window, topk, pool, score, decay):
    # tokens of static priority -inf (the static pool never takes them), and a second chunk from slots where some held
    # tokens' scores and static priorities are -inf (a leaving token of score -inf never enters the score pool): the
    # torch walk's shortcuts for finite priorities are off and it makes the reference's moves; topk 0 has no
    # long-range slot at all
    q, k, _, pi = _inputs(B, Hkv, G, S, D, False, seed=S + topk)
    g = torch.Generator().manual_seed(S)
    pi = torch.where(torch.rand(pi.shape, generator=g) < 0.3, float("-inf"), pi)
    N = sink + window + topk
    valid = left_padded(B, S, seed=3)
    position = valid.long().cumsum(-1) - 1
    empty = torch.full((B, Hkv, N), float("-inf"))
    half = S // 2
    slots = (k.new_zeros(B, Hkv, N, D), position.new_full((B, Hkv, N), -1), empty)
    args = (q[:, :, :half], k[:, :, :half], *slots, position[:, :half], valid[:, :half], pi[..., :half], sink, window,
            topk, D**-0.5, score)
    first = dynamic_walk(*args, backend="reference", slot_prior=empty, pool=pool, decay=decay)
    again = dynamic_walk(*args, backend="torch", slot_prior=empty, pool=pool, decay=decay)
    for a, b, what in zip(again, first, ("evicted", "pos", "pri", "prior")):
        assert torch.equal(a, b), f"first chunk: {what}"
    src = first[1].clamp(min=0)[..., None].expand(-1, -1, -1, D)
    keys = torch.where((first[1] >= 0)[..., None], k.gather(2, src), 0.0)
    gone = (first[1] >= 0) & (torch.rand(first[2].shape, generator=g) < 0.3)
    pri, prior = first[2].masked_fill(gone, float("-inf")), first[3].masked_fill(gone, float("-inf"))
    args = (q[:, :, half:], k[:, :, half:], keys, first[1], pri, position[:, half:], valid[:, half:], pi[..., half:],
            sink, window, topk, D**-0.5, score)
    want = dynamic_walk(*args, backend="reference", slot_prior=prior, pool=pool, decay=decay)
    got = dynamic_walk(*args, backend="torch", slot_prior=prior, pool=pool, decay=decay)
    for a, b, what in zip(got, want, ("evicted", "pos", "pri", "prior")):
        assert torch.equal(a, b), what
    # some -inf token was up for a slot
    assert bool((pi[..., half:] == float("-inf")).any()) and bool(gone.any())

@pytest.mark.parametrize("split", [(40,), (17, 30, 1, 1, 1, 13), (1, 5, 40, 1, 1, 15)], ids=str)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("layer,decay", [(False, None), (True, None), (True, 1.0), (True, 0.5)],
                         ids=["per-head", "layer-wide", "layer-wide-h2o", "layer-wide-mix"])
@torch.no_grad()
def test_chunked_prefill_equals_the_token_by_token_replay(split, ties, layer, decay):
    # the cache's prefill (the walk, then one attention) leaves the slots bit for bit as decoding does; the
    # layer-wide cascades at TOVA's split, with three KV heads whose static pools differ
    B, G, D = 3, 2, 8
    S = sum(split)
    Hkv, sink, window, topk, pool = (3, 0, 1, 13, 8) if layer else (2, 2, 3, 10, 4)
    q, k, v, _ = _inputs(B, Hkv, G, S, D, ties, seed=11 + layer)
    valid = left_padded(B, S, seed=2 + 2 * layer)
    if layer:
        _, policy = _layer_policy(sink, window, topk, pool, Hkv, D, decay=decay)
    else:
        _, policy = _policy(sink, window, topk, pool, Hkv, D)
    # priorities read off the key by indexing alone: the same bits whatever the chunk's shape (the MLP's einsum
    # may round a chunk of 40 tokens otherwise than one token); with ties, on a coarse grid
    grid = 2.0 if ties else 1e6
    policy.priority = lambda key, value, position: (key[..., 0].float() * grid).round() / grid
    replay = KVpopLayerCache(sink, window, topk)
    want, _ = _feed(replay, policy, q, k, v, valid, D**-0.5)
    fast = KVpopLayerCache(sink, window, topk)
    outs, start = [], 0
    for n in split:
        sl = slice(start, start + n)
        outs.append(fast.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], valid[:, sl], policy, D**-0.5))
        start += n
    for name in ("keys", "values", "pos", "pri", "prior", "seen"):
        assert torch.equal(getattr(fast, name), getattr(replay, name)), name
    got = torch.cat(outs, 2)
    real = valid[:, None, :, None].expand_as(got)
    assert_close(got[real], want[real], 2e-5, "outputs at real tokens")


def test_cascade_trains_as_the_static_rule():
    cfg = kvpop.KVpopConfig.for_budget(32, tova_pool=6, scorer_hidden=8)
    assert (cfg.sink, cfg.window, cfg.topk) == (4, 8, 20)  # KVpop's split: the pool comes out of the top-k
    policy = make_policy(cfg, 2, 4)
    assert isinstance(policy, CascadePolicy) and policy.training and not policy.dynamic
    policy.eval()
    assert policy.dynamic and policy.pool == 6
    assert type(make_policy(kvpop.KVpopConfig.for_budget(32, scorer_hidden=8), 2, 4)).__name__ == "ScorerPolicy"


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match=r"tova_pool=21 .*\[0, topk=20\]"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=21)
    with pytest.raises(ValueError, match="tova_pool=-1"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=-1)
    with pytest.raises(ValueError, match="tova_pool=2 .*scorer='mlp'"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=2, scorer="mlstm")
    with pytest.raises(ValueError, match="tova_pool=2 .*policy='kvpop'"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=2, policy="tova")
    with pytest.raises(ValueError, match="two different extensions"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=2, tova_prior=1.0)
    with pytest.raises(ValueError, match="must hold the TOVA pool"):
        kvpop.KVpopConfig(sink=2, window=2, topk=4, tova_pool=3, layer_topk=(2, 6))
    q, k = torch.zeros(1, 2, 5, 4), torch.zeros(1, 1, 5, 4)
    slots = (torch.zeros(1, 1, 6, 4), torch.full((1, 1, 6), -1), torch.full((1, 1, 6), float("-inf")))
    pos, valid, pri = torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 1, 5)
    with pytest.raises(ValueError, match="pool size is given with scores 'cascade', 'cascade_mean', 'cascade_sum' only"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "cascade", slot_prior=slots[2])
    with pytest.raises(ValueError, match=r"decay=1.5: score 'cascade_sum' takes a decay in \[0, 1\]"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "cascade_sum", slot_prior=slots[2], pool=1, decay=1.5)
    with pytest.raises(ValueError, match=r"decay=0.5: .*the other scores none"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "cascade_mean", slot_prior=slots[2], pool=1, decay=0.5)
    with pytest.raises(ValueError, match=r"pool=4 must be an integer in \[0, topk=3\]"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "cascade", slot_prior=slots[2], pool=4)
    with pytest.raises(ValueError, match="does not run score 'cascade'"):
        dynamic_walk(q, k, *slots, pos, valid, pri, 1, 2, 3, 1.0, "cascade", backend="parallel", slot_prior=slots[2],
                     pool=1)


# --- the Triton walk with two pools (ops/dynamic/kernel.py, score 3): the interpreter on the CPU, natively on CUDA ---

TRITON_CHECK = textwrap.dedent(
    """
    import torch
    from kvpop.ops.dynamic import dynamic_walk
    from kvpop.ops.dynamic.kernel import dynamic_walk_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def case(B, H, G, C, D, s, w, k, pool, ties, pad, seed, score="cascade", decay=1.0):
        g = torch.Generator().manual_seed(seed)
        q, key = torch.randn(B, H * G, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
        pi = torch.randn(B, H, C, generator=g)
        if ties:
            key[:, :, 2::3] = key[:, :, 0:1]  # equal probabilities
            pi = pi.round()  # equal static priorities
        valid = torch.ones(B, C, dtype=torch.bool)
        if pad:
            valid[-1, : C // 4] = False
        N = s + w + k
        empty = torch.full((B, H, N), float("-inf"))
        slots = (torch.zeros(B, H, N, D), torch.full((B, H, N), -1), empty)
        position = valid.long().cumsum(-1) - 1
        half = C // 2
        first = dynamic_walk(q[:, :, :half], key[:, :, :half], *slots, position[:, :half], valid[:, :half],
                             pi[..., :half], s, w, k, D**-0.5, score, backend="torch", slot_prior=empty, pool=pool,
                             decay=decay)
        keys = torch.zeros(B, H, N, D)  # the slot keys are not the walk's business; any values do for the check
        args = [t.to(device) for t in (q[:, :, half:], key[:, :, half:], keys, first[1], first[2], position[:, half:],
                                       valid[:, half:], pi[..., half:])]
        prior = first[3].to(device)
        want = dynamic_walk(*args, s, w, k, D**-0.5, score, backend="torch", slot_prior=prior, pool=pool, decay=decay)
        got = dynamic_walk(*args, s, w, k, D**-0.5, score, backend="triton", slot_prior=prior, pool=pool, decay=decay)
        blocks = dynamic_walk_triton(*args, s, w, k, D**-0.5, score, block=8, slot_prior=prior, pool=pool,
                                     decay=decay)
        what = (B, H, G, C, D, s, w, k, pool, ties, pad, seed, score, decay)
        for a, b in ((blocks, got), (got, want)):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[3], b[3]), what
        held = want[2].isfinite()
        assert torch.equal(got[2].isfinite(), held), what
        assert (got[2] - want[2])[held].abs().max() <= 1e-5 * max(1.0, float(want[2][held].abs().max())), what

    for i, (B, H, G, C, D, s, w, k, pool, *rest) in enumerate(SHAPES):
        score = rest[0] if rest else "cascade"
        decay = rest[1] if len(rest) > 1 else 1.0
        case(B, H, G, C, D, s, w, k, pool, ties=i % 2 == 0, pad=i % 3 == 1, seed=i, score=score, decay=decay)
    print("ok")
    """
)


def _run_triton_check(shapes) -> None:
    run_triton_check(TRITON_CHECK.replace("SHAPES", repr(shapes)), "<triton cascade check>")


def test_triton_walk_makes_the_torch_walks_cascade_decisions():
    pytest.importorskip("triton", reason="the Triton walk is optional (pip install triton)")
    # (B, H, G, C, D, sink, window, topk, pool): a split pool, all static (0), all TOVA (topk), GQA, padding
    _run_triton_check([(1, 2, 2, 31, 16, 2, 3, 8, 3), (2, 2, 3, 40, 12, 0, 1, 7, 0), (2, 1, 4, 37, 16, 0, 4, 6, 6),
                       (1, 1, 2, 29, 8, 1, 2, 5, 1), (2, 2, 1, 44, 8, 4, 4, 10, 4), (1, 2, 2, 9, 8, 1, 2, 3, 2)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cascade_walk_at_size_on_cuda():
    pytest.importorskip("triton")
    _run_triton_check([(1, 8, 4, 2048, 128, 4, 256, 764, 256), (2, 3, 3, 2048, 64, 4, 64, 188, 94)])


# --- the layer-wide cascade (`tova_head_average`, score "cascade_mean"): TOVA's paper ranking takes the token first ---


def _reference_layer_cascade(q, k, v, pi, sink, window, topk, pool, scale, decay=None):
    """The layer-wide cascade's step semantics in plain Python, per batch row (its KV heads together).

    The TOVA pool ("d", at most `pool` tokens) is one for the layer: the token leaving the window takes a free
    TOVA slot, or displaces the pool's weakest by (latest attention, position) if its attention is at least as
    high (it is the newest). The loser (the leaving token or the displaced one), the same token in every KV head,
    then meets each head's own static pool ("s", at most `topk - pool`): it takes a free slot, or displaces the
    weakest by (static priority `pi[b, h]`, position) if it beats it, or is evicted from that head. A token's
    latest attention is its probability averaged over every query head of the layer (TOVA's paper ranking); with
    `decay` the pool ranks by that attention accumulated over the steps instead: a token's score starts at 0 when it
    is inserted and is `decay` times itself plus the latest attention after each step (H2O's sum at `decay = 1`).
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    static = topk - pool
    out = torch.zeros(B, Hq, S, D)
    pools = []
    for b in range(B):
        held = [{} for _ in range(Hkv)]  # per head: position -> pool
        att = {}  # the layer's latest attention of the tokens every head holds (sinks, window, TOVA pool)
        for p in range(S):
            x = p - window
            if x >= sink:
                loser = x
                if pool:
                    dy = [t for t in held[0] if held[0][t] == "d"]
                    if len(dy) < pool:
                        loser = None
                    else:
                        d = min(dy, key=lambda t: (att[t], t))
                        if att[x] >= att[d]:
                            loser = d
                    if loser != x:
                        for h in range(Hkv):
                            held[h][x] = "d"
                for h in range(Hkv):
                    if loser is None:
                        break
                    del held[h][loser]
                    st = [t for t in held[h] if held[h][t] == "s"]
                    if len(st) < static:
                        held[h][loser] = "s"
                    elif static:
                        m = min(st, key=lambda t: (float(pi[b, h, t]), t))
                        if (float(pi[b, h, loser]), loser) > (float(pi[b, h, m]), m):
                            del held[h][m]
                            held[h][loser] = "s"
            for h in range(Hkv):
                held[h][p] = "sink" if p < sink else "w"
            att[p] = 0.0
            probs_of = {}
            for h in range(Hkv):
                ts = sorted(held[h])
                logits = torch.stack([q[b, h * G : (h + 1) * G, p] @ k[b, h, t] * scale for t in ts], -1)  # [G, n]
                probs = torch.softmax(logits, -1)
                out[b, h * G : (h + 1) * G, p] = probs @ v[b, h, ts]
                for i, t in enumerate(ts):
                    probs_of.setdefault(t, []).append(probs[:, i])
            for t, ps in probs_of.items():
                if len(ps) == Hkv:  # a token every head holds
                    latest = float(torch.cat(ps).double().mean())
                    att[t] = latest if decay is None else decay * att[t] + latest
        pools.append([dict(hh) for hh in held])
    return out, pools


@pytest.mark.parametrize("sink,window,topk,pool", [(0, 1, 8, 5), (0, 1, 7, 1), (2, 3, 8, 3), (1, 2, 6, 6),
                                                   (0, 3, 5, 4), (3, 2, 9, 8), (0, 1, 6, 3)])
@pytest.mark.parametrize("decay", DECAYS, ids=DECAY_IDS)
@torch.no_grad()
def test_layer_cascade_decode_step_matches_the_plain_reference(sink, window, topk, pool, decay):
    B, Hkv, G, S, D = 2, 3, 2, 36, 4
    g = torch.Generator().manual_seed(topk + pool + 100)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
    cfg, policy = _layer_policy(sink, window, topk, pool, Hkv, D, decay=decay)
    assert policy.dynamic and policy.score == _score(decay) and policy.tova_first and policy.pool == pool
    assert policy.decay == (1.0 if decay is None else decay)
    pi = policy.priority(k, v, torch.arange(S).expand(B, S))
    layer = KVpopLayerCache(sink, window, topk)
    got, held = _feed(layer, policy, q, k, v, scale=D**-0.5)
    want, pools = _reference_layer_cascade(q, k, v, pi, sink, window, topk, pool, D**-0.5, decay)
    assert_close(got, want, ATOL, "outputs")
    lo, top = sink + window, sink + window + topk - pool
    for b in range(B):
        for h in range(Hkv):
            slots = layer.pos[b, h].tolist()
            assert sorted(p for p in slots if p >= 0) == sorted(pools[b][h]), (b, h)
            assert sorted(p for p in slots[lo:top] if p >= 0) == sorted(t for t, c in pools[b][h].items() if c == "s")
            assert sorted(p for p in slots[top:] if p >= 0) == sorted(t for t, c in pools[b][h].items() if c == "d")
    # the TOVA pool, the sinks and the window hold the same tokens in the same slots in every KV head, at every step
    for pos in held:
        shared = torch.cat([pos[..., :lo], pos[..., top:]], -1)
        assert torch.equal(shared, shared[:, :1].expand_as(shared))
    # while the static pools differ between heads (their priorities do)
    assert not torch.equal(layer.pos[..., lo:top], layer.pos[:, :1, lo:top].expand_as(layer.pos[..., lo:top])) or pool == topk


def test_triton_walk_makes_the_torch_walks_layer_cascade_decisions():
    pytest.importorskip("triton", reason="the Triton walk is optional (pip install triton)")
    # (B, H, G, C, D, sink, window, topk, pool, score): TOVA's split with a split pool, all TOVA (topk), all static
    # (0), KVpop's split, one KV head, GQA, padding
    _run_triton_check([(1, 2, 2, 31, 16, 0, 1, 8, 5, "cascade_mean"), (2, 3, 2, 40, 12, 0, 1, 7, 7, "cascade_mean"),
                       (2, 2, 3, 37, 16, 0, 1, 6, 0, "cascade_mean"), (1, 3, 1, 29, 8, 2, 3, 6, 2, "cascade_mean"),
                       (2, 1, 4, 44, 8, 0, 2, 10, 4, "cascade_mean"), (1, 2, 2, 9, 8, 1, 2, 3, 2, "cascade_mean")])


def test_triton_walk_makes_the_torch_walks_accumulating_cascade_decisions():
    pytest.importorskip("triton", reason="the Triton walk is optional (pip install triton)")
    # the pool ranked by the accumulated attention: H2O's sum (decay 1) and a mix (0.6); a split pool, all in the
    # pool, KVpop's split, GQA, padding (the kernel's floats are its own: decisions equal, priorities close)
    _run_triton_check([(1, 2, 2, 31, 16, 0, 1, 8, 5, "cascade_sum", 1.0), (2, 3, 2, 40, 12, 0, 1, 7, 7, "cascade_sum", 0.6),
                       (1, 3, 1, 29, 8, 2, 3, 6, 2, "cascade_sum", 1.0), (2, 1, 4, 44, 8, 0, 2, 10, 4, "cascade_sum", 0.6)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_layer_cascade_walk_at_size_on_cuda():
    pytest.importorskip("triton")
    # SmolLM2's heads at B = 2048 and 1024 with TOVA's split (the GPU table's shapes), and the 8B shape's
    _run_triton_check([(1, 3, 3, 2048, 64, 0, 1, 2047, 1535, "cascade_mean"),
                       (2, 3, 3, 2048, 64, 0, 1, 1023, 767, "cascade_mean"),
                       (1, 8, 4, 2048, 128, 0, 1, 1023, 511, "cascade_mean"),
                       (1, 3, 3, 2048, 64, 0, 1, 1023, 767, "cascade_sum", 1.0),
                       (2, 3, 3, 2048, 64, 0, 1, 2047, 1535, "cascade_sum", 0.9)])


def test_layer_cascade_config():
    cfg = kvpop.KVpopConfig.for_budget(32, tova_pool=20, tova_head_average=True, scorer_hidden=8)
    assert (cfg.sink, cfg.window, cfg.topk) == (0, 1, 31)  # TOVA's split: it ranks like TOVA
    policy = make_policy(cfg, 2, 4)
    assert isinstance(policy, CascadePolicy) and policy.training and not policy.dynamic  # trains as KVpop-mlp
    policy.eval()
    assert policy.dynamic and policy.score == "cascade_mean" and policy.tova_first and policy.pool == 20
    # a window given: TOVA's split around it (no sinks unless given)
    c = kvpop.KVpopConfig.for_budget(32, window=8, tova_pool=4, tova_head_average=True)
    assert (c.sink, c.window, c.topk) == (0, 8, 24)
    with pytest.raises(ValueError, match="tova_head_average=True is invalid: applies to policy='tova' and to KVpop-cascade"):
        kvpop.KVpopConfig.for_budget(32, tova_head_average=True)
    with pytest.raises(ValueError, match="tova_head_average=1 is invalid: must be a bool"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=3, tova_head_average=1)


def test_a_kvpop_mlp_config_as_either_cascade():
    mlp = kvpop.KVpopConfig.for_budget(32, scorer_hidden=8)
    c = mlp.with_tova_pool(6)
    assert (c.sink, c.window, c.topk, c.tova_pool, c.tova_head_average) == (4, 8, 20, 6, False)
    c = mlp.with_tova_pool(24, layer=True)
    assert (c.sink, c.window, c.topk, c.tova_pool, c.tova_head_average) == (0, 1, 31, 24, True)
    assert c.budget == mlp.budget and c.scorer_hidden == 8
    with pytest.raises(ValueError, match="applies to a KVpop-mlp config"):
        kvpop.KVpopConfig.for_budget(32, policy="tova").with_tova_pool(4)
    with pytest.raises(ValueError, match="TOVA's split of one budget"):
        mlp.with_layer_budgets([30, 34]).with_tova_pool(4, layer=True)


@pytest.mark.parametrize("ties", [False, True])
def test_an_accumulating_pool_of_no_memory_is_tova_s(ties):
    # decay 0: each step's score is the latest attention alone, so the walk makes "cascade_mean"'s decisions and
    # leaves its priorities, bit for bit (the accumulating score is one variation of TOVA's)
    B, Hkv, G, S, D, topk, pool = 2, 3, 2, 60, 8, 13, 8
    q, k, _, pi = _inputs(B, Hkv, G, S, D, ties, seed=21)
    valid = left_padded(B, S, seed=4)
    position = valid.long().cumsum(-1) - 1
    N = 1 + topk
    empty = torch.full((B, Hkv, N), float("-inf"))
    slots = (k.new_zeros(B, Hkv, N, D), position.new_full((B, Hkv, N), -1), empty)
    args = (q, k, *slots, position, valid, pi, 0, 1, topk, D**-0.5)
    tova = dynamic_walk(*args, "cascade_mean", backend="torch", slot_prior=empty, pool=pool)
    none = dynamic_walk(*args, "cascade_sum", backend="torch", slot_prior=empty, pool=pool, decay=0.0)
    for a, b, what in zip(none, tova, ("evicted", "pos", "pri", "prior")):
        assert torch.equal(a, b), what
    # while H2O's sum decides otherwise on the same inputs
    h2o = dynamic_walk(*args, "cascade_sum", backend="torch", slot_prior=empty, pool=pool, decay=1.0)
    assert not torch.equal(h2o[1], tova[1]) or ties


# --- the accumulating pools through the model: teacher-forced == prefill + decode, padding, generate ---

ACCUMULATING = {
    # H2O's accumulated attention at TOVA's split; a mix at KVpop's split with pre-RoPE keys
    "h2o": kvpop.KVpopConfig.for_budget(14, tova_pool=9, tova_head_average=True, pool_decay=1.0, scorer_hidden=16),
    "mix": kvpop.KVpopConfig(sink=2, window=3, topk=9, tova_pool=5, tova_head_average=True, pool_decay=0.5,
                             scorer_hidden=16, scorer_keys="pre_rope"),
}
SEQ = 48


@pytest.fixture(scope="module")
def accumulating():
    return {(arch, name): retrofitted(arch, cfg) for arch in ("qwen3", "llama") for name, cfg in ACCUMULATING.items()}


def _ids(seed, n=SEQ):
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("name", list(ACCUMULATING))
@pytest.mark.parametrize("split", [(1,), (9,), (7, 7, 7), (13, 20, 15)], ids=str)
@torch.no_grad()
def test_accumulating_pool_teacher_forced_equals_prefill_and_decode(accumulating, arch, name, split):
    model = accumulating[(arch, name)]
    assert model.kvpop.layers[0].score == "cascade_sum"
    ids = _ids(0)
    cache = kvpop.KVpopCache(model)
    outs, start = [], 0
    with quiet():
        full = model(ids).logits
        for n in [*split, *[1] * (SEQ - sum(split))]:
            outs.append(model(ids[:, start : start + n], **cache_kwargs(cache)).logits)
            start += n
    assert_close(torch.cat(outs, 1), full, LOGIT_ATOL, f"{arch}/{name}/{split}")
    assert all(int(used.max()) <= ACCUMULATING[name].budget for used in cache.slots_used())


@pytest.mark.parametrize("name", list(ACCUMULATING))
@torch.no_grad()
def test_accumulating_pool_batch_with_left_padding(accumulating, name):
    model = accumulating[("qwen3", name)]
    a, b = _ids(2, 40)[0], _ids(3, 29)[0]
    ids, mask, pos = padded_batch([a, b])
    with quiet():
        alone = [model(x[None]).logits[0] for x in (a, b)]
        full = model(ids, attention_mask=mask, position_ids=pos).logits
        cache = kvpop.KVpopCache(model)
        prefill = model(ids[:, :15], attention_mask=mask[:, :15], position_ids=pos[:, :15], **cache_kwargs(cache))
        steps = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1],
                       **cache_kwargs(cache)).logits for t in range(15, ids.shape[1])]
    cached = torch.cat([prefill.logits, *steps], 1)
    for out, what in ((full, "teacher-forced"), (cached, "cached")):
        assert_close(out[0], alone[0], LOGIT_ATOL, f"{what} row 0")
        assert_close(out[1, -29:], alone[1], LOGIT_ATOL, f"{what} row 1 (padded)")


@pytest.mark.parametrize("name", list(ACCUMULATING))
@torch.no_grad()
def test_accumulating_pool_generate_batched_equals_single(accumulating, name):
    model = accumulating[("llama", name)]
    a, b = _ids(4, 30)[0], _ids(5, 21)[0]
    ids, mask, _ = padded_batch([a, b])
    with quiet():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25, do_sample=False,
                               pad_token_id=0, **cache_kwargs(kvpop.KVpopCache(model)))
        for row, x in enumerate((a, b)):
            single = model.generate(x[None], max_new_tokens=25, min_new_tokens=25, do_sample=False,
                                    **cache_kwargs(kvpop.KVpopCache(model)))
            assert torch.equal(batch[row, -single.shape[1]:], single[0])


def test_pool_decay_config():
    cfg = kvpop.KVpopConfig.for_budget(32, tova_pool=20, tova_head_average=True, pool_decay=1.0, scorer_hidden=8)
    assert (cfg.sink, cfg.window, cfg.topk) == (0, 1, 31)
    policy = make_policy(cfg, 2, 4).eval()
    assert policy.score == "cascade_sum" and policy.decay == 1.0 and policy.tova_first
    mlp = kvpop.KVpopConfig.for_budget(32, scorer_hidden=8)
    assert mlp.with_tova_pool(24, layer=True, decay=0.5).pool_decay == 0.5
    for bad, match in ((0.0, "pool_decay=0.0 is invalid: must be None"), (1.5, "pool_decay=1.5"),
                       (True, "pool_decay=True")):
        with pytest.raises(ValueError, match=match):
            kvpop.KVpopConfig.for_budget(32, tova_pool=20, tova_head_average=True, pool_decay=bad)
    with pytest.raises(ValueError, match="pool_decay=1.0 is invalid: applies to the layer-wide KVpop-cascade only"):
        kvpop.KVpopConfig.for_budget(32, tova_pool=20, pool_decay=1.0)
    with pytest.raises(ValueError, match="pool_decay=0.5 is invalid: applies to the layer-wide cascade only"):
        mlp.with_tova_pool(4, decay=0.5)


# --- the recommended policy: a trained KVpop-mlp directory runs as the layer-wide cascade unless told otherwise ---


def test_the_recommended_pool_rule():
    # 3/4 of the budget - 1 long-range slots, rounded down: the pools the GPU's development rows chose or tied
    assert [recommended_pool(b) for b in (2048, 1024, 512, 256, 3, 2)] == [1535, 767, 383, 191, 1, 0]
    with pytest.raises(ValueError, match="budget=0 must be an integer >= 1"):
        recommended_pool(0)
    mlp = kvpop.KVpopConfig.for_budget(512, scorer_hidden=8)
    rec = mlp.for_rule()
    assert rec == mlp.for_rule("cascade") == mlp.recommended()
    assert (rec.sink, rec.window, rec.topk, rec.tova_pool, rec.tova_head_average, rec.pool_decay) == (
        0, 1, 511, 383, True, RECOMMENDED_POOL_DECAY)
    assert rec.budget == mlp.budget and rec.scorer_hidden == 8
    # the static rule: the saved config itself; a saved cascade without its pool
    assert mlp.for_rule("static") is mlp
    assert rec.for_rule("static") == kvpop.KVpopConfig(sink=0, window=1, topk=511, scorer_hidden=8)
    assert rec.for_rule() is rec and rec.for_rule("cascade") is rec  # a saved cascade runs as saved
    # configs the recommended policy does not apply to run as saved by default, and are refused when asked
    for other in (kvpop.KVpopConfig.for_budget(512, scorer="mlstm"), kvpop.KVpopConfig.for_budget(512, policy="dms"),
                  kvpop.KVpopConfig.for_budget(512, scorer="evidence"), kvpop.KVpopConfig.for_budget(512, tova_prior=1.0),
                  mlp.with_layer_budgets([500, 524]), kvpop.KVpopConfig(sink=1, window=1, topk=0)):
        assert other.for_rule() is other and other.for_rule("static") is other
        with pytest.raises(ValueError, match="the recommended policy runs a KVpop-mlp trained for the static rule"):
            other.for_rule("cascade")
    with pytest.raises(ValueError, match=r"rule='tova' is invalid: use one of \('cascade', 'static'\)"):
        mlp.for_rule("tova")
    assert "layer-wide KVpop-cascade at budget 512: 383 of 511" in rec.describe()
    assert mlp.describe().startswith("the static rule at budget 512")
    # the same weights at another budget, split as for_budget splits it
    at = mlp.at_budget(256)
    assert (at.sink, at.window, at.topk, at.scorer_hidden) == (4, 64, 188, 8)


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "final"
    model, tok = load_model("tiny-random-qwen3")
    torch.manual_seed(0)
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(sink=1, window=4, topk=11, scorer_hidden=8)), path,
               tokenizer=tok)
    return path


def test_load_runs_a_kvpop_mlp_directory_as_the_recommended_policy(mlp_dir, tmp_path):
    saved = kvpop.KVpopConfig(sink=1, window=4, topk=11, scorer_hidden=8)
    model = kvpop.load(mlp_dir)
    assert model.kvpop.config == saved.recommended()
    assert model.kvpop.layers[0].score == "cascade_mean" and model.kvpop.layers[0].pool == recommended_pool(16) == 11
    assert kvpop.load(mlp_dir, rule="static").kvpop.config == saved
    assert kvpop.load(mlp_dir, rule="cascade").kvpop.config == saved.recommended()
    with pytest.raises(ValueError, match="rule='static' and config: give one of them"):
        kvpop.load(mlp_dir, rule="static", config=saved)
    # the saved config stays what was trained; the same scorer weights under either rule
    assert kvpop.KVpopConfig.from_dict(json.loads((mlp_dir / "kvpop_config.json").read_text())) == saved
    static = kvpop.load(mlp_dir, rule="static")
    for a, b in zip(model.kvpop.state_dict().values(), static.kvpop.state_dict().values()):
        assert torch.equal(a, b)
    # a directory saved as another rule runs as saved
    kvpop.save(kvpop.load(mlp_dir, config=saved.with_tova_pool(5, layer=True, decay=1.0)), tmp_path / "h2o")
    assert kvpop.load(tmp_path / "h2o").kvpop.config.pool_decay == 1.0


def _generate(capsys, *argv):
    rc = main(["generate", "--prompt", "the proof follows by induction", "--max-new-tokens", "20", *argv])
    captured = capsys.readouterr()
    return rc, captured.err


def test_generate_says_which_rule_runs(mlp_dir, capsys):
    rc, err = _generate(capsys, "--model", str(mlp_dir))
    assert rc == 0, err
    notes = [line for line in err.splitlines() if line.startswith("kvpop generate: note:")]
    assert len(notes) == 1 and "runs the layer-wide KVpop-cascade at budget 16: 11 of 15" in notes[0]
    assert "the recommended policy; --rule static runs the paper's static rule" in notes[0]
    assert "of 16 slots" in err
    rc, err = _generate(capsys, "--model", str(mlp_dir), "--rule", "static")
    assert rc == 0 and "runs the static rule at budget 16" in err and "(--rule static)" in err
    rc, err = _generate(capsys, "--model", str(mlp_dir), "--tova-pool-layer", "6", "--pool-decay", "1")
    assert rc == 0 and "6 of 15 long-range slots ranked by H2O's accumulated attention" in err
    # an untrained model keeps its behaviour, with its note
    rc, err = _generate(capsys, "--model", "tiny-random-qwen3", "--budget", "16")
    assert rc == 0 and "they are untrained (random)" in err and "runs the" not in err


@pytest.mark.parametrize("argv,expected", [
    (["--rule", "static", "--tova-pool-layer", "4"], "give --rule or --tova-pool-layer, not both"),
    (["--pool-decay", "1"], "--pool-decay ranks the pool of --tova-pool-layer N: give it with --tova-pool-layer"),
    (["--tova-pool-layer", "4", "--pool-decay", "2"], "--pool-decay 2.0 must lie in (0, 1]"),
])
def test_generate_rule_flags_refused(mlp_dir, capsys, argv, expected):
    rc, err = _generate(capsys, "--model", str(mlp_dir), *argv)
    assert rc == 1 and expected in err


def test_generate_rule_cascade_needs_trained_scorers(capsys):
    rc, err = _generate(capsys, "--model", "tiny-random-qwen3", "--rule", "cascade")
    assert rc == 1 and "--rule cascade runs a trained KVpop-mlp directory" in err


def test_eval_runs_trained_directories_by_the_rule(mlp_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(" ".join(["we add two to both sides and divide by three"] * 12) for _ in range(6)))
    base = ["eval", "--model", "tiny-random-qwen3", "--data", str(text), "--split", "all", "--seq-len", "96",
            "--sequences", "1", "--policies", "none", "--no-progress", "--force", "--out", str(tmp_path / "o")]

    def rows(*argv):
        assert main([*base, *argv]) == 0
        captured = capsys.readouterr()
        return {r["policy"]: r for r in json.loads((tmp_path / "o" / "results.json").read_text())["rows"]}, captured.err

    default, err = rows("--trained", str(mlp_dir))
    assert "runs the layer-wide KVpop-cascade at budget 16: 11 of 15" in err and "--rule static runs" in err
    assert default["kvpop"]["rule"].startswith("the layer-wide KVpop-cascade") and "recall" not in default["kvpop"]
    static, err = rows("--trained", str(mlp_dir), "--rule", "static")
    assert static["kvpop"]["rule"].startswith("the static rule") and 0 <= static["kvpop"]["recall"] <= 1
    assert static["kvpop"]["kl"] != pytest.approx(default["kvpop"]["kl"], rel=1e-6)
    # the pools of the development rows beside it, all from one copy of the weights: TOVA's, H2O's and a mix
    both, _ = rows("--trained", str(mlp_dir), "--rule", "static", "--tova-pool-layer", "11,7",
                   "--pool-decay", "none,1,0.5")
    assert set(both) == {"kvpop", *(f"kvpop+lpool{n}{r}" for n in (11, 7) for r in ("", "+h2o", "+d0.5"))}
    assert both["kvpop+lpool11"]["kl"] == pytest.approx(default["kvpop"]["kl"], rel=1e-6)
    assert both["kvpop"]["kl"] == pytest.approx(static["kvpop"]["kl"], rel=1e-6)
    assert "H2O's accumulated attention" in both["kvpop+lpool7+h2o"]["rule"]
    assert main([*base, "--trained", str(mlp_dir), "--pool-decay", "1"]) == 1
    assert "--pool-decay ranks the pools of --tova-pool-layer rows" in capsys.readouterr().err
    assert main([*base, "--trained", str(mlp_dir), "--tova-pool-layer", "4", "--pool-decay", "x"]) == 1
    assert "--pool-decay='x' must be comma-separated decays" in capsys.readouterr().err


def test_info_says_how_a_directory_runs(mlp_dir, capsys):
    assert main(["info", "--model", str(mlp_dir)]) == 0
    out = capsys.readouterr().out
    assert "runs as:" in out and "the layer-wide KVpop-cascade at budget 16" in out
