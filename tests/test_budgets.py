"""Per-layer budgets (`kvpop.eval.budgets`, `KVpopConfig.layer_topk`): the config, the measure, the allocation."""

import itertools
import json

import pytest
import torch

import kvpop
from helpers import quiet, retrofitted, tiny_model
from kvpop.attention import Capture
from kvpop.cli import main
from kvpop.eval import budgets as alloc
from kvpop.eval.metrics import RetentionRecall, priorities_from_records
from kvpop.policy import retention_mask


def test_layer_topk_keeps_the_uniform_memory_and_names_what_is_wrong():
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=[3, 11])
    assert cfg.layer_topk == (3, 11) and cfg.budget == 14
    assert cfg.for_layer(0).topk == 3 and cfg.for_layer(1).budget == 18 and cfg.for_layer(1).layer_topk is None
    assert kvpop.KVpopConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match=r"layer_topk.*must sum to layers x topk = 2 x 7 = 14"):
        kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=(3, 12))
    with pytest.raises(ValueError, match="not 'streaming_llm'"):
        kvpop.KVpopConfig(sink=2, window=12, topk=0, policy="streaming_llm", layer_topk=(0, 0))
    with pytest.raises(ValueError, match="integers >= 0"):
        kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=(15, -1))
    with pytest.raises(ValueError, match="one entry per layer of the model \\(2\\)"):
        retrofitted("qwen3", kvpop.KVpopConfig(sink=2, window=5, topk=7, layer_topk=(7, 7, 7)))
    # budgets -> this split's top-k, at the same total
    split = kvpop.KVpopConfig(sink=2, window=5, topk=7)
    assert split.with_layer_budgets([10, 18]).layer_topk == (3, 11)
    with pytest.raises(ValueError, match=">= sink \\+ window = 7"):
        split.with_layer_budgets([6, 22])


def test_mlstm_memory_match_shrinks_every_layer():
    cfg = kvpop.KVpopConfig(sink=2, window=5, topk=8, scorer="mlstm", match_mlp_memory=True, layer_topk=(4, 12))
    with pytest.raises(ValueError, match="every layer needs"):
        cfg.resolve(16)  # d = 16: ceil((256 + 16) / 32) = 9 entries, more than layer 0's 4
    ok = kvpop.KVpopConfig(sink=2, window=5, topk=12, scorer="mlstm", match_mlp_memory=True, layer_topk=(10, 14))
    assert ok.resolve(16).layer_topk == (1, 5) and ok.resolve(16).topk == 3


@pytest.mark.parametrize("seed", range(20))
def test_allocation_is_the_optimum_on_convex_curves(seed):
    # brute force over every split of L x topk (in units of the grid) on random convex decreasing curves
    g = torch.Generator().manual_seed(seed)
    L, topk = 3, 4
    candidates = [0, 2, 4, 6, 8]
    steps = torch.rand(L, 4, generator=g).sort(dim=1, descending=True).values  # decreasing drops: convex
    curves = 1.0 - torch.cat([torch.zeros(L, 1), steps.cumsum(1) / 4], dim=1)
    k = alloc.allocate(curves, candidates, topk)
    assert sum(k) == L * topk and all(0 <= x <= 8 for x in k)
    best = min(alloc.mean_lost(curves, candidates, c) for c in itertools.product(range(9), repeat=L)
               if sum(c) == L * topk)
    assert alloc.mean_lost(curves, candidates, k) <= best + 1e-12


def test_allocation_is_uniform_for_equal_layers_and_gives_to_the_needy_layer():
    candidates = [0, 4, 8, 16]
    same = torch.tensor([[1.0, 0.5, 0.3, 0.1]] * 3)
    assert alloc.allocate(same, candidates, 4) == [4, 4, 4]
    # layer 1 loses far more per missing slot: it gets more, the others less, the total stays
    curves = torch.tensor([[0.2, 0.1, 0.05, 0.0], [1.0, 0.6, 0.3, 0.0], [0.2, 0.1, 0.05, 0.0]])
    k = alloc.allocate(curves, candidates, 4)
    assert sum(k) == 12 and k[1] > 4 and k[0] < 4 and k[2] < 4
    with pytest.raises(ValueError, match="must increase from 0"):
        alloc.allocate(same, [4, 8, 16], 4)


