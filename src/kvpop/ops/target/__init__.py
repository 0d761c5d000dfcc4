"""The training target of the scorers: how much attention each key gets from the far future (`docs/method.md` Sec. 4).

`reference.py` is the dense float64 definition (tests only); `chunked.py` a loop over query chunks
for any device; `flex.py` one transposed FlexAttention pass for CUDA. Both fast backends return the
per-query-head log future mass; the count normalisation, `eps` and the pooling over the query heads
of a group happen once, here. The derivation is in `README.md`.
"""

from __future__ import annotations

import math
import operator
from typing import Literal

import torch
from torch import Tensor

AGGS = ("max", "mean")
BACKENDS = ("auto", "reference", "chunked", "flex")


def future_attention_target(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, Hkv, S, D]
    lse: Tensor,  # [B, Hq, S]
    window: int,
    scale: float | None = None,
    eps: float = 1e-6,
    agg: Literal["max", "mean"] = "max",
    count_norm: bool = True,
    backend: Literal["auto", "reference", "chunked", "flex"] = "auto",
    chunk: int = 256,
    softcap: float | None = None,
) -> Tensor:
    """Per-KV-head log future attention mass of every key: the label the scorers learn.

    With `p(d -> t) = exp(scale * q_d . k_t - lse[d])` for query head `(h, g)` (`hq = h * G + g`):

    - `count_norm=True` (default): `m[h,g,t] = (1 / N_t) sum_{d >= t + window} p(d -> t)` with
      `N_t = max(1, S - (t + window))`, and `r[h,t] = Agg_g log(eps + m[h,g,t])`: `agg="max"` takes
      the largest log over the `G` query heads, `agg="mean"` the mean of the logs.
    - `count_norm=False` (paper B.1): no `1 / N_t`, and the pooling goes inside the log:
      `agg="mean"` gives `log(eps + mean_g sum_d p)`, exactly B.1; `agg="max"` gives
      `log(eps + max_g sum_d p)`, which equals `max_g log(eps + sum_d p)`.

    Keys with no query `window` or more steps later (`t + window > S - 1`) get `log(eps)`.
    Runs without autograd: the target is a label. Reductions are float32 for any input dtype.

    Args:
        query: [B, Hq, S, D], the student's queries (after RoPE); query head `hq` reads KV head `hq // G`.
        key: [B, Hkv, S, D], the student's keys as cached; `Hq % Hkv == 0`.
        lse: [B, Hq, S], the log-normaliser (natural log) the student's own attention returned for
            each query; it need not be the dense one.
        window: `w >= 1`; query `d` counts for key `t` when `d >= t + w`.
        scale: logit scale; `None` means `D ** -0.5`.
        eps: `> 0`, floor inside the log.
        agg: pooling over the `G` query heads of a KV head, `"max"` or `"mean"`.
        count_norm: divide by the number of future queries `N_t` (see above).
        backend: `"auto"` picks `"flex"` on CUDA and `"chunked"` elsewhere; `"reference"` is the
            dense float64 definition (small `S` only); `"flex"` off CUDA runs eagerly (tests only).
        chunk: queries per step of the chunked backend (memory about `B * Hq * chunk * S * 4` bytes).
        softcap: the model's logit soft-capping (Gemma 2): `p(d -> t)` uses its capped logits
            `c * tanh(scale * q_d . k_t / c)`, as the attention (and its `lse`) did. None: none.
    Returns:
        float32 [B, Hkv, S].
    """
    window = _check(query, key, lse, window, eps, agg, backend, chunk)
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    if scale is None:
        scale = D**-0.5
    if backend == "auto":
        backend = "flex" if query.is_cuda else "chunked"
    with torch.no_grad():
        if backend == "reference":
            from kvpop.ops.target.reference import future_attention_target_reference

            return future_attention_target_reference(query, key, lse, window, scale, eps, agg, count_norm, softcap)
        if backend == "flex":
            from kvpop.ops.target.flex import log_future_mass_flex

            log_mass = log_future_mass_flex(query, key, lse, window, scale, softcap)
        else:
            from kvpop.ops.target.chunked import log_future_mass_chunked

            log_mass = log_future_mass_chunked(query, key, lse, window, scale, chunk, softcap)
        return pool_log_mass(log_mass.reshape(B, Hkv, Hq // Hkv, S), window, eps, agg, count_norm)


def pool_log_mass(
    log_mass: Tensor,  # [B, Hkv, G, S]
    window: int,
    eps: float,
    agg: str,
    count_norm: bool,
) -> Tensor:
    """From per-query-head `log sum_d p(d -> t)` to the target, all in log space (float32).

    Args:
        log_mass: float32 [B, Hkv, G, S], `-inf` where no query reaches the key.
    Returns:
        float32 [B, Hkv, S].
    """
    S = log_mass.shape[-1]
    log_eps = log_mass.new_full((), math.log(eps))
    if count_norm:
        pos = torch.arange(S, device=log_mass.device)
        log_n = torch.log((S - window - pos).clamp(min=1).float())
        # log(eps + m) computed as logaddexp so tiny masses never underflow to 0 before the floor
        per_head = torch.logaddexp(log_mass - log_n, log_eps)
        return per_head.amax(dim=2) if agg == "max" else per_head.mean(dim=2)
    if agg == "max":
        pooled = log_mass.amax(dim=2)
    else:
        pooled = torch.logsumexp(log_mass, dim=2) - math.log(log_mass.shape[2])
    return torch.logaddexp(pooled, log_eps)


def _check(query: Tensor, key: Tensor, lse: Tensor, window, eps: float, agg: str, backend: str, chunk: int) -> int:
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            f"query and key must be [B, H, S, D], got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    B, Hq, S, D = query.shape
    if key.shape[0] != B or key.shape[2:] != query.shape[2:]:
        raise ValueError(f"key {tuple(key.shape)} must match query {tuple(query.shape)} in batch, length and head dim")
    Hkv = key.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key heads ({Hkv})")
    if tuple(lse.shape) != (B, Hq, S):
        raise ValueError(f"lse must be [B, Hq, S] = {(B, Hq, S)}, got {tuple(lse.shape)}")
    for name, x in (("query", query), ("key", key), ("lse", lse)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if query.dtype != key.dtype:
        raise TypeError(f"query and key must share a dtype, got {query.dtype} and {key.dtype}")
    if not (query.device == key.device == lse.device):
        raise ValueError(f"query, key and lse must be on one device, got {query.device}, {key.device}, {lse.device}")
    if isinstance(window, bool):
        raise TypeError("window must be an int, got a bool")
    try:
        window = operator.index(window)
    except TypeError:
        raise TypeError(f"window must be an int, got {type(window).__name__}") from None
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if agg not in AGGS:
        raise ValueError(f"agg must be one of {AGGS}, got {agg!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "chunked" or (backend == "auto" and not query.is_cuda):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    return window


__all__ = ["AGGS", "BACKENDS", "future_attention_target", "pool_log_mass"]
