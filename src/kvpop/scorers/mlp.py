"""The stateless scorer of KVpop-mlp (`docs/method.md` Sec. 3): `r[t] = W2 silu(W1 [k_t; v_t] + b1) + b2`.

One set of weights per KV head, all heads evaluated by one batched matmul. The score of a token depends on
that token alone, so the decoding cache computes it once, when the token is inserted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MLPScorer(nn.Module):
    """Two-layer SiLU MLP per KV head over `x[t] = [k[t]; v[t]]` (detached, float32, also under autocast)."""

    def __init__(self, num_heads: int, head_dim: int, hidden: int = 256):
        super().__init__()
        self.num_heads, self.head_dim, self.hidden = num_heads, head_dim, hidden
        self.w1 = nn.Parameter(torch.empty(num_heads, 2 * head_dim, hidden))
        self.b1 = nn.Parameter(torch.zeros(num_heads, hidden))
        self.w2 = nn.Parameter(torch.empty(num_heads, hidden))
        self.b2 = nn.Parameter(torch.zeros(num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # fan-in init per head, like nn.Linear, so scores start O(1) and differ between tokens
        nn.init.uniform_(self.w1, -1 / math.sqrt(2 * self.head_dim), 1 / math.sqrt(2 * self.head_dim))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden))
        nn.init.zeros_(self.b1)
        nn.init.zeros_(self.b2)

    def forward(self, key: Tensor, value: Tensor) -> Tensor:
        """Scores of cached tokens.

        Args:
            key, value: [B, H, N, D] as cached (after k-norm and RoPE); gradients are not taken through them.
        Returns:
            float32 [B, H, N].
        """
        # float32 even under autocast, which would run the products in bf16 (ties among near scores)
        with torch.autocast(key.device.type, enabled=False):
            x = torch.cat([key.detach(), value.detach()], dim=-1).float()  # [B, H, N, 2D]
            # matmuls broadcast over the batch (an einsum costs ~4x the dispatches, paid per layer and decoded token)
            h = F.silu(torch.matmul(x, self.w1.float()) + self.b1.float()[:, None, :])
            return torch.matmul(h, self.w2.float()[:, :, None])[..., 0] + self.b2.float()[:, None]
