"""`kvpop.pretrained`: trained scorers shipped inside the package for a preset, the export that writes them, and
the commands that run them by default (a shipped directory for the tiny preset is built here, in a stand-in root)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import kvpop
from helpers import quiet
from kvpop import pretrained
from kvpop.cli import main
from kvpop.retrofit import SCORERS_FILE, read_config, read_layout

ROOT = Path(__file__).resolve().parents[1]
PRESET = "tiny-random-qwen3"
COMMAND = ["kvpop", "train", "--model", PRESET, "--freeze-base", "--steps", "2"]
SUMMARY = re.compile(r"cache: \d+ of (\d+) slots per layer and KV head")


def _retrofitted(name: str = PRESET):
    from kvpop.models import load_model

    model, _ = load_model(name)
    model = kvpop.retrofit(model, kvpop.KVpopConfig(sink=2, window=6, topk=12, scorer_hidden=16))
    with torch.no_grad():  # sharper than the random init, so that eviction differs between scorers
        for policy in model.kvpop.layers:
            policy.scorer.w2.mul_(4.0)
    return model


def _run(tmp: Path, model, *, base_weights: bool = False) -> Path:
    """A finished run's directory as `kvpop train` leaves it: its command in config.json, the model in final/."""
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps({"command": COMMAND}))
    return kvpop.save(model, tmp / "final", base_weights=base_weights)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """The package's shipped directories, moved to a fresh directory for the test."""
    monkeypatch.setattr(pretrained, "ROOT", tmp_path / "pretrained")
    return tmp_path / "pretrained"


@pytest.fixture
def shipped(root, tmp_path):
    model = _retrofitted()
    final = _run(tmp_path / "run", model)
    return pretrained.export(final, PRESET, note="test weights"), model


def test_shipped_finds_only_complete_directories_of_presets(root, shipped):
    path, _ = shipped
    assert path == root / PRESET
    assert pretrained.available() == [PRESET] and pretrained.shipped(PRESET) == path
    for other in ("tiny-random-llama", "nope", "../pretrained", ".tiny"):
        assert pretrained.shipped(other) is None, other
    (path / SCORERS_FILE).unlink()
    assert pretrained.shipped(PRESET) is None and pretrained.available() == []


def test_export_writes_bfloat16_scorers_with_their_recipe(shipped):
    from safetensors.torch import load_file

    path, model = shipped
    stored = load_file(str(path / SCORERS_FILE))
    want = model.kvpop.state_dict()
    assert stored.keys() == want.keys()
    for name, value in stored.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, want[name].to(torch.bfloat16)), name
    layout = read_layout(path)
    assert not layout.base_weights and layout.base == {"preset": PRESET}
    record = read_config(path).extra["shipped"]
    assert record["recipe"] == " ".join(COMMAND) and record["dtype"] == "bfloat16" and record["note"] == "test weights"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    line = pretrained.describe(path)
    assert str(path) in line and " ".join(COMMAND) in line and record["date"] in line and "test weights" in line
    # the shipped scorers run in float32, as bfloat16 values: the same model up to that rounding
    loaded = kvpop.load(path)
    for name, value in loaded.kvpop.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, want[name].to(torch.bfloat16).float()), name
    assert {p.name for p in path.iterdir()} == {"kvpop_config.json", "kvpop_scorers.safetensors", "kvpop_base.json",
                                                "kvpop_format.json"}
    # the config is the one trained (the static rule): loading runs the recommended policy, as loading the run does,
    # and the demo moves it to its budgets
    saved = read_config(path)
    assert saved.static_mlp and saved.budget == model.kvpop.config.budget
    assert loaded.kvpop.config == saved.recommended()
    assert saved.at_budget(8).budget == 8


