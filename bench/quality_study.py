"""The quality study (the paper's Table 1 in shape): every eviction policy against the dense teacher, two budgets.

    # command 1: train the ten runs, seven at a time on one GPU under NVIDIA MPS, stopped cleanly
    # (checkpoint) at 540 s
    python bench/quality_study.py --phase train --out $HOME/study --deadline-s 540 --concurrency 7 --mps
    # command 2: resume what is left (runs with a final/ are skipped), then evaluate in the last 300 s;
    # OUT gets results.json, table.md, eviction_pattern.png and recall_per_layer.png
    python bench/quality_study.py --phase all --out $HOME/study --deadline-s 540 --eval-reserve-s 300

Defaults: smollm2-135m, champ, S = 8192, sink 4, window 256, budgets 2048,1024 (CR 75 %, 88 %),
150 steps per run, 8 held-out sequences. A tiny CPU run (the test's): `--model tiny-random-qwen3
--data notes.jsonl --seq-len 128 --budgets 48,32 --window 16 --steps 2 --concurrency 2
--eval-sequences 1 --min-start-s 0`.

Rows, per budget B (CR = 1 - B / S): dense teacher; streaming_llm, tova, h2o (training-free; TOVA and
H2O as their papers define them) and tova_windowed, h2o_windowed (kvpop's variant: --sink, --window);
streaming_llm_plus (base distilled, topk 0), dms, kvpop-mlp, kvpop-mlstm (delay = window,
--match-mlp-memory) and kvpop-mlstm-delay0 (the ablation, same memory), each trained by full
distillation on champ; the oracle. Columns: relative next-token accuracy, top-1 agreement, KL,
perplexity ratio, the top-k retention recall against the oracle (static scorers) and the share of the
budget a row really holds (DMS), all teacher-forced on the same held-out sequences, each beginning at
a document start (`--packing document`; `concat` gives rows cut mid-document from one stream;
`kvpop.eval.evaluate.held_out_rows`). `*` marks the stronger TOVA (H2O) variant per budget.

Two-phase rows: `--pretrain-steps P` trains `--pretrain-rows` (default every KVpop scorer row)
first P steps with the base frozen (scorers only: no teacher, no base backward, several times the
tokens/s), in OUT/runs/<row>_b<B>_preP/, then `--steps` of full distillation from those weights
(`kvpop train --init-from`) in OUT/runs/<row>_b<B>_preP_distill/, the run the table evaluates (its
trained steps read `P+D`). The second starts once the first is final; each resumes across commands.
With `--keep-every N` every run keeps every N-th checkpoint, and `bench/recall_curve.py` draws the
held-out recall of both phases against the steps, one line per row:

    python bench/quality_study.py --phase train --rows kvpop-mlp,kvpop-mlstm --pretrain-steps 600 --steps 120 \
        --keep-every 100 --out $HOME/study --deadline-s 540
    python bench/recall_curve.py $HOME/study/runs/*_distill --out $HOME/study/curve

Training runs are `python -m kvpop.cli train ...` subprocesses, `--concurrency` at a time, each in
OUT/runs/<name>/ with its log. A run whose `final/` exists is skipped; one with a checkpoint is
resumed; near the deadline the running ones get SIGTERM (kvpop train then writes its checkpoint),
and the evaluation uses the final weights or else the latest checkpoint, and says which. A run
that fails out of GPU memory is retried once with one run fewer in parallel. The evaluation runs
one worker process per group (the fast rows per budget; TOVA and H2O per budget, whose
teacher-forced pass walks the tokens in order), each writing its rows after every
sequence, so a deadline leaves the sequences done; the number of sequences is in every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from kvpop.presets import model_help

TRAINING_FREE = ("streaming_llm", "tova", "tova_windowed", "h2o", "h2o_windowed", "oracle")
DYNAMIC = ("tova", "tova_windowed", "h2o", "h2o_windowed")
ROW_ORDER = ("dense", "streaming_llm", "tova", "tova_windowed", "h2o", "h2o_windowed", "streaming_llm_plus", "dms",
             "kvpop-mlp", "kvpop-tova", "kvpop-evidence", "kvpop-evidence-prerope", "kvpop-mlstm", "kvpop-mlstm-delay0",
             "oracle")
LEARNED = ("kvpop-mlp", "kvpop-tova", "kvpop-evidence", "kvpop-evidence-prerope", "kvpop-mlstm", "kvpop-mlstm-delay0")
STATIC_ROWS = 6
"""Trained rows per evaluation worker (each loads its model and runs every held-out sequence)."""
START = time.time()


def log(msg: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp} +{time.time() - START:6.0f}s] {msg}", flush=True)


def finite(obj):
    """NaN and infinities as null: strict JSON readers (jq, browsers) refuse them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    """Atomic: a reader (or a kill) never sees half a file."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(finite(obj), indent=2, default=str))
    os.replace(tmp, path)


# --- the plan ---


@dataclass
class Run:
    name: str
    row: str
    budget: int
    label: str
    """The table's name of the row: `row`, or `row/sN` for a seed after the first (`--seeds`)."""
    args: list[str]
    out: Path
    steps: int
    """The run's planned optimizer steps (`--steps`, the row's `+stepsN`, or `--pretrain-steps`)."""
    after: Run | None = None
    """The run whose final weights this one starts from (`--init-from`): it starts once that one is done."""
    pretrain: bool = False
    """A scorer-only pre-training: no row of the table, the start of the run that is (`after`)."""
    status: dict = field(default_factory=dict)
    retries: int = 0

    @property
    def final(self) -> Path:
        return self.out / "final"

    def done(self) -> bool:
        # kvpop.save writes kvpop_config.json after the weights: its presence means a complete directory
        return (self.final / "kvpop_config.json").exists()

    def last_log(self) -> dict:
        path = self.out / "train_log.jsonl"
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
        try:
            return json.loads(lines[-1]) if lines else {}
        except ValueError:
            return {}

    def steps_done(self) -> int:
        return int(self.last_log().get("step", 0))

    def checkpoint(self) -> Path | None:
        """The run's last complete checkpoint (`kvpop.train.checkpoint`), or None."""
        from kvpop.train.checkpoint import latest

        last = latest(self.out)
        return None if last is None else last.path

    def progress(self) -> str:
        row = self.last_log()
        return f"{row.get('step', 0)}/{self.steps}" + (f" ({row['step_time_s']:.2f} s/step)" if "step_time_s" in row
                                                       else "")

    def ready(self) -> bool:
        return self.after is None or self.after.done()

    def command(self) -> list[str]:
        """The `kvpop` arguments that start or go on with the run, from what its directory holds."""
        from kvpop.train.checkpoint import holds_run

        if self.checkpoint() is not None:
            # a run started from another records it; its checkpoints hold all it changed
            return [*self.args, "--resume"]
        start = [] if self.after is None else ["--init-from", str(self.after.out)]
        # stopped before its first checkpoint: nothing to resume, start it again
        return [*self.args, *start, *(["--overwrite"] if holds_run(self.out) else [])]


