"""The delayed evidence scorer: the window-evidence op (chunked vs dense), its scorer, and the cache's sums.

The central claim (teacher-forced == prefill + decode) runs for the evidence configs in `test_cache.py`;
here: the op against its references, the decode accumulators against the op, padding, batch-row
bookkeeping, float32 under autocast, and training.
"""

from __future__ import annotations

import pytest
import torch

import kvpop
from helpers import LOGIT_ATOL, assert_close, cache_kwargs, quiet, retrofitted
from kvpop.ops.evidence import sequence_evidence, window_evidence, window_probs
from kvpop.policy import EvidenceState
from kvpop.scorers.evidence import EvidenceScorer, evidence_features

STATS_ATOL = 2e-6  # float32 chunked vs float64 dense, on probabilities in [0, 1] and sums up to w
CONFIG = kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="evidence", scorer_hidden=16)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert_close(actual, expected, atol, what)


def _op_inputs(B, Hq, Hkv, N, Q, E, D=8, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    query = 2 * torch.randn(B, Hq, Q, D, generator=g)
    key = torch.randn(B, Hkv, N, D, generator=g)
    if ties:  # repeated keys: equal logits, equal probabilities
        key = key[:, :, torch.randint(0, 3, (N,), generator=g)]
    sink_key = torch.randn(B, Hkv, E, D, generator=g)
    key_valid = torch.rand(B, N, generator=g) > 0.2
    query_valid = torch.rand(B, Q, generator=g) > 0.2
    query_pos = torch.arange(Q).expand(B, Q) + 4
    sink_pos = torch.randint(-1, 8, (B, E), generator=g)
    return query, key, key_valid, query_valid, query_pos, sink_key, sink_pos


# (B, Hq, Hkv, N, Q, E, window): odd lengths, fewer queries than entries, window 1, window > N, no sinks
OP_CASES = [(2, 4, 2, 63, 63, 2, 5), (1, 3, 1, 500, 500, 4, 37), (2, 6, 2, 40, 17, 3, 7), (1, 2, 2, 10, 10, 0, 1),
            (2, 4, 2, 50, 50, 4, 60)]


# every case at every chunk, except 500 one-query chunks (slow; chunk 7 runs the same code on that case)
CHUNKED_CASES = [(case, chunk) for case in OP_CASES for chunk in (1, 7, 256) if not (case[3] == 500 and chunk == 1)]


@pytest.mark.parametrize("case,chunk", CHUNKED_CASES, ids=str)
@pytest.mark.parametrize("ties", [False, True])
def test_chunked_matches_dense_reference(case, chunk, ties):
    B, Hq, Hkv, N, Q, E, w = case
    args = _op_inputs(B, Hq, Hkv, N, Q, E, seed=N + w, ties=ties)
    ref, ref_reached = window_evidence(*args, w, 0.4, backend="reference")
    got, reached = window_evidence(*args, w, 0.4, backend="chunked", chunk=chunk)
    assert torch.equal(reached, ref_reached)
    _close(got, ref, STATS_ATOL * w, f"{case} chunk={chunk} ties={ties}")


def _naive_sequence_evidence(query, key, valid, sink, window, scale):
    """Query by query, from the definition: p~(d -> t) over the keys every query keeps (sinks and window)."""
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    pos = torch.cumsum(valid.long(), -1) - 1
    out = torch.zeros(B, Hkv, S, 3, G, dtype=torch.float64)
    for b in range(B):
        for d in range(S):
            if not valid[b, d]:
                continue
            pd = pos[b, d]
            keep = valid[b] & (pos[b] <= pd) & ((pos[b] < sink) | (pos[b] > pd - window))  # [S]
            q = query[b, :, d].double().reshape(Hkv, G, D)
            logits = torch.einsum("hgd,hsd->hgs", q, key[b].double()) * scale
            p = torch.softmax(logits.masked_fill(~keep, -torch.inf), -1)  # [Hkv, G, S]
            # evidence for the tokens past the sinks whose window holds query d
            gets = keep & (pos[b] >= sink) & (pos[b] > pd - window)
            for t in gets.nonzero().flatten().tolist():
                out[b, :, t, 0] += p[:, :, t]
                out[b, :, t, 1] = torch.maximum(out[b, :, t, 1], p[:, :, t])
                out[b, :, t, 2] = p[:, :, t]  # queries come in order: the latest wins
    return out.float()


@pytest.mark.parametrize("S, sink, window", [(63, 2, 5), (40, 0, 1), (30, 4, 40), (37, 3, 8)])
def test_sequence_evidence_is_the_definition(S, sink, window):
    g = torch.Generator().manual_seed(S)
    query, key = torch.randn(2, 6, S, 8, generator=g), torch.randn(2, 3, S, 8, generator=g)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, :7] = False  # left padding
    valid[1, 20:23] = False  # and padding inside
    pos = torch.cumsum(valid.long(), -1) - 1
    want = _naive_sequence_evidence(query, key, valid, sink, window, 0.5)
    for backend in ("reference", "chunked"):
        got = sequence_evidence(query, key, pos, valid, sink, window, 0.5, backend=backend, chunk=16)
        _close(got, want, STATS_ATOL * window, f"{backend} S={S} sink={sink} window={window}")