def test_export_refuses_weights_it_cannot_ship(root, tmp_path, shipped):
    with pytest.raises(ValueError, match="exists: pass force=True"):
        pretrained.export(tmp_path / "run" / "final", PRESET)
    assert pretrained.export(tmp_path / "run" / "final", PRESET, force=True, note="again") == root / PRESET
    assert read_config(root / PRESET).extra["shipped"]["note"] == "again"
    other = _run(tmp_path / "llama", _retrofitted("tiny-random-llama"))
    with pytest.raises(ValueError, match="trained on the preset tiny-random-llama, not the preset tiny-random-qwen3"):
        pretrained.export(other, PRESET, tmp_path / "out")
    with pytest.raises(ValueError, match="preset 'nope' is not one of"):
        pretrained.export(other, "nope", tmp_path / "out")
    distilled = _retrofitted()
    with torch.no_grad():
        distilled.model.layers[0].mlp.up_proj.weight.add_(0.01)
    full = _run(tmp_path / "distilled", distilled, base_weights=True)
    with pytest.raises(ValueError, match=r"holds base weights that are not the preset tiny-random-qwen3's "
                                         r"\(.*model.layers.0.mlp.up_proj.weight.*\).*--freeze-base"):
        pretrained.export(full, PRESET, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a full save of the unchanged base (written whole by an older kvpop) ships as well
    unchanged = _run(tmp_path / "whole", _retrofitted(), base_weights=True)
    out = pretrained.export(unchanged, PRESET, tmp_path / "out")
    assert not read_layout(out).base_weights


def _notes(tmp_path: Path) -> Path:
    """Forty short documents (a held-out split of four)."""
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": f"note {i}: the cache keeps what the scorer ranks highest. " * 8}) + "\n"
                            for i in range(40)))
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_runs_the_shipped_scorers_of_a_preset_and_says_so(shipped, capsys):
    path, model = shipped
    prompt = ("The bounded cache keeps sinks, a window and the best older tokens. " * 2,)
    args = ("--prompt", *prompt, "--max-new-tokens", "8", "--device", "cpu")
    rc, out, err = _cli(capsys, "generate", "--model", PRESET, *args)
    assert rc == 0, err
    line = next(x for x in err.splitlines() if "shipped trained scorers" in x)
    assert f"{PRESET} runs its shipped trained scorers at budget 20" in line and str(path) in line
    assert " ".join(COMMAND) in line and "--scorers untrained" in line
    assert SUMMARY.search(err).group(1) == "20"
    # what --model with the directory itself generates
    rc, same, err_dir = _cli(capsys, "generate", "--model", str(path), *args)
    assert rc == 0 and same == out and "shipped trained scorers" not in err_dir
    rc, _, err = _cli(capsys, "generate", "--model", PRESET, "--scorers", "untrained", "--budget", "24", *args)
    assert rc == 0 and "shipped" not in err and "untrained (random)" in err and SUMMARY.search(err).group(1) == "24"
    rc, _, err = _cli(capsys, "generate", "--model", "tiny-random-llama", "--scorers", "shipped", *args)
    assert rc == 1 and (f"kvpop generate: error: --scorers shipped: --model tiny-random-llama ships no trained "
                        f"scorers (presets that do: {PRESET})") in err
    rc, _, err = _cli(capsys, "generate", "--model", PRESET, "--base", "tiny-random-llama", *args)
    assert rc == 1 and "but the base model tiny-random-llama is another model" in err


def test_generate_without_shipped_scorers_retrofits_random_ones(root, capsys):
    rc, _, err = _cli(capsys, "generate", "--model", PRESET, "--prompt", "Hello there, cache.", "--max-new-tokens",
                      "4", "--budget", "16", "--device", "cpu")
    assert rc == 0 and "shipped" not in err and "untrained (random)" in err


def test_eval_takes_the_shipped_scorers_as_a_trained_row(shipped, tmp_path, capsys):
    text = _notes(tmp_path)
    rc, out, err = _cli(capsys, "eval", "--model", PRESET, "--trained", "shipped", "--policies", "kvpop",
                        "--budgets", "20", "--data", str(text), "--seq-len", "96", "--sequences", "1",
                        "--out", str(tmp_path / "eval"), "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "--trained shipped: " + str(shipped[0]) in err and "--trained shipped: those shipped for it" in err
    rows = json.loads((tmp_path / "eval" / "results.json").read_text())["rows"]
    assert [r["policy"] for r in rows].count("shipped") == 1, [r["policy"] for r in rows]


def test_ship_scorers_reports_sizes_and_bfloat16_agreement(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ship_scorers", ROOT / "bench" / "ship_scorers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    final = _run(tmp_path / "run", _retrofitted())
    text = _notes(tmp_path)
    with quiet():
        assert module.main([str(final), "--preset", PRESET, "--out", str(tmp_path / "out"), "--data", str(text),
                            "--seq-len", "128", "--rows", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["total_bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    assert result["bytes"][SCORERS_FILE] < (final / SCORERS_FILE).stat().st_size * 0.6
    # 2 layers x 2 KV heads; tokens 2..127 decided by the queries from 6 positions on
    assert result["tokens"] == 2 * 2 * 128 and result["positions"] == 128 - 20
    assert result["decisions"] == 2 * 2 * sum(128 - t - 6 for t in range(2, 122))
    # bfloat16 rounding moves some decisions of this tiny random model (its logits are far from flat)
    for key in ("retention_agreement", "eviction_time_agreement", "top1_agreement"):
        assert 0.5 < result[key] <= 1, (key, result)
    assert 0 <= result["mean_kl"] < 0.1
    # the measure itself: a model agrees with itself everywhere
    model = kvpop.load(final, rule="static")
    rows = torch.randint(3, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    same = module.compare(model, model, rows)
    assert same["retention_agreement"] == same["eviction_time_agreement"] == same["top1_agreement"] == 1
    assert same["mean_kl"] == 0


def test_the_package_data_carries_a_shipped_directory():
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # python >= 3.11
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvpop"]
    for name in ("kvpop_config.json", "kvpop_scorers.safetensors", "kvpop_base.json", "kvpop_format.json"):
        assert any(fnmatch.fnmatch(f"pretrained/smollm2-135m/{name}", p) for p in patterns), name


def test_smollm2_ships_trained_scorers():
    from kvpop import smollm2

    path = pretrained.shipped("smollm2-135m")
    assert path is not None, f"no trained scorers for smollm2-135m in {pretrained.ROOT}"
    assert (path / SCORERS_FILE).stat().st_size < 8e6
    record = read_config(path).extra["shipped"]
    assert record["recipe"] and record["date"] and record["dtype"] == "bfloat16"
    if not smollm2.available():
        pytest.skip(f"smollm2-135m cannot be loaded here: {smollm2.install_command()}")
    saved = read_config(path)
    assert saved.static_mlp, f"{path}: its config must be the static rule it was trained for (bench/ship_scorers.py)"
    model = kvpop.load(path)
    assert model.kvpop.config == saved.recommended()
    ids = torch.arange(100, 400)[None]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
