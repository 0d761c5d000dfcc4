"""DMS, Dynamic Memory Sparsification (Łańcucki et al., 2025): learned per-token eviction gates.

    kvpop train --model tiny-random-qwen3 --policy dms --budget 48 --seq-len 256 --steps 40 --out runs/dms
    kvpop eval --model tiny-random-qwen3 --trained runs/dms/final --policies none --seq-len 256

Each (layer, KV head) has a gate predictor with the shape of the KVpop-mlp scorer (a two-layer SiLU
MLP on the cached `[k_t; v_t]`, `scorer_hidden` wide; the KVpop policy has `Hkv` more parameters,
its decays). It gives every token a logit `a_t` at insertion. `alpha_t = 1` means "evict `t` once it
leaves the delayed-eviction window": our protected window `w` plays DMS's delay, so a token is always
attendable for `w` steps after insertion, and sinks are never evicted.

Inference (hard): `alpha_t = [a_t > 0]`, mapped onto the shared static-priority rule (`docs/method.md`
Sec. 2) as `pi[t] = -inf` if `alpha_t = 1`, else `0`. The rule never gives a `-inf` token a long-range
slot, so it is dropped as it leaves the window, and its slot stays free for others. Kept tokens all
tie at 0, and ties go to the newer token, so when a head wants to keep more than `topk` tokens the
fixed buffer holds by evicting the *oldest* kept token (the overflow rule). Per-head retention is
therefore ragged inside the fixed buffer, and teacher-forced evaluation, prefill and decoding agree
because they run the one rule. `cache_sizes` counts what each head really holds.

Training (relaxed), in the student's teacher-forced forward (`attention.py` calls `relaxed_attention`
when a DMS policy is in training mode): `alpha_t = sigmoid((a_t + L_t) / tau)`, with logistic noise
`L_t` (the difference of two Gumbels) and temperature `tau = dms_temperature`; for query `q` and key
`t` with `sink <= t <= q - w` the attention logit gets `log(1 - alpha_t + eps)` (soft eviction); the
window and the sinks are untouched, and the fixed buffer is not enforced (as in DMS). The gates learn
from the KL of the distillation through this soft mask plus the compression loss

    L_comp = dms_loss_weight * mean_{layer, KV head} |R_{l,h} - rho|,
    R_{l,h} = mean of 1 - sigmoid(a_t / tau) over the tokens that leave the window within the sequence,
    rho    = dms_target_retention, by default topk / (S - sink - window)  (S: training length),

so that at the last query of a training sequence the expected number of retained long-range tokens,
`rho * (S - sink - window)`, equals `topk`. The KVpop boundary loss is not used. Gate inputs are
detached, like the KVpop scorer's, so the base weights still learn from the KL only.

Where this differs from the paper (Łańcucki et al., 2025):
- the gate is this MLP on the cached key and value, not a repurposed query/key neuron;
- the compression loss is two-sided (DMS's hinge only penalises keeping too much): with a fixed
  buffer, keeping less than `topk` leaves paid-for slots empty, and in short runs the optimiser's
  momentum carries a one-sided hinge far below the target with nothing to bring it back;
- it constrains the noise-free relaxation `sigmoid(a_t / tau)` (the inference decision as
  `tau -> 0`), not the noisy `alpha` of the mask: while gates are undecided (`|a_t|` below the
  noise scale, as after tens of CPU steps) the mean noisy `alpha` says little about how many
  tokens `[a_t > 0]` will keep at inference;
- it is per (layer, KV head), each having its own fixed buffer, not pooled over the model;
- the gates start undecided (`a_t` near 0, the MLP's own init) instead of "keep everything" with a
  target ramped up over thousands of steps: our runs are tens to hundreds of steps;
- the fixed buffer with its oldest-first overflow is ours (DMS grows a paged cache per head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from kvpop.config import KVpopConfig
from kvpop.policy import LayerPolicy

EPS = 1e-6
"""`eps` of the soft mask `log(1 - alpha + eps)`: a fully evicted key keeps a weight of `eps`."""


def target_retention(cfg: KVpopConfig, seq_len: int) -> float:
    """`rho`: `cfg.dms_target_retention`, or `topk / (seq_len - sink - window)` (clipped to [0, 1])."""
    if cfg.dms_target_retention is not None:
        return float(cfg.dms_target_retention)
    eligible = seq_len - cfg.sink - cfg.window
    return 1.0 if eligible <= 0 else min(1.0, cfg.topk / eligible)


def gumbel_sigmoid(logits: Tensor, temperature: float, noise: bool = True) -> Tensor:
    """The relaxed binary decision `sigmoid((logits + L) / temperature)`, `L` logistic (Gumbel - Gumbel).

    As `temperature -> 0` it tends to the hard sample `[logits + L > 0]`, which is 1 with probability
    `sigmoid(logits)`; without noise, to the decision `[logits > 0]` used at inference.
    """
    x = logits.float()
    if noise:
        u = torch.rand_like(x).clamp(1e-6, 1 - 1e-6)
        x = x + torch.log(u) - torch.log1p(-u)
    return torch.sigmoid(x / temperature)


class DMSPolicy(LayerPolicy):
    """Per-token eviction gates: static priority `-inf` (evict when out of the window) or `0` (keep)."""

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__(cfg, num_kv_heads, head_dim)
        from kvpop.scorers import MLPScorer

        self.temperature = cfg.dms_temperature
        # the MLP's own init (b2 = 0): gates start undecided, where the compression loss has a gradient
        self.scorer = MLPScorer(num_kv_heads, head_dim, cfg.scorer_hidden)

    def gate_logits(self, key: Tensor, value: Tensor) -> Tensor:
        """`a_t`: float32 [B, H, N] for key/value [B, H, N, D] (inputs detached)."""
        return self.scorer(key, value)

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        """Hard decisions as static priorities: float32 [B, H, N], `-inf` where `a_t > 0`, else 0."""
        return hard_priority(self.gate_logits(key, value))

    def relaxed(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Training: the gate logits, the relaxed `alpha` (noisy in training mode) and the hard priority.

        Returns:
            logits and alpha float32 [B, H, N] (differentiable), priority float32 [B, H, N] (detached).
        """
        logits = self.gate_logits(key, value)
        alpha = gumbel_sigmoid(logits, self.temperature, noise=self.training)
        return logits, alpha, hard_priority(logits.detach())


