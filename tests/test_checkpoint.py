"""`kvpop.train.checkpoint`: no crash inside a save loses a checkpoint, parts are verified and hold data only, pickled
checkpoints of earlier versions are refused and converted on request, the log and `--out` are guarded."""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

import kvpop
from helpers import assert_same_state
from kvpop.cli import main
from kvpop.files import FileFormatError
from kvpop.train import checkpoint as ckpt
from kvpop.train import distill
from kvpop.train.distill import TrainConfig, TrainingError

KCFG = dict(sink=2, window=8, topk=16, scorer_hidden=32)


class Crash(Exception):
    """Stands for the process dying at that point: nothing after it runs."""


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    path = tmp_path_factory.mktemp("data") / "notes.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(300)) for _ in range(40)))
    return path


def _cfg(text_file, out, **kw) -> TrainConfig:
    base = dict(model="tiny-random-qwen3", data=str(text_file), seq_len=128, steps=6, batch_size=2, out=str(out),
                save_every=2, lr_scorer=1e-2, max_tokens=128 * 16, freeze_base=True)
    return TrainConfig(**{**base, **kw})


def _losses(out) -> list[tuple[float, float]]:
    return [(r["loss_score"], r["loss_kl"]) for r in ckpt.read_log(out)]


@pytest.fixture(scope="module")
def straight(text_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    distill.train(_cfg(text_file, out), kvpop.KVpopConfig(**KCFG), progress=False)
    return out


def _in_save_of_step_4(path) -> bool:
    return "step-00000004" in str(path)


# where the save of step 4 dies; the checkpoints complete after the crash
CRASHES = {
    "between the parts": [2],
    "before the manifest": [2],
    "before the rename": [2],
    "before the older one is removed": [2, 4],
}


@pytest.mark.parametrize("where", CRASHES)
def test_a_crash_inside_a_save_loses_no_checkpoint(text_file, tmp_path, monkeypatch, straight, where):
    kcfg = kvpop.KVpopConfig(**KCFG)
    out = tmp_path / "run"
    real_part, real_manifest, real_rename, real_prune = ckpt._write_part, ckpt._write_manifest, os.rename, ckpt._prune

    def part(path, obj):
        # the model part is written, the training state is not
        if _in_save_of_step_4(path) and path.name == "train_state":
            raise Crash(where)
        return real_part(path, obj)

    def manifest(path, m):
        if _in_save_of_step_4(path):
            raise Crash(where)
        real_manifest(path, m)

    def rename(src, dst):
        if _in_save_of_step_4(src) and ".partial" in str(src):
            raise Crash(where)
        real_rename(src, dst)

    def prune(run, keep, *rest):
        if keep.step == 4:
            raise Crash(where)
        real_prune(run, keep, *rest)

    patch = {"between the parts": ("_write_part", part), "before the manifest": ("_write_manifest", manifest),
             "before the rename": None, "before the older one is removed": ("_prune", prune)}[where]
    if patch is None:
        monkeypatch.setattr(ckpt.os, "rename", rename)
    else:
        monkeypatch.setattr(ckpt, *patch)
    with pytest.raises(Crash):
        distill.train(_cfg(text_file, out), kcfg, progress=False)
    monkeypatch.undo()

    found = ckpt.checkpoints(out)
    # none lost: the last checkpoint complete before the crash is there, whole, and nothing half-written counts
    assert [c.step for c in found] == CRASHES[where]
    for c in found:
        assert c.read()["step"] == c.step
    assert ckpt.latest(out).step == CRASHES[where][-1]

    distill.train(_cfg(text_file, out), kcfg, resume=True, progress=False)
    assert _losses(out) == _losses(straight)
    a, b = kvpop.load(straight / "final"), kvpop.load(out / "final")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name
    # the next complete save removed the older checkpoints and the partial one
    assert [c.step for c in ckpt.checkpoints(out)] == [6]
    assert [p.name for p in (out / ckpt.CHECKPOINTS).iterdir()] == ["step-00000006"]


def _saved(tmp_path) -> ckpt.Checkpoint:
    parts = {"model": {"model": {"w": torch.arange(6.0)}}, "train_state": {"step": 3, "optimizer": {},
                                                                           "scheduler": {}, "rng": {}}}
    return ckpt.write(tmp_path, 3, parts, {"train_config": {}, "kvpop_config": {}})


@pytest.mark.parametrize("damage,message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), "bytes, but the manifest records"),
    (lambda p: p.write_bytes(b"\0" * p.stat().st_size), "SHA-256 differs"),
    (lambda p: p.unlink(), "a part of the checkpoint is missing"),
])
@pytest.mark.parametrize("file", ["model.safetensors", "model.json"])
def test_a_damaged_part_is_named(tmp_path, damage, message, file):
    c = _saved(tmp_path)
    assert torch.equal(c.read()["model"]["w"], torch.arange(6.0))
    damage(c.path / file)
    with pytest.raises(FileFormatError, match=message) as err:
        ckpt.latest(tmp_path).read()
    assert str(c.path / file) in str(err.value)


