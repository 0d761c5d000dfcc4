"""The delayed evidence scorer (`docs/method.md` Sec. 8): a token scored from `[k; v]` and the attention its window gave it.

When token `t` leaves the window (query `t + w`), the `w` queries `t .. t + w - 1` have all attended
it. Per query head `g` of its KV head the scorer reads three numbers about the window-normalised
probabilities `p~(d -> t)` (`kvpop.ops.evidence`): their sum, their max, and the last query's.
Features `phi = (log(eps + x) - FEATURE_SHIFT) / FEATURE_SCALE`, `3 G` per token, then either

- `mix="concat"`: `r = W2 silu(W1 [k; v; phi] + b1) + b2` (the MLP scorer over a longer input), or
- `mix="additive"`: `r = MLP([k; v]) + u . phi` (the MLP scorer plus a per-head linear term, `u = 0` at init).

One set of weights per KV head, all heads by one einsum, in float32 even under autocast.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEATURE_EPS = 1e-6
"""Floor inside the log of a feature: `log(eps + x)`."""
FEATURE_SHIFT = -4.0
FEATURE_SCALE = 4.0
"""`phi = (log(eps + x) - shift) / scale`: the logs span about [-14, log w]; this puts most of them in [-2, 2]."""
MIXES = ("concat", "additive")


def evidence_features(stats: Tensor) -> Tensor:
    """`[B, H, N, 3, G]` sums / maxima / latest probabilities -> float32 features `[B, H, N, 3 G]`."""
    phi = (torch.log(stats.float() + FEATURE_EPS) - FEATURE_SHIFT) / FEATURE_SCALE
    return phi.flatten(-2)


class EvidenceScorer(nn.Module):
    """Per KV head: a SiLU MLP over `[k; v]` (detached) and the window evidence features of `G` query heads."""

    def __init__(self, num_heads: int, head_dim: int, group: int, hidden: int = 256,
                 mix: Literal["concat", "additive"] = "concat"):
        super().__init__()
        if mix not in MIXES:
            raise ValueError(f"mix={mix!r} must be one of {MIXES}")
        if group < 1:
            raise ValueError(f"group={group!r} must be >= 1 (query heads per KV head)")
        self.num_heads, self.head_dim, self.group, self.hidden, self.mix = num_heads, head_dim, group, hidden, mix
        self.n_features = 3 * group
        n_in = 2 * head_dim + (self.n_features if mix == "concat" else 0)
        self.w1 = nn.Parameter(torch.empty(num_heads, n_in, hidden))
        self.b1 = nn.Parameter(torch.zeros(num_heads, hidden))
        self.w2 = nn.Parameter(torch.empty(num_heads, hidden))
        self.b2 = nn.Parameter(torch.zeros(num_heads))
        self.u = nn.Parameter(torch.zeros(num_heads, self.n_features)) if mix == "additive" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        n_in = self.w1.shape[1]
        nn.init.uniform_(self.w1, -1 / math.sqrt(n_in), 1 / math.sqrt(n_in))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden))
        nn.init.zeros_(self.b1)
        nn.init.zeros_(self.b2)
        if self.u is not None:
            nn.init.zeros_(self.u)

    def forward(self, key: Tensor, value: Tensor, stats: Tensor) -> Tensor:
        """Scores of tokens leaving the window.

        Args:
            key, value: [B, H, N, D], as cached (or the key before RoPE); no gradient is taken through them.
            stats: [B, H, N, 3, G], the window evidence (`kvpop.ops.evidence`); detached here.
        Returns:
            float32 [B, H, N].
        """
        with torch.autocast(key.device.type, enabled=False):
            phi = evidence_features(stats.detach())
            parts = [key.detach().float(), value.detach().float()] + ([phi] if self.mix == "concat" else [])
            x = torch.cat(parts, dim=-1)
            h = F.silu(torch.einsum("bhnd,hdf->bhnf", x, self.w1.float()) + self.b1.float()[None, :, None, :])
            score = torch.einsum("bhnf,hf->bhn", h, self.w2.float()) + self.b2.float()[None, :, None]
            if self.u is not None:
                score = score + torch.einsum("bhnf,hf->bhn", phi, self.u.float())
            return score

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, group={self.group}, hidden={self.hidden}, mix={self.mix}"
