"""A training run's directory: checkpoints of which none is ever lost, the step log, and the guard on `--out`.

    OUT/config.json                    the resolved configs and the command (rewritten at each start)
    OUT/train_log.jsonl                one JSON line per optimizer step
    OUT/checkpoints/step-00000042/     model.safetensors + model.json (the trained weights),
                                       train_state.safetensors + train_state.json (step, optimizer,
                                       scheduler, RNG states), then manifest.json
                                       (the newest; with --keep-every N also every N-th step's)
    OUT/final/                         `kvpop.save` of the trained model

A checkpoint holds data only: each part is a JSON file (its structure, numbers and strings) and a
safetensors file (its tensors), written and read by `kvpop.train.state_file`; nothing in it is
unpickled, so a checkpoint someone shares cannot run code. Checkpoints of earlier kvpop versions
were pickles (format 1: `model.pt` and `train_state.pt`; before that one `OUT/checkpoint.pt`):
they are refused with the command that converts them once (`kvpop convert-checkpoint`,
`kvpop.train.convert`), which loads only tensors and plain data.

A checkpoint is written into a hidden directory: its parts, each fsynced, then `manifest.json` with
the format, the step, every file's size and SHA-256 and what a resume must match; then the directory
is renamed into place in one step. A crash at any point leaves either no new checkpoint (a hidden
partial directory, ignored and later removed) or a complete one; older checkpoints are removed only
after the new one is complete, so the last complete checkpoint always survives. Those of every
`keep_every`-th step are never removed: a curve of some metric against the steps reads them
afterwards. "Complete" is checkable: the manifest exists and every file has the size and hash it records.

An `--out` that holds a run is never reused silently: `--resume` continues it, `--overwrite` moves it
aside in one rename and deletes it once the new run has written its first checkpoint (and puts it
back if the new run fails before that).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from kvpop.files import (
    FileFormatError,
    check_file,
    fsync_dir,
    read_json,
    read_json_object,
    read_safetensors,
    write_atomic,
)
from kvpop.train.state_file import StateError, decode, encode

CHECKPOINTS = "checkpoints"
LOG = "train_log.jsonl"
RUN_CONFIG = "config.json"
FINAL = "final"
MANIFEST = "manifest.json"
LEGACY_CHECKPOINT = "checkpoint.pt"
"""Checkpoints of kvpop before the parts and manifest: one pickle, refused (`kvpop convert-checkpoint` converts it)."""
RUN_ENTRIES = (CHECKPOINTS, LEGACY_CHECKPOINT, LOG, RUN_CONFIG, FINAL)
"""What a run writes into OUT: a directory holding any of them holds a run."""
FORMAT = 2
"""The checkpoint format this kvpop writes and reads: 2, parts as JSON + safetensors. Format 1 held pickles."""
PICKLED_FORMAT = 1
MODEL = "model"
"""The part holding the trained weights (`{"model": state dict}`); the others hold the training state."""
_STEP_DIR = re.compile(r"step-(\d{8})")
_PART_FILE = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.-]*)\.(json|safetensors)")


class TrainingError(RuntimeError):
    """A run that cannot start or go on (its --out, a resume that does not match, a non-finite loss, ...)."""


def _say(message: str) -> None:
    print(f"kvpop train: {message}", file=sys.stderr)


# --- checkpoints ---


def pickled_refusal(path: Path, run: Path, what: str) -> FileFormatError:
    """The error for a checkpoint of an earlier kvpop: a pickle, which kvpop no longer loads."""
    return FileFormatError(
        f"{path}: {what} of an earlier kvpop, saved as pickles; kvpop no longer unpickles checkpoints (unpickling a "
        f"file can run any code it holds). Convert it once with `kvpop convert-checkpoint {run}`: it reads tensors and "
        "plain data only, refuses anything else, and writes the checkpoint as JSON + safetensors beside it")


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint on disk: a step directory with its manifest, or a legacy `checkpoint.pt`."""

    path: Path
    step: int
    manifest: dict[str, Any] | None
    """None for a legacy `checkpoint.pt` (its step is inside the pickle)."""

    @property
    def pickled(self) -> bool:
        """Written by an earlier kvpop as pickles (a legacy `checkpoint.pt` or format 1): refused, to be converted."""
        return self.manifest is None or self.manifest["format"] == PICKLED_FORMAT

    @property
    def run(self) -> Path:
        """The run directory the checkpoint belongs to."""
        return self.path.parent if self.manifest is None else self.path.parent.parent

    def read(self, parts: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Everything the checkpoint holds, every file checked against the manifest first.

        `parts`: only these parts of it (e.g. `("model",)` for the weights without the optimizer state).
        """
        if self.manifest is None and self.path.name != LEGACY_CHECKPOINT and not _looks_pickled(self.path):
            raise FileFormatError(f"{self.path}: not a kvpop checkpoint (a run directory, or one of its "
                                  f"{CHECKPOINTS}/step-NNNNNNNN directories)")
        if self.pickled:
            what = "a single-file checkpoint" if self.manifest is None else f"a checkpoint in format {PICKLED_FORMAT}"
            raise pickled_refusal(self.path, self.run, what)
        state = {k: v for k, v in self.manifest.items() if k != "parts"}
        for name in _part_names(self.manifest["parts"]):
            if parts is None or name in parts:
                state.update(self._read_part(name))
        _require(state, (MODEL,) if parts is not None else (MODEL, "optimizer", "scheduler", "rng"), self.path)
        if not (isinstance(state[MODEL], dict) and all(isinstance(k, str) and isinstance(v, Tensor)
                                                       for k, v in state[MODEL].items())):
            raise FileFormatError(f"{self.path}: its {MODEL!r} is not a state dict of named tensors")
        return state

    def _read_part(self, name: str) -> dict[str, Any]:
        files = self.manifest["parts"]
        for suffix in (".json", ".safetensors"):
            verify_part(self.path / f"{name}{suffix}", files[f"{name}{suffix}"])
        tree = read_json(self.path / f"{name}.json", "a checkpoint part")
        tensors = read_safetensors(self.path / f"{name}.safetensors", "a checkpoint part")
        try:
            part = decode(tree, tensors, str(self.path / f"{name}.json"))
        except StateError as err:
            raise FileFormatError(str(err)) from None
        if not isinstance(part, dict):
            raise FileFormatError(f"{self.path / name}.json: a checkpoint part must hold an object, found "
                                  f"{type(part).__name__}")
        return part


def _looks_pickled(path: Path) -> bool:
    """A file that begins as `torch.save` writes (a zip archive, or a bare pickle of protocol 2 or later)."""
    check_file(path, "the checkpoint")
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def _part_names(files: dict[str, Any]) -> list[str]:
    """The parts a format-2 manifest lists, each as a `.json` and a `.safetensors` file."""
    names = sorted({_PART_FILE.fullmatch(f).group(1) for f in files})
    return names


def _require(state: Any, keys: tuple[str, ...], path: Path) -> None:
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise FileFormatError(f"{path}: not a kvpop checkpoint (missing {missing})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_part(path: Path, meta: dict[str, Any]) -> None:
    if not path.exists() and not path.is_symlink():
        raise FileFormatError(f"{path}: a part of the checkpoint is missing")
    check_file(path, "a part of the checkpoint")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise FileFormatError(f"{path}: {size} bytes, but the manifest records {meta['bytes']}: the file was cut "
                              "off or changed after it was written")
    if _sha256(path) != meta["sha256"]:
        raise FileFormatError(f"{path}: its SHA-256 differs from the manifest's: the file changed after it was written")


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    manifest = read_json_object(file, "the checkpoint manifest")
    fmt, parts = manifest.get("format"), manifest.get("parts")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT:
        raise FileFormatError(f"{file}: a checkpoint in format {fmt}, written by a later kvpop; this kvpop reads "
                              f"format {FORMAT}: update kvpop")
    ok = (fmt in (PICKLED_FORMAT, FORMAT) and type(fmt) is int and type(manifest.get("step")) is int
          and isinstance(parts, dict) and all(isinstance(m, dict) and type(m.get("bytes")) is int
                                              and isinstance(m.get("sha256"), str) for m in parts.values()))
    if ok and fmt == FORMAT:
        # plain file names only: a manifest never points outside its directory
        names = [_PART_FILE.fullmatch(f) for f in parts]
        stems = {m.group(1) for m in names if m}
        ok = all(names) and all(f"{s}.json" in parts and f"{s}.safetensors" in parts for s in stems) \
            and MODEL in stems
    if not ok:
        raise FileFormatError(f"{file}: not a kvpop checkpoint manifest (format {FORMAT}: step, and parts as .json and "
                              ".safetensors files with bytes and sha256)")
    return manifest


def checkpoints(out: str | Path) -> list[Checkpoint]:
    """The complete checkpoints in `out`, oldest first (a legacy `checkpoint.pt` counts as the oldest)."""
    out = Path(out)
    found = []
    legacy = out / LEGACY_CHECKPOINT
    if legacy.is_file():
        found.append(Checkpoint(legacy, -1, None))
    root = out / CHECKPOINTS
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = _STEP_DIR.fullmatch(path.name)
        # the manifest is written last: a step directory without one was never renamed into place
        if m and (path / MANIFEST).is_file():
            found.append(Checkpoint(path, int(m.group(1)), _read_manifest(path)))
    return found


def is_checkpoint(path: str | Path) -> bool:
    """True for what names one checkpoint by its form: a `step-NNNNNNNN` directory or a file (a legacy `checkpoint.pt`)."""
    path = Path(path)
    return path.is_file() or _STEP_DIR.fullmatch(path.name) is not None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`: a step directory (its manifest checked) or a legacy `checkpoint.pt`."""
    path = Path(path)
    if path.is_file():
        return Checkpoint(path, -1, None)
    m = _STEP_DIR.fullmatch(path.name)
    if not m:
        raise FileFormatError(f"{path}: not a checkpoint (a {CHECKPOINTS}/step-NNNNNNNN directory)")
    return Checkpoint(path, int(m.group(1)), _read_manifest(path))


def latest(out: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint in `out`, or None."""
    found = checkpoints(out)
    return found[-1] if found else None


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write_part(path: Path, obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Write part `obj` as `path.json` (its structure) and `path.safetensors` (its tensors); their manifest entries."""
    from safetensors.torch import save

    try:
        tree, tensors = encode(obj)
    except StateError as err:
        raise ValueError(f"{path.name}: {err}") from None
    json_file, tensor_file = path.with_name(f"{path.name}.json"), path.with_name(f"{path.name}.safetensors")
    return {json_file.name: _write_file(json_file, json.dumps(tree, allow_nan=False).encode()),
            tensor_file.name: _write_file(tensor_file, save(tensors))}


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    with open(path / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path)


def _prune(out: Path, keep: Checkpoint, keep_every: int = 0) -> None:
    """Remove every checkpoint older than `keep` but those of every `keep_every`-th step (0: none), and
    partial directories of earlier, crashed saves."""
    for old in checkpoints(out):
        if old.path == keep.path or (keep_every and old.manifest is not None and old.step % keep_every == 0):
            continue
        if old.path.is_dir():
            shutil.rmtree(old.path)
        else:
            old.path.unlink()
    for partial in (out / CHECKPOINTS).glob(".step-*"):
        shutil.rmtree(partial, ignore_errors=True)


def write_directory(path: Path, step: int, parts: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Write a checkpoint's files into the new directory `path`, the manifest last; returns the manifest."""
    bad = [name for name in parts if not _PART_FILE.fullmatch(f"{name}.json")]
    if bad or MODEL not in parts:
        raise ValueError(f"checkpoint parts {sorted(parts)} must include {MODEL!r} and be plain names")
    path.mkdir()
    manifest = {"format": FORMAT, "step": step, **meta, "parts": {}}
    for name, obj in parts.items():
        manifest["parts"].update(_write_part(path / name, obj))
    manifest["written"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_manifest(path, manifest)
    return manifest


def write(out: str | Path, step: int, parts: dict[str, dict[str, Any]], meta: dict[str, Any],
          keep_every: int = 0) -> Checkpoint:
    """Write the checkpoint of `step` (`parts`: part name -> dict of data and tensors, `"model"` among them;
    `meta`: JSON for the manifest).

    The new checkpoint is complete before any older one is removed, and those of every `keep_every`-th
    step are kept (0: only the new one stays). A complete checkpoint of the same step is kept as it
    is: no optimizer step ran since it was written or resumed from.
    """
    out = Path(out)
    root = out / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    if (final / MANIFEST).is_file():
        return Checkpoint(final, step, _read_manifest(final))
    tmp = root / f".step-{step:08d}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = write_directory(tmp, step, parts, meta)
    os.rename(tmp, final)
    fsync_dir(root)
    checkpoint = Checkpoint(final, step, manifest)
    _prune(out, checkpoint, keep_every)
    return checkpoint


# --- the step log ---


def read_log(out: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The rows of `OUT/train_log.jsonl`. A torn last line (a crash while it was written) is an error
    naming the file, or with `repair` is cut off the file, with a message."""
    path = Path(out) / LOG
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as err:
            if i == len(lines) - 1 and repair:
                _say(f"{path}: its last line was cut off (a crash while writing it); dropped it: {line[:60]!r}")
                break
            where = "its last line was cut off" if i == len(lines) - 1 else f"line {i + 1} is not a log row ({err})"
            raise FileFormatError(f"{path}: {where}: {line[:60]!r}") from None
        rows.append(row)
    return rows


def trim_log(out: str | Path, step: int) -> None:
    """On resume: keep the log rows of steps up to the checkpoint's `step` (the later ones run again)."""
    path = Path(out) / LOG
    if not path.exists():
        return
    rows = [r for r in read_log(out, repair=True) if r["step"] <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


# --- the guard on --out ---


def describe(out: Path) -> str:
    """What the run in `out` holds, for messages: its checkpoint, log, final model."""
    what = []
    try:
        last = latest(out)
    except FileFormatError as err:
        what.append(f"a damaged checkpoint ({err})")
        last = None
    if last is not None:
        step = last.step if last.manifest is not None else "?"
        what.append(f"a checkpoint of step {step} ({last.path.relative_to(out)})")
    try:
        rows = read_log(out, repair=False)
        if rows:
            what.append(f"{LOG} up to step {rows[-1]['step']}")
    except FileFormatError:
        what.append(f"{LOG} (its last line cut off)")
    if (out / FINAL).exists():
        what.append(f"{FINAL}/")
    if not what:
        what = [e for e in RUN_ENTRIES if (out / e).exists()]
    return ", ".join(what)


def holds_run(out: str | Path) -> bool:
    out = Path(out)
    return out.is_dir() and any((out / e).exists() for e in RUN_ENTRIES)


def check_out(out: str | Path, *, resume: bool, overwrite: bool, init: bool = False) -> Checkpoint | None:
    """Refuse an `--out` that cannot serve the run as asked; return the checkpoint to resume from.

    `init`: the run is to start from other weights (`--init-from`), which only a new run can."""
    out = Path(out)
    if resume and overwrite:
        raise TrainingError("give --resume (continue the run in --out) or --overwrite (replace it), not both")
    if resume and init:
        raise TrainingError("give --resume (continue the run in --out, which records where it started) or "
                            "--init-from (start a new run from trained weights), not both")
    if out.exists() and not out.is_dir():
        raise TrainingError(f"--out {out} is a file, not a directory")
    if resume:
        last = latest(out)
        if last is None:
            there = f"it holds {describe(out)}" if holds_run(out) else "it holds no run"
            raise TrainingError(f"--resume: no complete checkpoint in {out} ({there}); start it without --resume "
                              "(and --overwrite to replace what is there)")
        return last
    if holds_run(out) and not overwrite:
        raise TrainingError(f"--out {out} holds a run ({describe(out)}): add --resume to continue it, --overwrite to "
                          "replace it, or choose another --out")
    if holds_run(out) and Path.cwd().resolve().is_relative_to(out.resolve()):
        raise TrainingError(f"--overwrite: --out {out} is the current directory or holds it; run from elsewhere")
    return None


def move_aside(out: str | Path) -> Path:
    """Move the run in `out` aside in one rename; files that are not the run's come back into a fresh `out`."""
    out = Path(out).resolve()
    aside = out.with_name(f".{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.rename(out, aside)
    fsync_dir(out.parent)
    out.mkdir()
    # an open file keeps working across renames: a log a wrapper holds open in OUT still receives its lines
    for entry in aside.iterdir():
        if entry.name not in RUN_ENTRIES:
            os.rename(entry, out / entry.name)
    _say(f"--overwrite: moved the run in {out} to {aside}; it is deleted once this run writes its first checkpoint")
    return aside


def restore(out: str | Path, aside: Path) -> None:
    """Undo `move_aside` (the new run failed before its first checkpoint): `out` is as it was."""
    out = Path(out).resolve()
    for entry in out.iterdir():
        if entry.name not in RUN_ENTRIES:
            os.rename(entry, aside / entry.name)
    shutil.rmtree(out)
    os.rename(aside, out)
    _say(f"the new run failed before its first checkpoint; the previous run is back in {out}")


def discard(aside: Path) -> None:
    """The new run has a checkpoint: the run it replaced goes."""
    shutil.rmtree(aside, ignore_errors=True)
    _say(f"--overwrite: removed the replaced run ({aside})")