def row_args(row: str, window: int) -> list[str]:
    w = ["--window", str(window)]
    return {
        # window = B - sink, topk 0 (KVpopConfig.for_budget)
        "streaming_llm_plus": ["--policy", "streaming_llm_plus"],
        "dms": ["--policy", "dms", *w],
        "kvpop-mlp": ["--scorer", "mlp", *w],
        # KVpop-TOVA (an extension): TOVA's split (no sinks, window 1) unless +wN gives a window
        "kvpop-tova": ["--scorer", "mlp", "--tova-prior", "1", *(w if window is not None else [])],
        # extensions: the delayed evidence scorer, with cached or pre-RoPE keys
        "kvpop-evidence": ["--scorer", "evidence", *w],
        "kvpop-evidence-prerope": ["--scorer", "evidence", "--scorer-keys", "pre_rope", *w],
        "kvpop-mlstm": ["--scorer", "mlstm", "--match-mlp-memory", *w],
        "kvpop-mlstm-delay0": ["--scorer", "mlstm", "--match-mlp-memory", "--delay", "0", *w],
    }[row]


MODIFIERS = {
    "frozen": "scorers (DMS: gates) only, the base frozen, whatever --freeze-base says",
    "wN": "a protected window of N tokens instead of --window",
    "prerope": "mlp/evidence scorers read the keys with RoPE undone (--scorer-keys pre_rope)",
    "bN": "only at budget N (one of --budgets; repeatable), not at every budget",
    "stepsN": "N optimizer steps instead of --steps (a slow learner, e.g. the mLSTM scorer-only)",
    "mix": "trained on the first --mix instead of --data (evaluated on --data's held-out split like every row)",
    "mixN": "trained on the N-th --mix (--mix is repeatable: e.g. without and with self-generated text)",
}
"""Per-row variations of an ablation, appended to a row with `+`: `kvpop-mlp+w32+frozen`."""


@dataclass(frozen=True)
class RowSpec:
    """A trained row of `--rows`: a base row (`TRAINED`) and its modifiers (`MODIFIERS`)."""

    name: str
    base: str
    window: int | None = None
    frozen: bool = False
    prerope: bool = False
    budgets: tuple[int, ...] = ()
    """The budgets this row trains at; empty: every budget of the study."""
    steps: int | None = None
    mix: int = 0
    """Which `--mix` this row trains on (1 = the first); 0: `--data`."""

    @classmethod
    def parse(cls, spec: str) -> RowSpec:
        base, *mods = spec.split("+")
        if base not in TRAINED:
            raise SystemExit(f"--rows: unknown row {base!r} in {spec!r}; choose from {', '.join(TRAINED)}")
        window, frozen, prerope, budgets, steps, mix = None, False, False, [], None, 0
        for m in mods:
            if re.fullmatch(r"w[1-9][0-9]*", m):
                window = int(m[1:])
            elif re.fullmatch(r"steps[1-9][0-9]*", m):
                steps = int(m[5:])
            elif re.fullmatch(r"mix([1-9][0-9]*)?", m):
                mix = int(m[3:] or 1)
            elif re.fullmatch(r"b[1-9][0-9]*", m):
                budgets.append(int(m[1:]))
            elif m == "frozen":
                frozen = True
            elif m == "prerope" and base in ("kvpop-mlp", "kvpop-tova", "kvpop-evidence"):
                prerope = True
            else:
                allowed = "; ".join(f"+{k}: {v}" for k, v in MODIFIERS.items())
                raise SystemExit(f"--rows: modifier {m!r} of {spec!r} is not one of ({allowed}; prerope only for "
                                 "kvpop-mlp and kvpop-evidence)")
        if window is not None and base == "streaming_llm_plus":
            raise SystemExit(f"--rows: {spec!r}: streaming_llm_plus's window is its whole budget; drop +w")
        # the budget is in the run's name already: the label drops it
        name = "+".join([base, *(m for m in mods if not re.fullmatch(r"b[1-9][0-9]*", m))])
        return cls(name, base, window, frozen, prerope, tuple(budgets), steps, mix)

    def args(self, window: int, freeze_base: bool) -> list[str]:
        if self.base == "kvpop-tova":  # its own split: the study's window only when the row asks (+wN)
            window = self.window
        out = row_args(self.base, window if self.window is None else self.window)
        if self.prerope:
            out += ["--scorer-keys", "pre_rope"]
        return out + (["--freeze-base"] if freeze_base or self.frozen else [])


TRAINED = ("streaming_llm_plus", "dms", "kvpop-mlp", "kvpop-mlstm", "kvpop-mlstm-delay0", "kvpop-evidence",
           "kvpop-evidence-prerope", "kvpop-tova")
DEFAULT_TRAINED = TRAINED[:5]
"""The rows trained unless `--rows` names others: the paper's (the evidence scorer is an opt-in extension)."""


def trained_rows(args) -> list[RowSpec]:
    """The trained rows of this study: `--rows` (default all), without StreamingLLM+ when the base is frozen."""
    rows = [RowSpec.parse(r) for r in (args.rows.split(",") if args.rows else DEFAULT_TRAINED) if r]
    for r in rows:
        if set(r.budgets) - set(args.budgets):
            raise SystemExit(f"--rows: {r.name} asks for budgets {sorted(set(r.budgets) - set(args.budgets))}, "
                             f"not among --budgets {args.budgets}")
    # StreamingLLM+ trains only the base: with it frozen it is StreamingLLM, already a row
    return [r for r in rows if not ((args.freeze_base or r.frozen) and r.base == "streaming_llm_plus")]


def pretrain_rows(args) -> list[str]:
    """The rows trained in two phases (`--pretrain-steps`): `--pretrain-rows`, default every KVpop scorer row."""
    if not args.pretrain_steps:
        return []
    if args.freeze_base:
        raise SystemExit("--pretrain-steps: with --freeze-base every run trains the scorers only already")
    rows = [r for r in trained_rows(args) if r.base in LEARNED and not r.frozen]
    names = [r.name for r in rows]
    chosen = [r for r in args.pretrain_rows.split(",") if r] if args.pretrain_rows else names
    wrong = sorted(set(chosen) - set(names))
    if wrong:
        raise SystemExit(f"--pretrain-rows: {wrong} are not KVpop scorer rows of this study with a distilled base "
                         f"(--rows: {', '.join(r.name for r in trained_rows(args))})")
    return chosen


