"""`kvpop train`: the losses fall, the final model loads, resume is exact, bad input is named, ranks agree."""

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvpop
from kvpop.cli import main
from kvpop.models import load_model
from kvpop.train import checkpoint as ckpt
from kvpop.train import distill
from kvpop.train.distill import TrainConfig, TrainingError, kl_divergence, scorer_lr_factor

KCFG = dict(sink=2, window=8, topk=16, scorer_hidden=32)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    docs = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(40)]
    path = tmp_path_factory.mktemp("data") / "notes.txt"
    path.write_text("\n\n".join(docs))
    return path


def _cfg(text_file, out, **kw) -> TrainConfig:
    base = dict(model="tiny-random-qwen3", data=str(text_file), seq_len=128, steps=6, batch_size=2, out=str(out),
                save_every=3, lr_scorer=1e-2, max_tokens=128 * 16)
    return TrainConfig(**{**base, **kw})


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]


def test_scorer_training_lowers_the_boundary_loss_and_saves_a_loadable_model(text_file, tmp_path):
    out = tmp_path / "run"
    final = distill.train(_cfg(text_file, out, steps=40, freeze_base=True, save_every=0),
                          kvpop.KVpopConfig(**KCFG), progress=False)
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 41))
    for key in ("loss_score", "loss_kl", "lr_base", "lr_scorer", "tokens_per_s", "keep_rate"):
        assert key in log[0]
    first = sum(r["loss_score"] for r in log[:5]) / 5
    last = sum(r["loss_score"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert log[-1]["accuracy"] > log[0]["accuracy"]
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["kvpop"]["topk"] == 16 and resolved["train"]["freeze_base"] is True
    model = kvpop.load(final)
    ids = torch.randint(0, 250, (1, 64))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("freeze_base", [True, False])
def test_resume_after_a_crash_continues_to_the_same_losses(text_file, tmp_path, monkeypatch, freeze_base):
    kcfg = kvpop.KVpopConfig(**KCFG)
    straight = tmp_path / "straight"
    distill.train(_cfg(text_file, straight, freeze_base=freeze_base), kcfg, progress=False)
    crashed = tmp_path / "crashed"
    real = distill.Distiller.train_step

    def crash_in_step_5(self, micro):
        if self.step == 4:
            raise RuntimeError("simulated crash")
        return real(self, micro)

    monkeypatch.setattr(distill.Distiller, "train_step", crash_in_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        distill.train(_cfg(text_file, crashed, freeze_base=freeze_base), kcfg, progress=False)
    monkeypatch.setattr(distill.Distiller, "train_step", real)
    distill.train(_cfg(text_file, crashed, freeze_base=freeze_base), kcfg, resume=True, progress=False)
    want, got = _log(straight), _log(crashed)
    # steps 4 (logged before the crash, then dropped on resume) to 6 come from the checkpoint of step 3
    assert [r["step"] for r in got] == list(range(1, 7))
    for a, b in zip(want, got):
        assert (a["loss_score"], a["loss_kl"]) == (b["loss_score"], b["loss_kl"])
    a = kvpop.load(straight / "final")
    b = kvpop.load(crashed / "final")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


# every trained row of the quality study: a run stopped at its deadline and resumed in the next device
# command must end where an uninterrupted one does (weights included)
RESUMED_ROWS = {"mlp": {}, "mlstm": dict(scorer="mlstm", mlstm_dim=8), "mlstm-delay0": dict(scorer="mlstm", mlstm_dim=8,
                delay=0), "dms": dict(policy="dms", scorer_hidden=None), "streaming_llm_plus": dict(policy="streaming_llm_plus", topk=0, scorer_hidden=None)}


@pytest.mark.parametrize("row", RESUMED_ROWS)
def test_interrupt_saves_and_resume_is_exact(text_file, tmp_path, monkeypatch, row):
    kcfg = kvpop.KVpopConfig(**{k: v for k, v in {**KCFG, **RESUMED_ROWS[row]}.items() if v is not None})
    straight = tmp_path / "straight"
    distill.train(_cfg(text_file, straight, save_every=0), kcfg, progress=False)
    out = tmp_path / "interrupted"
    real = distill.Distiller.train_step

    def ctrl_c_at_step_4(self, micro):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self, micro)

    monkeypatch.setattr(distill.Distiller, "train_step", ctrl_c_at_step_4)
    with pytest.raises(KeyboardInterrupt, match="step 3"):
        distill.train(_cfg(text_file, out, save_every=0), kcfg, progress=False)
    assert ckpt.latest(out).step == 3
    monkeypatch.setattr(distill.Distiller, "train_step", real)
    distill.train(_cfg(text_file, out, save_every=0), kcfg, resume=True, progress=False)
    assert [(r["loss_score"], r["loss_kl"]) for r in _log(out)] == [
        (r["loss_score"], r["loss_kl"]) for r in _log(straight)
    ]
    a, b = kvpop.load(straight / "final"), kvpop.load(out / "final")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), f"{row}: {name}"


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(text_file, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    calls = {"n": 0}

    def kl_nan_at_third_step(t, s, topk=0):
        calls["n"] += 1
        return torch.tensor(float("nan")) if calls["n"] == 3 else kl_divergence(t, s, topk)

    monkeypatch.setattr(distill, "kl_divergence", kl_nan_at_third_step)
    with pytest.raises(TrainingError, match=r"non-finite loss at step 3.*step 2\)"):
        distill.train(_cfg(text_file, out, save_every=2), kvpop.KVpopConfig(**KCFG), progress=False)
    assert ckpt.latest(out).read()["step"] == 2
    assert not (out / "final").exists()


def test_resume_refuses_a_different_run(text_file, tmp_path):
    out = tmp_path / "r"
    distill.train(_cfg(text_file, out, steps=2, freeze_base=True), kvpop.KVpopConfig(**KCFG), progress=False)
    with pytest.raises(TrainingError, match="seq_len"):
        distill.train(_cfg(text_file, out, seq_len=96, freeze_base=True), kvpop.KVpopConfig(**KCFG), resume=True,
                      progress=False)
    with pytest.raises(TrainingError, match="no complete checkpoint"):
        distill.train(_cfg(text_file, tmp_path / "none"), kvpop.KVpopConfig(**KCFG), resume=True, progress=False)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "/nonexistent/file.txt"], "does not exist"),
        (["--data", "EMPTY"], "empty"),
        (["--seq-len", "5000"], "max_position_embeddings=4096"),
        (["--seq-len", "64", "--window", "32", "--topk", "32"], "not below --seq-len 64"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--steps", "0"], "steps=0"),
    ],
)
def test_bad_input_is_a_clear_error(text_file, tmp_path, capsys, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    base = ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--window", "8",
            "--topk", "16", "--steps", "2", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(base + args) == 1
    assert message in capsys.readouterr().err


def test_kl_divergence():
    torch.manual_seed(0)
    t, s = torch.randn(2, 5, 50), torch.randn(2, 5, 50)
    assert kl_divergence(t, t).abs() < 1e-6
    want = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1).mean()
    assert torch.allclose(kl_divergence(t, s), want, atol=1e-6)
    # top-k: only the teacher's 10 best tokens, both sides renormalised over them
    idx = t.topk(10, -1).indices
    want10 = kl_divergence(t.gather(-1, idx), s.gather(-1, idx))
    assert torch.allclose(kl_divergence(t, s, topk=10), want10)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("topk", [0, 5])
