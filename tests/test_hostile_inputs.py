"""Every loader of kvpop tried with hostile input: one clear error line, exit status 1, nothing executed, nothing
written outside `--out`, the user's files untouched.

    python -m pytest tests/test_hostile_inputs.py -q

The loaders: `kvpop.load` (`generate --model DIR`, `eval --trained DIR`), `read_weights` (`train --init-from`),
`train --resume`, `convert-checkpoint`, the converted-model cache of the `smollm2-135m` preset, `--data` files and
`--layer-budgets` files. The inputs: a pickle whose unpickling writes a file, a safetensors file whose header lies
about shapes or offsets, configs with wrong types or huge values, a symlink loop, a directory where a file goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvpop
from kvpop.cli import main
from kvpop.files import FileFormatError
from kvpop.models import load_model
from kvpop.train import checkpoint as ckpt
from kvpop.train import distill
from kvpop.train.distill import TrainConfig
from kvpop.train.weights import read_weights

KCFG = dict(sink=2, window=8, topk=16, scorer_hidden=16)
FAST_S = 20
"""A refusal of a config asking for a billion layers or a 10**12-token window comes this fast: nothing was built."""


class Payload:
    """Unpickled, it writes `marker`: what a hostile checkpoint does to whoever loads it in full."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _evil_torch_file(path: Path, marker: Path, **extra) -> Path:
    """A torch.save file shaped like a kvpop checkpoint, its model a payload."""
    torch.save({"step": 1, "model": Payload(marker), "optimizer": {}, "scheduler": {}, "rng": {}, **extra}, path)
    return path


def _lying_safetensors(path: Path, lie: str) -> None:
    """Rewrite a safetensors file's header (8-byte little-endian length + JSON) to lie about a tensor."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    if lie == "shape":
        header[name]["shape"] = [10**12]
    elif lie == "offsets":
        header[name]["data_offsets"] = [0, 10**15]
    else:
        header = {name: {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _loop(path: Path) -> None:
    """Make `path` a symlink to itself (an existing file or directory is removed first)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(path.name, path)


def _as_directory(path: Path) -> None:
    """A directory where a file is expected."""
    path.unlink()
    path.mkdir()
    (path / "inside.txt").write_text("a directory, not the file\n")


def _text(name: str, content: str) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        (root / name).write_text(content)
        return root / name
    return make


def _made(name: str, make: Callable[[Path], None]) -> Callable[[Path], Path]:
    def made(root: Path) -> Path:
        make(root / name)
        return root / name
    return made


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's SHA-256, a symlink's target, a directory's mark."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _refused(argv: list[str], capsys, root: Path, marker: Path | None = None, out: Path | None = None,
             says: str | tuple[str, ...] = ()) -> str:
    """Run `kvpop argv`: exit 1, one `kvpop <cmd>: error:` line, no payload ran, nothing under `root` changed but
    `out`. Returns the error line."""
    before = _snapshot(root)
    capsys.readouterr()
    start = time.perf_counter()
    try:
        rc = main(argv)
    finally:
        # checked first, also when the command fails otherwise: whatever else happened, nothing of a file may run
        assert marker is None or not marker.exists(), "the pickle's payload ran"
    took = time.perf_counter() - start
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith(f"kvpop {argv[0]}: error: ")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    after = _snapshot(root)
    if out is not None:
        rel = str(out.relative_to(root))
        before = {k: v for k, v in before.items() if k != rel and not k.startswith(rel + os.sep)}
        after = {k: v for k, v in after.items() if k != rel and not k.startswith(rel + os.sep)}
    assert after == before, f"files changed: {sorted(set(after.items()) ^ set(before.items()))[:6]}"
    for word in (says,) if isinstance(says, str) else says:
        assert word in errors[0], errors[0]
    assert took < 60, took
    return errors[0]


