"""KVpopConfig validation: every bad value is named with what is allowed."""

import pytest

import kvpop


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("sink", -1, "sink=-1 .*>= 0"),
        ("sink", 1.5, "sink=1.5 .*integer"),
        ("window", 0, "window=0 .*>= 1"),
        ("topk", -3, "topk=-3"),
        ("topk", True, "topk=True"),
        ("policy", "lru", "policy='lru' .*kvpop"),
        ("scorer", "gru", "scorer='gru' .*mlp"),
        ("scorer_hidden", 0, "scorer_hidden=0"),
        ("decay_step", 0, "decay_step=0"),
        ("gamma_init", 1.0, "gamma_init=1.0 .*between 0 and 1"),
        ("gamma_init", 0.0, "gamma_init=0.0"),
        ("target_eps", 0.0, "target_eps=0.0"),
        ("target_agg", "sum", "target_agg='sum'"),
        ("loss_tau", -1.0, "loss_tau=-1.0"),
        ("loss_margin_delta", float("nan"), "loss_margin_delta=nan"),
        ("loss_balance_clip", (5.0, 0.2), r"loss_balance_clip=\(5.0, 0.2\)"),
        ("loss_balance_clip", (0.0, 1.0), "loss_balance_clip"),
        ("loss_query_fraction", 0.0, "loss_query_fraction=0.0 .*\\(0, 1\\]"),
        ("tova_prior", -0.5, "tova_prior=-0.5 .*weight >= 0"),
        ("tova_prior", float("inf"), "tova_prior=inf"),
        ("tova_prior", True, "tova_prior=True"),
    ],
)
def test_bad_values_are_named(field, value, match):
    with pytest.raises(ValueError, match=f"KVpopConfig.{match}"):
        kvpop.KVpopConfig(**{field: value})


def test_budget_round_trip_and_presets():
    cfg = kvpop.KVpopConfig(sink=4, window=256, topk=1788)
    assert cfg.budget == 2048
    assert cfg.compression_ratio(16384) == pytest.approx(0.875)
    assert kvpop.KVpopConfig.from_dict(cfg.to_dict()) == cfg
    small = kvpop.KVpopConfig.for_budget(512)
    assert (small.sink, small.window, small.topk, small.budget) == (4, 128, 380, 512)
    with pytest.raises(ValueError, match="budget=8 is smaller"):
        kvpop.KVpopConfig.for_budget(8, window=16)
    with pytest.raises(ValueError, match="unknown KVpopConfig field"):
        kvpop.KVpopConfig.from_dict({"sinks": 4})


def test_tova_and_h2o_splits_follow_their_papers_unless_windowed():
    tova = kvpop.KVpopConfig.for_budget(512, policy="tova")
    assert (tova.sink, tova.window, tova.topk, tova.tova_head_average) == (0, 1, 511, True)
    h2o = kvpop.KVpopConfig.for_budget(512, policy="h2o")
    assert (h2o.sink, h2o.window, h2o.topk) == (0, 256, 256)
    # kvpop's earlier variant, kept by name: 4 sinks, a quarter of the budget, TOVA per KV head
    tova_w = kvpop.KVpopConfig.for_budget(512, policy="tova", windowed=True)
    assert (tova_w.sink, tova_w.window, tova_w.topk, tova_w.tova_head_average) == (4, 128, 380, False)
    h2o_w = kvpop.KVpopConfig.for_budget(512, policy="h2o", windowed=True)
    assert (h2o_w.sink, h2o_w.window, h2o_w.topk) == (4, 128, 380)
    # what is given wins; the other policies keep their splits
    assert kvpop.KVpopConfig.for_budget(512, sink=4, policy="tova").topk == 507
    assert kvpop.KVpopConfig.for_budget(512, policy="tova", tova_head_average=False).tova_head_average is False
    slm = kvpop.KVpopConfig.for_budget(512, policy="streaming_llm")
    assert (slm.sink, slm.window, slm.topk) == (4, 508, 0)
    with pytest.raises(ValueError, match="windowed=True applies to"):
        kvpop.KVpopConfig.for_budget(512, windowed=True)