def hard_priority(logits: Tensor) -> Tensor:
    """The inference decision `alpha_t = [a_t > 0]` as a static priority: `-inf` (evict) or 0 (keep)."""
    return torch.where(logits > 0, float("-inf"), 0.0).float()


# --- the soft eviction mask and the relaxed attention (training) ---


def soft_eviction_bias(
    log_keep: Tensor,  # [B, H, N] float, log(1 - alpha + eps) per key
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    sink: int,
    window: int,
) -> Tensor:
    """The additive attention bias of relaxed DMS: float32 [B, H, Q, N].

    `-inf` where the key is in the future or padding, `log_keep[t]` where it is out of the window and
    not a sink (`sink <= pos_t <= pos_q - window`), 0 elsewhere. With `alpha` in {0, 1} and topk large
    enough, `bias > log(eps)` is the hard rule's mask.
    """
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    allowed = (kp <= qp) & q_valid[:, None, :, None] & k_valid[:, None, None, :]
    out_of_window = (kp >= sink) & (kp <= qp - window)
    bias = torch.where(out_of_window, log_keep.float()[:, :, None, :], 0.0)
    return bias.masked_fill(~allowed, float("-inf"))


def _relaxed_block(query, key, value, log_keep, q_pos, q_valid, k_pos, k_valid, sink, window, scale, softcap=None):
    """Attention of one block of queries under the soft bias (explicit softmax, float32; logits soft-capped by
    `softcap` first, as the model caps them)."""
    B, Hkv, G, Q, D = query.shape
    logits = torch.einsum("bhgqd,bhnd->bhgqn", query.float(), key.float()) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + soft_eviction_bias(log_keep, q_pos, q_valid, k_pos, k_valid, sink, window)[:, :, None]
    # a row with no key (a padding query) would give NaN, in the backward pass too (logsumexp of
    # -inf only): it gets finite logits here and zero weights below, so no gradient reaches it
    empty = torch.isneginf(logits).all(-1, keepdim=True)
    logits = logits.masked_fill(empty, 0.0)
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G, Q]
    probs = torch.exp(logits - lse[..., None]).masked_fill(empty, 0.0)
    return torch.einsum("bhgqn,bhnd->bhgqd", probs, value.float()), lse.masked_fill(empty[..., 0], float("-inf"))