# --- what the user has: a trained model directory, a plain model directory, a run ---


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    data = root / "notes.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(200)) for _ in range(30)))
    model, tokenizer = load_model("tiny-random-qwen3")
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(**KCFG)), root / "saved", tokenizer=tokenizer)
    # scorers alone, their base found again from where the directory records it: the local directory `hf`
    base, _ = load_model(str(root / "hf"))
    kvpop.save(kvpop.retrofit(base, kvpop.KVpopConfig(**KCFG)), root / "adapter", base_weights=False)
    run = root / "run"
    distill.train(TrainConfig(model="tiny-random-qwen3", data=str(data), seq_len=64, steps=2, batch_size=1,
                              out=str(run), save_every=0, max_tokens=64 * 8, freeze_base=True),
                  kvpop.KVpopConfig(**KCFG), progress=False)
    shutil.rmtree(run / "final")
    return {"data": data, "hf": root / "hf", "saved": root / "saved", "adapter": root / "adapter", "run": run}


@pytest.fixture
def home(tmp_path, pristine) -> Path:
    """A fresh copy of the user's files to damage; the marker a payload would write lies beside them."""
    for name in ("hf", "saved", "adapter", "run"):
        shutil.copytree(pristine[name], tmp_path / name, symlinks=True)
    # the copy's base is the copied `hf`, which a case may damage
    _edit_json(Path("adapter/kvpop_format.json"), base={"path": str(tmp_path / "hf")})(tmp_path)
    shutil.copy(pristine["data"], tmp_path / "notes.txt")
    return tmp_path


