"""Log future attention mass as one transposed attention pass on FlexAttention (CUDA).

The keys act as the pass's queries (one copy per query head that reads them), the original queries
act as its keys, `score_mod` subtracts each original query's log-normaliser and `mask_mod` keeps
`d >= t + window`. The log-sum-exp FlexAttention returns for row `t` is then the log future mass.
The values are never used: a small zero tensor satisfies the kernel.

On CUDA the pass is compiled; elsewhere it runs eagerly (forward only), which materialises the
scores and is meant for tests.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvpop.ops.attention.flex import flex_with_lse

# the compiled kernels want head dims of at least 16 (query/key and value)
MIN_HEAD_DIM = 16
# the value is never used: the smallest the kernel accepts
VALUE_DIM = MIN_HEAD_DIM
BLOCK_SIZE = 128


@functools.cache
def _compiled_flex():
    # automatic dynamic shapes: a second length recompiles once for all lengths; with dynamic=False
    # every new shape costs a compile and past dynamo's recompile limit flex silently falls back
    # to the eager path, which materialises S x S scores
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=16)
def _cached_block_mask(seq_len: int, window: int, device: torch.device) -> BlockMask:
    # building it is a dozen tiny kernels (~1.5 ms on an H200, half the pass itself at S = 16k);
    # training repeats the same (S, window) every step
    return future_block_mask(seq_len, window, device)


def future_block_mask(seq_len: int, window: int, device: torch.device | str, block_size: int = BLOCK_SIZE) -> BlockMask:
    """Block mask of `d >= t + window` (rows `t`, columns `d`) built from its known band structure.

    Row block `i` covers `t` in `[i * bs, min((i + 1) * bs, S) - 1]`. Column block `j` is partial when
    it holds some `d >= t_first + window` but not only `d >= t_last + window`, full from there on;
    a ragged last column block (`S % bs != 0`) counts as partial, as `create_block_mask` has it.
    Nothing is evaluated point by point.
    """
    S, bs = seq_len, block_size
    n = -(-S // bs)
    # column blocks that lie wholly inside the sequence
    n_whole = S // bs
    i = torch.arange(n, device=device, dtype=torch.int32)
    t_first = i * bs
    t_last = torch.clamp((i + 1) * bs, max=S) - 1
    d_first = t_first + window
    # first column block reached at all (n when the row block reaches no query)
    j_part = torch.where(d_first <= S - 1, d_first // bs, n)
    # first column block whose every d >= t_last + window
    j_full = torch.maximum(torch.clamp(-(-(t_last + window) // bs), max=n), j_part)
    # a ragged last block past the full ones is partial too, appended after the band's partial ones
    ragged_extra = (S % bs != 0) & (j_full <= n - 1)
    band = j_full - j_part
    part_num = band + ragged_extra.int()
    full_num = torch.clamp(n_whole - j_full, min=0)
    col = torch.arange(n, device=device, dtype=torch.int32)[None, :]
    part_idx = torch.where(col < band[:, None], j_part[:, None] + col, 0)
    part_idx = torch.where((col == band[:, None]) & ragged_extra[:, None], n - 1, part_idx)
    full_idx = torch.where(col < full_num[:, None], j_full[:, None] + col, 0)

    # a captured tensor rather than an int, so a new window does not recompile the pass
    w = torch.tensor(window, device=device, dtype=torch.int32)

    def mask_mod(b, h, t, d):
        return d >= t + w

    # batch and head dims of size 1 broadcast: the band is the same for every (b, h)
    return BlockMask.from_kv_blocks(
        part_num[None, None].int(),
        part_idx[None, None].int(),
        full_num[None, None].int(),
        full_idx[None, None].int(),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(S, S),
        # the target is a label: no backward, so the transposed (q-block) index is not needed
        compute_q_blocks=False,
    )


def log_future_mass_flex(
    query: Tensor,  # [B, Hq, S, D]
    key: Tensor,  # [B, Hkv, S, D]
    lse: Tensor,  # [B, Hq, S]
    window: int,
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """`log sum_{d >= t + window} exp(l(d, t) - lse[d])` for every query head and key `t`.

    `l(d, t) = scale * q_d . k_t`, soft-capped to `c * tanh(l / c)` with `softcap = c` (None: not capped).

    Args:
        query: [B, Hq, S, D]; query head `hq` reads KV head `hq // G`.
        key: [B, Hkv, S, D], same dtype as `query`.
        lse: [B, Hq, S], natural log.
        window: a query `d` counts for key `t` when `d >= t + window`.
        scale: logit scale.
    Returns:
        float32 [B, Hq, S]; `-inf` for keys no query reaches.
    """
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    compiled = query.is_cuda
    if not compiled:
        # the eager path computes scores in the input dtype; float32 keeps the reduction in float32
        query, key = query.float(), key.float()
    elif D < MIN_HEAD_DIM:
        # the compiled kernel needs a head dim of at least 16; zero columns leave every dot product unchanged
        query = torch.nn.functional.pad(query, (0, MIN_HEAD_DIM - D))
        key = torch.nn.functional.pad(key, (0, MIN_HEAD_DIM - D))
        D = MIN_HEAD_DIM
    # flex's GQA shares keys among queries; here the sharing runs the other way, so copy the keys
    rows = key[:, :, None].expand(B, Hkv, G, S, D).reshape(B, Hq, S, D)
    value = query.new_zeros(B, Hq, S, VALUE_DIM)
    lse = lse.float().contiguous()

    if softcap is None:
        def score_mod(score, b, h, t, d):
            return score - lse[b, h, d]
    else:
        # a captured tensor, as `lse`: one compiled kernel for every cap
        cap = torch.tensor(float(softcap), dtype=torch.float32, device=query.device)

        def score_mod(score, b, h, t, d):
            return torch.tanh(score / cap) * cap - lse[b, h, d]

    block_mask = _cached_block_mask(S, window, query.device)
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale)
    if compiled:
        fn = _compiled_flex()
    else:
        fn = flex_attention
    _, out = flex_with_lse(fn, rows, query, value, **kwargs)
    return out.float()
