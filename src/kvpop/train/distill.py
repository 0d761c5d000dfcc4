"""Distillation of a KVpop retrofit (`docs/method.md` Sec. 6): the trainer behind `kvpop train`.

    kvpop train --model tiny-random-qwen3 --data notes.txt --seq-len 256 --sink 4 --window 32 --topk 64 \
        --steps 100 --out runs/tiny

The student is the model with KVpop attention in every layer. Its base weights learn only from
`KL(teacher || student)` against a frozen dense copy (the teacher); its scorers and decays learn
only from the boundary loss on the future-attention target, computed from the student's own
sparse attention. `--freeze-base` trains the scorers alone (no teacher copy, no KL): the mode a
CPU runs in minutes; its `OUT/final` holds the scorers and where the base is found, not the base.
Under `torchrun` the same command runs data-parallel (DDP, or FSDP2 with `--fsdp`), each rank
taking its share of every global batch.

Nothing is lost: a checkpoint (model, optimizer, scheduler, RNG states, step; data only, as JSON
and safetensors) is written atomically every `--save-every` steps and on Ctrl-C, the previous one
kept until the new one is complete (`kvpop.train.checkpoint`); `--resume` continues to the losses an
uninterrupted run gives, in the same or a moved directory; an `--out` holding a run is refused
unless `--resume` or `--overwrite` is given; a non-finite loss stops the run before anything is
overwritten.
`--keep-every N` also keeps every N-th step's checkpoint, for a curve against the steps.

`--init-from DIR` starts a new run (step 0, fresh optimizer and schedule) from the weights of another
(`kvpop.train.weights`: a run directory, one of its checkpoints, or a `kvpop.save` directory) at the
same KVpop config: its scorers, and its base weights where they differ from `--model`'s (the source
distilled them). The teacher is always `--model` as loaded. The two-phase recipe:

    kvpop train --model smollm2-135m --scorer mlstm ... --freeze-base --steps 600 --out runs/pre
    kvpop train --model smollm2-135m --init-from runs/pre --steps 120 --out runs/distill

The run records where it started (`config.json` and every checkpoint's manifest, key `init`); a
`--resume` of it needs no `--init-from` (it is refused there): its checkpoints hold all it changed.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kvpop import limits
from kvpop.attention import Capture
from kvpop.config import KVpopConfig
from kvpop.files import check_scorers, write_atomic
from kvpop.ops.target import future_attention_target
from kvpop.retrofit import kvpop_modules, model_head_dim, resolve_config, retrofit, save
from kvpop.timing import timed
from kvpop.train import checkpoint as ckpt
from kvpop.train.calibrate import prior_offset, shift_bias
from kvpop.train.checkpoint import LOG, TrainingError
from kvpop.train.data import batches
from kvpop.train.loss import boundary_labels, boundary_loss, teacher_priority
from kvpop.train.mix import Pool, training_rows

__all__ = ["LOG", "Distiller", "TrainConfig", "TrainingError", "kl_divergence", "scorer_lr_factor", "train"]

RESUME_MAY_CHANGE = ("steps", "save_every", "keep_every")
"""TrainConfig fields a resume may change; `out`, `model`, `data` and `device` are matched by what they
are (the checkpoint's own directory, the base weights, the packed tokens, the device type), not spelled."""


@dataclass
class TrainConfig:
    """Everything of a run but the KVpop config; saved as `OUT/config.json` with it."""

    model: str = "tiny-random-qwen3"
    """Preset name, local Hugging Face directory or `kvpop.save` directory."""
    data: str = "champ"
    """Data source (`kvpop.train.data.load_texts`): champ, pystdlib, prose, a file, a directory or a dataset
    name; or a mixture of them, `champ:0.5,pystdlib:0.3,prose:0.2` (`kvpop.train.mix`)."""
    text_field: str | None = None
    """Field holding the text in jsonl/parquet/dataset records."""
    chat: bool = False
    """Format conversations (and champ problems, alone or in a mixture) with the tokenizer's chat template."""
    seq_len: int = 512
    """Tokens per packed training sequence; must exceed the KVpop budget."""
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 1
    """Sequences per micro-batch, over all ranks together (the global batch)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr_base: float = 8e-5
    """Constant learning rate of the base weights (KL only)."""
    lr_scorer: float = 1e-3
    """Peak learning rate of scorers and decays (warm-up, then cosine to 10 %)."""
    warmup_steps: int = -1
    """Scorer warm-up steps; -1 means 5 % of `steps`."""
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    """Gradient-norm clip, applied to the base and the scorer parameters separately; 0 disables."""
    freeze_base: bool = False
    """Train the scorers only: no KL for the base (DMS still keeps a teacher: its gates learn through the KL)."""
    kl_topk: int = 0
    """0: KL over the full vocabulary; N > 0: over the teacher's top-N logits, renormalised."""
    out: str = "runs/train"
    save_every: int = 50
    """Checkpoint every this many steps (and at the end and on Ctrl-C); 0: only then."""
    keep_every: int = 0
    """Also checkpoint every this many steps, and keep those checkpoints (a curve against the steps reads them);
    0: only the newest checkpoint is kept."""
    seed: int = 0
    device: str = "auto"
    """auto: CUDA when present (and this rank's GPU under torchrun), else CPU."""
    fsdp: bool = False
    """Under torchrun, shard with FSDP2 instead of replicating with DDP."""
    eval_fraction: float = 0.1
    """Share of documents (champ: problems) held out from training."""
    max_tokens: int = 0
    """Tokens of documents packed for training (0: what the run consumes, at least 8 sequences). The packed
    set, and so the order of the batches, follows `steps` unless this is set: runs of different lengths
    see the same batches in the same order only with the same `max_tokens`."""
    deterministic: bool = False
    """Deterministic kernels only (`torch.use_deterministic_algorithms`): the same command on the same GPU
    and software then repeats bitwise, at some cost in speed; an op without such a kernel raises, naming it."""
    attention: str = "auto"
    """The student's sparse attention (`ops.attention.sparse_attention`'s backend): "auto" (by shape and budget,
    `ops.attention.backends.auto_backend`: on CUDA the gathered tiles where they save enough attention work, as at the
    Qwen3-4B shape and S = 16k, where one layer's forward + backward is 3.4x faster than "flex", else FlexAttention
    over the whole sequence, as for SmolLM2 at S = 8192, whose step is bound by the host's launches and was 1.05-1.4x
    slower with the tiles; on the CPU the gathered tiles), "flex" (CUDA only) or "gather" (either device). The same
    decisions either way; the floats' order differs."""

    def __post_init__(self) -> None:
        checks = [
            ("seq_len", self.seq_len >= 2, "must be >= 2"),
            ("steps", self.steps >= 1, "must be >= 1"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("grad_accum", self.grad_accum >= 1, "must be >= 1"),
            ("lr_base", self.lr_base >= 0 and math.isfinite(self.lr_base), "must be a finite number >= 0"),
            ("lr_scorer", self.lr_scorer >= 0 and math.isfinite(self.lr_scorer), "must be a finite number >= 0"),
            ("warmup_steps", self.warmup_steps >= -1, "must be >= 0 (or -1 for 5 % of steps)"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0"),
            ("kl_topk", self.kl_topk >= 0, "must be >= 0"),
            ("save_every", self.save_every >= 0, "must be >= 0"),
            ("keep_every", self.keep_every >= 0, "must be >= 0"),
            ("eval_fraction", 0 <= self.eval_fraction < 1, "must lie in [0, 1)"),
            ("max_tokens", self.max_tokens >= 0, "must be >= 0"),
            ("attention", self.attention in ("auto", "flex", "gather"), "must be 'auto', 'flex' or 'gather'"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is invalid: {allowed}")

    @property
    def pool_tokens(self) -> int:
        """Tokens of training documents to pack: `max_tokens`, else what the run consumes (at least 8 sequences)."""
        return self.max_tokens or max(self.steps * self.grad_accum * self.batch_size * self.seq_len, 8 * self.seq_len)

    @property
    def warmup(self) -> int:
        return max(1, round(0.05 * self.steps)) if self.warmup_steps < 0 else self.warmup_steps


# --- schedules, KL, distributed helpers ---


def scorer_lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine down to `floor` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _kl_rows_sum(teacher_logits: Tensor, student_logits: Tensor, topk: int) -> Tensor:
    """Sum over rows of `KL(teacher || student)`, float32 (the reference; `kl_divergence` chunks it)."""
    t, s = teacher_logits.float(), student_logits.float()
    if topk:
        idx = t.topk(topk, dim=-1).indices
        t, s = t.gather(-1, idx), s.gather(-1, idx)
    log_p, log_q = F.log_softmax(t, -1), F.log_softmax(s, -1)
    return (log_p.exp() * (log_p - log_q)).sum()


KL_CHUNK = 1024
"""Positions per chunk of `kl_divergence`: float32 copies of 1024 x 49,152 logits are 200 MB each."""


def kl_divergence(teacher_logits: Tensor, student_logits: Tensor, topk: int = 0, chunk: int = KL_CHUNK) -> Tensor:
    """Mean over positions of `KL(teacher || student)` on next-token distributions, in float32.

    Computed `chunk` positions at a time, each recomputed in the backward pass: the float32 softmaxes
    of a whole 8192-token sequence over a 49k vocabulary would hold ~10 GB of activations, a chunk's
    are 1/8 of that and freed at once. Same value and gradient as one pass (`_kl_rows_sum`).

    Args:
        teacher_logits, student_logits: [B, S, V].
        topk: 0 for the full vocabulary, else the teacher's top-`topk` logits, both sides renormalised.
    """
    V = teacher_logits.shape[-1]
    t, s = teacher_logits.reshape(-1, V), student_logits.reshape(-1, V)
    n = t.shape[0]
    if n <= chunk:
        return _kl_rows_sum(t, s, topk) / n
    total = torch.zeros((), device=s.device, dtype=torch.float32)
    for i in range(0, n, chunk):
        part = (t[i : i + chunk], s[i : i + chunk], topk)
        total = total + (checkpoint(_kl_rows_sum, *part, use_reentrant=False) if s.requires_grad
                         else _kl_rows_sum(*part))
    return total / n


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    distributed: bool = False
    """Launched by torchrun: a process group exists and the model is wrapped (DDP / FSDP2), even on one rank."""

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, x: Tensor) -> Tensor:
        if self.distributed:
            x = x.clone()
            dist.all_reduce(x)
        return x


def init_distributed(device: str) -> Dist:
    """torchrun's environment -> a process group (NCCL on GPUs, gloo on CPUs); single process otherwise.

    Under torchrun a single rank still gets its process group and wrapped model, so that
    `torchrun --nproc-per-node 1` runs the same code (collectives, DDP / FSDP2) as a multi-GPU run.
    """
    if "RANK" not in os.environ:
        return Dist()
    d = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")), True)
    if not dist.is_initialized():
        use_cuda = device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(d.local_rank)
            # binding the group to this rank's GPU: NCCL then needs no guess at barrier() (torch warns otherwise)
            dist.init_process_group("nccl", device_id=torch.device("cuda", d.local_rank))
        else:
            dist.init_process_group("gloo")
    return d


def describe_cache(kcfg: KVpopConfig, head_dim: int) -> str:
    """One line on what the cache of a resolved config holds per (layer, KV head), the scorer state included."""
    entries = kcfg.state_entries(head_dim)
    matched = kcfg.extra.get("match_mlp_memory")
    topk = (f"effective topk {kcfg.topk} = {matched['mlp_topk']} - {entries} (match_mlp_memory)" if matched
            else f"topk {kcfg.topk}")
    return (f"scorer {kcfg.scorer}, delay {kcfg.readout_delay}; per KV head: sink {kcfg.sink} + window {kcfg.window} + "
            f"{topk} = {kcfg.budget} entries, plus the mLSTM state ({entries} KV entries)")


# --- the trainer ---


class Distiller:
    """One training run. `run()` trains to `steps`, checkpointing as it goes, and saves `OUT/final`."""

    def __init__(self, tcfg: TrainConfig, kcfg: KVpopConfig | None, *, resume: bool = False, overwrite: bool = False,
                 init_from: str | Path | None = None, argv: list[str] | None = None):
        """`kcfg` None: the config of `--model` (a kvpop directory), of `init_from`, or of the run resumed."""
        from kvpop.models import load_model

        self.tcfg, self.out, self.argv = tcfg, Path(tcfg.out), argv
        # before anything is loaded: a run in --out is never reused silently
        self.resume_from = ckpt.check_out(self.out, resume=resume, overwrite=overwrite, init=init_from is not None)
        self.init: dict[str, Any] | None = None
        """Where this run started from (`TrainedWeights.record()` and `base_weights`), or None: a fresh retrofit."""
        self.overwrite, self.aside = overwrite, None
        self.dist = init_distributed(tcfg.device)
        self.device = self._device(tcfg.device)
        if tcfg.attention == "flex" and self.device.type != "cuda":
            raise ValueError(f"--attention flex trains on CUDA only (FlexAttention has no backward on "
                             f"{self.device.type}); use auto or gather")
        if tcfg.batch_size % self.dist.world:
            raise ValueError(f"--batch-size {tcfg.batch_size} must be a multiple of the number of ranks ({self.dist.world})")
        torch.manual_seed(tcfg.seed)
        model, self.tokenizer = load_model(tcfg.model, device=self.device, config=as_trained(tcfg.model))
        pretrained = getattr(model, "kvpop", None)
        source = None
        if init_from is not None:
            from kvpop.train.weights import read_weights

            if pretrained is not None:
                raise ValueError(f"--init-from starts from the base model: --model {tcfg.model} is a kvpop directory; "
                                 "give the base model it was trained from")
            source = read_weights(init_from)
            kcfg = source.config if kcfg is None else kcfg
        if pretrained is not None and kcfg is None:
            kcfg = kvpop_modules(model).config
        if kcfg is None and self.resume_from is not None:
            kcfg = self._recorded_config(self.resume_from)
        if kcfg is None:
            raise ValueError("a KVpopConfig is needed unless --model is a kvpop directory (or --init-from gives one)")
        if kcfg.policy == "dms" and kcfg.dms_target_retention is None:
            # DMS: the retention target follows from the budget and this run's length; it is saved with the model
            from kvpop.baselines.dms import target_retention

            kcfg = dataclasses.replace(kcfg, dms_target_retention=target_retention(kcfg, tcfg.seq_len))
        # the config the model runs: with match_mlp_memory, topk shrinks by the mLSTM state
        self.kcfg = kcfg = resolve_config(model, kcfg)
        if tcfg.fsdp and kcfg.tova_prior is not None:
            raise ValueError("--fsdp with KVpop-TOVA (tova_prior): the bias calibration does not handle sharded "
                             "scorers yet; train it with DDP (torchrun without --fsdp) or on one device")
        if self.dist.main and kcfg.scorer == "mlstm" and kcfg.policy == "kvpop":
            print(f"kvpop train: {describe_cache(kcfg, model_head_dim(model))}", file=sys.stderr)
        if kcfg.policy in ("tova", "h2o", "oracle"):
            raise ValueError(f"policy {kcfg.policy!r} has nothing to train (training-free); evaluate it with kvpop eval")
        if kcfg.policy in ("streaming_llm", "streaming_llm_plus") and tcfg.freeze_base:
            raise ValueError(f"policy {kcfg.policy!r} has no scorer: with --freeze-base there is nothing to train")
        self._check_lengths(model)
        # before the teacher copy and the first step: a length or batch that cannot fit is refused with its estimate
        limits.check_training(model, tcfg, self.dist.world, self.device,
                              teacher=not tcfg.freeze_base or kcfg.policy == "dms")
        if source is not None and kcfg != source.config:
            from kvpop.train.weights import config_differences

            raise ValueError(f"--init-from {init_from} was trained at another KVpop config: "
                             f"{'; '.join(config_differences(kcfg, source.config))} (here: this run, there: "
                             f"{source.path}); a run started from it trains at its config")
        if pretrained is not None and kvpop_modules(model).config != kcfg:
            raise ValueError(
                f"{tcfg.model} is already retrofitted with {kvpop_modules(model).config}; it cannot be retrained "
                f"with a different config"
            )

        self.teacher = None
        # DMS gates learn from the KL even with the base frozen, so DMS always has a teacher
        if not tcfg.freeze_base or kcfg.policy == "dms":
            base = copy.deepcopy(model)
            if pretrained is not None:
                from kvpop.retrofit import detach

                detach(base)
            self.teacher = base.eval().requires_grad_(False)
        if pretrained is None:
            # on a weightless copy first: scorers a config or a source cannot have are refused before they are made
            from kvpop.train.weights import scorer_shapes

            check_scorers(model, kcfg, retrofit, None if source is None else scorer_shapes(source),
                          "the KVpop config" if source is None else source.path,
                          "lower --scorer-hidden or the budget" if source is None else "the source is damaged")
            retrofit(model, kcfg)
        mods = kvpop_modules(model)
        if mods.base is not None and not mods.base.get("name"):
            mods.base["name"] = tcfg.model
        self.model = model
        if source is not None:
            self._start_from(source)
        self.model.train()
        scorer_ids = {id(p) for p in kvpop_modules(model).parameters()}
        if tcfg.freeze_base:
            for p in model.parameters():
                if id(p) not in scorer_ids:
                    p.requires_grad_(False)
        # wrap before building the optimizer: FSDP2 replaces the parameters by sharded ones
        self.forward_model = self._wrap(model)
        scorer_params = list(kvpop_modules(model).parameters())
        scorer_ids = {id(p) for p in scorer_params}
        base_params = [p for p in model.parameters() if id(p) not in scorer_ids and p.requires_grad]
        groups = [{"params": scorer_params, "lr": tcfg.lr_scorer, "name": "scorer"}]
        if base_params:
            groups.append({"params": base_params, "lr": tcfg.lr_base, "name": "base"})
        self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay)
        factors = [lambda s: scorer_lr_factor(s, tcfg.warmup, tcfg.steps)] + [lambda s: 1.0] * (len(groups) - 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factors)
        self.sampler = torch.Generator(device="cpu").manual_seed(tcfg.seed + 1)
        self.step = 0
        self.last_saved: int | None = None
        self.last_checkpoint: Path | None = None
        # SIGTERM on this rank, and on any rank as of the last step's all-reduce (ranks must stop together)
        self.stop_requested = False
        self.stop_agreed = False
        # KVpop-TOVA: per layer, the offset sums and counts of the step in flight (`train/calibrate.py`)
        self.calibration: dict[int, tuple[Tensor, Tensor]] = {}
        self.pool_tokens = tcfg.pool_tokens  # a resumed run keeps the one it started with
        resumed = self._load_checkpoint(self.resume_from) if self.resume_from is not None else None
        self.pool = self._training_pool()
        self.tokens = self.pool.tokens
        self.data_sha256 = hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()
        if resumed is not None:
            self._check_same_data(resumed)
            if self.dist.main:
                print(f"kvpop train: resuming from step {self.step} of {tcfg.steps} ({self.resume_from.path})",
                      file=sys.stderr)

    # --- setup ---
    def _start_from(self, source) -> None:
        """Load `source`'s weights (`kvpop.train.weights.TrainedWeights`) into the student: a run started from them."""
        from kvpop.train.weights import SCORERS, check_base, load_into

        check_base(source, self.model, f"--model {self.tcfg.model}")
        current = self.model.state_dict()
        # base weights equal to --model's (a --freeze-base source's) are not the source's doing: they are left out,
        # so that this run's checkpoints hold the base only where it was distilled (here or there)
        distilled = any(k in current and not torch.equal(v.to(current[k]), current[k])
                        for k, v in source.state.items() if not k.startswith(SCORERS))
        load_into(self.model, source, None if distilled else
                  {k: v for k, v in source.state.items() if k.startswith(SCORERS)})
        self.init = {**source.record(), "base_weights": distilled}
        if self.dist.main:
            what = "gates" if self.kcfg.policy == "dms" else "scorers"
            step = "" if source.step is None else f", step {source.step}"
            print(f"kvpop train: starting from {source.path}{step}: its {what}"
                  f"{' and its distilled base weights' if distilled else ''}", file=sys.stderr)

    @staticmethod
    def _recorded_config(checkpoint: ckpt.Checkpoint) -> KVpopConfig:
        """The KVpop config of the run being resumed, from its checkpoint's manifest."""
        state = checkpoint.manifest if checkpoint.manifest is not None else checkpoint.read()
        try:
            return KVpopConfig.from_dict(state["kvpop_config"])
        except (KeyError, TypeError, ValueError) as err:
            raise TrainingError(f"--resume: {checkpoint.path} holds a config this kvpop cannot read ({err})") from None

    def _device(self, name: str) -> torch.device:
        from kvpop.models import resolve_device

        if name == "auto" and torch.cuda.is_available():
            return torch.device("cuda", self.dist.local_rank)
        return torch.device(resolve_device(name))

    def _check_lengths(self, model: nn.Module) -> None:
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and self.tcfg.seq_len > limit:
            raise ValueError(f"--seq-len {self.tcfg.seq_len} exceeds the model's max_position_embeddings={limit}")
        if self.kcfg.budget >= self.tcfg.seq_len:
            raise ValueError(
                f"the budget sink + window + topk = {self.kcfg.budget} is not below --seq-len {self.tcfg.seq_len}: "
                "nothing would ever be evicted, so there is nothing to train"
            )

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.dist.distributed:
            return model
        if self.tcfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.get_decoder().layers:
                fully_shard(layer)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def _training_pool(self) -> Pool:
        """Pack documents until `pool_tokens` are covered, identically on every rank (`kvpop.train.mix`)."""
        t = self.tcfg
        rows = -(-self.pool_tokens // t.seq_len)
        # the packed rows (int64), and the documents' token ids they are cut from, at the least as many again
        limits.check_fits({"training tokens": 2 * rows * t.seq_len * 8}, "cpu",
                          f"{self.pool_tokens} training tokens (--max-tokens, else --steps x --batch-size x --grad-accum "
                          "x --seq-len)", "lower --max-tokens or --steps")
        pool = training_rows(t.data, self.tokenizer, t.seq_len, self.pool_tokens, text_field=t.text_field,
                             eval_fraction=t.eval_fraction, seed=t.seed, chat=t.chat)
        if len(pool.parts) > 1 and self.dist.main:
            parts = ", ".join(f"{p['source']} {p['rows']} ({p['share']:.0%})"
                              + (f", repeated x{p['passes']:.2f}" if p["passes"] > 1 else "") for p in pool.summary())
            print(f"kvpop train: {len(pool.tokens)} sequences of {t.seq_len} tokens from {parts}", file=sys.stderr)
        return pool

    # --- one step ---
    def _micro_step(self, batch: Tensor) -> dict[str, Tensor]:
        t, k = self.tcfg, self.kcfg
        batch = batch.to(self.device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        records = Capture()
        with autocast:
            # scorer-only training needs no logits: the LM head runs on the last position only
            keep = {} if self.teacher is not None else {"logits_to_keep": 1}
            if t.attention != "auto":
                keep["kvpop_backend"] = t.attention
            with timed("kvpop.student_forward"):
                logits = self.forward_model(batch, kvpop_capture=records, use_cache=False, **keep).logits
            loss_kl = torch.zeros((), device=self.device)
            if self.teacher is not None:
                with torch.no_grad(), timed("kvpop.teacher_forward"):
                    teacher_logits = self.teacher(batch, use_cache=False).logits
                with timed("kvpop.kl"):
                    loss_kl = kl_divergence(teacher_logits, logits, t.kl_topk)
        # the layers the policy runs in (a hybrid model's sliding-window layers have nothing to learn)
        n_layers = len(kvpop_modules(self.model).policy_layers)
        if len(records) != n_layers:
            raise TrainingError(f"captured {len(records)} of {n_layers} layers: a wrapper dropped the kvpop_capture kwarg")
        losses, keep, acc = [], [], []
        extra: dict[str, Tensor] = {}
        if k.policy == "dms":
            # DMS: no boundary loss; its gates learn from the KL through the soft mask and the compression loss
            from kvpop.baselines.dms import compression_loss

            loss, extra = compression_loss(records, k)
            losses.append(loss)
            keep.append(extra["retention"])
        for rec in records if k.topk > 0 and k.policy != "dms" else []:
            lk = kvpop_modules(self.model).layer_config(rec.layer_idx)  # per-layer budgets: this layer's own top-k
            if lk.topk == 0:
                # a layer given no long-range slots has no ranking to learn; a zero loss keeps its scorer in
                # the graph (DDP expects a gradient for every parameter)
                losses.append(rec.priority.sum() * 0.0)
                continue
            with timed("kvpop.target"):
                r_tgt = future_attention_target(
                    rec.query.detach(), rec.key.detach(), rec.lse.detach(), lk.window, scale=rec.scale,
                    eps=lk.target_eps, agg=lk.target_agg, count_norm=lk.target_count_norm, softcap=rec.softcap,
                )
            with timed("kvpop.boundary_loss"):
                pi_tgt = teacher_priority(r_tgt, rec.log_gamma, lk.decay_step)
                pairs = boundary_labels(pi_tgt, lk.sink, lk.window, lk.topk, lk.loss_query_fraction, self.sampler)
                loss, stats = boundary_loss(
                    rec.priority, pairs, lk.loss_tau, lk.loss_margin_delta, lk.loss_balance, lk.loss_balance_clip,
                    reduce_counts=self.dist.all_sum if self.dist.distributed else None,
                )
            losses.append(loss)
            keep.append(stats["keep_rate"])
            acc.append(stats["accuracy"])
            if k.tova_prior is not None:
                # KVpop-TOVA: the per-head offset of `exp(r)` against the target (`train/calibrate.py`)
                sums, counts = prior_offset(pi_tgt, rec.priority, pairs)
                prev = self.calibration.get(rec.layer_idx)
                self.calibration[rec.layer_idx] = (sums, counts) if prev is None else (prev[0] + sums, prev[1] + counts)
        # a fixed pattern (topk = 0, StreamingLLM+) has no ranking to learn: only the KL trains it
        zero = torch.zeros((), device=self.device)
        loss_score = torch.stack(losses).mean() if losses else zero
        keep, acc = keep or [zero * float("nan")], acc or [zero * float("nan")]
        with timed("kvpop.backward"):
            ((loss_kl + loss_score) / t.grad_accum).backward()
        return {
            "loss_kl": loss_kl.detach(),
            "loss_score": loss_score.detach(),
            "keep_rate": torch.stack(keep).nanmean(),
            "accuracy": torch.stack(acc).nanmean(),
            **extra,
        }

    def train_step(self, micro_batches: list[Tensor]) -> dict[str, float]:
        """One optimizer step over `grad_accum` micro-batches; returns the logged numbers."""
        t = self.tcfg
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Tensor] = {}
        share = t.batch_size // self.dist.world
        for mb in micro_batches:
            rows = mb[self.dist.rank * share : (self.dist.rank + 1) * share]
            for name, v in self._micro_step(rows).items():
                sums[name] = sums.get(name, 0) + v / t.grad_accum
        # a stop request (SIGTERM on any rank) rides on the step's one all-reduce: every rank stops after this step
        stop = torch.tensor(float(self.stop_requested), device=self.device)
        stats = torch.stack([sums["loss_kl"], sums["loss_score"], sums["keep_rate"], sums["accuracy"], stop])
        stats = self.dist.all_sum(stats) / self.dist.world
        loss_kl, loss_score, keep_rate, accuracy, stop = stats.tolist()
        self.stop_agreed = stop > 0
        if not all(math.isfinite(x) for x in (loss_kl, loss_score)):
            where = f"{self.last_checkpoint} (step {self.last_saved})" if self.last_checkpoint is not None else "none yet"
            raise TrainingError(
                f"non-finite loss at step {self.step + 1} (loss_kl={loss_kl}, loss_score={loss_score}); "
                f"stopped without saving. Last good checkpoint: {where}"
            )
        # each group is clipped on its own: the two losses train disjoint parameters, and a large KL
        # gradient must not shrink the scorer's steps
        norms = {}
        with timed("kvpop.optimizer"):
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params and t.grad_clip > 0:
                    norms[group["name"]] = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
            self.optimizer.step()
        if self.calibration:
            self._calibrate()
        lrs = {g["name"]: g["lr"] for g in self.optimizer.param_groups}
        self.scheduler.step()
        self.step += 1
        elapsed = time.perf_counter() - start
        return {
            "step": self.step,
            "loss": loss_kl + loss_score,
            "loss_score": loss_score,
            "loss_kl": loss_kl,
            "lr_base": lrs.get("base", 0.0),
            "lr_scorer": lrs["scorer"],
            "tokens_per_s": t.grad_accum * t.batch_size * t.seq_len / elapsed,
            "keep_rate": keep_rate,
            "accuracy": accuracy,
            "grad_norm_scorer": norms.get("scorer", 0.0),
            "grad_norm_base": norms.get("base", 0.0),
            "step_time_s": elapsed,
            # policy-specific numbers (DMS: retention, retention_hard, target_retention)
            **{name: float(self.dist.all_sum(v) / self.dist.world) for name, v in sums.items()
               if name not in ("loss_kl", "loss_score", "keep_rate", "accuracy")},
        }

    def _calibrate(self) -> None:
        """KVpop-TOVA: move each layer's scorer bias `b2` toward the step's measured offset (all ranks alike)."""
        layers = sorted(self.calibration)
        sums = self.dist.all_sum(torch.stack([self.calibration[i][0] for i in layers]))
        counts = self.dist.all_sum(torch.stack([self.calibration[i][1] for i in layers]))
        policies = kvpop_modules(self.model).layers
        for j, i in enumerate(layers):
            shift_bias(policies[i].scorer.b2, sums[j], counts[j])
        self.calibration.clear()

    def batches(self) -> Iterator[list[Tensor]]:
        t = self.tcfg
        stream = batches(self.tokens, t.batch_size, t.seed, start_step=self.step * t.grad_accum)
        while True:
            yield [next(stream) for _ in range(t.grad_accum)]

    # --- the loop ---
    def run(self, progress: bool = True) -> Path:
        if self.dist.main:
            if self.overwrite and ckpt.holds_run(self.out):
                self.aside = ckpt.move_aside(self.out)
            self.out.mkdir(parents=True, exist_ok=True)
            self._write_config()
            if self.resume_from is not None:
                ckpt.trim_log(self.out, self.step)
        self._barrier()
        try:
            return self._loop(progress)
        except BaseException:
            if self.aside is not None:
                # --overwrite, and the new run has no checkpoint yet: the replaced run comes back whole
                ckpt.restore(self.out, self.aside)
                self.aside = None
            raise

    def _loop(self, progress: bool) -> Path:
        t = self.tcfg
        interrupted = False

        def on_sigterm(*_):
            # finish the step in flight, then checkpoint: a checkpoint never holds half an optimizer step,
            # and a second SIGTERM (schedulers repeat it) cannot kill the run while it saves
            self.stop_requested = True

        old = signal.signal(signal.SIGTERM, on_sigterm) if self._main_thread() else None
        bar = self._progress(progress)
        try:
            try:
                for micro in self.batches():
                    if self.step >= t.steps or self.stop_agreed or (self.stop_requested and not self.dist.distributed):
                        break
                    row = self.train_step(micro)
                    if self.dist.main:
                        with open(self.out / LOG, "a") as f:
                            f.write(json.dumps(row) + "\n")
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(score=f"{row['loss_score']:.4f}", kl=f"{row['loss_kl']:.4f}",
                                            acc=f"{row['accuracy']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                    due = any(n and self.step % n == 0 for n in (t.save_every, t.keep_every))
                    if due and self.step < t.steps:
                        self.save_checkpoint()
            except KeyboardInterrupt:
                interrupted = True
            finally:
                if bar is not None:
                    bar.close()
            interrupted = interrupted or self.stop_requested or self.stop_agreed
            self.save_checkpoint()
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
        if interrupted:
            raise KeyboardInterrupt(f"interrupted at step {self.step}; resume with --resume (checkpoint saved)")
        final = self.out / "final"
        self._save_final(final)
        return final

    # --- persistence ---
    def _checkpoint_parts(self) -> dict[str, dict[str, Any]]:
        """The files of a checkpoint: the trained weights, and the optimizer, scheduler and RNG states."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
               "sampler": self.sampler.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            ckpt.MODEL: {"model": self._trained_state()},
            "train_state": {"step": self.step, "optimizer": self._optimizer_state(),
                            "scheduler": self.scheduler.state_dict(), "rng": rng},
        }

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What a resume must match, as JSON in the manifest: a moved directory still resumes."""
        return {
            "train_config": dataclasses.asdict(self.tcfg),
            "kvpop_config": self.kcfg.to_dict(),
            "world": self.dist.world,
            "pool_tokens": self.pool_tokens,
            "device_type": self.device.type,
            "data_sha256": self.data_sha256,
            "base": kvpop_modules(self.model).base,
            "init": self.init,
        }

    @property
    def _holds_base(self) -> bool:
        """Whether the base weights differ from --model's: trained here, or distilled by the run started from."""
        return not self.tcfg.freeze_base or bool(self.init and self.init["base_weights"])

    def _trained_state(self) -> dict[str, Tensor]:
        state = self._full_state_dict()
        if not self._holds_base:
            state = {k: v for k, v in state.items() if k.startswith("kvpop.")}
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def _full_state_dict(self) -> dict[str, Tensor]:
        if self.dist.distributed and self.tcfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.model.state_dict()

    def _optimizer_state(self) -> dict[str, Any]:
        if self.dist.distributed and self.tcfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return self.optimizer.state_dict()

    def _save_final(self, path: Path) -> None:
        """`kvpop.save` of the trained model (every rank takes part in gathering FSDP2 shards)."""
        if self.dist.distributed and self.tcfg.fsdp:
            from kvpop.models import load_model

            state = self._full_state_dict()
            if self.dist.main:
                # an unsharded copy to hold the gathered weights
                model, _ = load_model(self.tcfg.model, device="cpu", config=as_trained(self.tcfg.model))
                if getattr(model, "kvpop", None) is None:
                    retrofit(model, self.kcfg)
                model.kvpop.base = kvpop_modules(self.model).base
                model.load_state_dict(state)
                save(model, path, **self._save_layout())
        elif self.dist.main:
            save(self.model, path, **self._save_layout())
        self._barrier()

    def _save_layout(self) -> dict[str, Any]:
        """`save`'s arguments: a base left as --model's is not written again (the directory records where it is
        found), unless --model is a kvpop directory holding base weights of its own."""
        from kvpop.models import is_kvpop_dir
        from kvpop.retrofit import read_layout

        model = self.tcfg.model
        if self._holds_base or (is_kvpop_dir(model) and read_layout(model).base_weights):
            return {"tokenizer": self.tokenizer}
        return {"base_weights": False, "base": model}

    def save_checkpoint(self) -> None:
        """Write the checkpoint of this step (`kvpop.train.checkpoint.write`): the previous one stays until it is complete."""
        parts = self._checkpoint_parts()  # every rank: FSDP2 gathers the full state together
        if self.dist.main:
            written = ckpt.write(self.out, self.step, parts, self._checkpoint_meta(), keep_every=self.tcfg.keep_every)
            self.last_checkpoint = written.path
            if self.aside is not None:
                ckpt.discard(self.aside)
                self.aside = None
        self.last_saved = self.step
        self._barrier()

    def _load_checkpoint(self, checkpoint: ckpt.Checkpoint) -> dict[str, Any]:
        """Restore the run from `checkpoint` after checking it is this run's; returns its state."""
        state = checkpoint.read()
        path = checkpoint.path
        try:
            saved = TrainConfig(**state["train_config"])
            saved_kcfg = KVpopConfig.from_dict(state["kvpop_config"])
        except (TypeError, ValueError) as err:
            raise TrainingError(f"--resume: {path} holds a config this kvpop cannot read ({err})") from None
        mine = dataclasses.asdict(self.tcfg)
        differ = [k for k, v in dataclasses.asdict(saved).items()
                  if k not in (*RESUME_MAY_CHANGE, "out", "model", "data", "device") and mine[k] != v]
        if state.get("device_type", _device_type(saved.device)) != self.device.type:
            differ.append(f"device ({state.get('device_type', saved.device)} then, {self.device.type} now)")
        recorded, mine_base = state.get("base"), kvpop_modules(self.model).base
        if recorded is not None and mine_base is not None:
            from kvpop.retrofit import same_base

            why = same_base(recorded, mine_base)
            if why is not None:
                differ.append(f"model ({why})")
        elif not _same_place(saved.model, self.tcfg.model):
            differ.append(f"model ({saved.model!r} then, {self.tcfg.model!r} now)")
        if "data_sha256" not in state and not _same_place(saved.data, self.tcfg.data):
            differ.append(f"data ({saved.data!r} then, {self.tcfg.data!r} now)")
        if differ or saved_kcfg != self.kcfg:
            raise TrainingError(
                f"--resume: {path} was written by a different run (differs in {differ or ['kvpop config']}); "
                f"resume with the same arguments (only {' and '.join('--' + k.replace('_', '-') for k in RESUME_MAY_CHANGE)} "
                "may change)"
            )
        if state.get("world", 1) != self.dist.world:
            raise TrainingError(f"--resume: checkpoint from {state['world']} ranks, now {self.dist.world}")
        # a run started from other weights stays one: what it records, and whether its checkpoints hold the base
        self.init = state.get("init")
        try:
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        except RuntimeError as err:
            raise TrainingError(f"--resume: {path} does not fit the model ({err})") from None
        if unexpected or (self._holds_base and missing):
            raise TrainingError(f"--resume: {path} does not fit the model (missing {missing}, unexpected {unexpected})")
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            rng = state["rng"]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            self.sampler.set_state(rng["sampler"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
            why = " ".join(str(err).split())[:200]
            raise TrainingError(f"--resume: {path}: its optimizer, scheduler or RNG state cannot be restored "
                                f"({type(err).__name__}: {why}); the checkpoint is damaged") from None
        if type(state["step"]) is not int or state["step"] < 0:
            raise TrainingError(f"--resume: {path}: its step {state['step']!r} is not a count of steps")
        self.step = self.last_saved = state["step"]
        self.last_checkpoint = path
        # the data the run has trained on: a resume with more --steps goes on over the same documents
        # (another epoch where it runs out) rather than repacking a larger set in another order
        self.pool_tokens = state.get("pool_tokens", saved.pool_tokens)
        if type(self.pool_tokens) is not int or self.pool_tokens < 1:
            raise TrainingError(f"--resume: {path}: its pool_tokens {self.pool_tokens!r} is not a count of tokens")
        return state

    def _check_same_data(self, state: dict[str, Any]) -> None:
        recorded = state.get("data_sha256")
        if recorded is not None and recorded != self.data_sha256:
            raise TrainingError(
                f"--resume: the training tokens from --data {self.tcfg.data!r} differ from those the run in {self.out} "
                f"trained on (--data {state['train_config']['data']!r} then): the data changed; resume with the "
                "same data"
            )

    def _write_config(self) -> None:
        resolved = {
            "train": dataclasses.asdict(self.tcfg),
            "kvpop": self.kcfg.to_dict(),
            "command": self.argv if self.argv is not None else sys.argv,
            "world_size": self.dist.world,
            # how the model was wrapped: None (one process), "ddp" or "fsdp2" (torchrun, any number of ranks)
            "parallel": ("fsdp2" if self.tcfg.fsdp else "ddp") if self.dist.distributed else None,
            "backend": dist.get_backend() if self.dist.distributed else None,
            "torch": torch.__version__,
            "init": self.init,
        }
        if len(self.pool.parts) > 1:
            resolved["data_mix"] = self.pool.summary()
        write_atomic(self.out / ckpt.RUN_CONFIG, json.dumps(resolved, indent=2))

    def _progress(self, progress: bool):
        if not (progress and self.dist.main):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.tcfg.steps, initial=self.step, desc="kvpop train", unit="step", dynamic_ncols=True)

    def _barrier(self) -> None:
        if self.dist.distributed:
            dist.barrier()

    @staticmethod
    def _main_thread() -> bool:
        import threading

        return threading.current_thread() is threading.main_thread()


def _device_type(name: str) -> str:
    """The device type a TrainConfig.device of an older checkpoint resolved to."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def _same_place(a: str, b: str) -> bool:
    """The same preset, or the same file or directory however it is spelled (`./runs/x` and `runs/x`)."""
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def as_trained(model: str) -> KVpopConfig | None:
    """A kvpop directory's saved config, which training continues (not the rule `kvpop.load` runs it under by
    default); None for a base model."""
    from kvpop.models import is_kvpop_dir
    from kvpop.retrofit import read_config

    return read_config(model) if is_kvpop_dir(model) else None


def train(tcfg: TrainConfig, kcfg: KVpopConfig | None, *, resume: bool = False, overwrite: bool = False,
          init_from: str | Path | None = None, progress: bool = True, argv: list[str] | None = None) -> Path:
    """Run (or resume) a distillation and return the directory of the final model.

    `init_from`: start from the weights of another run (a run directory, a checkpoint or a `kvpop.save`
    directory) instead of a fresh retrofit; `kcfg` None takes its config."""
    distiller = None
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if tcfg.deterministic:
        # cuBLAS reads its workspace setting when it creates a handle: before the trainer's first matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        distiller = Distiller(tcfg, kcfg, resume=resume, overwrite=overwrite, init_from=init_from, argv=argv)
        return distiller.run(progress=progress)
    finally:
        # a process group left to the interpreter's exit can abort the process (SIGABRT in gloo's
        # teardown). The wrapped model (DDP, FSDP2's device mesh) holds the group too, so it is freed
        # first: then destroy_process_group is the group's last owner (a 2-rank FSDP2 run on gloo still
        # aborted at exit, once in many, with the model left to the interpreter)
        if dist.is_initialized():
            del distiller
            gc.collect()
            dist.destroy_process_group()
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])

