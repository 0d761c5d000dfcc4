"""The boundary loss that trains the scorers (`docs/method.md` Sec. 5).

At every sampled query `q` the token `t_new = q - w` leaves the window and challenges `t_bnd`,
the weakest token the teacher retains at `q - 1`. The teacher's decision (keep `t_new` or drop
it) is the label `y`; the student's static priorities are pushed to the same side of the
boundary with a logistic loss, weighted by the teacher's margin and by the keep/drop balance
of each head. `boundary_labels` builds the pairs from the teacher's priorities in one
vectorised pass (the running top-k of `ops/topk`); `boundary_loss` scores the student on them.

Pairs are kept in a dense `[B, H, S]` layout indexed by the query position, with a validity
mask, so that shapes stay static and nothing syncs with the host. On CUDA the pairs' integer work
runs as one `torch.compile`d graph (`_compiled_pair_fields`): eagerly it is ~420 tiny kernels per
layer, whose launches cost 135 ms of a 407 ms SmolLM2-135M distillation step on an H100.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpop.ops.topk import boundary_tokens
from kvpop.policy import static_priority


class BoundaryPairs(NamedTuple):
    """Teacher keep/drop decisions, one slot per (sequence, KV head, query position).

    All fields are [B, H, S] and indexed by the query `q`; slots with `valid == False` (query not
    sampled, or `q < sink + window + topk`) hold `t_new = t_bnd = 0`, `y = 0`, `margin = 0`.
    """

    t_new: Tensor  # [B, H, S] int64, `q - window`: the token that has just left the window
    t_bnd: Tensor  # [B, H, S] int64, weakest token of the teacher's top-k of E(q - 1)
    y: Tensor  # [B, H, S] float32, +1 teacher keeps t_new, -1 it drops it, 0 where invalid
    margin: Tensor  # [B, H, S] float32, `Delta = y * (pi_tgt[t_new] - pi_tgt[t_bnd]) >= 0`
    valid: Tensor  # [B, H, S] bool, the slot holds a pair


def teacher_priority(
    r_tgt: Tensor,  # [B, H, S]
    log_gamma: Tensor,  # [H]
    decay_step: int,
) -> Tensor:
    """Teacher static priorities `pi_tgt[t] = r_tgt[t] - floor(t / n) * log(gamma_h)` (Sec. 2, 5).

    The teacher uses the student's decay, detached: the target must not train `gamma`, and
    `r_tgt` (built from the base model's attention) must not send gradient to the base model.

    Args:
        r_tgt: float [B, H, S], the supervision target of Sec. 4 for positions `0 .. S-1`.
        log_gamma: float [H], `log(gamma_h)`.
        decay_step: `n`.
    Returns:
        float32 [B, H, S], detached.
    """
    B, _, S = r_tgt.shape
    position = torch.arange(S, device=r_tgt.device).expand(B, S)
    return static_priority(r_tgt.detach(), position, log_gamma.detach(), decay_step)


def _sample_queries(
    eligible: Tensor,  # [B, S]
    query_fraction: float,
    generator: torch.Generator | None,
) -> Tensor:
    """A uniform random subset of each row's eligible queries, of size `round(fraction * n_eligible)`.

    At least one query is drawn from a row that has any. Returns bool [B, S].
    """
    B, S = eligible.shape
    n_eligible = eligible.sum(-1)
    n_take = torch.floor(n_eligible.double() * query_fraction + 0.5).long()
    n_take = torch.where(n_eligible > 0, n_take.clamp(min=1), 0)
    # random keys in [0, 1), drawn where the generator lives (the trainer's is a CPU one, checkpointed
    # with the run, while the tensors may be on a GPU), then moved; ineligible queries get 2 (sort last)
    where = generator.device if generator is not None else eligible.device
    keys = torch.rand(B, S, generator=generator, device=where).to(eligible.device)
    keys = torch.where(eligible, keys, 2.0)
    order = keys.argsort(dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=eligible.device).expand(B, S))
    return eligible & (rank < n_take[:, None])


def boundary_labels(
    pi_tgt: Tensor,  # [B, H, S]
    sink: int,
    window: int,
    topk: int,
    query_fraction: float = 1.0,
    generator: torch.Generator | None = None,
    query_mask: Tensor | None = None,  # [B, S]
    backend: str = "auto",
) -> BoundaryPairs:
    """The teacher's boundary pairs `(t_new, t_bnd, y, Delta)` for every sampled query (Sec. 5).

    `t_bnd` is the weakest token of the teacher's top-k of `E(q - 1) = E(q) minus {t_new}`, so
    `y = +1` exactly when the retention rule of Sec. 2 keeps `t_new` at query `q`. Since `t_new`
    is newer than every token of `E(q - 1)`, a tie `pi_tgt[t_new] == pi_tgt[t_bnd]` is a keep.

    Args:
        pi_tgt: float32 [B, H, S], teacher static priorities of positions `0 .. S-1` (detached here).
        sink, window, topk: the budget split of Sec. 1. `topk == 0` gives no pairs.
        query_fraction: share of the queries `q >= sink + window + topk` drawn per sequence, in
            (0, 1]; the subset is shared by the heads of a sequence. 1 takes them all and draws
            no random numbers.
        generator: random source of the query subset, on any device (the numbers are drawn on its device
            and moved to `pi_tgt`'s).
        query_mask: optional bool [B, S]; False marks queries to skip (e.g. padding). Sampling
            draws the fraction of the queries that remain.
        backend: "auto" (after the random draws, one graph compiled by inductor on CUDA,
            `_compiled_pair_fields`; eager elsewhere, and from a first failed compile on, with one warning),
            "eager", or a `torch.compile` backend ("inductor", "aot_eager", ...) to compile with on any
            device, failures raised. The results are the same bits whichever runs.
    Returns:
        `BoundaryPairs` of [B, H, S] tensors indexed by the query position.
    """
    if pi_tgt.dim() != 3 or not pi_tgt.is_floating_point():
        raise ValueError(f"pi_tgt must be a float [B, H, S] tensor, got {pi_tgt.dtype} {tuple(pi_tgt.shape)}")
    for name, value, lo in (("sink", sink, 0), ("window", window, 1), ("topk", topk, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}={value!r} must be an integer >= {lo}")
    if not 0.0 < query_fraction <= 1.0:
        raise ValueError(f"query_fraction={query_fraction!r} must lie in (0, 1]")
    B, H, S = pi_tgt.shape
    if query_mask is not None and query_mask.shape != (B, S):
        raise ValueError(f"query_mask must be [B, S] = {(B, S)}, got {tuple(query_mask.shape)}")
    pi = pi_tgt.detach().float()
    device = pi.device

    q = torch.arange(S, device=device)
    eligible = (q >= sink + window + topk).expand(B, S)
    if query_mask is not None:
        eligible = eligible & query_mask.bool()
    if query_fraction < 1.0:
        eligible = _sample_queries(eligible, query_fraction, generator)

    t_new, t_bnd, y, margin, valid = _run_pair_fields(backend, pi, eligible, sink, window, topk)
    return BoundaryPairs(t_new=t_new, t_bnd=t_bnd, y=y, margin=margin, valid=valid)


def _pair_fields(
    pi: Tensor,  # [B, H, S]
    eligible: Tensor,  # [B, S]
    sink: int,
    window: int,
    topk: int | Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`boundary_labels` after its random draws: `(t_new, t_bnd, y, margin, valid)` from float32 `pi` and the
    drawn queries `eligible` (bool [B, S]). `topk`: an int, or an int64 0-dim tensor >= 1 (the compiled form).

    All integer work but a gather, a subtraction and a sign per pair, each exact, so that a compiled form gives
    the same bits."""
    q = torch.arange(pi.shape[-1], device=pi.device)
    bnd = boundary_tokens(pi, sink, window, topk)
    valid = (bnd >= 0) & eligible[:, None, :]
    t_new = torch.where(valid, q - window, 0)
    t_bnd = torch.where(valid, bnd, 0)
    diff = pi.gather(-1, t_new) - pi.gather(-1, t_bnd)
    # t_new is newer than t_bnd, so it wins ties
    y = torch.where(diff >= 0, 1.0, -1.0)
    y = torch.where(valid, y, 0.0)
    margin = torch.where(valid, y * diff, 0.0)
    return t_new, t_bnd, y, margin, valid


@functools.cache
def _compiled_pair_fields(backend: str = "inductor"):
    """`_pair_fields` as one graph (`fullgraph`, static shapes), built on first use per `torch.compile` backend.

    Why: eagerly a call dispatches ~500 aten ops at `[1, 3, 8192]`, ~420 of them kernels (the wavelet matrix's
    14 levels of cumsum, scatter and wheres to build and 14 of gathers and wheres to query, the sorts), each
    tiny. On CUDA their launches are the cost: 4.5 ms a layer, 135 ms of a 407 ms distillation step of
    SmolLM2-135M (30 layers, S 8192, budget 1024) on an H100. Compiled on the CPU (C++) the same graph is 17
    fused loops plus the 2 sorts and the 14 cumsums as library calls.

    Dynamo specialises on ints: `S` (hence the bit count), `sink` and `window` are the same for every layer and
    step of a run, so one graph serves a run. `topk` is not (per-layer budgets give each layer its own: up to ~9
    values on `eval.budgets`' grid), so it comes in as a 0-dim tensor: specialised, every value would compile
    again, and past dynamo's recompile limit (8 per function) a `fullgraph` compile raises rather than running
    eagerly (in a process that meets that many sequence lengths, `backend="auto"` then turns eager for good).
    """
    return torch.compile(_pair_fields, fullgraph=True, dynamic=False, backend=backend)


COMPILE_ON = ("cuda",)
"""Device types on which `boundary_labels(backend="auto")` runs `_compiled_pair_fields`: where launches cost."""

_compile_failed = False
"""Set when the compiled form failed under `backend="auto"`: warned once, eager from then on."""


def _run_pair_fields(
    backend: str, pi: Tensor, eligible: Tensor, sink: int, window: int, topk: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`_pair_fields` eagerly or compiled, as `boundary_labels`' `backend` says."""
    global _compile_failed
    auto = backend == "auto"
    if auto:
        backend = "inductor" if pi.device.type in COMPILE_ON and not _compile_failed else "eager"
    # no ranking at all (top-k 0, or no token past the sinks) is a few kernels: nothing to compile
    if backend == "eager" or topk == 0 or pi.shape[-1] <= sink:
        return _pair_fields(pi, eligible, sink, window, topk)
    k = torch.full((), topk, dtype=torch.long, device=pi.device)
    if not auto:
        return _compiled_pair_fields(backend)(pi, eligible, sink, window, k)
    try:
        return _compiled_pair_fields(backend)(pi, eligible, sink, window, k)
    except Exception as err:  # noqa: BLE001 - the compiled form is an optimisation only
        _compile_failed = True
        warnings.warn(f"the compiled boundary labels failed ({type(err).__name__}: {err}); running them eagerly "
                      "from now on", stacklevel=3)
        return _pair_fields(pi, eligible, sink, window, topk)


def balance_weights(
    pairs: BoundaryPairs,
    clip: tuple[float, float] = (0.2, 5.0),
    reduce_counts: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Keep/drop balancing weights of paper B.5, per pair.

    `rho_h` is the share of keeps among the valid pairs of head `h` over the whole batch; keeps
    weigh `clip(1 / (2 rho_h))`, drops `clip(1 / (2 (1 - rho_h)))`, clipped to `[c_min, c_max]`.
    The denominators are floored at `1 / (2 c_max)`, which changes nothing after the clip but
    keeps `rho_h = 0` or `1` finite. A head without pairs gets `rho_h = 1/2`. `reduce_counts`
    (e.g. an all-reduce sum over data-parallel ranks) sees the stacked `[2, H]` pair and keep
    counts first, so that `rho_h` is the share over the global batch.

    Returns:
        float32 [B, H, S]; 0 where `pairs.valid` is False.
    """
    c_min, c_max = float(clip[0]), float(clip[1])
    if not 0.0 < c_min <= c_max < float("inf"):
        raise ValueError(f"balance clip={clip!r} must satisfy 0 < c_min <= c_max < inf")
    valid = pairs.valid
    keep = valid & (pairs.y > 0)
    counts = torch.stack([valid.sum(dim=(0, 2)), keep.sum(dim=(0, 2))]).float()  # [2, H]
    if reduce_counts is not None:
        counts = reduce_counts(counts)
    n_pairs, n_keep = counts[0], counts[1]
    rho = torch.where(n_pairs > 0, n_keep / n_pairs.clamp(min=1.0), 0.5)
    floor = 0.5 / c_max
    w_keep = (0.5 / rho.clamp(min=floor)).clamp(c_min, c_max)
    w_drop = (0.5 / (1.0 - rho).clamp(min=floor)).clamp(c_min, c_max)
    w = torch.where(keep, w_keep[None, :, None], w_drop[None, :, None])
    return torch.where(valid, w, 0.0)


def pair_weights(
    pairs: BoundaryPairs,
    margin_delta: float = 1.0,
    balance: bool = True,
    balance_clip: tuple[float, float] = (0.2, 5.0),
    reduce_counts: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """`omega = omega_margin * omega_bal` per pair, detached; 0 where `pairs.valid` is False.

    `omega_margin = tanh(Delta / delta)` (1 when `margin_delta == 0`), so near-ties count little;
    `omega_bal` is `balance_weights` (1 when `balance` is False).

    Returns:
        float32 [B, H, S].
    """
    if margin_delta < 0:
        raise ValueError(f"margin_delta={margin_delta!r} must be >= 0 (0 disables the margin weight)")
    valid = pairs.valid
    if margin_delta > 0:
        w = torch.tanh(pairs.margin.detach().float() / margin_delta)
    else:
        w = torch.ones_like(pairs.margin, dtype=torch.float32)
    if balance:
        w = w * balance_weights(pairs, balance_clip, reduce_counts)
    return torch.where(valid, w, 0.0).detach()


def boundary_loss(
    pi_hat: Tensor,  # [B, H, S]
    pairs: BoundaryPairs,
    tau: float = 1.0,
    margin_delta: float = 1.0,
    balance: bool = True,
    balance_clip: tuple[float, float] = (0.2, 5.0),
    reduce_counts: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`L_score` of Sec. 5 on the student's static priorities.

    `L = sum_{valid} omega * softplus(-y * (pi_hat[t_new] - pi_hat[t_bnd]) / tau) / n_valid`:
    the plain mean over the valid pairs of all (sequence, head, query) slots, not a
    weight-normalised mean, so the weights also scale the loss. No pairs gives 0 (still connected
    to `pi_hat`, with zero gradient). The weights `omega` are detached (`pair_weights`).

    Args:
        pi_hat: float [B, H, S], student static priorities (differentiable).
        pairs: from `boundary_labels` on the teacher's priorities of the same tokens.
        tau: temperature, > 0.
        margin_delta, balance, balance_clip, reduce_counts: see `pair_weights` / `balance_weights`.
    Returns:
        `(loss, stats)`: a 0-dim float32 loss and detached 0-dim float32 tensors
        `pairs` (count), `keep_rate` (share of teacher keeps), `accuracy` (student agrees with the
        teacher: keeps, i.e. `pi_hat[t_new] >= pi_hat[t_bnd]` as ties go to the newer `t_new`,
        exactly when `y = +1`), `keep_accuracy` / `drop_accuracy` (the same among teacher keeps /
        drops), `margin` (mean `Delta`) and `weight` (mean `omega`). A rate over an empty set is NaN.
    """
    if pi_hat.shape != pairs.valid.shape:
        raise ValueError(f"pi_hat shape {tuple(pi_hat.shape)} does not match the pairs' {tuple(pairs.valid.shape)}")
    if not tau > 0:
        raise ValueError(f"tau={tau!r} must be > 0")
    valid = pairs.valid
    pi_hat = pi_hat.float()
    diff = pi_hat.gather(-1, pairs.t_new) - pi_hat.gather(-1, pairs.t_bnd)
    omega = pair_weights(pairs, margin_delta, balance, balance_clip, reduce_counts)
    per_pair = torch.where(valid, omega * F.softplus(-pairs.y * diff / tau), 0.0)
    n_pairs = valid.sum().float()
    loss = per_pair.sum() / n_pairs.clamp(min=1.0)

    with torch.no_grad():
        keep = valid & (pairs.y > 0)
        drop = valid & (pairs.y < 0)
        student_keep = diff >= 0
        n_keep, n_drop = keep.sum().float(), drop.sum().float()
        hit_keep = (keep & student_keep).sum().float()
        hit_drop = (drop & ~student_keep).sum().float()
        stats = {
            "pairs": n_pairs,
            "keep_rate": n_keep / n_pairs,
            "accuracy": (hit_keep + hit_drop) / n_pairs,
            "keep_accuracy": hit_keep / n_keep,
            "drop_accuracy": hit_drop / n_drop,
            "margin": torch.where(valid, pairs.margin.float(), 0.0).sum() / n_pairs,
            "weight": omega.sum() / n_pairs,
        }
    return loss, stats


__all__ = ["BoundaryPairs", "balance_weights", "boundary_labels", "boundary_loss", "pair_weights", "teacher_priority"]