def test_the_payload_is_live(tmp_path):
    # the crafted files are not inert: a full unpickler runs them (as kvpop's loaders did before)
    marker = tmp_path / "ran.txt"
    _evil_torch_file(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.read_text() == "ran"


# --- a trained model directory: kvpop.load, generate --model, eval --trained ---


def _edit_json(path: Path, **changes) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        file = root / path
        file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return edit


def _pickled_weights(root: Path) -> None:
    (root / "saved" / "model.safetensors").unlink()
    _evil_torch_file(root / "saved" / "pytorch_model.bin", root / "ran.txt")


SAVED = {
    "pickled weights": (_pickled_weights, "is a pickle, which kvpop never loads"),
    "scorers whose header lies about a shape": (
        lambda r: _lying_safetensors(r / "saved" / "kvpop_scorers.safetensors", "shape"), "not a readable safetensors"),
    "weights whose header lies about offsets": (
        lambda r: _lying_safetensors(r / "saved" / "model.safetensors", "offsets"), "not a readable safetensors"),
    "weights whose header claims 4 TB": (
        lambda r: _lying_safetensors(r / "saved" / "model.safetensors", "size"), "not a readable safetensors"),
    "a window of 10**12": (_edit_json(Path("saved/kvpop_config.json"), window=10**12),
                           ("kvpop_config.json: ", "budget 1000000000", "more than the", "of memory available")),
    "a scorer of 10**9 hidden units": (_edit_json(Path("saved/kvpop_config.json"), scorer_hidden=10**9),
                                       "the scorer weights do not fit"),
    "a window given as text": (_edit_json(Path("saved/kvpop_config.json"), window="8"), "KVpopConfig.window='8'"),
    "a billion layers": (_edit_json(Path("saved/config.json"), num_hidden_layers=10**9), "num_hidden_layers=1000000000"),
    "ten thousand layers of one unit": (_edit_json(Path("saved/config.json"), num_hidden_layers=4000, hidden_size=1,
                                                   intermediate_size=1, num_attention_heads=1, num_key_value_heads=1,
                                                   head_dim=1, vocab_size=10**7),
                                        "the config does not belong to these weights"),
    "a hidden size given as text": (_edit_json(Path("saved/config.json"), hidden_size="64"), "hidden_size='64'"),
    "a symlink loop for the weights": (lambda r: _loop(r / "saved" / "model.safetensors"), "symlink loop"),
    "a directory for the scorers": (lambda r: _as_directory(r / "saved" / "kvpop_scorers.safetensors"),
                                    "found a directory"),
    "a config nested a million deep": (lambda r: (r / "saved" / "kvpop_config.json").write_text("[" * 10**6),
                                       "nests too deeply"),
}


@pytest.mark.parametrize("case", SAVED)
def test_a_hostile_model_directory_is_refused(home, capsys, case):
    damage, says = SAVED[case]
    damage(home)
    saved, marker = home / "saved", home / "ran.txt"
    _refused(["generate", "--model", str(saved), "--prompt", "hi", "--max-new-tokens", "2"], capsys, home, marker,
             says=says)
    out = home / "ev"
    _refused(["eval", "--model", "tiny-random-qwen3", "--trained", str(saved), "--policies", "none", "--data",
              str(home / "notes.txt"), "--split", "all", "--seq-len", "64", "--sequences", "1", "--out", str(out)],
             capsys, home, marker, out)
    with pytest.raises((FileFormatError, ValueError)):
        kvpop.load(saved)
    assert not marker.exists()


def _pickled_base(root: Path) -> None:
    (root / "hf" / "model.safetensors").unlink()
    _evil_torch_file(root / "hf" / "pytorch_model.bin", root / "ran.txt")


ADAPTERS = {
    "a base of pickled weights": (_pickled_base, "is a pickle, which kvpop never loads"),
    "a base of a billion layers": (_edit_json(Path("hf/config.json"), num_hidden_layers=10**9),
                                   "num_hidden_layers=1000000000"),
    "a base whose weights lie about offsets": (lambda r: _lying_safetensors(r / "hf" / "model.safetensors", "offsets"),
                                               "not a readable safetensors"),
    "a base that is a symlink loop": (lambda r: _loop(r / "hf"), "is not there"),
    "a format given as text": (_edit_json(Path("adapter/kvpop_format.json"), format="2"), "'format' must be an integer"),
    "a scorer of 10**9 hidden units": (_edit_json(Path("adapter/kvpop_config.json"), scorer_hidden=10**9),
                                       "the scorer weights do not fit"),
    "scorers whose header lies about a shape": (
        lambda r: _lying_safetensors(r / "adapter" / "kvpop_scorers.safetensors", "shape"), "not a readable safetensors"),
}


@pytest.mark.parametrize("case", ADAPTERS)
def test_a_hostile_adapter_is_refused(home, capsys, case):
    # a directory of scorers alone loads its base from where it records it: that base is read as any model directory
    damage, says = ADAPTERS[case]
    damage(home)
    adapter, marker = home / "adapter", home / "ran.txt"
    _refused(["generate", "--model", str(adapter), "--prompt", "hi", "--max-new-tokens", "2"], capsys, home, marker,
             says=says)
    out = home / "ev"
    _refused(["eval", "--model", str(home / "saved"), "--trained", str(adapter), "--policies", "none", "--data",
              str(home / "notes.txt"), "--split", "all", "--seq-len", "64", "--sequences", "1", "--out", str(out)],
             capsys, home, marker, out)
    if not case.startswith("a base"):
        # a run started from the scorers trains on --model: the recorded base is not read, its own files are
        out = home / "new"
        _refused(["train", "--model", "tiny-random-qwen3", "--data", str(home / "notes.txt"), "--seq-len", "64",
                  "--steps", "1", "--max-tokens", "512", "--freeze-base", "--no-progress", "--init-from", str(adapter),
                  "--out", str(out)], capsys, home, marker, out, says)
    with pytest.raises((FileFormatError, ValueError, OSError)):
        kvpop.load(adapter)
    assert not marker.exists()


def test_a_config_asking_for_a_billion_layers_is_refused_before_anything_is_built(home, capsys):
    _edit_json(Path("hf/config.json"), num_hidden_layers=10**9)(home)
    for argv in (["info", "--model", str(home / "hf")],
                 ["generate", "--model", str(home / "hf"), "--prompt", "hi", "--max-new-tokens", "2"]):
        start = time.perf_counter()
        _refused(argv, capsys, home, says="num_hidden_layers=1000000000")
        assert time.perf_counter() - start < FAST_S


# --- a run: train --resume, train --init-from, read_weights, convert-checkpoint ---


def _step_dir(root: Path) -> Path:
    return ckpt.latest(root / "run").path


def _rehash(step: Path) -> None:
    """Make the manifest agree with the damaged files: only their content is hostile, not their integrity."""
    manifest = json.loads((step / ckpt.MANIFEST).read_text())
    for name, meta in manifest["parts"].items():
        if (step / name).is_file():
            meta.update(bytes=(step / name).stat().st_size,
                        sha256=hashlib.sha256((step / name).read_bytes()).hexdigest())
    (step / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _single_file(root: Path) -> Path:
    shutil.rmtree(root / "run" / ckpt.CHECKPOINTS)
    return _evil_torch_file(root / "run" / ckpt.LEGACY_CHECKPOINT, root / "ran.txt")


def _format_1(root: Path) -> Path:
    step = _step_dir(root)
    manifest = json.loads((step / ckpt.MANIFEST).read_text())
    for name in list(manifest["parts"]):
        (step / name).unlink()
    _evil_torch_file(step / "model.pt", root / "ran.txt")
    _evil_torch_file(step / "train_state.pt", root / "ran.txt")
    manifest.update(format=1, parts={n: {} for n in ("model.pt", "train_state.pt")})
    (step / ckpt.MANIFEST).write_text(json.dumps(manifest))
    _rehash(step)
    return step


def _part(name: str, content: Callable[[Path], None]) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        step = _step_dir(root)
        content(step / name)
        _rehash(step)
        return step
    return damage


def _manifest(**changes) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        step = _step_dir(root)
        _edit_json(step.relative_to(root) / ckpt.MANIFEST, **changes)(root)
        return step
    return damage


RUNS = {
    "a pickled single-file checkpoint": (_single_file, "kvpop no longer unpickles checkpoints"),
    "a pickled format-1 checkpoint": (_format_1, "kvpop no longer unpickles checkpoints"),
    "weights whose header lies about a shape": (_part("model.safetensors", lambda p: _lying_safetensors(p, "shape")),
                                                "not a readable safetensors"),
    "weights whose header lies about offsets": (
        _part("model.safetensors", lambda p: _lying_safetensors(p, "offsets")), "not a readable safetensors"),
    "a structure naming a pickle": (_part("model.json", lambda p: p.write_text(json.dumps(
        {"model": {"__kvpop__": "pickle", "data": "gASVIAAAAAAAAACMCGJ1aWx0aW5zlIwEZXhlY5STlC4="}}))),
        "an entry tagged 'pickle' that kvpop does not write"),
    "weights of the wrong type": (_part("model.json", lambda p: p.write_text('{"model": [1, 2]}')),
                                  "not a state dict of named tensors"),
    "a structure nested a million deep": (_part("model.json", lambda p: p.write_text("[" * 10**6 + "]" * 10**6)),
                                          "nests too deeply"),
    "a manifest pointing outside": (_manifest(parts={"../../notes.json": {"bytes": 1, "sha256": "0"}}),
                                    "not a kvpop checkpoint manifest"),
    "a manifest of a later format": (_manifest(format=99), "written by a later kvpop"),
    # a valid config, read back as it is; a run refuses it before it allocates anything
    "a window of 10**12": (_manifest(kvpop_config={**KCFG, "window": 10**12}), "nothing would ever be evicted"),
    "a symlink loop for the weights": (_part("model.safetensors", _loop), "symlink loop"),
    "a directory for the structure": (_part("model.json", _as_directory), "found a directory"),
}


@pytest.mark.parametrize("case", RUNS)
def test_a_hostile_run_is_refused(home, capsys, case):
    damage, says = RUNS[case]
    named = damage(home)
    run, marker = home / "run", home / "ran.txt"
    train = ["train", "--model", "tiny-random-qwen3", "--data", str(home / "notes.txt"), "--seq-len", "64",
             "--steps", "3", "--max-tokens", str(64 * 8), "--freeze-base", "--no-progress"]
    for source in (run, named):
        out = home / "new"
        _refused([*train, "--init-from", str(source), "--out", str(out)], capsys, home, marker, out, says)
        if "window" not in case:
            with pytest.raises((FileFormatError, ValueError)):
                read_weights(source)
    # at the run's own config, read from its manifest
    _refused([*train, "--resume", "--out", str(run)], capsys, home, marker, run, says)
    assert not marker.exists()


def test_a_file_that_is_no_checkpoint_is_named_so(home, capsys):
    out = home / "new"
    _refused(["train", "--model", "tiny-random-qwen3", "--data", str(home / "notes.txt"), "--seq-len", "64",
              "--steps", "1", "--freeze-base", "--no-progress", "--init-from", str(home / "notes.txt"), "--out",
              str(out)], capsys, home, out=out, says="notes.txt: not a kvpop checkpoint")


@pytest.mark.parametrize("kind", [_single_file, _format_1], ids=["single file", "format 1"])
def test_convert_refuses_a_crafted_pickle_and_runs_nothing(home, capsys, kind):
    # the explicit conversion reads with weights_only=True: the payload's global (exec) is refused, not called
    named = kind(home)
    for target in (home / "run", named):
        _refused(["convert-checkpoint", str(target)], capsys, home, home / "ran.txt",
                 says=("holds more than tensors and plain data", "nothing of it ran"))


@pytest.mark.parametrize("damage,says", [
    (lambda r: _loop(r / "run" / ckpt.LEGACY_CHECKPOINT), "symlink loop"),
    (lambda r: _as_directory(_evil_torch_file(r / "run" / "x.pt", r / "ran.txt")) or (r / "run" / "x.pt"),
     "neither a run directory"),
])
def test_convert_refuses_what_is_no_checkpoint_file(home, capsys, damage, says):
    shutil.rmtree(home / "run" / ckpt.CHECKPOINTS)
    target = damage(home) or home / "run" / ckpt.LEGACY_CHECKPOINT
    _refused(["convert-checkpoint", str(target)], capsys, home, home / "ran.txt", says=says)


# --- the converted-model cache of the smollm2-135m preset ---


@pytest.fixture
def cache(home, monkeypatch) -> Path:
    """A complete-looking cache of the smollm2-135m preset (a tiny model under its name), in `home`."""
    from kvpop import smollm2

    monkeypatch.setenv(smollm2.CACHE_ENV, str(home / "cache"))
    path = smollm2.converted_dir()
    shutil.copytree(home / "hf", path)
    (path / smollm2.MARKER).write_text(json.dumps({"sha256": smollm2.GGUF_SHA256}))
    return path


CACHED = {
    "a billion layers": (lambda p: _edit_json(p / "config.json", num_hidden_layers=10**9)(Path("/")),
                         "num_hidden_layers=1000000000"),
    "weights whose header lies about a shape": (lambda p: _lying_safetensors(p / "model.safetensors", "shape"),
                                                "not a readable safetensors"),
    "pickled weights": (lambda p: (p / "model.safetensors").unlink() or _evil_torch_file(
        p / "pytorch_model.bin", p.parent.parent / "ran.txt"), "is a pickle, which kvpop never loads"),
    "a symlink loop for the weights": (lambda p: _loop(p / "model.safetensors"), "symlink loop"),
}


@pytest.mark.parametrize("case", CACHED)
def test_a_hostile_preset_cache_is_refused(home, cache, capsys, case):
    damage, says = CACHED[case]
    damage(cache)
    _refused(["generate", "--model", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "2"], capsys, home,
             home / "ran.txt", says=says)


def test_the_preset_cache_loads_when_intact(home, cache, capsys):
    # the fixture's cache is a working model: the refusals above come from the damage alone (a tiny model under the
    # preset's name, so not the base of the shipped scorers: it runs untrained ones)
    assert main(["generate", "--model", "smollm2-135m", "--scorers", "untrained", "--prompt", "hi",
                 "--max-new-tokens", "2"]) == 0


# --- a GGUF file as --model ---


def _gguf(root: Path, **metadata) -> Path:
    """A tiny Llama as a GGUF file, then integers of its metadata rewritten in place (its tensors stay those of 2 small
    layers), as `gguf`'s own metadata editor does."""
    gguf = pytest.importorskip("gguf")
    from helpers import tiny_gguf_model, write_gguf

    write_gguf(*tiny_gguf_model("llama"), root / "m.gguf")
    reader = gguf.GGUFReader(root / "m.gguf", "r+")
    for key, value in metadata.items():
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
    del reader
    return root / "m.gguf"


GGUFS = {
    "a billion blocks": (lambda r: _gguf(r, **{"llama.block_count": 10**9}), "llama.block_count=1000000000"),
    "sizes its tensors do not hold": (lambda r: _gguf(r, **{"llama.embedding_length": 10**5,
                                                            "llama.feed_forward_length": 10**6}), "its tensors hold"),
    "a pickle named .gguf": (lambda r: _evil_torch_file(r / "m.gguf", r / "ran.txt"), "not a GGUF file"),
    "a symlink loop": (_made("m.gguf", _loop), "symlink loop"),
}


@pytest.mark.parametrize("case", GGUFS)
def test_a_hostile_gguf_file_is_refused_before_it_is_converted(home, monkeypatch, capsys, case):
    from kvpop import gguf_models

    monkeypatch.setenv(gguf_models.CACHE_ENV, str(home / "cache"))
    make, says = GGUFS[case]
    path = make(home)
    for argv in (["info", "--model", str(path)],
                 ["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2"]):
        start = time.perf_counter()
        _refused(argv, capsys, home, home / "ran.txt", says=says)
        assert time.perf_counter() - start < FAST_S
    assert not (home / "cache").exists() or not any((home / "cache").iterdir())


# --- --data files and --layer-budgets files ---


DATA = {
    "a pickle": (lambda r: _evil_torch_file(r / "evil.pt", r / "ran.txt"), "unsupported file type '.pt'"),
    "a pickle named .jsonl": (lambda r: _evil_torch_file(r / "evil.jsonl", r / "ran.txt"), "evil.jsonl: not UTF-8"),
    "a record nested a million deep": (_text("deep.jsonl", "[" * 10**6 + "\n"), "deep.jsonl:1 is not a JSON record"),
    "a number of 10**5 digits": (_text("big.jsonl", '{"text": ' + "9" * 10**5 + "}\n"), "big.jsonl:1"),
    "a symlink loop": (_made("loop.txt", _loop), "symlink loop"),
    "a directory named as a file": (_made("dir.jsonl", Path.mkdir), "holds no data files"),
}


@pytest.mark.parametrize("case", DATA)
def test_a_hostile_data_file_is_refused(home, capsys, case):
    make, says = DATA[case]
    path = make(home)
    out = home / "o"
    _refused(["train", "--model", "tiny-random-qwen3", "--data", str(path), "--seq-len", "64", "--steps", "1",
              "--max-tokens", "512", "--freeze-base", "--window", "8", "--topk", "16", "--no-progress", "--out",
              str(out)], capsys, home, home / "ran.txt", out, says)
    _refused(["eval", "--model", "tiny-random-qwen3", "--data", str(path), "--policies", "streaming_llm", "--budgets",
              "32", "--split", "all", "--seq-len", "64", "--sequences", "1", "--out", str(out)],
             capsys, home, home / "ran.txt", out, says)


def _budgets(doc) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        (root / "b.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return root / "b.json"
    return make


BUDGET_FILES = {
    "a pickle": (lambda r: _evil_torch_file(r / "b.json", r / "ran.txt"), "not UTF-8 text"),
    "budgets given as text": (_budgets({"budget": "32", "layer_budgets": ["32", "32"]}), "must be an integer >= 1"),
    "a budget of 10**12": (_budgets({"budget": 10**12, "layer_budgets": [10**12, 10**12]}), "1000000000000"),
    "nested a million deep": (_budgets("[" * 10**6), "nests too deeply"),
    "a symlink loop": (_made("b.json", _loop), "symlink loop"),
    "a directory": (_made("b.json", Path.mkdir), "found a directory"),
}


@pytest.mark.parametrize("case", BUDGET_FILES)
def test_a_hostile_layer_budget_file_is_refused(home, capsys, case):
    make, says = BUDGET_FILES[case]
    path = make(home)
    out = home / "o"
    _refused(["train", "--model", "tiny-random-qwen3", "--data", str(home / "notes.txt"), "--seq-len", "64",
              "--budget", "32", "--layer-budgets", str(path), "--steps", "1", "--freeze-base", "--no-progress",
              "--out", str(out)], capsys, home, home / "ran.txt", out, says)
    _refused(["eval", "--model", "tiny-random-qwen3", "--data", str(home / "notes.txt"), "--policies", "tova",
              "--budgets", "32", "--layer-budgets", str(path), "--split", "all", "--seq-len", "64", "--sequences",
              "1", "--out", str(out)], capsys, home, home / "ran.txt", out, says)


def test_no_loader_unpickles(tmp_path, monkeypatch, pristine):
    # whatever a run or a model directory holds, the readers above never reach pickle; convert-checkpoint alone
    # does, with weights_only=True
    calls = []
    real = pickle.Unpickler

    class Watched(real):
        def __init__(self, *a, **kw):
            calls.append(a)
            super().__init__(*a, **kw)

    monkeypatch.setattr(pickle, "Unpickler", Watched)
    monkeypatch.setattr(torch.serialization.pickle, "Unpickler", Watched, raising=False)
    weights = read_weights(pristine["run"])
    assert weights.step == 2 and ckpt.latest(pristine["run"]).read()["step"] == 2
    kvpop.load(pristine["saved"])
    assert calls == []
