"""`kvpop.gguf_models`: a GGUF file given as the model, converted once, loaded from the cache, bad files refused.

The files are written here from tiny random models (`helpers.write_gguf`), so nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from helpers import tiny_gguf_model, write_gguf
from kvpop import gguf_models
from kvpop.cli import main
from kvpop.files import FileFormatError
from kvpop.models import load_config, load_model

SECOND_LOAD_SECONDS = 5.0
IDS = torch.arange(60, 100)[None]  # 40 tokens: past the tiny Gemma 3's 16-token window

pytestmark = pytest.mark.skipif(bool(gguf_models.missing_converters()),
                                reason=f"reading GGUF files needs: {gguf_models.CONVERTER_INSTALL}")


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """`{arch: (path, model, vocab)}`: a float32 GGUF file per architecture and the model it was written from."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ("gemma3", "llama"):
        model, vocab = tiny_gguf_model(arch)
        path = root / f"tiny-{arch}.gguf"
        write_gguf(model, vocab, path)
        out[arch] = (path, model, vocab)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _damaged(path: Path, out: Path, *, keep: int | None = None, flip: int | None = None) -> Path:
    data = bytearray(path.read_bytes())
    if flip is not None:
        data[flip] ^= 0xFF
    out.write_bytes(bytes(data[:keep] if keep is not None else data))
    return out


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_a_gguf_file_loads_as_the_model_it_was_written_from(files, cache, arch):
    path, original, vocab = files[arch]
    start = time.perf_counter()
    model, tok = load_model(str(path))
    seconds = time.perf_counter() - start
    sha = gguf_models.sha256(path)
    out = cache / f"gguf-{sha[:16]}"
    assert sorted(p.name for p in cache.iterdir()) == [out.name], "one directory, no scratch left behind"
    assert json.loads((out / gguf_models.MARKER).read_text())["sha256"] == sha
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert model.dtype == torch.float32 and not model.training
    assert type(model) is type(original)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, original(IDS).logits, atol=1e-5, rtol=0)
    if arch == "gemma3":
        # the file states no layer kinds: transformers rebuilds Gemma 3's 5:1 pattern, full attention in layer 5
        assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert model.config.sliding_window == 16
    text = "naïve café, 你好 🙂\n\tx² ≤ 1."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (vocab.bos, vocab.eos, vocab.pad)
    assert len(tok) == len(vocab.tokens)
    assert tok.model_max_length == original.config.max_position_embeddings
    print(f"{arch}: conversion + first load {seconds:.2f} s")


def test_the_second_load_reads_the_cache(files, cache, monkeypatch):
    path, original, _ = files["gemma3"]
    first, _ = load_model(str(path))
    out = next(cache.iterdir())
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_models, "convert", fail)
    start = time.perf_counter()
    again, _ = load_model(str(path))
    seconds = time.perf_counter() - start
    assert seconds < SECOND_LOAD_SECONDS, f"second load took {seconds:.2f} s"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, first(IDS).logits)
    assert load_config(str(path)).num_hidden_layers == 6


def test_a_copy_under_another_name_shares_the_conversion(files, cache, tmp_path):
    path, _, _ = files["llama"]
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    load_model(str(path))
    load_model(str(copy))
    assert len(list(cache.iterdir())) == 1