def test_kl_divergence_chunks_equal_one_pass(chunk, topk):
    # chunked (and recomputed in backward) gives the one-pass value and gradient, ragged last chunk included
    torch.manual_seed(chunk + topk)
    t = torch.randn(2, 11, 40) * 3
    s1 = (torch.randn(2, 11, 40) * 3).requires_grad_()
    s2 = s1.detach().clone().requires_grad_()
    got = kl_divergence(t, s1, topk, chunk=chunk)
    want = distill._kl_rows_sum(t, s2, topk) / 22
    got.backward()
    want.backward()
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert torch.allclose(s1.grad, s2.grad, atol=1e-7, rtol=1e-5)


def test_scorer_schedule_warms_up_then_decays():
    f = [scorer_lr_factor(s, warmup=10, total=100) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] >= 0.1


def _torchrun(args, n):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
           str(29500 + random.Random().randint(1, 400)), "-m", "kvpop.cli", "train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("ranks", [2, 1])
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_gloo_ranks_match_one_process(text_file, tmp_path, sharding, ranks):
    # one rank under torchrun still builds the process group and wraps the model: the multi-GPU code path
    args = ["--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--window", "8", "--topk",
            "16", "--steps", "3", "--batch-size", "2", "--no-progress", "--max-tokens", str(128 * 8)]
    assert main(args[:0] + ["train", *args, "--out", str(tmp_path / "one")]) == 0
    _torchrun([*args, "--out", str(tmp_path / "two"), *(["--fsdp"] if sharding == "fsdp" else [])], ranks)
    one, two = _log(tmp_path / "one"), _log(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        assert a["loss_score"] == pytest.approx(b["loss_score"], abs=1e-5)
        assert a["loss_kl"] == pytest.approx(b["loss_kl"], abs=1e-5)
        # AdamW hides a gradient scaled by the number of ranks (a sum for a mean) from the losses: the norms do not
        for key in ("grad_norm_base", "grad_norm_scorer"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    assert (tmp_path / "two" / "final" / "kvpop_config.json").exists()
    run = json.loads((tmp_path / "two" / "config.json").read_text())
    assert (run["world_size"], run["parallel"], run["backend"]) == (ranks, "fsdp2" if sharding == "fsdp" else "ddp",
                                                                     "gloo")
    assert json.loads((tmp_path / "one" / "config.json").read_text())["parallel"] is None


@pytest.mark.parametrize("delay", [None, 0], ids=["delay=window", "delay=0"])
def test_mlstm_scorer_training_lowers_the_boundary_loss(text_file, tmp_path, delay):
    out = tmp_path / "run"
    kcfg = kvpop.KVpopConfig(**{**KCFG, "scorer": "mlstm", "mlstm_hidden": 32, "delay": delay})
    final = distill.train(_cfg(text_file, out, steps=20, freeze_base=True, save_every=0), kcfg, progress=False)
    log = _log(out)
    first = sum(r["loss_score"] for r in log[:5]) / 5
    last = sum(r["loss_score"] for r in log[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert sum(r["accuracy"] for r in log[-5:]) > sum(r["accuracy"] for r in log[:5])
    model = kvpop.load(final)
    assert model.kvpop.config == kcfg and model.kvpop.layers[0].scorer.delay == kcfg.readout_delay


def test_cli_trains_the_mlstm_scorer_and_reports_the_effective_topk(text_file, tmp_path, capsys):
    out = tmp_path / "o"
    common = ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--window", "8",
              "--topk", "16", "--steps", "2", "--out", str(out), "--no-progress", "--freeze-base", "--max-tokens",
              str(128 * 8), "--delay", "4"]
    assert main(common + ["--scorer", "mlstm", "--match-mlp-memory"]) == 0
    # head dim 16: the state costs ceil((16 * 16 + 16) / 32) = 9 KV entries
    assert "effective topk 7 = 16 - 9" in capsys.readouterr().err
    saved = json.loads((out / "final" / "kvpop_config.json").read_text())
    assert (saved["scorer"], saved["delay"], saved["topk"], saved["match_mlp_memory"]) == ("mlstm", 4, 7, False)
    assert json.loads((out / "config.json").read_text())["kvpop"]["topk"] == 7
    assert main(common + ["--scorer", "mlp"]) == 1
    assert "need --scorer mlstm" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{}, {"scorer_keys": "pre_rope", "evidence_mix": "additive"}], ids=["concat", "additive+pre_rope"])
def test_evidence_scorer_training_lowers_the_boundary_loss(text_file, tmp_path, extra):
    out = tmp_path / "run"
    kcfg = kvpop.KVpopConfig(**{**KCFG, "scorer": "evidence", **extra})
    final = distill.train(_cfg(text_file, out, steps=20, freeze_base=True, save_every=0), kcfg, progress=False)
    log = _log(out)
    first = sum(r["loss_score"] for r in log[:5]) / 5
    last = sum(r["loss_score"] for r in log[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert sum(r["accuracy"] for r in log[-5:]) > sum(r["accuracy"] for r in log[:5])
    assert kvpop.load(final).kvpop.config == kcfg


def test_cli_flags_of_the_evidence_scorer(text_file, tmp_path, capsys):
    out = tmp_path / "o"
    common = ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--window", "8",
              "--topk", "16", "--steps", "1", "--out", str(out), "--no-progress", "--freeze-base", "--max-tokens",
              str(128 * 8), "--query-fraction", "0.5"]
    assert main(common + ["--scorer", "evidence", "--scorer-keys", "pre_rope", "--evidence-mix", "additive"]) == 0
    saved = json.loads((out / "final" / "kvpop_config.json").read_text())
    assert (saved["scorer"], saved["scorer_keys"], saved["evidence_mix"]) == ("evidence", "pre_rope", "additive")
    assert main(common + ["--scorer", "mlstm", "--scorer-keys", "pre_rope"]) == 1
    assert "scorer_keys" in capsys.readouterr().err


def test_step_ranges_are_timed_and_nest(text_file, tmp_path):
    from kvpop.timing import RangeTimer

    d = distill.Distiller(_cfg(text_file, tmp_path, steps=2), kvpop.KVpopConfig(sink=2, window=8, topk=8))
    stream = d.batches()
    start = time.perf_counter()
    with RangeTimer("cpu") as timer:
        d.train_step(next(stream))
    wall_ms = (time.perf_counter() - start) * 1e3
    ms = timer.totals()
    expected = {"kvpop.teacher_forward", "kvpop.student_forward", "kvpop.scorer", "kvpop.rule",
                "kvpop.sparse_attention", "kvpop.kl", "kvpop.target", "kvpop.boundary_loss", "kvpop.backward",
                "kvpop.optimizer"}
    assert set(ms) == expected and all(v > 0 for v in ms.values())
    # the per-layer ranges run inside the student's forward; the top-level ranges fit in the step
    assert ms["kvpop.scorer"] + ms["kvpop.rule"] + ms["kvpop.sparse_attention"] < ms["kvpop.student_forward"]
    top = expected - {"kvpop.scorer", "kvpop.rule", "kvpop.sparse_attention"}
    assert sum(ms[n] for n in top) <= wall_ms
    # outside a timer the ranges record nothing
    d.train_step(next(stream))
    assert timer.totals() == ms


def test_sigterm_twice_stops_at_a_step_boundary_with_a_checkpoint(text_file, tmp_path):
    """Schedulers send SIGTERM and often repeat it: the run stops at a step boundary with an exact checkpoint."""
    import signal

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "kvpop.cli", "train", "--model", "tiny-random-qwen3", "--data", str(text_file),
           "--seq-len", "128", "--window", "8", "--topk", "16", "--steps", "100000", "--save-every", "0",
           "--no-progress", "--max-tokens", str(128 * 8), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = out / "train_log.jsonl"
    deadline = time.time() + 240
    while (not log.exists() or len(log.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    # 130: stopped by the first signal; a second one landing after the checkpoint, as the process
    # exits with its old handler back, may end it by SIGTERM instead - with nothing left to lose
    assert proc.returncode in (130, -signal.SIGTERM), err[-2000:]
    assert "checkpoint saved" in err
    steps = len(log.read_text().splitlines())
    assert ckpt.latest(out).read()["step"] == steps


@pytest.mark.parametrize("policy", [dict(scorer="mlp"), dict(scorer="mlstm", mlstm_hidden=16), dict(policy="dms")],
                         ids=["mlp", "mlstm", "dms"])
def test_deterministic_run_trains_the_same_and_restores_the_global_setting(text_file, tmp_path, policy):
    # the CPU kernels are deterministic already: --deterministic must change no number there, and must
    # find a deterministic kernel for every op of full distillation (one without raises)
    kcfg = kvpop.KVpopConfig(**{**KCFG, **policy})
    logs = []
    for flag in (False, True):
        distill.train(_cfg(text_file, tmp_path / str(flag), steps=2, save_every=0, deterministic=flag), kcfg,
                      progress=False)
        assert not torch.are_deterministic_algorithms_enabled()
        logs.append([(r["loss_kl"], r["loss_score"], r["grad_norm_base"]) for r in _log(tmp_path / str(flag))])
    assert logs[0] == logs[1]


def test_resume_with_more_steps_goes_on_over_the_same_documents(text_file, tmp_path):
    # without --max-tokens the packed documents follow --steps (3 steps: 1024 tokens, 6 steps: 1536); a run
    # extended by --resume keeps the documents, and their order, that it trained on
    kcfg = kvpop.KVpopConfig(**KCFG)
    rng = random.Random(1)
    words = text_file.read_text().split()[:200]
    records = tmp_path / "docs.jsonl"  # many short documents: the packed set grows with --steps
    records.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=60))}) + "\n" for _ in range(300)))
    short, longer = (_cfg(records, tmp_path / "run", steps=n, max_tokens=0, save_every=0) for n in (3, 6))
    assert short.pool_tokens < longer.pool_tokens
    distill.train(short, kcfg, progress=False)
    # (overwrite: a fresh run in the same --out, built but never run, so nothing is moved)
    trained_on = distill.Distiller(short, kcfg, overwrite=True).tokens
    resumed = distill.Distiller(longer, kcfg, resume=True)
    assert resumed.step == 3
    assert torch.equal(resumed.tokens, trained_on)
    assert len(distill.Distiller(longer, kcfg, overwrite=True).tokens) > len(trained_on)  # a fresh 6-step run packs more