def test_padding_changes_nothing():
    g = torch.Generator().manual_seed(3)
    S, P = 45, 11
    query, key = torch.randn(1, 4, S, 8, generator=g), torch.randn(1, 2, S, 8, generator=g)
    alone = sequence_evidence(query, key, torch.arange(S)[None], torch.ones(1, S, dtype=torch.bool), 2, 6, 0.3)
    # the same tokens with padding spread over the row (random contents there)
    n = S + P
    real = torch.ones(n, dtype=torch.bool)
    real[torch.randperm(n, generator=g)[:P]] = False
    q, k = torch.randn(1, 4, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    q[:, :, real], k[:, :, real] = query, key
    valid = real[None]
    got = sequence_evidence(q, k, torch.cumsum(valid.long(), -1) - 1, valid, 2, 6, 0.3)
    _close(got[:, :, real], alone, 1e-6, "padded vs alone")
    assert (got[:, :, ~real] == 0).all()


def test_window_probs_is_one_query_of_the_op():
    # a decode step's probabilities over [sinks, window ring] equal the op's for that query
    g = torch.Generator().manual_seed(0)
    s, w, D = 3, 6, 8
    query, keys = torch.randn(2, 4, 1, D, generator=g), torch.randn(2, 2, s + w, D, generator=g)
    occupied = torch.ones(2, 2, s + w, dtype=torch.bool)
    occupied[1, :, -2:] = False
    p = window_probs(query, keys, occupied, 0.5)  # [B, Hkv, G, s + w]
    assert torch.allclose(p.sum(-1), torch.ones(2, 2, 2)) and (p[1, :, :, -2:] == 0).all()
    stats, _ = window_evidence(query, keys[:, :, s:], occupied[:, 0, s:], torch.ones(2, 1, dtype=torch.bool),
                               torch.full((2, 1), 100), keys[:, :, :s], torch.arange(s).expand(2, s), w, 0.5)
    # the query is the last entry, so every valid ring entry is in its window
    _close(stats[..., 0, :].transpose(-1, -2), p[..., s:], 1e-6, "window_probs vs the op")


def test_decode_accumulators_equal_the_op():
    # after any prefill + decode the ring's sums are the op's for the window's tokens
    model = retrofitted("qwen3", CONFIG)
    ids = torch.randint(3, 300, (1, 37), generator=torch.Generator().manual_seed(1))
    cfg = model.kvpop.config
    cache = kvpop.KVpopCache(model)
    queries: list[list[torch.Tensor]] = [[] for _ in model.kvpop.layers]
    keys: list[list[torch.Tensor]] = [[] for _ in model.kvpop.layers]
    from kvpop import cache_evidence

    real_accumulate = cache_evidence.decode_accumulate
    real_chunk = cache_evidence.chunk_readout

    def spy_decode(layer, query, key, *a, **kw):
        i = cache.layers.index(layer)
        queries[i].append(query)
        keys[i].append(key)
        return real_accumulate(layer, query, key, *a, **kw)

    def spy_chunk(layer, query, key, *a, **kw):
        i = cache.layers.index(layer)
        queries[i].append(query)
        keys[i].append(key)
        return real_chunk(layer, query, key, *a, **kw)

    with torch.no_grad(), quiet(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache_evidence, "decode_accumulate", spy_decode)
        mp.setattr(cache_evidence, "chunk_readout", spy_chunk)
        model(ids[:, :13], **cache_kwargs(cache))
        for t in range(13, 37):
            model(ids[:, t : t + 1], **cache_kwargs(cache))
    S, s, w = 37, cfg.sink, cfg.window
    for i, layer in enumerate(cache.layers):
        q, k = torch.cat(queries[i], 2), torch.cat(keys[i], 2)
        want = sequence_evidence(q, k, torch.arange(S)[None], torch.ones(1, S, dtype=torch.bool), s, w,
                                 model.config.head_dim**-0.5)
        state: EvidenceState = layer.state
        for p in range(S - w + 1, S):  # the tokens in the window now
            _close(state.acc[:, :, (p - s) % w], want[:, :, p], 1e-6, f"layer {i} token {p}")


@torch.no_grad()
def test_padding_step_and_batch_rows():
    model = retrofitted("llama", CONFIG)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(3, 300, (1, 30), generator=g), torch.randint(3, 300, (1, 30), generator=g)

    def run(ids):
        cache = kvpop.KVpopCache(model)
        outs = [model(ids[:, :11], **cache_kwargs(cache)).logits]
        outs += [model(ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(11, 30)]
        return torch.cat(outs, 1)

    with quiet():
        alone = [run(x) for x in (a, b)]
        cache = kvpop.KVpopCache(model)
        model(torch.cat([a, b])[:, :11], **cache_kwargs(cache))
        # a padding step changes neither the sums nor the priorities
        before = [(layer.state.acc.clone(), layer.pri.clone()) for layer in cache.layers]
        mask = torch.cat([torch.ones(2, 11, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)], 1)
        model(torch.cat([a, b])[:, 11:12], attention_mask=mask, **cache_kwargs(cache))
        for layer, (acc, pri) in zip(cache.layers, before):
            assert torch.equal(layer.state.acc, acc) and torch.equal(layer.pri, pri)
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.batch_select_indices(torch.tensor([1]))  # row a
        # positions count real tokens: the padding step took no RoPE position
        rest = [model(a[:, t : t + 1], position_ids=torch.tensor([[t]]), **cache_kwargs(cache)).logits
                for t in range(11, 30)]
    assert_close(torch.cat(rest, 1)[0], alone[0][0, 11:], LOGIT_ATOL, "row a after padding, reorder and select")


def test_scorer_float32_under_autocast_and_detached_inputs():
    torch.manual_seed(0)
    H, D, G, N = 2, 16, 3, 512
    for mix in ("concat", "additive"):
        s = EvidenceScorer(H, D, G, hidden=32, mix=mix)
        if s.u is not None:
            torch.nn.init.normal_(s.u)
        key, value = torch.randn(1, H, N, D, requires_grad=True), torch.randn(1, H, N, D)
        stats = torch.rand(1, H, N, 3, G).requires_grad_()
        want = s(key, value, stats)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = s(key, value, stats)
        assert got.dtype == torch.float32 and torch.equal(got, want), f"{mix}: autocast changed the scores"
        assert want[0].unique(dim=-1).shape == want[0].shape, f"{mix}: ties"
        want.sum().backward()
        assert key.grad is None and stats.grad is None
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in s.parameters()), mix


def test_features_and_layout():
    stats = torch.tensor([0.0, 1.0, 1e-3]).reshape(1, 1, 1, 3, 1).expand(1, 1, 1, 3, 2)
    phi = evidence_features(stats)
    assert phi.shape == (1, 1, 1, 6)
    # [sum_g0, sum_g1, max_g0, max_g1, last_g0, last_g1]
    assert torch.allclose(phi[0, 0, 0, ::2], (torch.log(torch.tensor([0.0, 1.0, 1e-3]) + 1e-6) + 4.0) / 4.0)
    with pytest.raises(ValueError, match="mix"):
        EvidenceScorer(1, 4, 1, mix="sum")


def test_op_input_checks():
    args = list(_op_inputs(1, 4, 2, 10, 10, 2))
    with pytest.raises(ValueError, match="N >= Q"):
        window_evidence(args[0], args[1][:, :, :5], args[2][:, :5], *args[3:], 3, 1.0)
    with pytest.raises(ValueError, match="window"):
        window_evidence(*args, 0, 1.0)
    with pytest.raises(ValueError, match="backend"):
        window_evidence(*args, 3, 1.0, backend="flex")
    with pytest.raises(ValueError, match="multiple"):
        window_evidence(args[0][:, :3], *args[1:], 3, 1.0)


def test_config_checks():
    with pytest.raises(ValueError, match="scorer_keys"):
        kvpop.KVpopConfig(scorer_keys="rotated")
    with pytest.raises(ValueError, match="scorer_keys"):
        kvpop.KVpopConfig(scorer="mlstm", scorer_keys="pre_rope")
    with pytest.raises(ValueError, match="scorer_keys"):
        kvpop.KVpopConfig(policy="tova", scorer_keys="pre_rope")
    with pytest.raises(ValueError, match="evidence_mix"):
        kvpop.KVpopConfig(scorer="mlp", evidence_mix="additive")
    with pytest.raises(ValueError, match="evidence_mix"):
        kvpop.KVpopConfig(scorer="evidence", evidence_mix="product")
    cfg = kvpop.KVpopConfig(scorer="evidence", scorer_keys="pre_rope", evidence_mix="additive")
    assert kvpop.KVpopConfig.from_dict(cfg.to_dict()) == cfg


def test_save_and_load_keep_the_scorer(tmp_path):
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=7, scorer="evidence", scorer_hidden=16, evidence_mix="additive")
    model = retrofitted("qwen3", cfg)
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), quiet():
        want = model(ids).logits
        kvpop.save(model, tmp_path / "m")
        got = kvpop.load(tmp_path / "m")(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("split", [(1, 9), (2, 5, 30), (1, 1, 2, 40)], ids=str)
@torch.no_grad()
def test_chunks_starting_inside_the_sinks(split):
    # a prefill chunk that begins before the last sink: its sinks come partly from their slots, partly
    # from the chunk itself
    from test_cache import run_cached

    cfg = kvpop.KVpopConfig(sink=4, window=3, topk=5, scorer="evidence", scorer_hidden=16, scorer_keys="pre_rope")
    model = retrofitted("qwen3", cfg)
    ids = torch.randint(3, 300, (1, 48), generator=torch.Generator().manual_seed(3))
    with quiet():
        full = model(ids).logits
        cached, _ = run_cached(model, ids, split)
    assert_close(cached, full, LOGIT_ATOL, str(split))
