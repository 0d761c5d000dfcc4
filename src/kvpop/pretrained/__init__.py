"""Trained scorer weights that ship inside the package, one directory per preset that has them.

    kvpop generate --model smollm2-135m --prompt "The capital of France is"   # the shipped scorers
    model = kvpop.load(kvpop.pretrained.shipped("smollm2-135m"))

Each is an adapter directory (`kvpop.save(..., base_weights=False)`): bfloat16 scorers, the KVpop
config (its `extra["shipped"]` records the training command and date) and the identity of the preset
it was trained on, whose weights it loads. `export` turns a `kvpop train --freeze-base` run's
`OUT/final` into one (`bench/ship_scorers.py` is its command).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).parent
"""Where the shipped directories live: `ROOT / <preset>`."""
DTYPE = torch.bfloat16
"""The dtype the shipped scorers are stored in (they run in float32, as every scorer does)."""


def _complete(path: Path) -> bool:
    from kvpop.retrofit import CONFIG_FILE, SCORERS_FILE

    return (path / CONFIG_FILE).is_file() and (path / SCORERS_FILE).is_file()


def available() -> list[str]:
    """The presets that ship trained scorers."""
    if not ROOT.is_dir():
        return []
    return sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_")) and _complete(p))


def shipped(preset: str) -> Path | None:
    """The directory of the trained scorers shipped for `preset`, or None where it ships none."""
    return ROOT / preset if preset in available() else None


def describe(path: str | Path) -> str:
    """One line on a shipped directory: where it is, how its scorers were trained, and when."""
    from kvpop.retrofit import read_config

    record = read_config(path).extra.get("shipped", {})
    recipe = record.get("recipe") or "recipe not recorded"
    note = f"; {record['note']}" if record.get("note") else ""
    return f"{path} (trained {record.get('date', 'on an unrecorded date')}: {recipe}{note})"


def _run_command(final: Path) -> str | None:
    """The command of the run whose `OUT/final` this is, from its `OUT/config.json`."""
    try:
        command = json.loads((final.parent / "config.json").read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        return None
    return " ".join(command) if isinstance(command, list) else command if isinstance(command, str) else None


def _check_frozen(final: Path, preset: str, model: torch.nn.Module) -> None:
    """Refuse weights whose base is not `preset` as it ships: the shipped directory loads the preset's weights."""
    from kvpop.models import load_model
    from kvpop.retrofit import base_identity, read_layout, same_base

    layout = read_layout(final)
    if not layout.base_weights:
        if layout.base != {"preset": preset}:
            raise ValueError(f"{final} was trained on {layout.describe_base()}, not the preset {preset}")
        return
    # a full save: shippable only where the base it holds is the preset's, unchanged
    base, _ = load_model(preset)
    why = same_base(base_identity(base), base_identity(model))
    mine = {k: v for k, v in model.state_dict().items() if not k.startswith("kvpop.")}
    theirs = base.state_dict()
    changed = why or next((k for k, v in mine.items() if k not in theirs or not torch.equal(v, theirs[k].to(v))), None)
    if changed:
        raise ValueError(f"{final} holds base weights that are not the preset {preset}'s ({changed}): shipped "
                         "scorers must be trained with the base frozen (kvpop train --freeze-base)")


def export(final: str | Path, preset: str, out: str | Path | None = None, *, recipe: str | None = None,
           date: str | None = None, note: str | None = None, force: bool = False) -> Path:
    """Write the scorers of a trained directory as the shipped directory of `preset`.

    Args:
        final: a `kvpop.save` directory trained on `preset` with the base frozen (`kvpop train --freeze-base`'s
            `OUT/final`); its base must be the preset's, unchanged.
        out: where to write (default `ROOT / preset`, inside the package); an existing one needs `force`.
        recipe: how the scorers were trained (default: the run's command, from `OUT/config.json`).
        date: when (default: the day `final` was written, UTC, ISO format).
        note: anything a user should know about these weights, shown with them.
    Returns:
        the directory written: bfloat16 scorers, the config with `extra["shipped"]`, the base's identity.
    """
    import kvpop
    from kvpop.models import PRESETS
    from kvpop.retrofit import CONFIG_FILE, kvpop_modules

    final = Path(final)
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    if not (final / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{final} is not a complete kvpop.save directory ({CONFIG_FILE} is missing)")
    out = ROOT / preset if out is None else Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} exists: pass force=True (--force) to replace it")
    # the config as trained (a KVpop-mlp's static rule), so that loading the shipped directory applies the same
    # default rule as loading the run itself (`KVpopConfig.for_rule`), and `at_budget` can move it to other budgets
    model = kvpop.load(final, device="cpu", rule="static")
    _check_frozen(final, preset, model)
    mods = kvpop_modules(model)
    if date is None:
        written = (final / CONFIG_FILE).stat().st_mtime
        date = datetime.datetime.fromtimestamp(written, datetime.timezone.utc).date().isoformat()
    record: dict[str, Any] = {"recipe": recipe or _run_command(final), "date": date,
                              "dtype": str(DTYPE).removeprefix("torch.")}
    if note:
        record["note"] = note
    mods.config = dataclasses.replace(mods.config, extra={**mods.config.extra, "shipped": record})
    # named by the preset, not by the directory it was read from on the training machine
    mods.base = {**mods.base, "name": preset}
    mods.to(DTYPE)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        kvpop.save(model, work / "new", base_weights=False, base=preset)
        if out.exists():
            os.rename(out, work / "old")
        os.rename(work / "new", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
