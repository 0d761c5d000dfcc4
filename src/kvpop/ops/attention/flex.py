"""Sparse attention under the retention rule on FlexAttention: the CUDA training/prefill backend.

Computes what `reference.masked_attention` computes under `ops.topk.mask_from_eviction`, but never
forms the `Q x N` mask: a `BlockMask` built at block granularity (`block_mask.py`) skips empty
tiles and a `mask_mod` that captures positions and eviction positions decides the partial ones.
On CUDA FlexAttention is compiled once (lazily) and runs forward and backward; on CPU it runs
eagerly, forward only (its eager path materialises the scores: fine for tests, not for speed).

Compilation: the first two sequence lengths compile (about 10 s each on an H200), later lengths
reuse the shape-generic kernel. Each new head count, dtype or grad mode compiles again, and past
dynamo's `recompile_limit` (8) dynamo silently falls back to eager FlexAttention, which materialises
the `Q x N` scores; one model uses one configuration, so only test suites that sweep shapes meet this.

    python -m pytest tests/test_attention_flex.py -q
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from kvpop.ops.attention.block_mask import sparse_block_mask

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch without `return_aux`: `return_lse`
    AuxRequest = None

_compiled_flex = None


def flex_with_lse(fn, *args, **kwargs) -> tuple[Tensor, Tensor]:
    """(out, lse) of `fn`, FlexAttention compiled or not, by `return_aux` where torch has it.

    torch >= 2.9 deprecates `return_lse`, and its warn-once check is a guard of the compiled function: the
    second call compiles it again (as `generate` does on an H100), one of the 8
    recompiles dynamo allows before it falls back to eager FlexAttention.
    """
    with warnings.catch_warnings():
        # eager flex warns that it is unfused; off CUDA that is the intended, test-only path
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        if AuxRequest is None:
            return fn(*args, return_lse=True, **kwargs)
        out, aux = fn(*args, return_aux=AuxRequest(lse=True), **kwargs)
        return out, aux.lse


def _flex_for(device: torch.device):
    """Compiled FlexAttention on CUDA (built on first use, then shared), eager elsewhere."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # default dynamic: a second sequence length compiles one shape-generic kernel instead of
        # recompiling for every prefill length
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def soft_cap_mod(softcap: float, device: torch.device):
    """The `score_mod` of a logit soft-capping `c * tanh(score / c)` (FlexAttention's score is already scaled).

    `c` is a captured tensor, not a constant: one compiled kernel serves every cap."""
    cap = torch.tensor(float(softcap), dtype=torch.float32, device=device)

    def score_mod(score, b, h, q, k):
        return torch.tanh(score / cap) * cap

    return score_mod


def _check(query, key, value, q_pos, q_valid, k_pos, k_valid, evict) -> None:
    B, Hq, Q, D = query.shape
    if key.dim() != 4 or key.shape[0] != B or key.shape[-1] != D or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [B, Hkv, N, D] matching query {tuple(query.shape)}, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    Hkv, N = key.shape[1], key.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    for name, t, shape in (
        ("q_pos", q_pos, (B, Q)),
        ("q_valid", q_valid, (B, Q)),
        ("k_pos", k_pos, (B, N)),
        ("k_valid", k_valid, (B, N)),
        ("evict", evict, (B, Hkv, N)),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if (
        query.device.type != "cuda"
        and torch.is_grad_enabled()
        and (query.requires_grad or key.requires_grad or value.requires_grad)
    ):
        raise NotImplementedError("FlexAttention has no backward off CUDA; use the reference backend for training")


def flex_sparse_attention(
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, N, D]
    value: Tensor,  # [B, Hkv, N, D]
    q_pos: Tensor,  # [B, Q]
    q_valid: Tensor,  # [B, Q]
    k_pos: Tensor,  # [B, N]
    k_valid: Tensor,  # [B, N]
    evict: Tensor,  # [B, Hkv, N]
    sink: int,
    window: int,
    scale: float,
    return_lse: bool = False,
    block_size: int = 128,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention of each query over the keys the retention rule keeps visible to it.

    Query `q` sees key `t` iff both are valid, `pos_t <= pos_q`, and `t` is a sink (`pos_t < sink`),
    in the window (`pos_t > pos_q - window`) or not yet evicted (`pos_q < evict_t`).

    Args:
        query: [B, Hq, Q, D]; query head `hq` reads KV head `hq // G`.
        key, value: [B, Hkv, N, D].
        q_pos: int64 [B, Q]; q_valid: bool [B, Q] (False for padding queries).
        k_pos: int64 [B, N]; k_valid: bool [B, N] (False for padding keys).
        evict: int64 [B, Hkv, N], each key's eviction position (`NEVER` if never).
        sink, window: the budget split of `docs/method.md` Sec. 1.
        scale: logit scale (usually `D ** -0.5`).
        block_size: FlexAttention's sparse block size (128 unless the kernel is tuned otherwise).
        softcap: the model's logit soft-capping `c * tanh(l / c)` of the scaled logits, as a `score_mod`; None: none.
    Returns:
        out [B, Hq, Q, D] in the query's dtype, and lse float32 [B, Hq, Q] (natural log) or None.
        Rows with no visible key give zeros and `lse = -inf`.
    """
    _check(query, key, value, q_pos, q_valid, k_pos, k_valid, evict)
    Hq = query.shape[1]
    block_mask = sparse_block_mask(q_pos, q_valid, k_pos, k_valid, evict, sink, window, Hq, block_size)
    kwargs = {} if softcap is None else {"score_mod": soft_cap_mod(softcap, query.device)}
    out, lse = flex_with_lse(_flex_for(query.device), query, key, value, block_mask=block_mask, scale=scale,
                             enable_gqa=True, **kwargs)
    return out, (lse.float() if return_lse else None)


__all__ = ["flex_sparse_attention", "soft_cap_mod"]