def plan_runs(args) -> list[Run]:
    runs = []
    two_phase = pretrain_rows(args)
    for budget in args.budgets:
        rows = [r for r in trained_rows(args) if not r.budgets or budget in r.budgets]
        for row, seed in ((r, s) for r in rows for s in args.seeds):
            # the first seed's runs keep the plain name `row_bB` (a study with one seed resumes them); a later one is `row_sN`
            first = seed == args.seeds[0]
            name = f"{row.name}_b{budget}" if first else f"{row.name}_s{seed}_b{budget}"
            label = row.name if first else f"{row.name}/s{seed}"
            steps = row.steps or args.steps
            after = None
            if row.name in two_phase:
                # scorer-only pre-training first, then the full distillation from its weights (`--init-from`)
                name = f"{name}_pre{args.pretrain_steps}"
                pre_args = train_args(args, row, budget, seed, name, args.pretrain_steps, True)
                after = Run(name, row.base, budget, label, pre_args, args.out / "runs" / name, args.pretrain_steps,
                            pretrain=True)
                runs.append(after)
                name = f"{name}_distill"
            runs.append(Run(name, row.base, budget, label, train_args(args, row, budget, seed, name, steps,
                                                                      args.freeze_base), args.out / "runs" / name,
                            steps, after=after))
    return runs


