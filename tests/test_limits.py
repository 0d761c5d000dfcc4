"""`kvpop.limits`: the memory estimates are right where they are exact, and a length, budget or batch that cannot
fit is refused before anything is allocated, with the estimate and the limit in one line.

    python -m pytest tests/test_limits.py -q
"""

from __future__ import annotations

import random
import re
import time

import pytest
import torch

import kvpop
from helpers import cache_kwargs, tiny_model
from kvpop import limits
from kvpop.cache import KVpopLayerCache
from kvpop.cli import main
from kvpop.models import load_model
from kvpop.train import distill


@pytest.mark.parametrize("cfg", [
    dict(sink=2, window=5, topk=7),
    dict(sink=2, window=5, topk=7, tova_pool=3),
    dict(sink=2, window=4, topk=8, layer_topk=(4, 12)),
], ids=["mlp", "cascade", "layer budgets"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bounded_cache_is_counted_exactly(cfg, dtype):
    model = kvpop.retrofit(tiny_model("qwen3").to(dtype), kvpop.KVpopConfig(scorer_hidden=8, **cfg))
    cache = kvpop.KVpopCache(model)
    ids = torch.randint(3, 250, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.buffers)
    shape = limits.Shape.of(model.config)
    assert limits.kv_slot_bytes(shape, model.kvpop.config, 3, dtype.itemsize) == held


def test_the_estimates_follow_the_model():
    model = tiny_model("llama")
    shape = limits.Shape.of(model.config)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (2, 64, 4, 2, 16)
    # the config's parameter count, as kvpop.files estimates it before loading, is the model's
    sizes = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "output_matrices": 1}
    actual = sum(p.numel() for p in model.parameters())
    assert 0.9 * actual <= limits.parameter_estimate(sizes) <= 1.1 * actual
    # activations grow with the length and the batch, linearly: no S x S term
    one = limits.evaluation_bytes(model, 1, 1000)["activations"]
    assert limits.evaluation_bytes(model, 2, 2000)["activations"] == 4 * one


def test_available_memory_is_read_on_this_machine():
    free = limits.available_memory("cpu")
    assert free is None or 0 < free < 1 << 60
    assert limits.available_memory("meta") is None


def test_check_fits_names_the_estimate_and_the_limit(monkeypatch):
    monkeypatch.setattr(limits, "available_memory", lambda device: 10**6)
    limits.check_fits({"KV slots": 10**5}, "cpu", "--budget 8", "lower it")
    with pytest.raises(limits.ResourceError) as err:
        limits.check_fits({"KV slots": 3 * 10**9, "activations": 0, "token ids": 800}, "cpu", "--budget 8", "lower it")
    assert str(err.value) == ("--budget 8 needs about 3.0 GB (KV slots 3.0 GB, token ids 800 B), more than the 1.0 MB of "
                              "memory available on cpu; lower it")
    monkeypatch.setattr(limits, "available_memory", lambda device: None)
    limits.check_fits({"KV slots": 10**18}, "mps", "--budget 8", "lower it")


@pytest.fixture
def little_memory(monkeypatch):
    """A machine with 2 MB free: what the tiny presets need beyond it is refused."""
    monkeypatch.setattr(limits, "available_memory", lambda device: 2 * 10**6)


def _one_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"kvpop {command}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_generate_refuses_a_budget_that_cannot_fit_before_the_cache_exists(monkeypatch, capsys, little_memory):
    argv = ["generate", "--model", "tiny-random-qwen3", "--prompt", "hello", "--max-new-tokens", "4"]
    assert main([*argv, "--budget", "64"]) == 0  # 2 layers x 2 heads x 65 slots x 140 B: 36 KB
    capsys.readouterr()

    def allocated(*args, **kwargs):
        raise AssertionError("the cache was allocated")

    monkeypatch.setattr(KVpopLayerCache, "lazy_initialization", allocated)
    assert main([*argv, "--budget", "4096"]) == 1
    line = _one_error(capsys, "generate")
    assert re.search(r"--budget 4096 \(sink 4, window 1024, topk 3068\) with a prompt of 5 tokens, --max-new-tokens "
                     r"4 needs about 2\.3 MB \(KV slots 2\.3 MB, .*\), more than the 2\.0 MB of memory available on "
                     r"cpu; lower --budget", line), line


def test_eval_and_budgets_refuse_a_length_that_cannot_fit(tmp_path, capsys, little_memory):
    data = tmp_path / "notes.txt"
    data.write_text("the cat sat on the mat. " * 2000)
    assert main(["eval", "--model", "tiny-random-qwen3", "--data", str(data), "--split", "all", "--policies",
                 "streaming_llm", "--budgets", "32", "--seq-len", "4000", "--sequences", "1", "--out",
                 str(tmp_path / "ev")]) == 1
    assert "--seq-len 4000 needs about" in _one_error(capsys, "eval") and not (tmp_path / "ev").exists()
    assert main(["budgets", "--model", "tiny-random-qwen3", "--data", str(data), "--seq-len", "4000", "--budget", "32",
                 "--out", str(tmp_path / "b.json")]) == 1
    assert "--seq-len 4000 needs about" in _one_error(capsys, "budgets") and not (tmp_path / "b.json").exists()


def test_train_refuses_a_length_or_batch_that_cannot_fit_before_its_first_step(tmp_path, monkeypatch, capsys,
                                                                              little_memory):
    def stepped(*args, **kwargs):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(distill.Distiller, "train_step", stepped)
    rng = random.Random(0)
    data = tmp_path / "notes.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(["a", "cat", "sat"]) for _ in range(300)) for _ in range(20)))
    argv = ["train", "--model", "tiny-random-qwen3", "--data", str(data), "--window", "8", "--topk", "16", "--steps",
            "1", "--no-progress", "--out", str(tmp_path / "run")]
    assert main([*argv, "--seq-len", "1024", "--batch-size", "8"]) == 1
    line = _one_error(capsys, "train")
    assert re.search(r"--seq-len 1024 with --batch-size 8 needs about .* \(activations .*, teacher copy .*, gradients "
                     r"and optimizer .*\), more than the 2\.0 MB of memory available on cpu; lower --seq-len or "
                     r"--batch-size \(--grad-accum N keeps the batch in N smaller steps\)", line), line
    assert not (tmp_path / "run").exists()
    # the packed training tokens too: --max-tokens asks for 10**9 of them (16 GB of ids)
    assert main([*argv, "--seq-len", "64", "--max-tokens", str(10**9), "--freeze-base"]) == 1
    assert "1000000000 training tokens" in _one_error(capsys, "train")


def test_the_tiny_presets_fit_as_they_are(capsys):
    # nothing here is refused on a real machine: the estimates of everyday commands stay far below its memory
    model, _ = load_model("tiny-random-qwen3")
    model = kvpop.retrofit(model, kvpop.KVpopConfig.for_budget(512))
    limits.check_generation(model, 2000, 2000)
    limits.check_evaluation(model, 4096)


def test_train_refuses_scorers_that_cannot_fit_before_making_them(tmp_path, capsys):
    # a billion hidden units per scorer: refused from a weightless copy, on this machine's own memory
    data = tmp_path / "notes.txt"
    data.write_text("the cat sat on the mat. " * 500)
    start = time.perf_counter()
    assert main(["train", "--model", "tiny-random-qwen3", "--data", str(data), "--seq-len", "64", "--window", "8",
                 "--topk", "16", "--scorer-hidden", str(10**9), "--steps", "1", "--freeze-base", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 1
    line = _one_error(capsys, "train")
    assert re.search(r"the KVpop config: kvpop scorers \(mlp, hidden 1000000000\) and budget 28 .* needs about "
                     r"[\d.]+ [TG]B \(scorer weights [\d.]+ [TG]B, KV slots .*\), more than the .* of memory available "
                     r"on cpu; lower --scorer-hidden or the budget", line), line
    assert time.perf_counter() - start < 30 and not (tmp_path / "run").exists()