@pytest.mark.parametrize("content", ["", "{", "[1, 2]", '{"format": 1}', '{"format": 2, "step": 3, "parts": {}}',
                                     '{"format": 2, "step": 3, "parts": {"../../x.json": {"bytes": 1, "sha256": ""}}}'])
def test_a_damaged_manifest_is_named(tmp_path, content):
    c = _saved(tmp_path)
    (c.path / ckpt.MANIFEST).write_text(content)
    with pytest.raises(FileFormatError, match="manifest") as err:
        ckpt.latest(tmp_path)
    assert str(c.path / ckpt.MANIFEST) in str(err.value)


def test_a_checkpoint_holds_data_only(straight):
    # JSON and safetensors (an 8-byte header length, then a JSON header): no file of a checkpoint is a pickle
    c = ckpt.latest(straight)
    files = sorted(p.name for p in c.path.iterdir())
    assert files == ["manifest.json", "model.json", "model.safetensors", "train_state.json", "train_state.safetensors"]
    for name in files:
        raw = (c.path / name).read_bytes()
        if name.endswith(".json"):
            json.loads(raw)
        else:
            n = int.from_bytes(raw[:8], "little")
            assert isinstance(json.loads(raw[8 : 8 + n]), dict), name
    state = c.read()
    assert state["step"] == 6 and c.manifest["format"] == ckpt.FORMAT == 2
    # the types a restore needs come back as they were: integer keys, tuples, NumPy's uint32 array
    assert all(isinstance(k, int) for k in state["optimizer"]["state"])
    assert isinstance(state["optimizer"]["param_groups"][0]["betas"], tuple)
    assert isinstance(state["rng"]["python"], tuple) and state["rng"]["numpy"][1].dtype.name == "uint32"
    assert state["rng"]["torch"].dtype == torch.uint8


