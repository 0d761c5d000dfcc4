"""TOVA (Oren et al., 2024): evict the token the current query attends to least.

A token's priority is the attention weight it received at the latest step: per KV head, the
largest weight over that head's query heads (default), or the layer-wide average over all query
heads as in the original (`KVpopConfig(tova_head_average=True)`), which makes every KV head of
a layer keep the same tokens. To stay within the budget without a second attention pass, the
weights of step `q - 1` decide the eviction at step `q` (the token leaving the window against the
weakest long-range slot), as the shared decode step does for every policy.

The paper's TOVA is `KVpopConfig.for_budget(B, policy="tova")`: no sinks, a window of 1 (the
current token) and the head average, so at every step the cache holds B tokens and the one the
latest query attended least is dropped. `for_budget(B, policy="tova", windowed=True)` is kvpop's
earlier variant (4 sinks, a window of B/4, per KV head), kept for comparison (`tova_windowed`).
"""

from kvpop.config import KVpopConfig
from kvpop.policy import LayerPolicy


class TOVAPolicy(LayerPolicy):
    dynamic = True

    def __init__(self, cfg: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__(cfg, num_kv_heads, head_dim)
        self.head_average = cfg.tova_head_average
        self.chunk = int(cfg.decision_chunk)

    @property
    def score(self) -> str:
        return "mean" if self.head_average else "max"
