"""Sampling on the device from counter-based random numbers: a row's draws depend on its seed and step only.

Sampled generations are compared across policies, batch sizes and machines, so the random numbers
must not come from a stateful generator: its stream depends on how many numbers were drawn before
(the batch), and CPU and CUDA generators differ. Here every number is a hash of `(seed, step, token)`:

    row   = H(H(seed) + step)                   # [B], one per row and step
    bits  = H(row + (v + 1) * GOLDEN)           # [B, V], one per vocabulary entry v
    u     = ((bits >>> 12) + 0.5) / 2**52       # float64 uniform in (0, 1); >>> is a logical shift
    token = argmax(logits / T - log(-log(u)))   # Gumbel-max: a draw from softmax(logits / T)

`H` is splitmix64's finaliser (Steele, Lea, Flood 2014) written in int64 torch ops: products wrap
modulo 2**64 as the hardware does, and right shifts are made logical with a mask. The integers are
the same on every device; the float64 logarithms may differ in the last bit between CPU and CUDA,
which moves a draw only on an exact tie. One elementwise pass over `[B, V]`, no host sync, no loop
over rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

SAMPLER = "gumbel-splitmix64"
"""The name of this scheme: stores of sampled generations record it (`kvpop.eval.fidelity`)."""


def _signed(c: int) -> int:
    """A 64-bit unsigned constant as the int64 of the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """splitmix64's output for state `x` (int64 tensor, any shape): a bijection of 64-bit words with full avalanche."""
    z = x + GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def hash_uniform(seeds: Tensor, step: int, vocab: int) -> Tensor:
    """Uniforms in (0, 1), float64 [B, vocab]: entry `[r, v]` depends on `(seeds[r], step, v)` only.

    Args:
        seeds: int64 [B], one per row (on the device the uniforms are wanted on).
        step: the index of the token being drawn (0 for the first generated token).
    """
    row = splitmix64(splitmix64(seeds) + step)  # [B]
    index = (torch.arange(vocab, device=seeds.device, dtype=torch.long) + 1) * GOLDEN  # [V]
    bits = splitmix64(row[:, None] + index)  # [B, V]
    # 52 bits: k + 0.5 is exact in float64 for k < 2**52, so u is never 0 or 1
    return (_shr(bits, 12).double() + 0.5) * 2.0**-52


def gumbel_sample(logits: Tensor, seeds: Tensor, step: int, temperature: float) -> Tensor:
    """One token per row drawn from `softmax(logits / temperature)` by Gumbel-max with `hash_uniform` noise.

    Args:
        logits: [B, V], any float dtype.
        seeds: int64 [B], each row's seed (rows of equal seed and step draw the same noise).
        step: the index of the token being drawn.
    Returns:
        int64 [B] token ids.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 to sample (use argmax for greedy)")
    u = hash_uniform(seeds, step, logits.shape[-1])
    return (logits.double() / temperature - torch.log(-torch.log(u))).argmax(-1)


def next_tokens(logits: Tensor, seeds: Tensor | None, step: int, temperature: float) -> Tensor:
    """Greedy (`temperature == 0`: argmax) or sampled (`gumbel_sample`) tokens, int64 [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    if seeds is None:
        raise ValueError("sampling needs a seed per row")
    return gumbel_sample(logits, seeds, step, temperature)


__all__ = ["GOLDEN", "SAMPLER", "gumbel_sample", "hash_uniform", "next_tokens", "splitmix64"]
