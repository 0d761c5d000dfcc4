"""`kvpop bench` (decode latency and memory against context) and the random-weight shape presets it runs on."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import kvpop
from helpers import cache_kwargs, quiet, retrofitted, tiny_model
from kvpop.eval.bench import add_bench_args, bench_decode, cache_bytes, format_table, main
from kvpop.shapes import SHAPE_PRESETS, build_shape_model, shape_config

CFG = kvpop.KVpopConfig(sink=2, window=4, topk=6, scorer_hidden=16)
CONTEXTS = (32, 64)


@pytest.fixture(scope="module")
def rows():
    model = tiny_model("qwen3")
    with quiet():
        out = bench_decode(model, CONTEXTS, new_tokens=3, warmup=1, device="cpu", config=CFG)
    assert not hasattr(model, "kvpop"), "bench_decode must leave a plain model plain"
    return out


def test_rows_for_both_caches(rows):
    assert [(r["cache"], r["context"]) for r in rows] == [(c, n) for n in CONTEXTS for c in ("dense", "kvpop")]
    for r in rows:
        assert r["error"] is None
        assert r["ms_per_token"] > 0 and r["tokens_per_s"] > 0 and r["prefill_s"] > 0
        assert r["memory_kind"] == "cache tensors" and r["peak_mb"] == r["cache_mb"]
        # warm-up and timed steps all went through the cache
        assert r["seen"] == r["context"] + 1 + 3
    assert all(r["vs_dense"] == 1.0 for r in rows if r["cache"] == "dense")


def test_kvpop_memory_is_constant_while_dense_grows(rows):
    kv = [r["cache_mb"] for r in rows if r["cache"] == "kvpop"]
    dense = [r["cache_mb"] for r in rows if r["cache"] == "dense"]
    assert kv[0] == kv[1]
    assert dense[1] > dense[0] > kv[0]


def test_format_table(rows):
    table = format_table(rows + [{"cache": "dense", "context": 128, "budget": None, "error": "out of memory"}])
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["cache", "context", "budget"]
    assert len(lines) == 2 + len(rows) + 1 and "out of memory" in lines[-1]


def test_cache_bytes_counts_every_slot():
    model = retrofitted("qwen3", CFG)
    cache = kvpop.KVpopCache(model)
    with quiet(), torch.no_grad():
        model(torch.randint(3, 300, (2, 20)), **cache_kwargs(cache))
    c = model.config
    per_slot = 2 * 16 * 4 + 8 + 4  # float32 key and value of dim 16, int64 position, float32 priority
    # budget + 1 slots: the decode step's scratch slot is memory too; + `seen`, int64 [B], and the length, int64
    want = c.num_hidden_layers * (2 * c.num_key_value_heads * (CFG.budget + 1) * per_slot + 2 * 8 + 8)
    assert cache_bytes(cache) == want


def test_cache_bytes_counts_the_mlstm_memory():
    # the stateful scorer's memory is cache memory too: C (d x d), n (d) and m, float32, per row and KV head
    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=6, scorer="mlstm")
    model = retrofitted("qwen3", cfg)
    cache = kvpop.KVpopCache(model)
    with quiet(), torch.no_grad():
        model(torch.randint(3, 300, (2, 20)), **cache_kwargs(cache))
    c, d = model.config, 16
    per_slot = 2 * 16 * 4 + 8 + 4
    state = (d * d + d + 1) * 4
    want = c.num_hidden_layers * (2 * c.num_key_value_heads * ((cfg.budget + 1) * per_slot + state) + 2 * 8 + 8)
    assert cache_bytes(cache) == want


def test_retrofitted_model_is_restored():
    model = retrofitted("qwen3", CFG)
    before = {k: v.clone() for k, v in model.kvpop.state_dict().items()}
    with quiet():
        out = bench_decode(model, (24,), new_tokens=2, warmup=0, device="cpu")
    assert [r["cache"] for r in out] == ["dense", "kvpop"] and out[1]["budget"] == CFG.budget
    assert model.kvpop.config == CFG
    after = model.kvpop.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.config._attn_implementation == "kvpop"


def test_bad_arguments():
    model = tiny_model("qwen3", max_positions=64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bench_decode(model, (60,), new_tokens=8, config=CFG)
    with pytest.raises(ValueError, match="needs a KVpopConfig"):
        bench_decode(model, (8,), cache_kinds=("kvpop",), new_tokens=1)
    with pytest.raises(ValueError, match="new_tokens"):
        bench_decode(model, (8,), new_tokens=0, config=CFG)


def test_main_prints_table_then_json(tmp_path, capsys):
    plot, out_json = tmp_path / "bench.png", tmp_path / "bench.json"
    with quiet():
        rc = main(["--model", "tiny-random-qwen3", "--contexts", "32,64", "--sink", "2", "--budget", "12",
                   "--new-tokens", "2", "--warmup", "0", "--device", "cpu", "--plot", str(plot),
                   "--json-out", str(out_json)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert {"rows", "device", "model", "command"} <= result.keys()
    assert result["model"] == "tiny-random-qwen3" and "--budget 12" in result["command"]
    assert result["kvpop_config"] == {"sink": 2, "window": 3, "topk": 7, "policy": "kvpop"}
    assert len(result["rows"]) == 4
    assert any(line.split()[:2] == ["cache", "context"] for line in lines[:-1]), "no table before the JSON line"
    assert json.loads(out_json.read_text())["rows"] == result["rows"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_add_bench_args_defaults():
    args = add_bench_args(argparse.ArgumentParser()).parse_args(["--model", "m"])
    assert (args.contexts, args.caches, args.new_tokens, args.budget, args.device) == \
        ("256,512,1024", "dense,kvpop", 16, None, None)


# --- the random-weight shape presets (kvpop.shapes) ---

@torch.no_grad()
def test_tiny_shape_builds_and_runs():
    model, tokenizer = build_shape_model("tiny-qwen3-shape", "cpu", dtype=torch.float32)
    assert tokenizer is None
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    again, _ = build_shape_model("tiny-qwen3-shape", "cpu", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    assert logits.shape == (1, 12, c.vocab_size) and torch.isfinite(logits).all()
    # rotary tables computed, not left as the uninitialised memory of the meta build
    fresh = type(model.model.rotary_emb)(c)
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.inv_freq)
    # and it takes a KVpop retrofit and cache
    kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=4, topk=4, scorer_hidden=8))
    cache = kvpop.KVpopCache(model)
    with quiet():
        model(ids, **cache_kwargs(cache))
    assert cache.layers[0].keys.shape == (1, 8, 10, 128)


@pytest.mark.parametrize("name,hidden,inter,tied,params_b", [
    ("qwen3-4b-shape", 2560, 9728, True, 4.02),
    ("qwen3-8b-shape", 4096, 12288, False, 8.19),
])
def test_real_shapes(name, hidden, inter, tied, params_b):
    from transformers import AutoModelForCausalLM

    c = shape_config(name)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (hidden, inter, 36)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (32, 8, 128, 151_936)
    assert c.tie_word_embeddings is tied and c.max_position_embeddings >= 131_072
    assert c.rope_parameters["rope_theta"] == 1_000_000
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - params_b) < 0.01, f"{n / 1e9:.3f}B parameters"
    assert shape_config(name, num_layers=4).num_hidden_layers == 4


def test_smollm2_shape_is_the_default_models_layout():
    # the random-weight twin of the embedded default model: the same architecture and shapes as its config
    from kvpop.models import load_config

    real, twin = load_config("smollm2-135m"), shape_config("smollm2-135m-shape")
    fields = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
              "bos_token_id", "eos_token_id")
    assert {f: getattr(twin, f) for f in fields} == {f: getattr(real, f) for f in fields}
    assert twin.rope_parameters["rope_theta"] == real.rope_parameters["rope_theta"]
    assert twin.rms_norm_eps == pytest.approx(real.rms_norm_eps)


def test_unknown_shape():
    assert set(SHAPE_PRESETS) == {"qwen3-4b-shape", "qwen3-8b-shape", "tiny-qwen3-shape", "smollm2-135m-shape"}
    with pytest.raises(ValueError, match="unknown shape preset"):
        shape_config("qwen3-70b-shape")


def test_a_budget_covering_the_context_is_flagged(capsys):
    model = tiny_model("qwen3")
    with quiet():
        out = bench_decode(model, (8, 32), new_tokens=1, warmup=0, device="cpu", config=CFG)
    assert "budget 12 is not below context 8" in capsys.readouterr().err
    assert [(r["cache"], r["context"], r["no_eviction"]) for r in out] == [
        ("dense", 8, False), ("kvpop", 8, True), ("dense", 32, False), ("kvpop", 32, False)]
    table = format_table(out)
    assert "12*" in table and table.splitlines()[-1].startswith("* budget not below the context")


def test_existing_outputs_need_force(tmp_path, capsys):
    # a benchmark never replaces a user's file unless asked: refused before the model loads
    for flag in ("--json-out", "--plot"):
        path = tmp_path / f"keep{flag}"
        path.write_text("keep")
        assert main(["--model", "tiny-random-qwen3", "--contexts", "32", "--device", "cpu", flag, str(path)]) == 1
        err = capsys.readouterr().err
        assert f"{flag} {path} exists: pass --force" in err and "Traceback" not in err
        assert path.read_text() == "keep"
    out_json = tmp_path / "keep--json-out"
    with quiet():
        rc = main(["--model", "tiny-random-qwen3", "--contexts", "32", "--sink", "2", "--budget", "12",
                   "--new-tokens", "1", "--warmup", "0", "--device", "cpu", "--json-out", str(out_json), "--force"])
    assert rc == 0 and json.loads(out_json.read_text())["model"] == "tiny-random-qwen3"
    assert main(["--model", "tiny-random-qwen3", "--device", "cpu", "--plot", str(tmp_path)]) == 1
    assert f"--plot {tmp_path} is a directory" in capsys.readouterr().err


def test_the_bandwidth_floor():
    from kvpop.eval.bench import PEAK_BANDWIDTH, add_floor, weight_bytes

    model, _ = build_shape_model("tiny-qwen3-shape", "cpu", dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    # tied embeddings: the output layer reads the table, so every weight counts once
    assert model.config.tie_word_embeddings and weight_bytes(model) == 2 * n
    untied = build_shape_model("tiny-qwen3-shape", "cpu", dtype=torch.bfloat16)[0]
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    embedding = untied.get_input_embeddings().weight.numel()
    assert weight_bytes(untied) == 2 * (sum(p.numel() for p in untied.parameters()) - embedding)
    rows = [{"cache_mb": 1.0, "ms_per_token": 4.0, "batch": 1}, {"cache_mb": None, "ms_per_token": None, "batch": 1}]
    assert add_floor(rows, 3 * 2**20, "NVIDIA H100 80GB HBM3") == PEAK_BANDWIDTH["H100"]
    assert rows[0]["floor_ms"] == pytest.approx(4 * 2**20 / 3.35e12 * 1e3)
    assert rows[0]["x_floor"] == pytest.approx(4.0 / rows[0]["floor_ms"])
    assert rows[1]["floor_ms"] is None and rows[1]["x_floor"] is None
    assert add_floor(rows, 1, "cpu (x86_64, 2 threads)") is None and rows[0]["floor_ms"] is None