def _relaxed_block_sdpa(query, key, value, log_keep, q_pos, q_valid, k_pos, k_valid, sink, window, scale, softcap=None):
    """`_relaxed_block` through SDPA with the soft bias as its additive mask (no lse: returns None).

    `key`, `value` come with their heads already repeated to the query heads ([B, Hkv * G, N, D]).
    """
    B, Hkv, G, Q, D = query.shape
    bias = soft_eviction_bias(log_keep, q_pos, q_valid, k_pos, k_valid, sink, window)  # [B, Hkv, Q, N]
    # a padding query has no key at all: give it every key (finite row), and zero its output below
    bias = bias.masked_fill(~q_valid[:, None, :, None], 0.0).to(query.dtype)
    q = query.reshape(B, Hkv * G, Q, D)
    if bias.requires_grad and not (q.requires_grad or key.requires_grad or value.requires_grad):
        # only the gates learn (the base frozen): torch's SDPA then skips the logsumexp in the forward, which the
        # memory-efficient backward needs for the mask's gradient ("LSE is not correctly aligned (strideH)" on
        # CUDA, torch 2.11; pytorch/pytorch#148476). A query that asks for a gradient (never read) keeps it.
        q = q.detach().requires_grad_()
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=bias.repeat_interleave(G, dim=1), scale=scale)
    out = out.masked_fill(~q_valid[:, None, :, None], 0.0)
    return out.reshape(B, Hkv, G, Q, D), None


