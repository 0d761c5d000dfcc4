"""Eviction policies beside KVpop, each supplying only what differs from the shared machinery.

`make_policy(cfg, ...)` builds the `LayerPolicy` of `cfg.policy` for one layer.
"""

from __future__ import annotations

from kvpop.baselines.dms import DMSPolicy
from kvpop.baselines.h2o import H2OPolicy
from kvpop.baselines.oracle import OraclePolicy
from kvpop.baselines.streaming_llm import RecencyPolicy, SlidingWindowPolicy
from kvpop.baselines.tova import TOVAPolicy
from kvpop.config import KVpopConfig
from kvpop.policy import CascadePolicy, EvidencePolicy, LayerPolicy, MLSTMPolicy, ScorerPolicy, TOVAPriorPolicy

POLICY_CLASSES: dict[str, type[LayerPolicy]] = {
    "kvpop": ScorerPolicy,
    "streaming_llm": RecencyPolicy,
    "streaming_llm_plus": RecencyPolicy,
    "tova": TOVAPolicy,
    "h2o": H2OPolicy,
    "oracle": OraclePolicy,
    "dms": DMSPolicy,
}
# the learned policy's class by `cfg.scorer`
SCORER_CLASSES: dict[str, type[LayerPolicy]] = {"mlp": ScorerPolicy, "mlstm": MLSTMPolicy, "evidence": EvidencePolicy}


def make_policy(cfg: KVpopConfig, num_kv_heads: int, head_dim: int, group: int = 1) -> LayerPolicy:
    """The policy of one layer; `group` = query heads per KV head (the evidence scorer reads each of them)."""
    if cfg.policy == "kvpop" and cfg.tova_prior is not None:
        return TOVAPriorPolicy(cfg, num_kv_heads, head_dim, group=group)
    if cfg.policy == "kvpop" and cfg.tova_pool:
        return CascadePolicy(cfg, num_kv_heads, head_dim, group=group)
    if cfg.policy == "kvpop":
        return SCORER_CLASSES[cfg.scorer](cfg, num_kv_heads, head_dim, group=group)
    return POLICY_CLASSES[cfg.policy](cfg, num_kv_heads, head_dim)


__all__ = ["POLICY_CLASSES", "SCORER_CLASSES", "DMSPolicy", "H2OPolicy", "OraclePolicy", "RecencyPolicy",
           "SlidingWindowPolicy", "TOVAPolicy", "make_policy"]