def test_mlstm_fields_are_checked():
    with pytest.raises(ValueError, match=r"KVpopConfig.delay=9 is invalid: .*\[0, window=8\]"):
        kvpop.KVpopConfig(window=8, delay=9, scorer="mlstm")
    with pytest.raises(ValueError, match=r"KVpopConfig.delay=-1 "):
        kvpop.KVpopConfig(delay=-1, scorer="mlstm")
    with pytest.raises(ValueError, match="KVpopConfig.delay=3 .*scorer='mlstm'"):
        kvpop.KVpopConfig(delay=3)
    with pytest.raises(ValueError, match="KVpopConfig.match_mlp_memory=True .*scorer='mlstm'"):
        kvpop.KVpopConfig(match_mlp_memory=True)
    with pytest.raises(ValueError, match="KVpopConfig.mlstm_dim=0 "):
        kvpop.KVpopConfig(mlstm_dim=0, scorer="mlstm")
    with pytest.raises(ValueError, match="KVpopConfig.mlstm_hidden=-1 "):
        kvpop.KVpopConfig(mlstm_hidden=-1, scorer="mlstm")
    assert kvpop.KVpopConfig(window=8, scorer="mlstm").readout_delay == 8
    assert kvpop.KVpopConfig(window=8, delay=0, scorer="mlstm").readout_delay == 0


def test_match_mlp_memory_reduces_topk_by_the_state():
    from kvpop.scorers import MLSTMScorer

    cfg = kvpop.KVpopConfig(sink=4, window=256, topk=1788, scorer="mlstm", match_mlp_memory=True)
    # D = d = 64: ceil((64 * 64 + 64) / 128) = 33 KV entries, as the scorer counts them
    assert cfg.state_entries(64) == MLSTMScorer(1, 64).state_entries() == 33
    assert cfg.effective_topk(64) == 1755
    resolved = cfg.resolve(64)
    assert (resolved.topk, resolved.budget, resolved.match_mlp_memory) == (1755, 2015, False)
    assert resolved.extra["match_mlp_memory"] == {"mlp_topk": 1788, "state_entries": 33, "head_dim": 64}
    # resolving is idempotent (a saved, resolved config is not reduced again when loaded)
    assert resolved.resolve(64) == resolved
    assert kvpop.KVpopConfig.from_dict(resolved.to_dict()) == resolved
    assert kvpop.KVpopConfig(scorer="mlstm", mlstm_dim=32, match_mlp_memory=True).state_entries(64) == 9
    plain = kvpop.KVpopConfig(topk=1788, scorer="mlstm")
    assert plain.effective_topk(64) == 1788 and plain.resolve(64) is plain
    assert kvpop.KVpopConfig(topk=1788).state_entries(64) == 0
    with pytest.raises(ValueError, match="KVpopConfig.topk=10 is invalid: .*33 KV entries"):
        kvpop.KVpopConfig(topk=10, scorer="mlstm", match_mlp_memory=True).effective_topk(64)


def test_kvpop_tova_needs_the_mlp_scorer_and_takes_tova_split():
    for kw in ({"scorer": "mlstm"}, {"scorer": "evidence"}, {"policy": "tova"}):
        with pytest.raises(ValueError, match="tova_prior=1.0 .*scorer='mlp'"):
            kvpop.KVpopConfig(tova_prior=1.0, **kw)
    cfg = kvpop.KVpopConfig.for_budget(512, tova_prior=0.5)
    assert (cfg.sink, cfg.window, cfg.topk, cfg.tova_prior) == (0, 1, 511, 0.5)
    assert not cfg.tova_head_average  # a TOVA-only field, left alone
    assert kvpop.KVpopConfig.from_dict(cfg.to_dict()) == cfg
    # given splits are kept
    cfg = kvpop.KVpopConfig.for_budget(512, sink=4, window=64, tova_prior=1.0)
    assert (cfg.sink, cfg.window, cfg.topk) == (4, 64, 444)
