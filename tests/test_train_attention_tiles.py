"""`bench/train_attention_tiles.py`: the work of the training path's attention tiles, counted without an S x S matrix,
against the S x S mask built here (tests only)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kvpop.config import KVpopConfig
from kvpop.ops.attention.block_mask import EMPTY, FULL, alive_until, tile_states
from kvpop.ops.topk import eviction_positions

ROOT = Path(__file__).resolve().parents[1]


def _tiles():
    spec = importlib.util.spec_from_file_location("train_attention_tiles", ROOT / "bench" / "train_attention_tiles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("S,budget,bs", [(300, 64, 16), (257, 40, 32), (128, 20, 128)])
def test_counts_equal_the_full_mask(S, budget, bs):
    cfg = KVpopConfig.for_budget(budget)
    g = torch.Generator().manual_seed(S)
    pri = torch.randn(1, 3, S, generator=g).round(decimals=1)  # coarse: tied priorities too
    pos, valid = torch.arange(S), torch.ones(1, S, dtype=torch.bool)
    evict = eviction_positions(pri, pos[None, None], valid[:, None], cfg.sink, cfg.window, cfg.topk, ordered=True)
    alive = alive_until(pos[None], valid, evict, cfg.sink, cfg.window)[0]  # [H, S]
    got = _tiles().count(alive, pos, S, bs)
    q = pos[:, None]
    mask = (pos[None, None, :] <= q) & (q < alive[:, None, :])  # [H, Q, K]: who sees whom
    assert got["visible_pairs"] == int(mask.sum())
    nb = -(-S // bs)
    unions = torch.stack([mask[:, i * bs:(i + 1) * bs].any(1).sum(-1) for i in range(nb)], dim=1)  # [H, nb]
    rows = torch.tensor([min(bs, S - i * bs) for i in range(nb)])
    assert got["gather_pairs"] == float((unions * rows).sum())
    assert got["union_max"] == int(unions.max())
    # the block mask's own classes are sound: a skipped tile holds no visible pair, a full one only visible pairs
    tiles = tile_states(pos[None], valid, pos[None], valid, evict, cfg.sink, cfg.window, bs)[0]
    pad = nb * bs - S
    m = torch.nn.functional.pad(mask, (0, pad, 0, pad)).reshape(3, nb, bs, nb, bs)
    assert not m.any(dim=(2, 4))[tiles == EMPTY].any()
    assert m.all(dim=(2, 4))[tiles == FULL].all()


def test_main_prints_a_row_per_tile_size(capsys):
    assert _tiles().main(["--length", "512", "--budget", "128", "--kv-heads", "2", "--blocks", "64,16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["block"] for r in out["rows"]] == [64, 16]
    for r in out["rows"]:
        assert r["visible_pairs"] <= r["gather_pairs"] <= out["causal_pairs"]
        assert 0 < r["pair_efficiency"] <= 1 and r["empty"] + r["partial"] + r["full"] == 2 * (512 // r["block"]) ** 2


def test_a_budget_at_the_length_is_refused():
    with pytest.raises(SystemExit, match="must be below"):
        _tiles().main(["--length", "256", "--budget", "256"])


def test_a_trained_runs_priorities_every_layer_and_head(tmp_path, capsys):
    import kvpop
    from kvpop.models import load_model

    model, tokenizer = load_model("tiny-random-qwen3")
    model = kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=16, topk=32))
    kvpop.save(model, tmp_path / "run", tokenizer=tokenizer)
    assert _tiles().main(["--model", str(tmp_path / "run"), "--length", "256", "--blocks", "32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = model.config
    assert out["head_rows"] == cfg.num_hidden_layers * cfg.num_key_value_heads
    assert out["args"]["budget"] == 50 and out["rows"][0]["visible_pairs"] > 0


def test_a_model_without_scorers_is_refused():
    with pytest.raises(SystemExit, match="not a kvpop run"):
        _tiles().main(["--model", "tiny-random-qwen3", "--length", "256"])