def _interrupted_at_step_4(text_file, out, monkeypatch):
    real = distill.Distiller.train_step

    def ctrl_c_at_step_5(self, micro):
        if self.step == 4:
            raise KeyboardInterrupt
        return real(self, micro)

    monkeypatch.setattr(distill.Distiller, "train_step", ctrl_c_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        distill.train(_cfg(text_file, out, save_every=0), kvpop.KVpopConfig(**KCFG), progress=False)
    monkeypatch.undo()
    return ckpt.latest(out).read()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_pickled(out: Path, state: dict, kind: str) -> Path:
    """The checkpoint of `state` as earlier kvpop versions wrote it (torch.save): one file, or format 1's parts."""
    shutil.rmtree(out / ckpt.CHECKPOINTS)
    meta = {k: state[k] for k in ("train_config", "kvpop_config", "world", "pool_tokens", "device_type", "data_sha256",
                                  "base", "init")}
    if kind == "single file":
        torch.save({**meta, **{k: state[k] for k in ("step", "model", "optimizer", "scheduler", "rng")}},
                   out / ckpt.LEGACY_CHECKPOINT)
        return out / ckpt.LEGACY_CHECKPOINT
    step = out / ckpt.CHECKPOINTS / f"step-{state['step']:08d}"
    step.mkdir(parents=True)
    torch.save({"model": state["model"]}, step / "model.pt")
    torch.save({k: state[k] for k in ("step", "optimizer", "scheduler", "rng")}, step / "train_state.pt")
    parts = {n: {"bytes": (step / n).stat().st_size, "sha256": _sha(step / n)} for n in ("model.pt", "train_state.pt")}
    (step / ckpt.MANIFEST).write_text(json.dumps({"format": 1, "step": state["step"], **meta, "parts": parts}))
    return step


@pytest.mark.parametrize("kind", ["single file", "format 1"])
def test_a_pickled_checkpoint_is_refused_then_converted_and_resumes_exactly(text_file, tmp_path, monkeypatch, capsys,
                                                                           straight, kind):
    # a run interrupted under an earlier kvpop's pickled format goes on where it stopped, once converted
    out = tmp_path / "run"
    state = _interrupted_at_step_4(text_file, out, monkeypatch)
    pickled = _write_pickled(out, state, kind)
    before = {p: _sha(p) for p in pickled.rglob("*") if p.is_file()} if pickled.is_dir() else {pickled: _sha(pickled)}
    kcfg = kvpop.KVpopConfig(**KCFG)
    with pytest.raises(FileFormatError, match=r"pickles; kvpop no longer unpickles .* `kvpop convert-checkpoint "):
        distill.train(_cfg(text_file, out), kcfg, resume=True, progress=False)
    assert {p: _sha(p) for p in before} == before, "a refused checkpoint is left as it was"
    assert main(["convert-checkpoint", str(out)]) == 0
    err = capsys.readouterr().err
    kept = pickled.with_name(pickled.name + ".pickled")
    assert f"wrote {out / ckpt.CHECKPOINTS / 'step-00000004'}" in err and str(kept) in err
    # the pickles are kept beside, unchanged, where kvpop no longer looks
    assert {p: _sha(kept / p.relative_to(pickled)) if kept.is_dir() else _sha(kept) for p in before} == before
    assert [c.step for c in ckpt.checkpoints(out)] == [4] and not ckpt.latest(out).pickled
    converted = ckpt.latest(out).read()
    for key in ("model", "optimizer", "scheduler", "rng"):
        assert_same_state(converted[key], state[key], key)
    assert main(["convert-checkpoint", str(out)]) == 0
    assert "nothing to convert" in capsys.readouterr().err
    distill.train(_cfg(text_file, out), kcfg, resume=True, progress=False)
    assert _losses(out) == _losses(straight)


def test_a_torn_last_log_line_is_cut_off_and_said(tmp_path, capsys):
    log = tmp_path / ckpt.LOG
    rows = [{"step": i, "loss": 0.5} for i in (1, 2, 3)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    with pytest.raises(FileFormatError, match="last line was cut off") as err:
        ckpt.read_log(tmp_path)
    assert str(log) in str(err.value)
    ckpt.trim_log(tmp_path, 2)
    assert "cut off" in capsys.readouterr().err
    assert ckpt.read_log(tmp_path) == rows[:2]
    # a damaged line that is not the last is no crash's doing: an error naming the line, not a repair
    log.write_text(json.dumps(rows[0]) + "\nnot json\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(FileFormatError, match="line 2"):
        ckpt.trim_log(tmp_path, 2)


def test_out_guard(tmp_path):
    out = tmp_path / "run"
    assert ckpt.check_out(out, resume=False, overwrite=False) is None  # new directory
    out.mkdir()
    (out / "notes.md").write_text("mine")
    assert ckpt.check_out(out, resume=False, overwrite=False) is None  # holds no run
    with pytest.raises(TrainingError, match="no complete checkpoint"):
        ckpt.check_out(out, resume=True, overwrite=False)
    (out / ckpt.LOG).write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(TrainingError, match=r"holds a run \(train_log.jsonl up to step 1\).*--resume.*--overwrite"):
        ckpt.check_out(out, resume=False, overwrite=False)
    with pytest.raises(TrainingError, match="not both"):
        ckpt.check_out(out, resume=True, overwrite=True)
    assert ckpt.check_out(out, resume=False, overwrite=True) is None
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainingError, match="is a file"):
        ckpt.check_out(tmp_path / "file", resume=False, overwrite=False)


def test_move_aside_and_restore_keep_other_files_in_place(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ckpt.LOG).write_text(json.dumps({"step": 1}) + "\n")
    (out / "study.log").write_text("a wrapper's log\n")
    with open(out / "study.log", "a") as held:  # a file a wrapper holds open keeps receiving its lines
        aside = ckpt.move_aside(out)
        held.write("more\n")
    assert sorted(p.name for p in out.iterdir()) == ["study.log"]
    assert (out / "study.log").read_text() == "a wrapper's log\nmore\n"
    assert (aside / ckpt.LOG).exists()
    (out / ckpt.LOG).write_text("new run\n")
    ckpt.restore(out, aside)
    assert not aside.exists()
    assert sorted(p.name for p in out.iterdir()) == ["study.log", ckpt.LOG]
    assert ckpt.read_log(out) == [{"step": 1}]
    assert "back in" in capsys.readouterr().err


def test_keep_every_keeps_those_checkpoints_across_a_resume(text_file, tmp_path, monkeypatch, straight):
    # a long scorer-only run over several commands keeps every 2nd checkpoint for a curve; the others go as before
    kcfg = kvpop.KVpopConfig(**KCFG)
    out = tmp_path / "run"
    real = distill.Distiller.train_step

    def ctrl_c_at_step_4(self, micro):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self, micro)

    monkeypatch.setattr(distill.Distiller, "train_step", ctrl_c_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        distill.train(_cfg(text_file, out, save_every=0, keep_every=2), kcfg, progress=False)
    monkeypatch.undo()
    assert [c.step for c in ckpt.checkpoints(out)] == [2, 3]
    distill.train(_cfg(text_file, out, save_every=0, keep_every=2), kcfg, resume=True, progress=False)
    assert _losses(out) == _losses(straight)
    assert [c.step for c in ckpt.checkpoints(out)] == [2, 4, 6]
    assert ckpt.latest(out).read()["model"].keys() == ckpt.checkpoints(out)[0].read(parts=("model",))["model"].keys()
