"""The figures: PNGs of sane size from synthetic arrays, and `eviction_counts` against the cache and the rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpop
from helpers import cache_kwargs, quiet, retrofitted
from kvpop.attention import Capture
from kvpop.eval.plots import (
    eviction_counts,
    plot_eviction_pattern,
    plot_memory_latency,
    plot_recall_curve,
    plot_recall_per_layer,
    plot_training_curves,
    visible_token,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_BYTES, MAX_BYTES = 5_000, 400_000
S = 48


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert MIN_BYTES < len(data) < MAX_BYTES, f"{path}: {len(data)} bytes, want {MIN_BYTES}..{MAX_BYTES}"


@pytest.fixture(scope="module")
def model():
    return retrofitted("qwen3")


def _ids(n=S, seed=0):
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def test_visible_token():
    assert visible_token("a b\n") == "a␣b⏎"
    assert visible_token("\t") == "⇥"
    assert visible_token("") == "∅"


def test_plot_eviction_pattern(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, size=(30, 112))
    tokens = [rng.choice(["x", " =", "\n", "\\frac", "é", ""]) for _ in range(112)]
    path = plot_eviction_pattern(counts, tokens, 3, tmp_path / "evict.png", "synthetic", positions=np.arange(500, 612))
    assert_png(path)
    with pytest.raises(ValueError, match="token labels"):
        plot_eviction_pattern(counts, tokens[:-1], 3, tmp_path / "bad.png")


def test_plot_recall_per_layer(tmp_path):
    recall = np.random.default_rng(1).uniform(0.2, 1.0, size=(30, 3))
    recall[4, 1] = np.nan  # a head without eligible tokens
    assert_png(plot_recall_per_layer(recall, tmp_path / "recall.png"))


def test_plot_memory_latency(tmp_path):
    rows = [{"cache": c, "context": n, "ms_per_token": 5.0 + (n / 1e3 if c == "dense" else 0.0),
             "peak_mb": 100.0 + (n / 10 if c == "dense" else 10.0), "memory_kind": "cache tensors"}
            for c in ("dense", "kvpop") for n in (1024, 4096, 16384)]
    rows.append({"cache": "dense", "context": 65536, "ms_per_token": None, "peak_mb": None, "error": "out of memory"})
    assert_png(plot_memory_latency(rows, tmp_path / "mem.png"))
    with pytest.raises(ValueError, match="no rows"):
        plot_memory_latency(rows[-1:], tmp_path / "empty.png")


def test_plot_training_curves(tmp_path):
    def log(shift):
        return [{"step": i + 1, "loss_kl": 0.02 + shift / (i + 1), "loss_score": 0.2 - 0.001 * i} for i in range(10)]

    assert_png(plot_training_curves({"1 GPU": log(0.0), "2 GPUs": log(0.001)}, tmp_path / "curves.png"))
    with pytest.raises(ValueError, match=r"'2 GPUs'.*lack \['loss_score'\]"):
        plot_training_curves({"1 GPU": log(0.0), "2 GPUs": [{"step": 1, "loss_kl": 0.1}]}, tmp_path / "bad.png")
    with pytest.raises(ValueError, match="at least one record"):
        plot_training_curves({"empty": []}, tmp_path / "empty.png")


def test_plot_recall_curve(tmp_path):
    # two budgets, MLP and mLSTM each: scorer-only pre-training to step 600, then distillation from there
    curves = [{"name": f"kvpop-{s}_b{b}", "budget": b, "starts": [600],
               "points": [(step, 0.5 + 0.3 * step / 720 - (0.1 if s == "mlstm" else 0)) for step in range(100, 721, 100)]}
              for b in (2048, 1024) for s in ("mlp", "mlstm")]
    assert_png(plot_recall_curve(curves, tmp_path / "curve.png"))
    with pytest.raises(ValueError, match="no curve"):
        plot_recall_curve([], tmp_path / "empty.png")


@torch.no_grad()
def test_eviction_counts_match_cache_and_rule(model):
    cfg = model.kvpop.config
    hkv = model.config.num_key_value_heads
    ids = _ids()
    with quiet():
        counts, positions = eviction_counts(model, ids, last=20)
        chunked, _ = eviction_counts(model, ids[0], last=20, chunk=11)
        # the cache itself, filled independently
        cache = kvpop.KVpopCache(model)
        model(ids, **cache_kwargs(cache))
        # the rule on the teacher-forced priorities
        records = Capture()
        model(ids, kvpop_capture=records)

    end = S - cfg.window
    assert counts.shape == (model.config.num_hidden_layers, 20)
    assert positions.tolist() == list(range(end - 20, end))
    assert counts.min() >= 0 and counts.max() <= hkv
    assert torch.equal(chunked, counts)
    for layer, (held, rec) in enumerate(zip(cache.layers, records)):
        times = kvpop.eviction_times(rec.priority, cfg.sink, cfg.window, cfg.topk)[0]  # [Hkv, S]
        for j, p in enumerate(positions.tolist()):
            in_cache = sum(p in held.pos[0, h].tolist() for h in range(hkv))
            by_rule = int((times[:, p] > S - 1).sum())
            assert counts[layer, j] == in_cache == by_rule, f"layer {layer}, position {p}"
    # some tokens are dropped by some heads, or the plot would show nothing
    assert (counts < hkv).any()


@torch.no_grad()
def test_eviction_counts_cover_exactly_topk_per_head(model):
    cfg = model.kvpop.config
    with quiet():
        counts, positions = eviction_counts(model, _ids(seed=3), last=S)
    # asked for more than exists: every evictable position, sink .. S - w - 1
    assert positions.tolist() == list(range(cfg.sink, S - cfg.window))
    assert (counts.sum(1) == cfg.topk * model.config.num_key_value_heads).all()


def test_eviction_counts_needs_evictable_tokens(model):
    cfg = model.kvpop.config
    with pytest.raises(ValueError, match="nothing evictable"):
        eviction_counts(model, _ids(cfg.sink + cfg.window))