@torch.no_grad()
def test_lost_mass_equals_the_dense_reference():
    # 1 - exp(lse_sparse - lse_dense) is the dense attention mass on the keys the oracle's rule drops
    base = tiny_model("qwen3", seed=3)
    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=5, policy="oracle")
    model = kvpop.retrofit(base, cfg)
    ids = torch.randint(3, 300, (2, 37), generator=torch.Generator().manual_seed(0))
    records = Capture()
    with quiet():
        model(ids, kvpop_dense=True, kvpop_capture=records, use_cache=False)
    candidates = [0, 3, 5, 9]
    got = alloc.lost_mass(records, model.kvpop.config, candidates)
    teacher = priorities_from_records(records, model.kvpop.config)
    for rec, pri in zip(records, teacher):
        G = rec.query.shape[1] // rec.key.shape[1]
        logits = torch.einsum("bhqd,bhtd->bhqt", rec.query.double(), rec.key.double().repeat_interleave(G, 1))
        causal = torch.ones(37, 37, dtype=torch.bool).tril()
        p = torch.softmax((logits * rec.scale).masked_fill(~causal, float("-inf")), -1)
        for j, k in enumerate(candidates):
            keep = retention_mask(pri, cfg.sink, cfg.window, k).repeat_interleave(G, 1)  # [B, Hq, S, S]
            lost = (p * ~keep).sum(-1)[:, :, cfg.sink + cfg.window:]
            assert got[rec.layer_idx, j].item() == pytest.approx(lost.sum().item(), rel=1e-4, abs=1e-5)
    kvpop.detach(model)


def test_recall_with_per_layer_topk_is_each_layer_on_its_own():
    g = torch.Generator().manual_seed(0)
    teacher = [torch.randn(2, 3, 40, generator=g) for _ in range(3)]
    model = [t + 0.7 * torch.randn(2, 3, 40, generator=g) for t in teacher]
    mixed = RetentionRecall(2, 4, [3, 0, 9])
    mixed.update(teacher, model)
    res = mixed.result()
    for layer, k in ((0, 3), (2, 9)):
        alone = RetentionRecall(2, 4, k)
        alone.update([teacher[layer]], [model[layer]])
        assert torch.allclose(res.per_head[layer], alone.result().per_head[0])
    assert torch.isnan(res.per_layer[1])
    assert res.mean == pytest.approx(res.per_head[[0, 2]].mean().item())


def test_budgets_command_writes_what_train_and_eval_read(tmp_path, capsys):
    out = tmp_path / "b.json"
    with quiet():
        rc = main(["budgets", "--model", "tiny-random-qwen3", "--data", "champ", "--seq-len", "96", "--budget", "24",
                   "--sequences", "1", "--out", str(out)])
    assert rc == 0
    budget, per_layer = alloc.read(out)
    assert budget == 24 and len(per_layer) == 2 and sum(per_layer) == 48
    assert "mean lost mass: uniform" in capsys.readouterr().out
    # eval adds the `+layers` rows at the same memory
    with quiet():
        rc = main(["eval", "--model", "tiny-random-qwen3", "--data", "champ", "--seq-len", "96", "--sequences", "1",
                   "--budgets", "24", "--policies", "oracle", "--layer-budgets", str(out), "--out", str(tmp_path / "e")])
    assert rc == 0
    rows = json.loads((tmp_path / "e" / "results.json").read_text())["rows"]
    assert {r["policy"] for r in rows} == {"oracle", "oracle+layers"}
    layered = next(r for r in rows if r["policy"] == "oracle+layers")
    assert sum(layered["layer_topk"]) == 2 * layered["topk"]
    # a file for another budget is refused by train
    rc = main(["train", "--model", "tiny-random-qwen3", "--data", "champ", "--seq-len", "96", "--budget", "32",
               "--layer-budgets", str(out), "--steps", "1", "--out", str(tmp_path / "t")])
    assert rc == 1
    assert "allocates budget 24, but the run's budget is 32" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"budget": 24, "layer_budgets": [20, 20]}')
    with pytest.raises(ValueError, match="sum to 40, not layers x budget = 48"):
        alloc.read(tmp_path / "bad.json")


