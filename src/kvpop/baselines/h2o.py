"""H2O (Zhang et al., 2023): keep the heavy hitters, the tokens with the most accumulated attention.

A token's priority is the sum of the attention weights it has received from every query since
it was inserted (summed over the query heads of its KV head), plus the protected recent window.

The paper's H2O is `KVpopConfig.for_budget(B, policy="h2o")`: no sinks, the budget split in half
between the recent window and the heavy hitters. `for_budget(B, policy="h2o", windowed=True)` is
kvpop's earlier variant (4 sinks, a window of B/4), kept for comparison (`h2o_windowed`). With
`decision_chunk = C` (`KVpopConfig.with_decision_chunk`, an extension) the paper's split decides once every `C` steps
from the chunk's queries (`ops/dynamic/chunked.py`).
"""

from kvpop.config import KVpopConfig
from kvpop.policy import LayerPolicy


class H2OPolicy(LayerPolicy):
    dynamic = True
    score = "sum"

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__(cfg, num_kv_heads, head_dim)
        self.chunk = int(cfg.decision_chunk)