def test_a_file_that_is_not_gguf_is_refused(cache, tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_text('{"model_type": "llama"}')
    with pytest.raises(FileFormatError, match=r"model.gguf: not a GGUF file \(it starts with b'\{\"mo'"):
        load_model(str(bad))
    assert main(["info", "--model", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"kvpop info: error: {bad}: not a GGUF file") and len(err) == 2
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("keep", [3, 40, "half", "minus one"])
def test_a_cut_off_file_is_refused(files, cache, tmp_path, keep):
    path, _, _ = files["gemma3"]
    size = path.stat().st_size
    n = {"half": size // 2, "minus one": size - 1}.get(keep, keep)
    bad = _damaged(path, tmp_path / "cut.gguf", keep=n)
    with pytest.raises(FileFormatError, match=r"cut.gguf: (not a GGUF file|a damaged or cut-off GGUF file|a cut-off GGUF)"):
        load_model(str(bad))
    assert not cache.exists() or not any(cache.iterdir())


def test_a_damaged_header_is_refused(files, cache, tmp_path):
    path, _, _ = files["gemma3"]
    # byte 8 starts the tensor count: a huge count sends the reader past the end of the file
    bad = _damaged(path, tmp_path / "header.gguf", flip=15)
    with pytest.raises(FileFormatError, match="header.gguf: a (damaged or )?cut-off GGUF file"):
        load_model(str(bad))


def test_an_unknown_path_is_still_an_unknown_model(cache):
    with pytest.raises(ValueError, match="not a preset, a local directory or a file"):
        load_model("no/such/model.gguf")


def _packaged(path: Path, tmp_path: Path, **fields) -> gguf_models.PackagedGguf:
    """A `PackagedGguf` whose package is a directory holding the tiny file (no real package needed)."""
    sha = gguf_models.sha256(path)
    package = tmp_path / "pkg"
    package.mkdir(exist_ok=True)
    (package / path.name).write_bytes(path.read_bytes())
    defaults = dict(
        name="tiny-preset", file_name=path.name, sha256=sha, package="tiny-preset-gguf", module="json",
        package_install="pip install tiny-preset-gguf", env="KVPOP_TINY_GGUF",
        locate=lambda pkg, work: package / path.name,
        convert=lambda gguf, out: gguf_models.convert(gguf, out, sha),
        notice=lambda pkg: "kvpop: tiny-preset is under the Tiny Terms",
    )
    return gguf_models.PackagedGguf(**{**defaults, **fields})


def test_a_packaged_file_is_checked_converted_once_and_its_notice_shown(files, cache, tmp_path, monkeypatch, caplog):
    path, original, _ = files["gemma3"]
    preset = _packaged(path, tmp_path)
    monkeypatch.delenv(preset.env, raising=False)
    assert preset.available()
    with caplog.at_level(logging.WARNING, logger="kvpop.gguf_models"):
        model, _ = preset.load()
        preset.load()
    notices = [r.getMessage() for r in caplog.records if "Tiny Terms" in r.getMessage()]
    assert notices == ["kvpop: tiny-preset is under the Tiny Terms"], "named once, at the conversion"
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-preset"]
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, original(IDS).logits, atol=1e-5, rtol=0)
    # the same file given by path is recognised: no second conversion
    gguf_models.ensure_file_converted(path, known=[preset])
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-preset"]


def test_a_packaged_file_with_another_checksum_is_refused_naming_both(files, cache, tmp_path, monkeypatch):
    path, _, _ = files["llama"]
    preset = _packaged(path, tmp_path)
    size = path.stat().st_size
    bad = _damaged(path, tmp_path / "flipped.gguf", flip=size - 1)
    monkeypatch.setenv(preset.env, str(bad))
    with pytest.raises(ValueError) as info:
        preset.load()
    msg = str(info.value)
    assert str(bad) in msg and preset.sha256 in msg and gguf_models.sha256(bad) in msg and preset.env in msg
    assert not (cache / "tiny-preset").exists()
    monkeypatch.setenv(preset.env, str(tmp_path / "absent.gguf"))
    with pytest.raises(RuntimeError, match=f"{preset.env}=.*absent.gguf' is not a file"):
        preset.load()


def test_a_missing_package_names_the_install_command(files, cache, tmp_path, monkeypatch):
    preset = _packaged(files["llama"][0], tmp_path, module="kvpop_no_such_package")
    monkeypatch.delenv(preset.env, raising=False)
    assert not preset.available()
    with pytest.raises(RuntimeError) as info:
        preset.load()
    msg = str(info.value)
    assert "needs the PyPI package tiny-preset-gguf" in msg and "pip install tiny-preset-gguf" in msg
    assert preset.env in msg


def test_a_half_written_directory_is_replaced(files, cache, tmp_path):
    path, original, _ = files["llama"]
    preset = _packaged(path, tmp_path)
    final = cache / preset.name
    final.mkdir(parents=True)
    (final / "config.json").write_text("{")
    model, _ = preset.load()
    assert sorted(p.name for p in cache.iterdir()) == [preset.name]
    assert gguf_models.is_complete(final, preset.sha256)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, original(IDS).logits, atol=1e-5, rtol=0)


def test_an_architecture_transformers_cannot_read_is_a_clear_error(files, cache, tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "no-such-arch")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"other.gguf: transformers .* cannot load this GGUF file"):
        load_model(str(path))
    assert not any(cache.iterdir())


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(tmp_path / "a"))
    assert gguf_models.cache_root() == tmp_path / "a"
    monkeypatch.delenv(gguf_models.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_models.cache_root() == tmp_path / "xdg" / "kvpop"



def test_an_older_transformers_is_refused_for_a_gemma_tokenizer_only(files, cache, monkeypatch, tmp_path):
    import transformers

    gemma, _, _ = files["gemma3"]
    for version in ("5.17.0", "5.22.2"):
        monkeypatch.setattr(transformers, "__version__", version)
        with pytest.raises(RuntimeError, match=rf"tiny-gemma3.gguf: transformers {version} builds the tokenizer of a "
                                               r"Gemma GGUF file wrongly .* >= 5.23"):
            load_model(str(gemma))
    assert not any(cache.iterdir())
    # a byte-level vocabulary converts right, and so does a Gemma file given a tokenizer converted elsewhere
    gguf_models.check_tokenizer_support(files["llama"][0])
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    good = gguf_models.ensure_file_converted(gemma)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    out = tmp_path / "with-tokenizer"
    gguf_models.convert(gemma, out, "0" * 64, tokenizer=good)
    from transformers import AutoTokenizer

    text = "naïve café, 你好 🙂 the thin"
    ids = [AutoTokenizer.from_pretrained(d)(text)["input_ids"] for d in (out, good)]
    assert ids[0] == ids[1] and ids[0][0] == 2, "Gemma's <bos> first, then the same pieces"


def test_info_on_a_gguf_file(files, cache, capsys):
    path, _, _ = files["gemma3"]
    assert main(["info", "--model", str(path), "--length", "64", "--budget", "8"]) == 0
    out = capsys.readouterr().out
    assert "layers:             6: full attention in layers 5; a sliding window of 16 tokens in the other 5" in out
    assert "KV cache at 64 tokens of one sequence (bfloat16):" in out
    assert "full-attention layers compressed 87.5 %" in out