def test_training_runs_with_per_layer_budgets(tmp_path):
    from kvpop.train.distill import TrainConfig, train

    cfg = kvpop.KVpopConfig(sink=2, window=8, topk=12, scorer_hidden=16, layer_topk=(4, 20))
    tcfg = TrainConfig(model="tiny-random-qwen3", data="champ", seq_len=96, steps=2, save_every=0,
                       freeze_base=True, out=str(tmp_path / "run"))
    with quiet():
        final = train(tcfg, cfg, progress=False)
    loaded = kvpop.load(final)
    assert loaded.kvpop.config.layer_topk == (4, 20)
    cache = kvpop.KVpopCache(loaded)
    assert [layer.slots for layer in cache.layers] == [14, 30]
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(row["loss_score"] > 0 for row in log)


def test_a_trained_scorer_is_measured_and_evaluated_at_per_layer_budgets(tmp_path, capsys):
    from kvpop.train.distill import TrainConfig, train

    tcfg = TrainConfig(model="tiny-random-qwen3", data="champ", seq_len=96, steps=2, save_every=0, freeze_base=True,
                       out=str(tmp_path / "run"))
    with quiet():
        final = train(tcfg, kvpop.KVpopConfig(sink=2, window=8, topk=12, scorer_hidden=16), progress=False)
        rc = main(["budgets", "--model", "tiny-random-qwen3", "--trained", str(final), "--data", "champ",
                   "--seq-len", "96", "--sequences", "1", "--out", str(tmp_path / "own.json")])
    assert rc == 0
    budget, per_layer = alloc.read(tmp_path / "own.json")
    assert budget == 22 and sum(per_layer) == 44
    with quiet():
        rc = main(["eval", "--model", "tiny-random-qwen3", "--data", "champ", "--seq-len", "96", "--sequences", "1",
                   "--policies", "none", "--trained", str(final), "--rule", "static", "--layer-budgets",
                   str(tmp_path / "own.json"),
                   "--out", str(tmp_path / "e")])
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "e" / "results.json").read_text())["rows"]}
    assert set(rows) == {"kvpop", "kvpop+layers"}
    assert rows["kvpop"]["layer_topk"] is None
    assert rows["kvpop+layers"]["layer_topk"] == [b - 10 for b in per_layer]
    # the same weights: where the budgets agree with the uniform split, so do the rows
    if per_layer == [22, 22]:
        assert rows["kvpop+layers"]["kl"] == rows["kvpop"]["kl"]
    capsys.readouterr()
    assert main(["budgets", "--model", "tiny-random-qwen3", "--out", str(tmp_path / "x.json")]) == 1
    assert "--budget" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_budgets_refuses_an_existing_out_unless_forced(tmp_path, capsys):
    out = tmp_path / "b.json"
    out.write_text("keep")
    rc = main(["budgets", "--model", "tiny-random-qwen3", "--budget", "24", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and f"--out {out} exists: pass --force" in err and "Traceback" not in err
    assert out.read_text() == "keep"
    with quiet():
        rc = main(["budgets", "--model", "tiny-random-qwen3", "--data", "champ", "--seq-len", "96", "--budget", "24",
                   "--sequences", "1", "--out", str(out), "--force"])
    assert rc == 0 and json.loads(out.read_text())["budget"] == 24
