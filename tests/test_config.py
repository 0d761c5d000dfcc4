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
