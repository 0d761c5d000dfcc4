"""Reading the files kvpop writes, each failure one clear error that names the file and what is wrong.

JSON configs, safetensors weights and torch pickles fail in their own ways (`JSONDecodeError`
naming no file, `SafetensorError`, `EOFError`, `UnpicklingError`); the readers here turn every one
of them into `FileFormatError`, a `ValueError` whose message starts with the path. The writers
make a file appear whole or not at all (temporary name, fsync, rename).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class FileFormatError(ValueError):
    """A file kvpop reads is missing, truncated or malformed; the message names the file."""


def read_json(path: str | Path, what: str) -> Any:
    """`path` parsed as JSON; `what` says what the file is for (e.g. "the KVpop config")."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileFormatError(f"{path}: {what} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise FileFormatError(f"{path}: cannot read {what} ({err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        state = "empty" if not text.strip() else f"not valid JSON ({err})"
        raise FileFormatError(f"{path}: {what} is {state}; the file is damaged or was cut off") from None


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """`read_json`, and a clear error unless the file holds a JSON object."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise FileFormatError(f"{path}: {what} must be a JSON object, found {type(value).__name__}")
    return value


def read_safetensors(path: str | Path, what: str, device: str = "cpu") -> dict:
    """The tensors of a safetensors file, or a clear error (missing, truncated, not safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: {what} is missing")
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError) as err:
        raise FileFormatError(f"{path}: {what} is not a readable safetensors file ({err}); "
                              "the file is damaged or was cut off") from None


def read_torch(path: str | Path, what: str) -> Any:
    """A `torch.save` file, loaded on the CPU, or a clear error (empty, truncated, not a torch file)."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: {what} is missing")
    if path.stat().st_size == 0:
        raise FileFormatError(f"{path}: {what} is empty (0 bytes)")
    try:
        # our own files: they hold optimizer and RNG states, which the weights-only loader refuses
        return torch.load(path, map_location="cpu", weights_only=False)
    except (EOFError, pickle.UnpicklingError, RuntimeError, OSError, ValueError, AttributeError, ImportError,
            IndexError, KeyError) as err:
        raise FileFormatError(f"{path}: {what} is not a readable torch file ({type(err).__name__}: {err}); "
                              "the file is damaged or was cut off") from None


def check_safetensors(path: str | Path, what: str) -> None:
    """Read the header of a safetensors file: a truncated or foreign file is named before anything loads it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError, ValueError) as err:
        raise FileFormatError(f"{path}: {what} is not a readable safetensors file ({err}); "
                              "the file is damaged or was cut off") from None


def load_pretrained(path: str | Path, what: str, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained` of a local directory, every weights file checked first."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = Path(path)
    for file in sorted(path.glob("*.safetensors")):
        if not file.name.startswith("kvpop_"):
            check_safetensors(file, f"a weights file of {what}")
    try:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileFormatError(f"{path}: cannot load {what} ({type(err).__name__}: {first})") from None


def refuse_existing(path: str | Path | None, flag: str, force: bool) -> None:
    """Before any work: a command never replaces a file the user has unless asked (`--force`).

    Called first, so a refusal costs nothing; a directory where a file is to go is refused even with `--force`."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file name")
    if path.exists() and not force:
        raise ValueError(f"{flag} {path} exists: pass --force to replace it, or choose another file")


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A file to write `path` through, whole or not at all: a temporary file beside it, fsync, then a rename
    over `path` when the block ends; an error in the block removes the temporary file and leaves `path` as it was.

    Args:
        mode: "w" (text) or "wb" (bytes).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode={mode!r} must be 'w' or 'wb'")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `path` whole or not at all: a temporary file, fsync, then rename over `path`."""
    with atomic_open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