def train_args(args, row: RowSpec, budget: int, seed: int, name: str, steps: int, freeze_base: bool) -> list[str]:
    """The `kvpop train` arguments of the run `name` (into OUT/runs/<name>), less how it starts (`Run.command`)."""
    mixes = args.mix or []
    if row.mix > len(mixes):
        raise SystemExit(f"--rows: {row.name} trains on --mix number {row.mix}, but {len(mixes)} --mix given")
    data = mixes[row.mix - 1] if row.mix else args.data
    return ["train", "--model", args.model, "--data", data, "--seq-len", str(args.seq_len),
            "--sink", str(args.sink), "--budget", str(budget), *row.args(args.window, freeze_base),
            "--steps", str(steps), "--lr-scorer", str(args.lr_scorer), "--seed", str(seed),
            "--save-every", str(args.save_every or max(1, min(20, steps // 2))), "--out", str(args.out / "runs" / name),
            "--no-progress", *(["--lr-base", str(args.lr_base)] if args.lr_base is not None else []),
            *(["--keep-every", str(args.keep_every)] if args.keep_every else [])]


def visible_gpus() -> list[str]:
    """The GPU ids the training runs are spread over: CUDA_VISIBLE_DEVICES if set, else every device."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no CUDA: the runs go wherever kvpop train puts them
        return []


def child_env(threads: int) -> dict:
    import kvpop

    env = dict(os.environ)
    src = str(Path(kvpop.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["OMP_NUM_THREADS"] = str(threads)
    # parallel runs compile at once: one inductor worker pool of cpu_count processes each is too many
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop(proc: subprocess.Popen, grace: float, signalled: bool = False) -> None:
    """SIGTERM (kvpop train checkpoints on it) unless `signalled`, then SIGKILL of its process group after `grace` s."""
    if proc.poll() is None and not signalled:
        proc.send_signal(signal.SIGTERM)
    end = time.time() + grace
    while proc.poll() is None and time.time() < end:
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, n: int = 6) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def start_mps(out: Path):
    """Start NVIDIA's MPS daemon, so the parallel runs' kernels share the GPU at once.

    Without it the driver time-slices processes: five launch-bound training steps sharing an H200
    each run 3.4x slower than alone, i.e. the GPU sits mostly idle. Returns the
    function that stops the daemon again, or None (daemon missing, or a CUDA probe through it
    failed: then the runs time-slice). Call before anything in this process touches CUDA.
    """
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        log("MPS: nvidia-cuda-mps-control not found; the runs time-slice the GPU")
        return None
    pipe, logs = out / "mps" / "pipe", out / "mps" / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}

    def stop_mps() -> None:
        # `quit` can block well past its clients' exit (30 s timed out on the H200 each time): ask, don't wait
        try:
            subprocess.run([exe], input="quit\n", env=env, text=True, capture_output=True, timeout=5)
        except subprocess.TimeoutExpired:
            log("MPS: quit asked (the daemon stops in the background)")
        except (OSError, subprocess.SubprocessError) as err:
            log(f"MPS: quit failed: {err!r}")

    try:
        started = subprocess.run([exe, "-d"], env=env, text=True, capture_output=True, timeout=30,
                                 stdin=subprocess.DEVNULL)
        if started.returncode != 0:
            log(f"MPS: the daemon did not start (rc {started.returncode}: {started.stderr.strip()[:200]})")
            return None
        # the probe allocates as the runs do (expandable segments: the driver's virtual-memory calls)
        code = ("import torch; x = torch.ones(4096, 8192, device='cuda', dtype=torch.bfloat16); "
                "print(float((x @ x[:256].T).float().mean()))")
        probe = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=120,
                               env={**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        ok = probe.returncode == 0 and probe.stdout.strip().endswith("8192.0")
    except (OSError, subprocess.SubprocessError) as err:
        ok, probe = False, err
    if not ok:
        log(f"MPS: a CUDA probe through the daemon failed ({str(getattr(probe, 'stderr', probe)).strip()[-300:]}); "
            "stopped it, the runs time-slice the GPU")
        stop_mps()
        return None
    os.environ.update(CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    log(f"MPS: on (pipe {pipe})")
    return stop_mps


# --- phase train ---


def train_phase(args, runs: list[Run], deadline: float) -> None:
    pending = []
    for run in runs:
        if run.done():
            log(f"skip {run.name}: {run.final} exists")
            run.status = {"status": "final", "steps_done": run.steps_done(), "skipped": True}
        else:
            pending.append(run)
    # runs with no weights yet first (a row at all beats more steps for another), then the slowest rows:
    # a slow run started late decides when the phase ends (on the H200 under MPS, DMS and the two mLSTM
    # rows took 3-5 s/step, KVpop-mlp 2.5 and StreamingLLM+ 0.35), while a fast one fills a freed slot
    priority = {row: i for i, row in enumerate(("dms", "kvpop-mlstm", "kvpop-mlstm-delay0", "kvpop-evidence",
                                                 "kvpop-evidence-prerope", "kvpop-mlp", "kvpop-tova",
                                                 "streaming_llm_plus"))}
    pending.sort(key=lambda r: (r.checkpoint() is not None, priority[r.row], -r.budget))
    limit = args.concurrency
    waves = -(-len(pending) // max(1, limit))
    # --fair-share: each run gets an equal share of the phase, waves of `limit` runs; one past its share
    # is stopped (checkpointed) so that the later waves get their turn, and resumes in the next
    # command. Off by default: on an H200 it stops slow runs at half time while the later wave
    # (fast runs) leaves its slots idle; without it a finished run's slot goes to the next at once
    share = (deadline - time.time()) / max(1, waves)
    threads = max(1, (os.cpu_count() or 1) // max(1, min(limit, len(pending) or 1)))
    env = child_env(threads)
    gpus = visible_gpus()
    gpu_of: dict[str, str] = {}
    running: dict[str, tuple[subprocess.Popen, Run, float]] = {}
    caps: dict[str, float] = {}
    last_report = time.time()
    log(f"train: {len(pending)} runs to go, {limit} at a time, deadline in {deadline - time.time():.0f} s")
    while pending or running:
        now = time.time()
        while len(running) < limit and deadline - now > args.min_start_s:
            # a distillation after pre-training waits for it (final, its process ended); the next run ready
            # takes the slot
            run = next((r for r in pending if r.ready() and (r.after is None or r.after.name not in running)), None)
            if run is None:
                break
            pending.remove(run)
            run.out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "kvpop.cli", *run.command()]
            run_env = env
            if len(gpus) > 1:
                # spread the runs over the host's GPUs: the least loaded one takes the next run
                load = {g: sum(1 for n in running if gpu_of.get(n) == g) for g in gpus}
                gpu_of[run.name] = min(gpus, key=lambda g: load[g])
                run_env = {**env, "CUDA_VISIBLE_DEVICES": gpu_of[run.name]}
            with open(run.out / "study_train.log", "a") as f:
                f.write(f"\n# {datetime.datetime.now().isoformat()} {' '.join(cmd)}\n")
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
            running[run.name] = (proc, run, now)
            # the last wave may use all the time left
            caps[run.name] = min(deadline, now + share) if args.fair_share and pending else deadline
            run.status = {"command": " ".join(cmd), "status": "running"}
            where = f" on GPU {gpu_of[run.name]}" if run.name in gpu_of else ""
            log(f"start {run.name} (pid {proc.pid}){where}"
                f"{' --resume from step ' + str(run.steps_done()) if '--resume' in cmd else ''}")
        for name, (proc, run, started) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[name]
            finish(run, rc, now - started)
            if run.status["status"] == "failed" and "out of memory" in tail(run.out / "study_train.log", 40).lower() \
                    and run.retries < 1:
                run.retries += 1
                limit = max(1, len(running))
                pending.insert(0, run)
                log(f"{run.name}: CUDA out of memory; retrying with at most {limit} runs in parallel")
        if pending and not running and (deadline - now <= args.min_start_s or not any(r.ready() for r in pending)):
            for run in pending:
                reason = "too close to the deadline" if run.ready() else f"{run.after.name} is not finished"
                run.status = {"status": "not started", "reason": reason}
                log(f"not started: {run.name} ({reason})")
            break
        if now >= deadline - args.stop_grace_s and running:
            log(f"deadline: stopping {', '.join(running)} (SIGTERM, checkpoint)")
            for proc, run, _ in running.values():
                run.status["stopping"] = True
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc, run, started in running.values():
                stop(proc, max(1.0, deadline - time.time()), signalled=True)
                finish(run, proc.returncode, time.time() - started)
            running.clear()
            for run in pending:
                run.status = {"status": "not started", "reason": "deadline"}
            break
        for name, (proc, run, _) in running.items():
            if now >= caps[name] and caps[name] < deadline and proc.poll() is None and not run.status.get("stopping"):
                run.status["stopping"] = True
                log(f"{name}: its share of the phase is used up; SIGTERM (checkpoint, resumed next time)")
                proc.send_signal(signal.SIGTERM)
        if now - last_report >= args.report_s and running:
            last_report = now
            log("progress: " + ", ".join(f"{r.name} {r.progress()}" for _, r, _ in running.values()))
        time.sleep(0.5)
    for run in runs:
        if run.out.exists():
            write_json(run.out / "study_status.json", run.status)


def finish(run: Run, rc: int, seconds: float) -> None:
    steps = run.steps_done()
    if run.done():
        status = "final"
    elif run.checkpoint() is not None:
        status = "interrupted"
    else:
        status = "failed"
    if rc not in (0, 130) and status != "final":
        # SIGTERM before the first step (loading, packing, compiling) ends a run without a checkpoint
        status = "stopped before its first checkpoint" if rc == -signal.SIGTERM and run.status.get("stopping") \
            else "failed"
    run.status.pop("stopping", None)
    run.status.update(status=status, rc=rc, steps_done=steps, seconds=round(seconds, 1),
                      checkpoint=run.checkpoint() is not None)
    if status == "failed":
        run.status["log_tail"] = tail(run.out / "study_train.log")
    log(f"end {run.name}: {status}, rc {rc}, {steps} steps in {seconds:.0f} s"
        + (f"\n    {run.status['log_tail']}" if status == "failed" else ""))


# --- phase eval ---


def eval_phase(args, runs: list[Run], deadline: float) -> dict:
    from safetensors.torch import save_file

    from kvpop.eval.evaluate import held_out_rows, mark_stronger_variants
    from kvpop.models import load_model

    eval_dir = args.out / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    _, tokenizer = load_model(args.model)
    tokens = held_out_rows(args.data, tokenizer, args.seq_len, args.eval_sequences, packing=args.packing,
                           seed=args.seed)
    # data, not a pickle: the workers read it back without unpickling anything
    save_file({"tokens": tokens.contiguous()}, str(eval_dir / "tokens.safetensors"))
    log(f"eval: {len(tokens)} held-out sequences of {args.seq_len} tokens ({args.packing} packing)")

    missing, trained = [], {}
    for run in (r for r in runs if not r.pretrain):
        status = run.status or (json.loads((run.out / "study_status.json").read_text())
                                if (run.out / "study_status.json").exists() else {})
        if run.done():
            trained[run.name] = {"path": str(run.final), "weights": "final", "steps_done": run.steps_done()}
        elif run.checkpoint() is not None:
            trained[run.name] = {"path": str(run.checkpoint()), "weights": "checkpoint",
                                 "steps_done": run.steps_done()}
            log(f"{run.name}: no final weights; evaluating its checkpoint (step {run.steps_done()} of {run.steps})")
        else:
            reason = status.get("status", "not trained") + (f": {status['log_tail']}" if "log_tail" in status else "")
            missing.append({"policy": run.label, "budget": run.budget, "missing": reason})
            log(f"{run.name}: missing ({reason.splitlines()[0]})")
            continue
        trained[run.name].update(row=run.label, budget=run.budget)
        if run.after is not None:
            trained[run.name]["pretrain_steps"] = run.after.steps

    groups = []
    for budget in args.budgets:
        entries = [{"name": p, "budget": budget, "policy": p} for p in args.free_rows if p not in DYNAMIC]
        learned = [{"name": t["row"], "budget": budget, "trained": t["path"]} for t in trained.values()
                   if t["budget"] == budget]
        # KVpop-TOVA rows walk token by token like TOVA: a worker each, batched like the dynamic free rows
        walked = [e for e in learned if base_row(e["name"]) == "kvpop-tova"]
        learned = [e for e in learned if e not in walked]
        groups += [{"group": f"{e['name']}_b{budget}".replace("+", "_").replace("/", "_"), "entries": [e], "plot": False,
                    "batch": args.dynamic_batch} for e in walked]
        # an ablation has many trained rows: at most STATIC_ROWS per worker, so the groups spread over the GPUs
        for k in range(0, max(1, len(learned)), STATIC_ROWS):
            plot = budget == max(args.budgets) and k == 0
            groups.append({"group": f"static_b{budget}" + (f"_{k // STATIC_ROWS}" if k else ""),
                           "entries": (entries if k == 0 else []) + learned[k : k + STATIC_ROWS], "plot": plot,
                           "batch": 1})
        groups += [{"group": f"{p}_b{budget}", "entries": [{"name": p, "budget": budget, "policy": p}], "plot": False,
                    "batch": args.dynamic_batch} for p in DYNAMIC if p in args.free_rows]
    procs = []
    threads = max(1, (os.cpu_count() or 1) // len(groups))
    gpus = visible_gpus()
    for i, g in enumerate(groups):
        spec = {**g, "model": args.model, "seq_len": args.seq_len, "sink": args.sink, "window": args.window,
                "tokens": str(eval_dir / "tokens.safetensors"), "out": str(eval_dir / f"{g['group']}.json"),
                "plot_path": str(args.out / "eviction_pattern.png"), "deadline": deadline - 5,
                "seed": args.seed}
        Path(spec["out"]).unlink(missing_ok=True)
        spec_path = eval_dir / f"{g['group']}.spec.json"
        write_json(spec_path, spec)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", "worker", "--spec", str(spec_path)]
        f = open(eval_dir / f"{g['group']}.log", "w")
        env = child_env(threads)
        if len(gpus) > 1:  # the groups round-robin over the host's GPUs
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True), g, f, " ".join(cmd)))
        log(f"eval worker {g['group']}: {', '.join(e['name'] for e in g['entries'])}")
    last_report = time.time()
    while any(p.poll() is None for p, *_ in procs):
        if time.time() >= deadline:
            log("eval deadline: stopping the workers still running (their rows so far are kept)")
            for p, *_ in procs:
                stop(p, 5.0)
            break
        if time.time() - last_report >= args.report_s:
            last_report = time.time()
            done = []
            for _, g, _, _ in procs:
                part = eval_dir / f"{g['group']}.json"
                n = json.loads(part.read_text())["sequences"] if part.exists() else 0
                done.append(f"{g['group']} {n}/{len(tokens)}")
            log("eval progress: " + ", ".join(done))
        time.sleep(1)
    rows, commands = [], []
    for p, g, f, cmd in procs:
        f.close()
        commands.append(cmd)
        part = eval_dir / f"{g['group']}.json"
        if not part.exists():
            reason = f"eval worker {g['group']} finished no sequence (rc {p.returncode}): " + tail(Path(f.name), 4)
            missing += [{"policy": e["name"], "budget": e["budget"], "missing": reason} for e in g["entries"]]
            log(reason)
            continue
        result = json.loads(part.read_text())
        rows += result["rows"]
        missing += result["failed"]
        log(f"eval worker {g['group']}: rc {p.returncode}, {result['sequences']} sequences")
    mark_stronger_variants(rows)
    for row in rows:
        t = next((t for t in trained.values() if t["row"] == row["policy"] and t["budget"] == row["budget"]),
                 None) if row.get("trained") else None
        if t is not None:
            row.update(weights=t["weights"], steps_done=t["steps_done"],
                       **({"pretrain_steps": t["pretrain_steps"]} if "pretrain_steps" in t else {}))
    # the dense teacher: accuracy over the same counted positions (>= budget); the ratios are 1 by definition
    for budget in args.budgets:
        ref = next((r for r in rows if r["budget"] == budget), None)
        if ref is not None:
            rows.append({"policy": "dense", "budget": budget, "cr": ref["cr"], "rel_accuracy": 1.0,
                         "top1_agreement": 1.0, "kl": 0.0, "ppl_ratio": 1.0, "accuracy": ref["accuracy_dense"],
                         "accuracy_dense": ref["accuracy_dense"], "positions": ref["positions"],
                         "sequences": ref["sequences"]})
    return {"rows": sort_rows(rows), "missing": missing, "sequences": len(tokens), "worker_commands": commands,
            "trained": trained}


def sort_rows(rows: list[dict]) -> list[dict]:
    order = {name: i for i, name in enumerate(ROW_ORDER)}
    return sorted(rows, key=lambda r: (-r["budget"], order.get(base_row(r["policy"]), len(order)), r["policy"]))


def base_row(label: str) -> str:
    """`kvpop-mlp+w32/s1` -> `kvpop-mlp`: the row a label was trained as, without modifiers or seed."""
    return label.split("/")[0].split("+")[0]


# --- the worker: one group of rows over the held-out sequences ---


def worker(spec_path: str) -> int:
    import torch
    import torch._dynamo

    from kvpop.config import KVpopConfig
    from kvpop.eval.evaluate import WINDOWED, Entry, Evaluator, from_directory, training_free
    from kvpop.files import read_safetensors
    from kvpop.models import load_model
    from kvpop.train.checkpoint import is_checkpoint
    from kvpop.train.weights import model_with, read_weights, source_config

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    # one worker runs several (sink, window) splits and the dense pass through compiled FlexAttention;
    # past dynamo's recompile limit (8) flex falls back to eager and materialises S x S scores
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(spec["seed"])
    base, tokenizer = load_model(spec["model"], device=device)
    tokens = read_safetensors(spec["tokens"], "the held-out tokens")["tokens"]

    class StudyEvaluator(Evaluator):
        """The evaluator with checkpoint loading and per-row isolation: one failing row does not sink the group."""

        def _model(self, entry):
            if entry.trained is None or not is_checkpoint(entry.trained):
                return super()._model(entry)
            if entry.trained not in self._trained:
                model = model_with(self.base, read_weights(entry.trained), f"--model {spec['model']}")
                self._trained[entry.trained] = (model, model.kvpop.config)
            return self._trained[entry.trained][0]

        @torch.no_grad()
        def add(self, input_ids):
            ids = input_ids.to(self.device)
            dense, reference = self.reference(ids)
            keep = []
            for entry in self.entries:
                try:
                    self.add_entry(entry, ids, dense, reference)
                    keep.append(entry)
                except Exception as err:  # noqa: BLE001 - the row is reported missing with the error
                    log(f"{entry.name} b{entry.budget} failed: {err!r}\n{traceback.format_exc()}")
                    if counts[id(entry)]:
                        # its earlier sequences still count; it just takes no more
                        retired.append(entry)
                    else:
                        failed.append({"policy": entry.name, "budget": entry.budget,
                                       "missing": f"eval error: {err!r}"})
                    self._trained.pop(entry.trained, None)
                    if device == "cuda":
                        torch.cuda.empty_cache()
            self.entries = keep
            for entry in keep:
                counts[id(entry)] += ids.shape[0]

        def all_rows(self, seq_len: int) -> list[dict]:
            active, self.entries = self.entries, self.entries + retired
            try:
                rows = self.rows(seq_len)
                for r, entry in zip(rows, self.entries):
                    r["sequences"] = counts[id(entry)]
                return rows
            finally:
                self.entries = active

    failed: list[dict] = []
    retired: list = []
    entries = []
    for e in spec["entries"]:
        if e.get("trained"):
            path = e["trained"]
            if is_checkpoint(path):
                cfg = source_config(path)
                entry = Entry(e["name"], cfg.budget, cfg, trained=path)
            else:
                # the study's rows are the methods as trained: a KVpop-mlp under the paper's static rule (`kvpop eval
                # --trained` runs it as the recommended cascade by default)
                entry = from_directory(path, name=e["name"], rule="static")
            # the nominal budget: every row of a budget counts the same positions (>= B), also an mLSTM
            # whose matched top-k holds B minus its state's size in KV entries
            entry.budget = e["budget"]
        elif e["policy"] in ("tova", "h2o"):
            entry = training_free(e["policy"], e["budget"])  # as their papers define them
        else:
            policy = WINDOWED.get(e["policy"], e["policy"])
            window = None if policy == "streaming_llm" else spec["window"]
            cfg = KVpopConfig.for_budget(e["budget"], sink=spec["sink"], window=window, policy=policy,
                                         windowed=e["policy"] in WINDOWED)
            entry = Entry(e["name"], e["budget"], cfg)
        entries.append(entry)
    counts = {id(e): 0 for e in entries}
    evaluator = StudyEvaluator(base, entries, device=device)
    last = 0.0
    # sequences per pass: the dynamic rows' walk (a sequential loop over the tokens) costs about the
    # same for 1 row as for 4, so they take several at once; the static rows one at a time
    batch = max(1, int(spec.get("batch", 1)))
    done = 0
    while done < len(tokens):
        if done and time.time() + last > spec["deadline"]:
            log(f"{spec['group']}: stopping after {done} sequences (the next pass would pass the deadline)")
            break
        ids = tokens[done : done + batch]
        t0 = time.time()
        try:
            evaluator.add(ids)
        except Exception as err:  # noqa: BLE001 - the dense pass itself failed: keep what is done
            log(f"{spec['group']}: the dense reference pass failed on sequences {done + 1}-{done + len(ids)}: "
                f"{err!r}\n{traceback.format_exc()}")
            break
        if device == "cuda":
            # workers share the GPU: give back what this pass's activations held
            torch.cuda.empty_cache()
        last = time.time() - t0
        first_pass, done = done == 0, done + len(ids)
        write_json(out, {"rows": evaluator.all_rows(spec["seq_len"]), "failed": failed, "sequences": done,
                         "group": spec["group"]})
        log(f"{spec['group']}: sequences {done}/{len(tokens)} ({len(ids)} in {last:.1f} s)")
        if first_pass and spec["plot"]:
            eviction_plot(evaluator, tokenizer, ids[0], spec)
    if not out.exists():
        write_json(out, {"rows": [], "failed": failed, "sequences": 0, "group": spec["group"]})
    return 0


def eviction_plot(evaluator, tokenizer, ids, spec) -> None:
    """Fig. 6 for the main trained KVpop (mLSTM, delay = window; else the MLP) on the first held-out sequence."""
    from kvpop.eval import plots

    by_name = {e.name: e for e in evaluator.entries if e.trained}
    entry = by_name.get("kvpop-mlstm") or by_name.get("kvpop-mlp")
    if entry is None:
        log("eviction plot: no trained KVpop row to plot")
        return
    try:
        model = evaluator._model(entry)
        counts, positions = plots.eviction_counts(model, ids[None].to(evaluator.device), last=112)
        labels = plots.token_labels(tokenizer, ids[positions].tolist())
        cfg = entry.cfg
        path = plots.plot_eviction_pattern(
            counts.numpy(), labels, model.config.num_key_value_heads, spec["plot_path"], positions=positions,
            title=f"{entry.name}, B = {entry.budget} (sink {cfg.sink}, window {cfg.window}, topk {cfg.topk}"
                  f"{' + mLSTM state' if cfg.scorer == 'mlstm' else ''}): KV heads retaining each token")
        log(f"eviction plot: {path}")
    except Exception as err:  # noqa: BLE001 - a plot must not cost the table
        log(f"eviction plot failed: {err!r}\n{traceback.format_exc()}")


# --- outputs ---


def recall_plot(rows: list[dict], seq_len: int, path: Path) -> Path | None:
    """Recall per layer of every learned scorer, one panel per budget."""
    import numpy as np
    from matplotlib.figure import Figure

    budgets = sorted({r["budget"] for r in rows if r.get("recall_per_layer")}, reverse=True)
    if not budgets:
        return None
    fig = Figure(figsize=(6.0 * len(budgets), 3.6))
    axes = fig.subplots(1, len(budgets), squeeze=False)[0]
    for ax, budget in zip(axes, budgets):
        for r in rows:
            if r["budget"] == budget and base_row(r["policy"]) in LEARNED and r.get("recall_per_layer"):
                y = np.asarray(r["recall_per_layer"], dtype=float)
                ax.plot(range(len(y)), y, marker="o", markersize=3, label=f"{r['policy']} (mean {r['recall']:.3f})")
        ax.set_ylim(0.0, 1.02)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("layer")
        ax.set_ylabel("top-k retention recall")
        ax.set_title(f"B = {budget} (CR {1 - budget / seq_len:.0%}, S = {seq_len})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def seed_lines(rows: list[dict], budget: int) -> list[str]:
    """A row trained with several seeds (`row`, `row/s1`, ...): their mean and sample standard deviation."""
    import statistics

    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["budget"] == budget and r.get("trained"):
            groups.setdefault(r["policy"].split("/")[0], []).append(r)
    lines = []
    for name, group in groups.items():
        if len(group) < 2:
            continue
        cells = []
        for key, spec in (("rel_accuracy", ".3f"), ("top1_agreement", ".3f"), ("kl", ".4f"), ("ppl_ratio", ".3f"),
                          ("recall", ".3f")):
            xs = [r[key] for r in group if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            cells.append(f"{fmt(statistics.mean(xs), spec)} ± {fmt(statistics.stdev(xs), spec)}" if len(xs) > 1
                         else "-")
        lines.append(f"| {name}: mean ± sd of {len(group)} seeds | {' | '.join(cells)} | - | - | - |")
    return lines


def table_md(result: dict) -> str:
    some_frozen = not result.get("freeze_base") and any("+frozen" in r["policy"] for r in result["rows"])
    lines = [f"# Quality study: {result['model']}, S = {result['seq_len']}, sink {result['sink']}, "
             f"window {result['window']}", "",
             f"{result['date']}, {result['device']}, torch {result['torch']}, transformers {result['transformers']}; "
             f"{result['eval']['sequences']} held-out sequences ({result['data']}, split eval); "
             f"{result['steps']} training steps planned per run, "
             f"{'scorers only (base frozen)' if result.get('freeze_base') else 'full distillation'}"
             f"{' (rows marked +frozen: scorers only, the base frozen)' if some_frozen else ''}.", ""]
    for budget in result["budgets"]:
        cr = 1 - budget / result["seq_len"]
        lines += [f"## B = {budget} (CR {cr:.0%})", "",
                  "| row | rel. acc | top-1 agr | KL | ppl ratio | recall | cache held | trained steps | seqs |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["rows"]:
            if r["budget"] != budget:
                continue
            ckpt = " (ckpt)" if r.get("weights") == "checkpoint" else ""
            pre = f"{r['pretrain_steps']}+" if r.get("pretrain_steps") else ""
            steps = f"{pre}{r['steps_done']}{ckpt}" if "steps_done" in r else "-"
            name = r["policy"] + (" *" if r.get("stronger") else "")
            lines.append(f"| {name} | {fmt(r['rel_accuracy'], '.3f')} | {fmt(r['top1_agreement'], '.3f')} | "
                         f"{fmt(r['kl'], '.4f')} | {fmt(r['ppl_ratio'], '.3f')} | {fmt(r.get('recall'), '.3f')} | "
                         f"{fmt(r.get('avg_cache_fraction'), '.3f')} | {steps} | {r.get('sequences', '-')} |")
        lines += seed_lines(result["rows"], budget)
        for m in result["missing"]:
            if m["budget"] == budget:
                lines.append(f"| {m['policy']} | missing: {m['missing'].splitlines()[0][:120]} ||||||||")
        lines.append("")
    lines.append("cache held: the share of the budget a row really holds (DMS; the others fill it). "
                 "*: the stronger of TOVA's (H2O's) paper and windowed variants at that budget (lower KL)."
                 + (" P+D trained steps: P of the scorers alone (base frozen), then D of full distillation from "
                    "those weights." if any(r.get("pretrain_steps") for r in result["rows"]) else ""))
    return "\n".join(lines)


def versions() -> dict:
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'cpu'})"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "python": platform.python_version(), "host": platform.node()}


def parse(argv=None) -> argparse.Namespace:
    default_out = Path(os.environ["HOME"]) / "study" if os.environ.get("HOME") else Path("runs/study")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", default="all", choices=["train", "eval", "all", "worker"])
    p.add_argument("--out", type=Path, default=default_out, help=f"output directory (default {default_out})")
    p.add_argument("--model", default="smollm2-135m", help=f"{model_help()} (default smollm2-135m)")
    p.add_argument("--data", default="champ",
                   help="training data, one source or a mixture (champ,pystdlib,prose: kvpop.train.mix); the eval "
                        "phase uses its held-out split (a mixture's: --eval-sequences divided by the weights); "
                        "bench/domain_eval.py gives each source's rows apart")
    p.add_argument("--mix", action="append", default=None,
                   help="training data of the rows marked +mix (a `kvpop train --data` mixture, e.g. several "
                        "domains); repeatable: +mixN trains on the N-th; they are evaluated on --data too")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--budgets", default="2048,1024")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per training run (default 150)")
    p.add_argument("--lr-scorer", type=float, default=3e-3, help="peak scorer lr (default 3e-3, kvpop demo's)")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps (default min(20, half the steps): a run killed outright loses "
                        "at most that many)")
    p.add_argument("--concurrency", type=int, default=5,
                   help="training runs at once, over all GPUs of the host (default 5; spread evenly)")
    p.add_argument("--deadline-s", type=float, default=540, help="wall seconds for this command (default 540)")
    p.add_argument("--eval-reserve-s", type=float, default=300,
                   help="--phase all: seconds of the deadline kept for the evaluation (default 300)")
    p.add_argument("--stop-grace-s", type=float, default=60,
                   help="seconds before a deadline at which runs get SIGTERM to checkpoint (default 60)")
    p.add_argument("--fair-share", action="store_true",
                   help="stop each run after an equal share of the phase (waves of --concurrency runs), so that "
                        "every run starts within one command; default: every run goes on to --steps or the "
                        "deadline, and a finished run's slot goes to the next")
    p.add_argument("--min-start-s", type=float, default=60,
                   help="no training run starts with fewer seconds than this left (default 60)")
    p.add_argument("--eval-sequences", type=int, default=8)
    p.add_argument("--packing", default="document", choices=["document", "concat"],
                   help="held-out rows from a document start, as in real use (default), or cut from one stream "
                        "(rows that begin mid-document)")
    p.add_argument("--dynamic-batch", type=int, default=4,
                   help="held-out sequences per pass of the TOVA and H2O workers (default 4): their replayed "
                        "decode step is launch-bound, so a pass of 4 costs about what a pass of 1 does; memory "
                        "grows as 4 x S x vocab float32 logits, twice")
    p.add_argument("--report-s", type=float, default=30, help="seconds between progress lines (default 30)")
    p.add_argument("--seed", type=int, default=0, help="the evaluation's seed, and the trained runs' unless --seeds")
    p.add_argument("--seeds", default=None,
                   help="comma-separated training seeds: each trained row once per seed, the later ones as row/sN "
                        "(default: --seed); the table gives each seed's row and their mean and spread")
    p.add_argument("--freeze-base", action="store_true",
                   help="train the scorers (DMS: its gates) only, every row on the same base weights; no "
                        "StreamingLLM+ row (it trains nothing else)")
    p.add_argument("--lr-base", type=float, default=None,
                   help="base learning rate of the full-distillation runs (default: kvpop train's)")
    p.add_argument("--mps", action="store_true",
                   help="run the parallel processes under NVIDIA MPS (started here, stopped at the end; "
                        "falls back to time-slicing if it cannot start)")
    p.add_argument("--rows", default="", help=f"comma-separated trained rows (default all: {','.join(TRAINED)}), "
                   "each with optional modifiers: " + "; ".join(f"+{k}: {v}" for k, v in MODIFIERS.items()))
    p.add_argument("--free-rows", default=",".join(TRAINING_FREE),
                   help="comma-separated training-free rows to evaluate (default all: %(default)s); a study that "
                        "repeats earlier sequences may leave the slow dynamic rows (TOVA, H2O) to the earlier run")
    p.add_argument("--pretrain-steps", type=int, default=0,
                   help="train --pretrain-rows in two phases: this many steps of the scorers alone (--freeze-base: "
                        "no teacher, no base backward), then --steps of full distillation from those weights "
                        "(kvpop train --init-from); each phase resumes across commands (default 0: one phase)")
    p.add_argument("--pretrain-rows", default="",
                   help="comma-separated rows pre-trained with --pretrain-steps (default: every KVpop scorer row)")
    p.add_argument("--keep-every", type=int, default=0,
                   help="keep every N-th step's checkpoint of each run (kvpop train --keep-every), for "
                        "bench/recall_curve.py (default 0: the newest only)")
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.budgets = sorted((int(b) for b in str(args.budgets).split(",") if b), reverse=True)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else [args.seed]
    args.free_rows = [r for r in args.free_rows.split(",") if r]
    unknown = sorted(set(args.free_rows) - set(TRAINING_FREE))
    if unknown:
        p.error(f"--free-rows: unknown {unknown}; choose from {', '.join(TRAINING_FREE)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.phase == "worker":
        return worker(args.spec)
    args.out.mkdir(parents=True, exist_ok=True)
    end = START + args.deadline_s
    log(f"quality study: phase {args.phase}, out {args.out}, {args.model}, S {args.seq_len}, budgets {args.budgets}, "
        f"steps {args.steps}, concurrency {args.concurrency}, deadline in {args.deadline_s:.0f} s")
    for b in args.budgets:
        if not args.sink + args.window < b < args.seq_len:
            raise SystemExit(f"budget {b} must lie between sink + window = {args.sink + args.window} and --seq-len")
    runs = plan_runs(args)
    stop_mps = start_mps(args.out) if args.mps else None
    try:
        return run_phases(args, runs, end, mps=stop_mps is not None, argv=argv)
    finally:
        if stop_mps is not None:
            stop_mps()


def run_phases(args, runs: list[Run], end: float, mps: bool, argv=None) -> int:
    if args.phase in ("train", "all"):
        # convert / load the model once here, so that the parallel runs find it ready
        from kvpop.models import load_model

        load_model(args.model)
        train_end = end - args.eval_reserve_s if args.phase == "all" else end
        train_phase(args, runs, train_end)
    if args.phase == "train":
        summary = {"mps": mps, **{r.name: r.status for r in runs}}
        write_json(args.out / "train_status.json", summary)
        done = sum(r.done() for r in runs)
        log(f"train phase over: {done} of {len(runs)} runs final; statuses in {args.out / 'train_status.json'}")
        return 0
    ev = eval_phase(args, runs, end - 15)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **versions(),
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(["quality_study.py", *argv]),
        "model": args.model, "data": args.data, "mix": args.mix, "seq_len": args.seq_len, "budgets": args.budgets,
        "sink": args.sink,
        "window": args.window, "packing": args.packing, "steps": args.steps, "seed": args.seed,
        "lr_scorer": args.lr_scorer, "freeze_base": args.freeze_base, "free_rows": args.free_rows,
        "lr_base": args.lr_base, "mps": mps, "pretrain_steps": args.pretrain_steps,
        "pretrain_rows": pretrain_rows(args),
        "rows": ev["rows"], "missing": ev["missing"],
        "columns": ["rel_accuracy", "top1_agreement", "kl", "ppl_ratio", "recall"],
        "eval": {"sequences": ev["sequences"], "worker_commands": ev["worker_commands"]},
        "train": {r.name: {**(json.loads((r.out / "study_status.json").read_text())
                              if (r.out / "study_status.json").exists() else r.status),
                           "args": " ".join(r.args), "steps_done": r.steps_done(), "final": r.done()}
                  for r in runs},
        "seconds": round(time.time() - START, 1),
    }
    write_json(args.out / "results.json", result)
    (args.out / "table.md").write_text(table_md(result))
    try:
        recall_plot(result["rows"], args.seq_len, args.out / "recall_per_layer.png")
    except Exception as err:  # noqa: BLE001 - a plot must not cost the table
        log(f"recall plot failed: {err!r}")
    print(table_md(result), flush=True)
    print(json.dumps({"rows": [{k: r.get(k) for k in ("policy", "budget", "rel_accuracy", "top1_agreement", "kl",
                                                       "ppl_ratio", "recall", "avg_cache_fraction", "stronger")}
                               for r in result["rows"]],
                      "missing": [(m["policy"], m["budget"]) for m in result["missing"]]}), flush=True)
    log(f"done: {args.out / 'results.json'}, table.md, recall_per_layer.png, eviction_pattern.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
