"""The oracle: the teacher's own ranking, from the future-attention target of the dense model.

It needs the whole sequence (future attention), so it exists only teacher-forced: the caller
computes the priorities (`kvpop.eval.metrics.oracle_priorities`) and passes them to the forward
as `kvpop_priority=[one float32 [B, Hkv, S] tensor per layer]`. It is the upper bound of what a
static-priority scorer can reach under the same budget.
"""

import math

import torch
from torch import Tensor, nn

from kvpop.config import KVpopConfig
from kvpop.policy import LayerPolicy


class OraclePolicy(LayerPolicy):
    teacher_forced_only = True

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__(cfg, num_kv_heads, head_dim)
        # the decay of Sec. 2 at its initial value, so the oracle ranks like an untrained KVpop would decay
        self.register_buffer("theta", torch.full((num_kv_heads,), math.log(cfg.gamma_init / (1 - cfg.gamma_init))))

    @property
    def log_gamma(self) -> Tensor:
        return nn.functional.logsigmoid(self.theta.float())

    def priority(self, key: Tensor, value: Tensor, position: Tensor) -> Tensor:
        raise ValueError(
            "the oracle policy needs priorities from the dense model's future attention: pass "
            "kvpop_priority=kvpop.eval.metrics.oracle_priorities(model, input_ids) to the forward (teacher-forced only)"
        )
