"""Checkpoints of earlier kvpop versions, saved as pickles, converted once into data (JSON + safetensors).

    kvpop convert-checkpoint runs/x                                # every pickled checkpoint of the run
    kvpop convert-checkpoint runs/x/checkpoints/step-00000400      # one of them
    kvpop convert-checkpoint runs/x/checkpoint.pt                  # the single file of the oldest versions

Earlier versions saved checkpoints with `torch.save`: format 1 (`model.pt` and `train_state.pt` beside
a manifest) and, before it, one `OUT/checkpoint.pt`. Unpickling a file in full can run any code it
holds, so kvpop refuses them everywhere else. This converts each, once, when asked: the pickles are
read by `torch.load(weights_only=True)`, which builds tensors, numbers, strings and containers only,
plus the NumPy array of NumPy's RNG state (`ALLOWED`); a file naming anything else (a function to
call, a class to build) is refused and nothing of it runs. What is read must be a kvpop checkpoint;
it is written as a current checkpoint (`kvpop.train.checkpoint`) under the same step, and the pickles
are kept beside it, renamed (`step-00000400.pickled/`, `checkpoint.pt.pickled`), where kvpop no longer
looks: delete them once the run resumes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpop.files import FileFormatError, check_file, fsync_dir
from kvpop.train import checkpoint as ckpt

PICKLED = ".pickled"
"""Appended to the name of a converted pickled checkpoint: kvpop no longer sees it as one."""
TRAIN_STATE = ("step", "optimizer", "scheduler", "rng")
LEGACY_META = ("train_config", "kvpop_config", "world", "pool_tokens", "device_type", "data_sha256", "base", "init")
"""What a single-file checkpoint held besides its training state: the manifest's entries now."""


def _allowed() -> list:
    """The globals a kvpop pickle needs beyond torch's weights-only set: a NumPy array (NumPy's RNG state)."""
    multiarray = getattr(np, "_core", None) or np.core
    return [np.ndarray, np.dtype, multiarray.multiarray._reconstruct, type(np.dtype(np.uint32))]


ALLOWED = _allowed()


def load_pickle(path: Path, what: str) -> Any:
    """A pickle read with `torch.load(weights_only=True)` and `ALLOWED`: data only, or a `FileFormatError`."""
    check_file(path, what)
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = next((line for line in str(err).splitlines() if "Unsupported" in line or "global" in line.lower()),
                     str(err).splitlines()[0] if str(err) else "")
        raise FileFormatError(f"{path}: {what} holds more than tensors and plain data, so it is not converted and "
                              f"nothing of it ran ({first.strip()[:200]})") from None
    except (EOFError, RuntimeError, OSError, ValueError, AttributeError, ImportError, IndexError, KeyError,
            TypeError) as err:
        raise FileFormatError(f"{path}: {what} is not a readable torch file ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]}); the file is damaged or was cut off") from None


def _split(state: dict[str, Any], where: Path) -> dict[str, dict[str, Any]]:
    """A pickled checkpoint's state as the parts of a current one."""
    missing = [k for k in ("model", *TRAIN_STATE) if k not in state]
    if missing:
        raise FileFormatError(f"{where}: not a kvpop checkpoint (missing {missing})")
    model = state["model"]
    if not (isinstance(model, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in model.items())):
        raise FileFormatError(f"{where}: its 'model' is not a state dict of tensors")
    if type(state["step"]) is not int:
        raise FileFormatError(f"{where}: its step {state['step']!r} is not an integer")
    return {ckpt.MODEL: {"model": model}, "train_state": {k: state[k] for k in TRAIN_STATE}}


def _read_format1(c: ckpt.Checkpoint) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The parts and manifest entries of a format-1 step directory, its files checked against its manifest."""
    state: dict[str, Any] = {}
    for name, meta in c.manifest["parts"].items():
        path = c.path / name
        if Path(name).name != name:
            raise FileFormatError(f"{c.path / ckpt.MANIFEST}: a part named {name!r} is not a file of the checkpoint")
        ckpt.verify_part(path, meta)
        part = load_pickle(path, "a checkpoint part")
        if not isinstance(part, dict):
            raise FileFormatError(f"{path}: a checkpoint part must hold a dict, found {type(part).__name__}")
        state.update(part)
    meta = {k: v for k, v in c.manifest.items() if k not in ("format", "step", "parts", "written")}
    return _split(state, c.path), meta


def _read_legacy(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any], int]:
    state = load_pickle(path, "the checkpoint")
    if not isinstance(state, dict):
        raise FileFormatError(f"{path}: not a kvpop checkpoint (it holds a {type(state).__name__})")
    parts = _split(state, path)
    meta = {k: state[k] for k in LEGACY_META if k in state}
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise FileFormatError(f"{path}: its configs are not plain data ({err})") from None
    return parts, meta, state["step"]


def pickled_checkpoints(path: str | Path) -> list[ckpt.Checkpoint]:
    """The pickled checkpoints `path` names: a run directory's, one step directory or a single-file checkpoint."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        check_file(path, "the checkpoint")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (a run directory, a checkpoint directory or a checkpoint.pt)")
    if path.is_file():
        return [ckpt.Checkpoint(path, -1, None)]
    if ckpt.is_checkpoint(path):
        found = [ckpt.open_checkpoint(path)]
    elif ckpt.holds_run(path):
        found = ckpt.checkpoints(path)
    else:
        raise FileFormatError(f"{path}: neither a run directory, a {ckpt.CHECKPOINTS}/step-NNNNNNNN directory nor a "
                              f"{ckpt.LEGACY_CHECKPOINT}")
    return [c for c in found if c.pickled]


def _write_beside(root: Path, step: int, parts: dict[str, dict[str, Any]], meta: dict[str, Any]) -> Path:
    """A current checkpoint of `step` written into a hidden directory of `root` (renamed into place by the caller)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step-{step:08d}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ckpt.write_directory(tmp, step, parts, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def convert_one(c: ckpt.Checkpoint) -> tuple[Path, Path]:
    """Convert one pickled checkpoint; returns (the new checkpoint, where its pickles are kept)."""
    if c.manifest is None:
        parts, meta, step = _read_legacy(c.path)
        root = c.path.parent / ckpt.CHECKPOINTS
        final = root / _step_name(step)
        if final.exists():
            raise FileFormatError(f"{c.path}: {final} exists already; move one of them away and convert again")
        kept = c.path.with_name(c.path.name + PICKLED)
    else:
        parts, meta = _read_format1(c)
        step, root, final = c.step, c.path.parent, c.path
        kept = c.path.with_name(c.path.name + PICKLED)
    if kept.exists():
        raise FileFormatError(f"{c.path}: {kept} exists already (an earlier conversion?); move it away and convert again")
    tmp = _write_beside(root, step, parts, meta)
    # the pickles go aside first, then the new checkpoint takes the step's place: a crash between the two renames
    # leaves the pickles kept and the new checkpoint in a hidden directory, never a half-converted step
    os.rename(c.path, kept)
    os.rename(tmp, final)
    fsync_dir(root)
    fsync_dir(kept.parent)
    return final, kept


def convert(path: str | Path) -> list[tuple[Path, Path]]:
    """Convert every pickled checkpoint `path` names (see the module docstring); returns (new, kept) pairs."""
    return [convert_one(c) for c in pickled_checkpoints(path)]