# --- the run directory under mistakes and faults ---


def _argv(text_file, out, *extra) -> list[str]:
    return ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--window", "8",
            "--topk", "16", "--steps", "4", "--batch-size", "2", "--max-tokens", str(128 * 16), "--freeze-base",
            "--no-progress", "--out", str(out), *extra]


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _interrupted(monkeypatch, at_step: int) -> Callable:
    """Patch the trainer so that Ctrl-C comes during step `at_step + 1` (a checkpoint of `at_step` is saved)."""
    real = distill.Distiller.train_step

    def ctrl_c(self, micro):
        if self.step == at_step:
            raise KeyboardInterrupt
        return real(self, micro)

    monkeypatch.setattr(distill.Distiller, "train_step", ctrl_c)
    return real


def test_train_into_a_run_without_resume_or_overwrite_is_refused_and_changes_nothing(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_argv(text_file, out)) == 0
    before = _snapshot(out)
    assert {"train_log.jsonl", "config.json", "final/kvpop_config.json"} <= before.keys()
    capsys.readouterr()
    assert main(_argv(text_file, out, "--seed", "1")) == 1
    err = capsys.readouterr().err
    assert f"--out {out} holds a run" in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(out) == before


def test_forgetting_resume_after_an_interruption_keeps_the_checkpoint(text_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _interrupted(monkeypatch, 3)
    assert main(_argv(text_file, out, "--save-every", "0")) == 130
    monkeypatch.undo()
    assert ckpt.latest(out).step == 3
    capsys.readouterr()
    assert main(_argv(text_file, out, "--save-every", "0")) == 1
    assert "a checkpoint of step 3" in capsys.readouterr().err
    assert ckpt.latest(out).step == 3 and [r["step"] for r in ckpt.read_log(out)] == [1, 2, 3]
    assert main(_argv(text_file, out, "--save-every", "0", "--resume")) == 0
    assert f"resuming from step 3 of 4 ({out / 'checkpoints' / 'step-00000003'})" in capsys.readouterr().err
    assert [r["step"] for r in ckpt.read_log(out)] == [1, 2, 3, 4]


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(text_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(_argv(text_file, out)) == 0
    (out / "notes.md").write_text("not the run's: stays where it is")
    before = _snapshot(out)
    real = distill.Distiller.train_step

    def fail_in_step_1(self, micro):
        raise RuntimeError("simulated failure before the first checkpoint")

    monkeypatch.setattr(distill.Distiller, "train_step", fail_in_step_1)
    capsys.readouterr()
    assert main(_argv(text_file, out, "--overwrite", "--seed", "1")) == 1
    err = capsys.readouterr().err
    assert "simulated failure" in err and f"the previous run is back in {out}" in err
    assert _snapshot(out) == before
    monkeypatch.setattr(distill.Distiller, "train_step", real)
    assert main(_argv(text_file, out, "--overwrite", "--seed", "1")) == 0
    assert "removed the replaced run" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["train"]["seed"] == 1
    assert (out / "notes.md").read_text() == "not the run's: stays where it is"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing left aside


def test_resume_matches_paths_and_devices_however_spelled(text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text(text_file.read_text())
    real = _interrupted(monkeypatch, 2)
    assert main(_argv("notes.txt", "runs/x")) == 130
    monkeypatch.setattr(distill.Distiller, "train_step", real)
    capsys.readouterr()
    assert main(_argv("./notes.txt", "./runs/x", "--resume", "--device", "cpu")) == 0, capsys.readouterr().err
    assert "resuming from step 2" in capsys.readouterr().err


def test_a_moved_run_resumes_to_the_same_losses(text_file, tmp_path, capsys, monkeypatch):
    kcfg = kvpop.KVpopConfig(**KCFG)
    straight = tmp_path / "straight"
    distill.train(_cfg(text_file, straight, save_every=0), kcfg, progress=False)
    _interrupted(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        distill.train(_cfg(text_file, tmp_path / "first", save_every=0), kcfg, progress=False)
    monkeypatch.undo()
    # the run and its data both moved (another disk, another machine)
    os.rename(tmp_path / "first", tmp_path / "moved")
    data = tmp_path / "elsewhere.txt"
    data.write_text(text_file.read_text())
    distill.train(_cfg(data, tmp_path / "moved", save_every=0), kcfg, resume=True, progress=False)
    assert [(r["loss_score"], r["loss_kl"]) for r in _log(tmp_path / "moved")] == [
        (r["loss_score"], r["loss_kl"]) for r in _log(straight)]
    # the data are matched by content: other text under the old name is refused
    os.rename(tmp_path / "moved", tmp_path / "again")
    data.write_text(text_file.read_text().replace("cat", "dog"))
    with pytest.raises(TrainingError, match="the data changed"):
        distill.train(_cfg(data, tmp_path / "again", save_every=0, steps=8), kcfg, resume=True, progress=False)


def test_a_torn_last_log_line_is_cut_off_on_resume(text_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _interrupted(monkeypatch, 2)
    assert main(_argv(text_file, out, "--save-every", "0")) == 130
    monkeypatch.undo()
    with open(out / "train_log.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.12')  # the process died while writing this line
    capsys.readouterr()
    assert main(_argv(text_file, out, "--save-every", "0", "--resume")) == 0
    err = capsys.readouterr().err
    assert f"{out / 'train_log.jsonl'}: its last line was cut off" in err
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]


def test_train_from_a_kvpop_directory_refuses_another_config(text_file, tmp_path, capsys):
    from kvpop.models import load_model

    model, tok = load_model("tiny-random-qwen3")
    saved = tmp_path / "saved"
    kvpop.save(kvpop.retrofit(model, kvpop.KVpopConfig(**KCFG)), saved, tokenizer=tok)
    base = ["train", "--model", str(saved), "--data", str(text_file), "--seq-len", "128", "--steps", "1",
            "--max-tokens", str(128 * 8), "--freeze-base", "--no-progress"]
    for flags, named in ((["--budget", "30"], "--budget 30 (the directory has 26)"),
                         (["--window", "16"], "--window 16 (the directory has 8)"),
                         (["--scorer", "mlstm"], "--scorer mlstm (the directory has mlp)")):
        assert main(base + ["--out", str(tmp_path / "o"), *flags]) == 1
        err = capsys.readouterr().err
        assert "already retrofitted" in err and named in err
    # the flags it already has are no conflict
    assert main(base + ["--out", str(tmp_path / "ok"), "--budget", "26", "--sink", "2"]) == 0


@pytest.mark.parametrize("damage,message", [
    (lambda out: (out / "checkpoint.pt").write_bytes(b""), "checkpoint.pt: a single-file checkpoint of an earlier kvpop"),
    (lambda out: (out / "checkpoint.pt").write_bytes(b"\x80garbage"),
     "checkpoint.pt: a single-file checkpoint of an earlier kvpop, saved as pickles; kvpop no longer unpickles"),
    (lambda out: (ckpt.latest(out).path / "model.safetensors").write_bytes(b"garbage"),
     "model.safetensors: 7 bytes, but the manifest"),
])
def test_a_damaged_checkpoint_is_a_clear_error(text_file, tmp_path, capsys, damage, message):
    out = tmp_path / "run"
    assert main(_argv(text_file, out, "--steps", "2")) == 0
    if "checkpoint.pt" in message:
        shutil.rmtree(out / "checkpoints")
    damage(out)
    capsys.readouterr()
    assert main(_argv(text_file, out, "--steps", "3", "--resume")) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(text_file, tmp_path, capsys):
    assert main(_argv(text_file, tmp_path / "o", "--device", "cuda")) == 1
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_attention_flag_reaches_the_students_layers(text_file, tmp_path, monkeypatch, capsys):
    # `kvpop train --attention gather`: every layer of the student's forward runs the gathered tiles; the resumed run
    # must ask for the same attention (another changes the floats' order)
    import kvpop.attention as att

    seen = []
    real = att.sparse_attention
    monkeypatch.setattr(att, "sparse_attention", lambda *a, **kw: seen.append(kw.get("backend")) or real(*a, **kw))
    assert main(_argv(text_file, tmp_path / "o", "--attention", "gather", "--steps", "1")) == 0
    assert seen.count("gather") == 2  # the two layers of tiny-random-qwen3, one step (the teacher's stay "auto")
    assert main(_argv(text_file, tmp_path / "o", "--steps", "2", "--resume")) == 1
    assert "differs in ['attention']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="TrainConfig.attention='sdpa'"):
        _cfg(text_file, tmp_path / "x", attention="sdpa")


@pytest.mark.skipif(torch.cuda.is_available(), reason="FlexAttention trains on CUDA")
def test_attention_flex_without_cuda_is_a_clear_error(text_file, tmp_path, capsys):
    assert main(_argv(text_file, tmp_path / "o", "--attention", "flex")) == 1
    assert "--attention flex trains on CUDA only" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# --- two phases: scorer-only pre-training, then a new run from its weights (--init-from) ---


def _kvpop_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.startswith("kvpop.")}


@pytest.mark.parametrize("first,then", [("frozen", "full"), ("full", "frozen")])
def test_init_from_starts_a_new_run_from_the_weights_and_resumes_exactly(text_file, tmp_path, monkeypatch, first,
                                                                        then):
    kcfg = kvpop.KVpopConfig(**KCFG)
    pre = tmp_path / "pre"
    distill.train(_cfg(text_file, pre, steps=4, save_every=0, freeze_base=first == "frozen"), kcfg, progress=False)
    source = ckpt.latest(pre).read()["model"]
    cfg = dict(freeze_base=then == "frozen", warmup_steps=2)

    straight = distill.Distiller(_cfg(text_file, tmp_path / "straight", **cfg), None, init_from=pre)
    # a new run: step 0, the source's config, its scorers (and distilled base) loaded, the teacher the base as loaded
    assert straight.step == 0 and straight.kcfg == kvpop.KVpopConfig.from_dict(ckpt.latest(pre).manifest["kvpop_config"])
    for name, value in source.items():
        assert torch.equal(straight.model.state_dict()[name], value), name
    assert straight.init["base_weights"] is (first == "full")
    if straight.teacher is not None:
        fresh, _ = load_model("tiny-random-qwen3")
        for (name, p), (_, q) in zip(straight.teacher.state_dict().items(), fresh.state_dict().items()):
            assert torch.equal(p, q), name
    straight.run(progress=False)
    log = _log(tmp_path / "straight")
    # a fresh schedule: the first step warms up from the start again
    assert [r["step"] for r in log] == list(range(1, 7))
    assert log[0]["lr_scorer"] == pytest.approx(1e-2 / 2)
    init = json.loads((tmp_path / "straight" / "config.json").read_text())["init"]
    assert init["run"] == str(pre.resolve()) and init["step"] == 4 and init["base_weights"] is (first == "full")
    # its checkpoints hold the base whenever it differs from --model's: distilled here or before
    holds = any(not k.startswith("kvpop.") for k in ckpt.latest(tmp_path / "straight").read()["model"])
    assert holds is (first == "full" or then == "full")

    crashed = tmp_path / "crashed"
    real = distill.Distiller.train_step

    def crash_in_step_5(self, micro):
        if self.step == 4:
            raise RuntimeError("simulated crash")
        return real(self, micro)

    monkeypatch.setattr(distill.Distiller, "train_step", crash_in_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        distill.train(_cfg(text_file, crashed, **cfg), None, init_from=pre, progress=False)
    monkeypatch.setattr(distill.Distiller, "train_step", real)
    # the source is not needed to resume: the checkpoints hold all the run changed
    shutil.move(pre, tmp_path / "gone")
    distill.train(_cfg(text_file, crashed, **cfg), None, resume=True, progress=False)
    assert [(r["loss_score"], r["loss_kl"]) for r in _log(crashed)] == [(r["loss_score"], r["loss_kl"]) for r in log]
    assert json.loads((crashed / "config.json").read_text())["init"]["step"] == 4
    a, b = kvpop.load(tmp_path / "straight" / "final"), kvpop.load(crashed / "final")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


def test_init_from_refuses_another_config_a_resume_and_a_kvpop_model(text_file, tmp_path, capsys):
    pre = tmp_path / "pre"
    assert main(_argv(text_file, pre, "--steps", "2")) == 0
    capsys.readouterr()
    post = tmp_path / "post"
    assert main(_argv(text_file, post, "--init-from", str(pre), "--window", "16", "--scorer", "mlstm")) == 1
    err = capsys.readouterr().err
    assert f"--init-from {pre} was trained" in err and "--window 16 (the directory has 8)" in err
    assert "--scorer mlstm (the directory has mlp)" in err and "Traceback" not in err
    assert main(_argv(text_file, post, "--init-from", str(pre), "--resume")) == 1
    assert "--init-from (start a new run from trained weights), not both" in capsys.readouterr().err
    assert main(["train", "--model", str(pre / "final"), "--data", str(text_file), "--seq-len", "128", "--steps", "1",
                 "--freeze-base", "--no-progress", "--out", str(post), "--init-from", str(pre)]) == 1
    assert "--init-from starts from the base model" in capsys.readouterr().err
    # the API names every field that differs, with both values
    with pytest.raises(ValueError, match="topk 12 here, 16 there"):
        distill.train(_cfg(text_file, post), kvpop.KVpopConfig(**{**KCFG, "topk": 12}), init_from=pre, progress=False)
    # the source's own flags are no conflict; a resume needs neither --init-from nor the config flags
    assert main(_argv(text_file, post, "--init-from", str(pre), "--scorer", "mlp")) == 0
    assert "starting from" in capsys.readouterr().err
    resume = ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--steps", "5",
              "--batch-size", "2", "--max-tokens", str(128 * 16), "--freeze-base", "--no-progress", "--out", str(post),
              "--resume"]
    assert main(resume) == 0, capsys.readouterr().err
    assert [r["step"] for r in _log(post)] == [1, 2, 3, 4, 5]


def test_kvpop_tova_trains_as_kvpop_mlp_and_calibrates_its_bias(text_file, tmp_path, capsys):
    # KVpop-TOVA's scorer trains exactly as KVpop-mlp's (the ranking loss ignores each head's offset), while
    # its bias b2 moves to where exp(r) estimates the target's future attention
    split = dict(sink=0, window=1, topk=23, scorer_hidden=32)
    plain = distill.train(_cfg(text_file, tmp_path / "plain", steps=8, freeze_base=True, save_every=0),
                          kvpop.KVpopConfig(**split), progress=False)
    out = tmp_path / "prior"
    common = ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--budget", "24",
              "--scorer-hidden", "32", "--steps", "8", "--batch-size", "2", "--lr-scorer", "1e-2", "--max-tokens",
              str(128 * 16), "--save-every", "0", "--out", str(out), "--no-progress", "--freeze-base"]
    assert main(common + ["--tova-prior", "0.5"]) == 0
    capsys.readouterr()
    a, b = _log(tmp_path / "plain"), _log(out)
    for x, y in zip(a, b):
        assert x["loss_score"] == pytest.approx(y["loss_score"], rel=1e-4, abs=1e-6)
        assert x["accuracy"] == pytest.approx(y["accuracy"], abs=0.01)
    model, reference = kvpop.load(out / "final"), kvpop.load(plain)
    assert model.kvpop.config.tova_prior == 0.5 and (model.kvpop.config.sink, model.kvpop.config.window) == (0, 1)
    for mine, theirs in zip(model.kvpop.layers, reference.kvpop.layers):
        assert torch.allclose(mine.scorer.w2, theirs.scorer.w2, atol=1e-4)
        # the target is log(eps + m) with m ~ 1 / context, far below the untrained scores; the plain run's b2 moves
        # only by Adam's normalised float noise (its gradient is zero up to rounding)
        assert mine.scorer.b2.max() < -1.0 and theirs.scorer.b2.abs().max() < 0.1


def test_prior_offset_and_bias_shift():
    from kvpop.train.calibrate import prior_offset, shift_bias
    from kvpop.train.loss import boundary_labels

    g = torch.Generator().manual_seed(0)
    pi_hat = torch.randn(2, 3, 40, generator=g)
    offset = torch.tensor([-4.0, 0.5, 2.0])
    pi_tgt = pi_hat + offset[None, :, None]
    pairs = boundary_labels(pi_tgt, 1, 2, 5)
    sums, counts = prior_offset(pi_tgt, pi_hat, pairs)
    assert torch.allclose(sums / counts, offset) and torch.all(counts == 2 * pairs.valid.sum(dim=(0, 2)))
    bias = torch.zeros(3)
    shift_bias(bias, sums, counts)
    assert torch.allclose(bias, offset / 2)
    shift_bias(bias, torch.zeros(3), torch.zeros(3))  # no pairs: no move
    assert torch.allclose(bias, offset / 2)


def test_kvpop_cascade_trains_as_kvpop_mlp(text_file, tmp_path, capsys):
    # KVpop-cascade's scorer trains exactly as KVpop-mlp's (the static rule in training); the saved run decodes
    # with its TOVA pool
    plain = distill.train(_cfg(text_file, tmp_path / "plain", steps=4, freeze_base=True, save_every=0),
                          kvpop.KVpopConfig.for_budget(24, scorer_hidden=32), progress=False)
    out = tmp_path / "cascade"
    argv = ["train", "--model", "tiny-random-qwen3", "--data", str(text_file), "--seq-len", "128", "--budget", "24",
            "--scorer-hidden", "32", "--steps", "4", "--batch-size", "2", "--max-tokens", str(128 * 16),
            "--lr-scorer", "1e-2", "--save-every", "0", "--out", str(out), "--no-progress", "--freeze-base", "--tova-pool", "5"]
    assert main(argv) == 0
    capsys.readouterr()
    for x, y in zip(_log(tmp_path / "plain"), _log(out)):
        assert x["loss_score"] == pytest.approx(y["loss_score"], rel=1e-5, abs=1e-7)
    model = kvpop.load(out / "final")
    assert model.kvpop.config.tova_pool == 5 and model.kvpop.layers[0].score == "cascade"
    reference = kvpop.load(plain)
    for mine, theirs in zip(model.kvpop.layers, reference.kvpop.layers):
        assert torch.allclose(mine.scorer.w2, theirs.scorer.w2, atol=1e-5)
    assert main([*argv[:-1], "40", "--overwrite"]) == 1
    assert "tova_pool=40 is invalid: must be an integer in [0, topk=14]" in capsys.readouterr().err
