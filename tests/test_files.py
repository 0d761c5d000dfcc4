"""Tests of `kvpop.files`' writers: a file appears whole or not at all.

    python -m pytest tests/test_files.py -q
"""

from __future__ import annotations

import pytest

from kvpop.files import atomic_open, write_atomic


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
