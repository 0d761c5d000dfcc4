"""Batched generation of left-padded prompts, greedy or sampled: a fast path and the plain loop it is tested against.

    generate_batch(model, prompts, 4096, kvpop.KVpopCache(model), temperature=0.7, seeds=[11, 12])
    generate_batch(base, prompts, 4096, None)            # the dense model (no eviction)

`kvpop eval --generate` (`kvpop.eval.fidelity`) writes thousands of tokens per prompt for every
policy. Two backends of one signature:

- "reference": one forward per token with an attention mask grown by a column each step, and the
  tokens read back to the host every step. Slow on a GPU (Python and launch bound), obviously right;
- "fast" (the default): `kvpop.decode.Decoder`. The prompts are prefilled eagerly in one forward with
  their padding mask, then every step is the one-token forward captured as a CUDA graph (on CUDA;
  eager elsewhere). The tokens stay on the device in one [B, N] tensor, EOS is checked every 16 steps.
  A `KVpopCache` needs no mask after the prefill: it skipped the padding there (each row's sinks are
  its own first tokens, its positions count its real tokens), and every decoded token is real. The
  dense model decodes on a `StaticCache` of `width + N` slots under one fixed mask that hides the
  padding columns: the same attention as the reference's growing mask over a `DynamicCache`.

Both draw with `kvpop.sampling.next_tokens`: argmax, or Gumbel-max from counter-based noise, so a
row's random numbers depend on its seed and the step only, never on the batch or the device. On the
CPU both backends run the same eager forwards and give the same tokens (the tests check it). On CUDA
the captured step also compiles the norms and MLPs (`kvpop.decode.fuse_blocks`), which rounds a
little differently; greedy texts agree until a near-tie of the logits, as texts of different batch
sizes always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

Backend = Literal["fast", "reference"]
BACKENDS = ("fast", "reference")


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, device) -> tuple[Tensor, Tensor]:
    """The prompts as one left-padded batch: token ids int64 [B, width] and the attention mask int64 [B, width]."""
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(list(p))
        mask[r, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def trim_at_eos(rows: Sequence[Sequence[int]], eos_token_id: int | None, max_new_tokens: int) -> list[list[int]]:
    """Each row up to its first EOS (kept) and at most `max_new_tokens` tokens: what a row that stops would have written."""
    out = []
    for row in rows:
        row = list(row[:max_new_tokens])
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]
        out.append(row)
    return out


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    cache=None,
    *,
    temperature: float = 0.0,
    seeds: Sequence[int] | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    backend: Backend = "fast",
) -> list[list[int]]:
    """Prefill the prompts, left-padded in one batch, then generate: greedy at temperature 0, else sampled.

    Args:
        model: a retrofitted model with a fresh `KVpopCache` as `cache`, or the plain model with
            `cache=None` (each backend makes its own dense cache).
        seeds: one per prompt (default 0 each): row `r`'s token `n` is drawn from `softmax(logits /
            temperature)` with noise of `(seeds[r], n)` alone (`kvpop.sampling`), so two models given
            the same seed take the same random numbers, and a row does not depend on its batch.
        eos_token_id: a row stops at it (kept); rows that stopped go on being fed until all have, and
            what they wrote after their EOS is dropped.
        backend: "fast" (`kvpop.decode.Decoder`) or "reference" (the plain loop); see the module docstring.
    Returns:
        per prompt, its generated token ids.
    """
    from kvpop.cache import KVpopCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and no empty one")
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if cache is not None and not isinstance(cache, KVpopCache):
        raise ValueError(f"cache must be a KVpopCache (a retrofitted model) or None (the dense model), got "
                         f"{type(cache).__name__}: each backend makes its own dense cache")
    if cache is not None and cache.get_seq_length() != 0:
        raise ValueError("the KVpopCache has seen tokens already: pass a fresh one")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id, device)
    seeds_t = torch.tensor(seeds, dtype=torch.long, device=device)
    run = _fast if backend == "fast" else _reference
    rows = run(model, ids, mask, max_new_tokens, cache, temperature, seeds_t, eos_token_id)
    return trim_at_eos(rows, eos_token_id, max_new_tokens)


def generate_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    cache=None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    backend: Backend = "fast",
) -> list[int]:
    """`generate_batch` for one prompt: its generated token ids."""
    return generate_batch(model, [prompt], max_new_tokens, cache, temperature=temperature, seeds=[seed],
                          eos_token_id=eos_token_id, backend=backend)[0]


def _fast(model, ids: Tensor, mask: Tensor, max_new_tokens: int, cache, temperature: float, seeds: Tensor,
          eos_token_id: int | None) -> list[list[int]]:
    """`kvpop.decode.Decoder`: the step captured as a CUDA graph on CUDA, eager elsewhere."""
    from kvpop.decode import Decoder, static_cache

    if cache is None:
        # the last generated token is never fed: width + N - 1 slots are written
        cache = static_cache(model, ids.shape[1] + max_new_tokens)
    # a decoder per batch of prompts: the eager step captured (seconds), not an inductor compile per batch
    decoder = Decoder(model, cache, compile=ids.is_cuda, backend="cudagraph")
    try:
        # one prefill forward, as the reference does, so that both round alike
        out = decoder.generate(ids, max_new_tokens, attention_mask=mask, temperature=temperature, seeds=seeds,
                               eos_token_id=eos_token_id, chunk=ids.shape[1])
    finally:
        # the cache and the captured graph go now, not at the next full garbage collection
        decoder.close()
    return out.tolist()


def _reference(model, ids: Tensor, mask: Tensor, max_new_tokens: int, cache, temperature: float, seeds: Tensor,
               eos_token_id: int | None) -> list[list[int]]:
    """One forward per token with a growing attention mask, on a `DynamicCache` for the dense model."""
    from transformers import DynamicCache

    from kvpop.cache import cache_kwargs
    from kvpop.sampling import next_tokens

    cache = DynamicCache() if cache is None else cache
    kw = cache_kwargs(model, cache)
    n = ids.shape[0]
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position, **kw, use_cache=True, logits_to_keep=1).logits[:, -1]
    out: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    position = position[:, -1:]
    for step in range(max_new_tokens):
        tokens = next_tokens(logits, seeds, step, temperature)
        for r, token in enumerate(tokens.tolist()):
            if not done[r]:
                out[r].append(token)
                done[r] = token == eos_token_id or len(out[r]) == max_new_tokens
        if all(done):
            break
        mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
        position = position + 1
        logits = model(tokens[:, None], attention_mask=mask, position_ids=position, **kw, use_cache=True).logits[:, -1]
    return out


__all__ = ["BACKENDS", "generate_batch", "generate_tokens", "left_pad", "trim_at_eos"]
