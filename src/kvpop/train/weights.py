"""Trained weights read back from a run: where a new run starts (`kvpop train --init-from`) and what a
curve over a run's checkpoints evaluates (`bench/recall_curve.py`).

    OUT                              a run directory: its newest complete checkpoint (a finished run's last step)
    OUT/checkpoints/step-00000600    that checkpoint
    OUT/final, any kvpop.save dir    its scorers and base weights (an adapter's: its scorers only)

A checkpoint holds what its run trained: the scorers (DMS: its gates) and, unless the run froze the
base (`--freeze-base`), the base weights; a `kvpop.save` directory holds both, or the scorers alone
where it was saved without base weights. `model_with` puts them on a copy of the base model they
were trained from.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from kvpop.config import KVpopConfig
from kvpop.files import FileFormatError
from kvpop.retrofit import CONFIG_FILE, base_identity, load, read_base, read_config, retrofit, same_base
from kvpop.train import checkpoint as ckpt

SCORERS = "kvpop."
"""The prefix of the scorer (and DMS gate) weights in a retrofitted model's state dict."""


@dataclass(frozen=True)
class TrainedWeights:
    """The weights of one checkpoint or `kvpop.save` directory, with what identifies them."""

    path: Path
    """What was read: a checkpoint (step directory or legacy `checkpoint.pt`) or a `kvpop.save` directory."""
    run: Path | None
    """The run directory the checkpoint belongs to; None for a `kvpop.save` directory."""
    step: int | None
    """Optimizer steps behind the weights; None for a `kvpop.save` directory (it records none)."""
    config: KVpopConfig
    """The resolved config the weights were trained at."""
    base: dict[str, Any] | None
    """The identity of the base model they were trained from (`kvpop.retrofit.base_identity`); None if unrecorded."""
    state: dict[str, Tensor]
    """`kvpop.*` weights, and the base weights where the source holds them (a frozen base's are not in a checkpoint)."""
    init: dict[str, Any] | None
    """Where the source's own run started from (its `--init-from` record), or None."""

    @property
    def holds_base(self) -> bool:
        return any(not k.startswith(SCORERS) for k in self.state)

    def record(self) -> dict[str, Any]:
        """What a run started from these weights records about them (JSON)."""
        return {"path": str(self.path.resolve()), "run": None if self.run is None else str(self.run.resolve()),
                "step": self.step, "init": self.init}


def _locate(path: str | Path) -> ckpt.Checkpoint | Path:
    """The checkpoint `path` names (itself, or a run directory's newest), or the `kvpop.save` directory it is."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (a run directory, a checkpoint or a kvpop.save directory)")
    if (path / CONFIG_FILE).is_file():
        return path
    if ckpt.is_checkpoint(path):
        return ckpt.open_checkpoint(path)
    if ckpt.holds_run(path):
        last = ckpt.latest(path)
        if last is not None:
            return last
        if (path / ckpt.FINAL / CONFIG_FILE).is_file():
            return path / ckpt.FINAL
        raise FileFormatError(f"{path}: the run holds no complete checkpoint and no final model ({ckpt.describe(path)})")
    raise FileFormatError(f"{path}: neither a run directory, a checkpoint nor a kvpop.save directory")


def _config(state: dict[str, Any], where: Path) -> KVpopConfig:
    try:
        return KVpopConfig.from_dict(state["kvpop_config"])
    except (KeyError, TypeError, ValueError) as err:
        raise FileFormatError(f"{where}: holds no KVpop config this kvpop can read ({err})") from None


def source_config(path: str | Path) -> KVpopConfig:
    """The resolved config of the weights at `path`, read without the weights (a manifest or `kvpop_config.json`)."""
    found = _locate(path)
    if isinstance(found, Path):
        return read_config(found)
    if found.manifest is not None:
        return _config(found.manifest, found.path / ckpt.MANIFEST)
    return _config(found.read(), found.path)


def read_weights(path: str | Path) -> TrainedWeights:
    """The trained weights at `path`: a run directory (its newest checkpoint), a checkpoint or a `kvpop.save` directory."""
    found = _locate(path)
    if isinstance(found, Path):
        from kvpop.files import read_safetensors
        from kvpop.retrofit import SCORERS_FILE, read_layout

        # the saved config as it was trained (not the rule a load would run it under)
        config = read_config(found)
        if read_layout(found).base_weights:
            state = load(found, device="cpu", config=config).state_dict()
        else:
            # an adapter: the scorers alone, on the base `check_base` matches
            state = {SCORERS + k: v for k, v in read_safetensors(found / SCORERS_FILE, "the scorer weights").items()}
        return TrainedWeights(found, None, None, config, read_base(found), state, None)
    state = found.read(parts=("model.pt",))
    run = found.path.parent if found.manifest is None else found.path.parent.parent
    step = state.get("step", found.step)
    return TrainedWeights(found.path, run, step, _config(state, found.path), state.get("base"), state["model"],
                          state.get("init"))


def config_differences(mine: KVpopConfig, theirs: KVpopConfig) -> list[str]:
    """The fields in which two configs differ, each with both values: `topk 16 here, 8 there`."""
    return [f"{f.name} {getattr(mine, f.name)!r} here, {getattr(theirs, f.name)!r} there"
            for f in dataclasses.fields(KVpopConfig) if getattr(mine, f.name) != getattr(theirs, f.name)]


def check_base(weights: TrainedWeights, model: nn.Module, name: str) -> None:
    """Raise unless `weights` were trained from the base `model` (`name` says which, for the message)."""
    current = base_identity(model)
    if weights.base is None or current is None:
        return
    why = same_base(weights.base, current)
    if why is not None:
        raise ValueError(f"{weights.path} was trained from another base model than {name} ({why})")


def load_into(model: nn.Module, weights: TrainedWeights, state: dict[str, Tensor] | None = None) -> None:
    """Copy `state` (default: all of `weights.state`) into a model retrofitted at `weights.config`.

    Every scorer weight must be there; base weights not given keep the model's own.
    """
    state = weights.state if state is None else state
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:
        raise FileFormatError(f"{weights.path}: the weights do not fit the model ({err})") from None
    missing = [k for k in missing if k.startswith(SCORERS)]
    if missing or unexpected:
        raise FileFormatError(f"{weights.path}: the weights do not fit the model (missing {missing}, "
                              f"unexpected {unexpected})")


def model_with(base: nn.Module, weights: TrainedWeights, name: str = "the base model") -> nn.Module:
    """A copy of `base`, retrofitted at `weights.config` and holding `weights`, in eval mode.

    `base` must be the model the weights were trained from (its recorded identity is checked); it is
    left as it is.
    """
    check_base(weights, base, name)
    model = retrofit(copy.deepcopy(base), weights.config)
    load_into(model, weights)
    return model.eval()
