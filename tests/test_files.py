"""Tests of `kvpop.files`: a file appears whole or not at all; every reader names the file and its fault, and
reads data only.

    python -m pytest tests/test_files.py -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest
import torch

from kvpop import files
from kvpop.files import (
    FileFormatError,
    atomic_open,
    check_model_config,
    load_pretrained,
    read_json,
    read_safetensors,
    safetensors_shapes,
    write_atomic,
)


def test_atomic_open_replaces_the_file_when_the_block_ends(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("old\n")
    with atomic_open(path) as f:
        f.write("new\n")
        assert path.read_text() == "old\n", "the file changed before the block ended"
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_in_the_block_leaves_the_file_and_no_temporary(tmp_path, error):
    path = tmp_path / "a.jsonl"
    path.write_text("old\n")
    with pytest.raises(error):
        with atomic_open(path) as f:
            f.write("half")
            raise error()
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_write_atomic_writes_text_and_bytes(tmp_path):
    write_atomic(tmp_path / "t", "text")
    write_atomic(tmp_path / "b", b"\x00\x01")
    assert (tmp_path / "t").read_text() == "text" and (tmp_path / "b").read_bytes() == b"\x00\x01"
    with pytest.raises(ValueError, match="mode='a'"):
        with atomic_open(tmp_path / "x", "a"):
            pass


# --- the readers: each fault one error naming the file ---


def _loop(path):
    os.symlink(path.name, path)
    return path


@pytest.mark.parametrize("make,says", [
    (lambda p: p, "the config is missing"),
    (lambda p: p.mkdir() or p, "the config must be a file, found a directory"),
    (_loop, "the config is a symlink loop"),
    (lambda p: os.symlink("nowhere", p) or p, "the config is a symlink to nothing (nowhere)"),
    (lambda p: os.mkfifo(p) or p, "the config must be a regular file, found a device, pipe or socket"),
])
def test_check_file_names_what_is_there_instead(tmp_path, make, says):
    path = make(tmp_path / "c.json")
    with pytest.raises(FileFormatError, match=f"^{path}: {re.escape(says)}"):
        read_json(path, "the config")


@pytest.mark.parametrize("content,says", [
    (b"", "is empty"),
    (b"{", "not valid JSON"),
    (b"[" * 100_000, "nests too deeply"),
    (b'{"n": ' + b"9" * 10_000 + b"}", "holds a value kvpop cannot read"),
    (b"\x80\x05\x95 pickled", "is not UTF-8 text"),
])
def test_read_json_names_the_fault(tmp_path, content, says):
    (tmp_path / "c.json").write_bytes(content)
    with pytest.raises(FileFormatError, match=f"^{tmp_path / 'c.json'}: the config .*{says}"):
        read_json(tmp_path / "c.json", "the config")


def test_read_json_refuses_a_file_larger_than_any_kvpop_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_JSON_BYTES", 1 << 20)
    (tmp_path / "c.json").write_text('{"x": "' + "a" * (2 << 20) + '"}')
    with pytest.raises(FileFormatError, match="2 MiB, more than the 1 MiB"):
        read_json(tmp_path / "c.json", "the config")


def _header(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header,says", [
    ({"w": {"dtype": "F32", "shape": [10**12], "data_offsets": [0, 24]}}, "invalid shape"),
    ({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 10**15]}}, "invalid shape, data type, or offset"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, "not fully covered"),
    ({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}, "v": {"dtype": "F32", "shape": [6],
                                                                          "data_offsets": [0, 24]}}, "offset"),
    ({"w": {"dtype": "PICKLE", "shape": [6], "data_offsets": [0, 24]}}, "PICKLE"),
])
def test_a_safetensors_header_that_lies_is_refused_before_any_data_is_read(tmp_path, header, says):
    path = tmp_path / "w.safetensors"
    _header(path, header, bytes(24))
    for read in (lambda: safetensors_shapes(path, "the weights"), lambda: read_safetensors(path, "the weights")):
        with pytest.raises(FileFormatError, match=f"^{path}: the weights is not a readable safetensors file") as err:
            read()
        assert says in str(err.value)
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(FileFormatError, match="header too large"):
        safetensors_shapes(path, "the weights")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from helpers import tiny_model

    path = tmp_path_factory.mktemp("hf") / "m"
    tiny_model("qwen3").save_pretrained(path)
    return path


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes,says", [
    (dict(num_hidden_layers="2"), "num_hidden_layers='2' must be a positive integer"),
    (dict(hidden_size=True), "hidden_size=True must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size=-1"),
    (dict(num_hidden_layers=2**41), "below 2**40"),
    (dict(num_hidden_layers=5000), "num_hidden_layers=5000 is more than any model has"),
    (dict(num_hidden_layers=2000), "the config does not belong to these weights"),
    (dict(text_config={"hidden_size": 10**6}), "the config does not belong to these weights"),
])
def test_a_model_config_that_cannot_be_its_model_is_refused(hf_dir, tmp_path, changes, says):
    path = _with_config(hf_dir, tmp_path / "m", **changes)
    with pytest.raises(FileFormatError, match=f"^{path / 'config.json'}: .*{re.escape(says)}"):
        load_pretrained(path, "the model")


def test_load_pretrained_reads_safetensors_only(hf_dir, tmp_path):
    from helpers import tiny_model

    assert load_pretrained(hf_dir, "the model").config.num_hidden_layers == 2
    # a quantised model packs several parameters per stored value: its count is not held against its files
    check_model_config(_with_config(hf_dir, tmp_path / "q", num_hidden_layers=2000, quantization_config={}))
    # weights as a pickle only (a benign one: torch.save of a state dict), the way older checkpoints were shared
    pickled = shutil.copytree(hf_dir, tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    torch.save(tiny_model("qwen3").state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(FileFormatError, match=r"pytorch_model.bin: the weights of the model is a pickle, which kvpop "
                                              r"never loads .*; convert it once with `python -c"):
        load_pretrained(pickled, "the model")
