"""H2O (Zhang et al., 2023): keep the heavy hitters, the tokens with the most accumulated attention.

A token's priority is the sum of the attention weights it has received from every query since
it was inserted (summed over the query heads of its KV head), plus the protected recent window.
"""

from torch import Tensor

from kvpop.ops.dynamic import score_update
from kvpop.policy import LayerPolicy


class H2OPolicy(LayerPolicy):
    dynamic = True
    score = "sum"

    def update(self, priority: Tensor, probs: Tensor, occupied: Tensor) -> Tensor:
        return score_update(self.score, priority, probs, occupied)