def relaxed_attention(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, Hkv, S, D]
    value: Tensor,  # [B, Hkv, S, D]
    position: Tensor,  # [B, S]
    valid: Tensor,  # [B, S]
    alpha: Tensor,  # [B, Hkv, S] float in [0, 1]
    sink: int,
    window: int,
    scale: float,
    return_lse: bool = False,
    chunk: int = 512,
    backend: str = "auto",
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced attention with DMS's soft eviction: differentiable in `alpha`, `q`, `k`, `v`.

    Queries are processed in blocks of `chunk`, each recomputed in the backward pass (activation
    checkpointing), so memory is `O(chunk * S)` per layer, never `S x S` for long sequences.

    Args:
        backend: "explicit" (the reference: float32 logits and softmax written out), "sdpa" (the bias
            handed to `scaled_dot_product_attention`, whose memory-efficient kernel also returns the
            bias's gradient; the bias is then in the query's dtype, and no lse is returned), or
            "auto": "sdpa" on CUDA when no lse is asked for, else "explicit". On an H200 the explicit
            form made DMS the slowest training row (about 2x the KVpop-mlp step): it moves the
            float32 `chunk x S` logits and probabilities through memory several times per block.
        softcap: the model's logit soft-capping `c * tanh(l / c)` (Gemma 2), None for none; "sdpa" cannot take it,
            so "auto" runs "explicit" then.
    Returns:
        out [B, Hq, S, D] in the query's dtype, and lse float32 [B, Hq, S] or None.
    """
    if backend == "auto":
        backend = "sdpa" if query.is_cuda and not return_lse and softcap is None else "explicit"
    if backend not in ("explicit", "sdpa"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'explicit' or 'sdpa'")
    if backend == "sdpa" and softcap is not None:
        raise ValueError(f"backend='sdpa' takes no logit soft-capping (softcap={softcap}): use 'explicit'")
    if backend == "sdpa" and return_lse:
        raise ValueError("backend='sdpa' returns no lse: use backend='explicit' for return_lse=True")
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    q = query.reshape(B, Hkv, Hq // Hkv, S, D)
    log_keep = torch.log(1.0 - alpha.float() + EPS)
    block = _relaxed_block
    if backend == "sdpa":
        # GQA written out once per layer (key/value heads repeated, the bias G-fold per block), so that
        # the memory-efficient kernel, which takes an arbitrary mask and returns its gradient, runs
        # instead of the math fallback
        block = _relaxed_block_sdpa
        key, value = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (key, value))
    outs, lses = [], []
    for start in range(0, S, chunk):
        sl = slice(start, start + chunk)
        args = (q[:, :, :, sl], key, value, log_keep, position[:, sl], valid[:, sl], position, valid, sink, window, scale,
                softcap)
        if S > chunk and torch.is_grad_enabled():
            out, lse = checkpoint(block, *args, use_reentrant=False)
        else:
            out, lse = block(*args)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=3).reshape(B, Hq, S, -1).to(query.dtype)
    return out, (torch.cat(lses, dim=3).reshape(B, Hq, S) if return_lse else None)


# --- the compression loss ---


def leaves_window(position: Tensor, valid: Tensor, sink: int, window: int) -> Tensor:
    """bool [B, S]: real non-sink tokens that leave the window before their sequence ends."""
    last = (valid.long().sum(-1, keepdim=True) - 1)  # [B, 1]
    return valid & (position >= sink) & (position + window <= last)


def compression_loss(records, cfg: KVpopConfig, target: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """`L_comp` over the layers captured in a relaxed forward, and what it measured.

    The retention it constrains is that of the noise-free relaxation `1 - sigmoid(a_t / tau)`, which
    tends to the inference rule's `[a_t <= 0]` as `tau -> 0`: the gates are held to the share of tokens
    that inference will really keep (the noisy `alpha` of the mask would over-count undecided gates).

    Args:
        records: `LayerRecord`s of a relaxed DMS forward, with `gate` (the logits `a_t`, [B, Hkv, S]).
        target: `rho`; default `target_retention(cfg, S)`.
    Returns:
        the loss (scalar), and float32 scalars `retention` (relaxed, what the loss sees),
        `retention_hard` (the share of `a_t <= 0`: what inference keeps) and `target_retention`.
    """
    soft, hard = [], []
    for rec in records:
        if rec.gate is None:
            raise ValueError("compression_loss needs records of a relaxed DMS forward (a DMS model in training mode)")
        elig = leaves_window(rec.position, rec.valid, cfg.sink, cfg.window)[:, None].float()  # [B, 1, S]
        n = elig.sum().clamp(min=1)
        keep = torch.sigmoid(-rec.gate.float() / cfg.dms_temperature)
        soft.append((keep * elig).sum((0, 2)) / n)  # [H]
        hard.append(((rec.gate <= 0).float() * elig).sum((0, 2)) / n)
    S = records[0].position.shape[-1]
    rho = target_retention(cfg, S) if target is None else target
    soft, hard = torch.stack(soft), torch.stack(hard)  # [L, H]
    loss = cfg.dms_loss_weight * (soft - rho).abs().mean()
    stats = {"retention": soft.mean().detach(), "retention_hard": hard.mean().detach(),
             "target_retention": torch.tensor(rho, device=soft.device)}
    return loss, stats


# --- what DMS really holds (evaluation) ---


def cache_sizes(evict: Tensor, sink: int, window: int) -> Tensor:
    """Entries each head holds at each query of a whole sequence (positions `0 .. S-1`), in O(S).

    Args:
        evict: int64 [B, H, S], eviction positions (`ops.topk.eviction_positions`).
    Returns:
        int64 [B, H, S]: sinks + window + long-range tokens retained at query `q`.
    """
    B, H, S = evict.shape
    t = torch.arange(S, device=evict.device)
    enter = (t + window).expand(B, H, S)  # first query at which `t` is long-range
    counts = ((t >= sink) & (t + window < S)).long().expand(B, H, S)
    # +1 when a token becomes long-range, -1 when it is evicted (index S: never, within this sequence)
    diff = torch.zeros(B, H, S + 1, dtype=torch.long, device=evict.device)
    diff.scatter_add_(-1, enter.clamp(max=S), counts)
    diff.scatter_add_(-1, evict.clamp(max=S), -counts)
    long_range = diff.cumsum(-1)[..., :S]
    short = (t + 1).clamp(max=sink) + (t + 1 - sink).clamp(min=0, max=window)
    return short + long_range


def cache_fraction(evict: Tensor, sink: int, window: int, budget: int) -> tuple[float, int]:
    """Sum and count over (batch, head, query `>= budget`) of entries held / budget."""
    sizes = cache_sizes(evict, sink, window)[..., budget:]
    return float(sizes.sum()) / budget, sizes.numel()


__all__ = [
    "DMSPolicy",
    "cache_fraction",
    "cache_sizes",
    "compression_loss",
    "gumbel_sigmoid",
    "relaxed_attention",
    "soft_eviction_bias",
    "target_retention",
]
